"""How a rank becomes a lane: the lane plan (plan.py: what each lane holds, which imports
no engine), the thread pools (threads.py), the backends behind the decode loop
(backend.py, native_engine.py) and a rank's start-up from the command line (start.py)."""
