"""kccl.Communicator.all_reduce on a CPU torch tensor against the same on a numpy array
(issue 34 item 7: within 1.5x of numpy at 4 KB), interleaved in one run.

    mpiexec -n 2 python bench/python_api_torch.py --json bench/results/python_api_torch_vs_numpy.json
    python bench/python_api_torch.py          # one rank: the Python cost alone, no peer to wait for

Each round times `iters` calls on the same array / tensor (as decode does with its
buffers) after a barrier; the figure of a round is the slowest rank's mean.  Reported
min / median / max over the rounds, and the ratio torch / numpy of the medians."""
import argparse
import os
import statistics
import time

import numpy as np
import torch

import kccl
from benchlib import write_json


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--json")
    args = ap.parse_args()
    try:
        from mpi4py import MPI
        world = MPI.COMM_WORLD
    except ImportError:
        world = None
    if world is not None and world.Get_size() > 1:
        comm = kccl.Communicator.from_mpi(world)
        slowest = lambda v: world.allreduce(v, op=MPI.MAX)  # noqa: E731
    else:
        comm = kccl.Communicator(1, kccl.get_unique_id(), 0)
        slowest = lambda v: v  # noqa: E731
    rows = []
    for nbytes in (4, 4096, 65536):
        a = np.ones(nbytes // 4, np.float32)
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        res = {"numpy": [], "torch": []}
        for x in (a, t):
            for _ in range(1000):
                comm.all_reduce(x)
        for _ in range(args.rounds):
            for name, x in (("numpy", a), ("torch", t)):
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    comm.all_reduce(x)
                res[name].append(slowest((time.perf_counter() - t0) / args.iters * 1e6))
        row = {"bytes": nbytes}
        for name, v in res.items():
            row[name] = {"min_us": min(v), "median_us": statistics.median(v), "max_us": max(v), "rounds_us": v}
        row["torch_over_numpy"] = row["torch"]["median_us"] / row["numpy"]["median_us"]
        rows.append(row)
        if comm.rank == 0:
            print(f"{comm.size} rank(s) {nbytes:>6} B  numpy {row['numpy']['median_us']:7.2f} us  "
                  f"torch {row['torch']['median_us']:7.2f} us  torch/numpy {row['torch_over_numpy']:.2f}", flush=True)
    comm.close()
    if comm.rank == 0 and args.json:
        write_json(args.json, {"ranks": comm.size, "loadavg": os.getloadavg(), "rows": rows})


if __name__ == "__main__":
    main()
