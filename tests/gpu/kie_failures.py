"""KIE's GPU engine when something goes wrong at run time (run on a GPU machine; the
two-lane scenarios take a GPU each where there are two, else both GPU 0 under MPS):

    python tests/gpu/kie_failures.py [scenario ...]

Scenarios (lanes spawned with multiprocessing, bootstrapped by a KCCL unique id, so
that a lane can be SIGKILLed without an MPI launcher tearing the job down):
  kill        two lanes generate (tiny preset, DTP delay 1); lane 1 is SIGKILLed after
              10 tokens: lane 0's generate raises a GpuError within DETECT_S
  abort       the same, lane 1 calls comm.abort() instead
  kill_d0     kill with DTP delay 0 (the in-line all-reduce instead of the split phase)
  kill_mono, abort_mono, kill_mono_d0   the same with the monokernel (the lanes' sums
              inside it, through KCCL's device API): lane 0 raises within MONO_DETECT_S
  stall_mono  the monokernel, lane 1 stays alive but stops enqueueing steps for
              STALL_S: lane 0 raises once its waits' bound has passed (KCCL_TIMEOUT_MS
              below ends its reducers' calls, the monokernel's 2 s its other waits),
              within MONO_DETECT_S + TIMEOUT_MS of lane 1's last token
  (every monokernel scenario: lane 0's engine also closes, its kernel ended, within
  CLOSE_S of the error: nothing is left spinning on the GPU)
  nan         one lane, a final norm of NaN: generate raises a GpuError naming
              non-finite logits (graph kernel)
  nan_mono    the same with the monokernel
After each: no KCCL segment is left in /dev/shm.  Prints PASS/FAIL per scenario and
`KIE GPU FAILURES: n passed, m failed`; exit 1 on any failure."""
import os
import signal
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)

from failures import spawn_ranks  # noqa: E402  (tests/gpu/failures.py: the same spawn and gather)

DETECT_S = 3.0     # KCCL_TIMEOUT_MS below, and the engine's 1 ms polling of the communicator
MONO_DETECT_S = 2.0  # the bound for the monokernel: a dead peer is seen by KCCL's watcher at once
CLOSE_S = 5.0      # lane 0's close (its stream synchronized: the failed kernel ended) after its error
STALL_S = 4.0      # how long lane 1 stops enqueueing in stall_mono (longer than TIMEOUT_MS)
TIMEOUT_MS = 1500
# scenario -> (DTP delay, kernel)
LANES = {"kill": (1, "graph"), "abort": (1, "graph"), "kill_d0": (0, "graph"), "kill_mono": (1, "mono"),
         "abort_mono": (1, "mono"), "kill_mono_d0": (0, "mono"), "stall_mono": (1, "mono")}


def lane(scenario, path, uid, rank, q):
    import torch
    import kccl
    from kie_engine.formats.checkpoint import Checkpoint
    from kie_engine.errors import KieError
    from kie_engine.generate import Sampling
    from kie_engine.gpu.engine import GpuModel
    from kie_engine.lanes.plan import comm_config
    dev = rank % torch.cuda.device_count()  # a GPU per lane where there are two, else both on GPU 0 (MPS)
    torch.cuda.set_device(dev)
    ckpt = Checkpoint(path)
    cfg = dict(comm_config(ckpt.config), KCCL_TIMEOUT_MS=TIMEOUT_MS)
    comm = kccl.Communicator(2, kccl.UniqueId(uid), rank, device=dev, config=cfg)
    out = {"rank": rank}
    m = None
    try:
        m = GpuModel(ckpt.config, comm, max_seq=ckpt.config.max_position_embeddings,
                     kernel=LANES[scenario][1]).load(ckpt)
        m.generate([1, 2, 3], 8, Sampling())  # a good run first
        seen = [0]

        def on_token(t):
            seen[0] += 1
            if rank == 1 and seen[0] == 10:
                q.put({"rank": 1, "t_event": time.monotonic()})
                if scenario.startswith("kill"):
                    # the queue's feeder thread must have written the event to the pipe before
                    # the kill, or the parent never sees it
                    q.close()
                    q.join_thread()
                    os.kill(os.getpid(), signal.SIGKILL)
                if scenario.startswith("stall"):  # alive, but its steps stop coming
                    time.sleep(STALL_S)
                    raise SystemExit(0)
                comm.abort()
                time.sleep(2.0)
                raise SystemExit(0)
        try:
            m.generate([1, 2, 3], ckpt.config.max_position_embeddings - 8, Sampling(), on_token=on_token)
            out["err"] = "none"
        except KieError as e:
            out["err"] = type(e).__name__
            out["msg"] = str(e)
        out["t_err"] = time.monotonic()
    except Exception as e:  # anything else is a failure of the check
        out["err"] = "unexpected " + type(e).__name__
        out["msg"] = str(e)
    finally:
        if m is not None:
            m.close()
        out["t_closed"] = time.monotonic()
        comm.abort() if out.get("err", "none") != "none" else comm.close()
    q.put(out)


def two_lanes(scenario, root):
    from kie_engine.formats.config import preset
    from kie_engine.formats.init import write_checkpoint
    path = os.path.join(root, f"tiny_{scenario}")
    delay, kernel = LANES[scenario]
    write_checkpoint(preset("tiny", dtp_delay=delay), path, seed=3)
    got = spawn_ranks(lane, (scenario, path), 2, lambda got: "err" in got.get(0, {}), 90)
    r0, r1 = got.get(0, {}), got.get(1, {})
    ok = r0.get("err") in ("GpuError", "GpuTimeoutError")
    why = f"lane 0 got {r0.get('err')}: {r0.get('msg', '')[:240]}"
    if ok and "t_event" in r1:
        delay = r0["t_err"] - r1["t_event"]
        why += f" ({delay:.2f} s after the event"
        if kernel == "mono":
            closed = r0["t_closed"] - r0["t_err"]
            why += f", closed {closed:.2f} s after the error"
            ok = closed < CLOSE_S
        why += ")"
        if scenario.startswith("stall"):  # the bound of the waits the stall leaves waiting, and slack
            ok = ok and delay < MONO_DETECT_S + TIMEOUT_MS / 1000.0
        else:
            ok = ok and delay < (MONO_DETECT_S if kernel == "mono" else DETECT_S)
    elif ok:
        ok, why = False, why + "; lane 1 never reached its event"
    return ok, why


def nan_logits(kernel, root):
    import numpy as np
    from kie_engine.formats.checkpoint import Checkpoint
    from kie_engine.formats.config import preset
    from kie_engine.errors import GpuError
    from kie_engine.generate import Sampling
    from kie_engine.gpu.engine import GpuModel, lib
    from kie_engine.formats.init import write_checkpoint
    path = os.path.join(root, f"tiny_nan_{kernel}")
    cfg = preset("tiny")
    write_checkpoint(cfg, path, seed=3)
    with GpuModel(cfg, max_seq=64, kernel=kernel) as m:
        m.load(Checkpoint(path))
        m.upload_vector(lib.KIE_F_FINAL_NORM, 0, np.full(cfg.hidden_size, np.nan, np.float32))
        try:
            m.generate([1, 2, 3], 8, Sampling())
            return False, "no error"
        except GpuError as e:
            return "not finite" in str(e), f"{type(e).__name__}: {e}"


def run(scenario, root):
    try:
        if scenario in LANES:
            ok, why = two_lanes(scenario, root)
        else:
            ok, why = nan_logits("mono" if scenario.endswith("mono") else "graph", root)
    except Exception as e:
        ok, why = False, f"crashed: {type(e).__name__}: {e}"
    leftover = [n for n in os.listdir("/dev/shm") if n.startswith("kccl-")]
    if leftover:
        ok, why = False, why + f"; /dev/shm leftovers {leftover}"
    print(("PASS " if ok else "FAIL ") + scenario + ": " + why, flush=True)
    return ok


def main(argv):
    scenarios = argv or [*LANES, "nan", "nan_mono"]
    unknown = [s for s in scenarios if s not in LANES and s not in ("nan", "nan_mono")]
    if unknown:
        print(f"unknown scenario(s) {unknown}; choose from {[*LANES, 'nan', 'nan_mono']}", flush=True)
        return 2
    with tempfile.TemporaryDirectory() as root:
        results = [run(s, root) for s in scenarios]
    print(f"KIE GPU FAILURES: {sum(results)} passed, {len(results) - sum(results)} failed", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
