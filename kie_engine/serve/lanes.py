"""Tensor-parallel lanes behind the server.  Rank 0 serves HTTP; every other rank runs
follow(): it waits for rank 0's next request (MPI point-to-point, polled with 1 ms
sleeps: an idle lane takes ~2 % of a core, where MPICH's blocking receive would spin on
one), runs the same generation loop, and each token takes part in agree(), a one-byte MPI
broadcast of rank 0's stop decision (stop string, client gone, shutdown).  Every lane's
tokens are equal (KCCL reduces in rank order), so end-of-text and max_tokens end all
lanes at the same step; agree() carries what only rank 0 knows."""
import signal
import sys
import time

import numpy as np

from ..generate import Sampling

_TAG = 36           # control messages from rank 0
_IDLE_SLEEP = 1e-3  # poll period of an idle lane: at most this much added to a request's start


class LaneLink:
    def __init__(self, mpi_comm):
        self.comm = mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.leader = self.rank == 0
        self._flag = np.zeros(1, np.int8)
        self._finished = False

    # -- rank 0 --------------------------------------------------------------------------
    def _send_all(self, msg):
        for r in range(1, self.size):
            self.comm.send(msg, dest=r, tag=_TAG)

    def announce(self, prompt_ids, max_tokens, sampling, stop_ids):
        self._send_all({"op": "run", "prompt_ids": [int(i) for i in prompt_ids], "max_tokens": int(max_tokens),
                        "sampling": (sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed),
                        "stop_ids": sorted(int(i) for i in stop_ids) if stop_ids is not None else None})

    def finish(self):
        """Tells every lane to leave follow() (once)."""
        if self.leader and not self._finished:
            self._finished = True
            self._send_all({"op": "stop"})

    # -- every rank ----------------------------------------------------------------------
    def agree(self, stop):
        self._flag[0] = 1 if (stop and self.leader) else 0
        self.comm.Bcast(self._flag, root=0)
        return bool(self._flag[0])

    # -- the other ranks -----------------------------------------------------------------
    def _next(self):
        while not self.comm.iprobe(source=0, tag=_TAG):
            time.sleep(_IDLE_SLEEP)
        return self.comm.recv(source=0, tag=_TAG)

    def follow(self, runner):
        """Runs rank 0's requests until it says stop.  SIGTERM and SIGINT (mpiexec sends
        them to every rank) are left to rank 0, which finishes or cancels the current
        request and then ends every lane, so no lane leaves a collective half done."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        while True:
            msg = self._next()
            if msg["op"] == "stop":
                return
            try:
                runner.run(msg["prompt_ids"], msg["max_tokens"], Sampling(*msg["sampling"]), msg["stop_ids"])
            except Exception as e:  # the same error on every lane (same tokens); rank 0 reports it
                from kccl import KcclError
                if isinstance(e, KcclError):
                    raise
                print(f"lane {self.rank}: request failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
