"""One-shot against two-shot all-reduce, interleaved in one run, to place the
crossover (KCCL_ONESHOT_MAX_BYTES).

    mpiexec -n 2 python bench/crossover.py -b 4 -e 4M

Two communicators, one per algorithm, live in the same processes; each size is
timed in alternating rounds (loop inside C, so Python overhead is left out),
and the table shows the median over rounds of the slowest rank."""
import argparse
import statistics
import sys

import numpy as np
from mpi4py import MPI

import kccl
import kccl_bench as kbench
from benchlib import fmt_size, parse_size


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-b", "--minbytes", default="4")
    ap.add_argument("-e", "--maxbytes", default="4M")
    ap.add_argument("-r", "--rounds", type=int, default=7)
    ap.add_argument("--round-ms", type=float, default=20.0)
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    comms = {a: kccl.Communicator.from_mpi(world, config={"algo": a}) for a in ("oneshot", "twoshot")}
    rows, n = [], parse_size(args.minbytes)
    if world.rank == 0:
        print(f"# one-shot vs two-shot all_reduce, {world.size} ranks, float32 sum, us per call (C loop), "
              f"median of {args.rounds} alternating rounds, slowest rank")
        print(f"{'size':>8} {'oneshot':>10} {'twoshot':>10} {'two/one':>8}  faster")
    while n <= parse_size(args.maxbytes):
        x = np.ones(n // 4, np.float32)
        y = np.empty_like(x)
        one = kbench.bench_all_reduce(comms["oneshot"], x, y, iters=3)
        iters = world.allreduce(int(max(3, min(20000, args.round_ms * 1e3 / max(one, 1e-3)))), op=MPI.MIN)
        t = {a: [] for a in comms}
        for _ in range(args.rounds):
            for a, c in comms.items():
                world.Barrier()
                t[a].append(world.allreduce(kbench.bench_all_reduce(c, x, y, iters=iters), op=MPI.MAX))
        med = {a: statistics.median(v) for a, v in t.items()}
        rows.append((n, med["oneshot"], med["twoshot"]))
        if world.rank == 0:
            r = med["twoshot"] / med["oneshot"]
            print(f"{fmt_size(n):>8} {med['oneshot']:10.3f} {med['twoshot']:10.3f} {r:8.2f}  "
                  f"{'oneshot' if r >= 1 else 'twoshot'}", flush=True)
        n *= 2
    if world.rank == 0:
        # crossover: the largest size up to which one-shot wins at every size
        best = 0
        for n, o, tw in rows:
            if o > tw:
                break
            best = n
        print(f"# one-shot wins at every size up to {fmt_size(best) if best else 'none'} bytes")
    for c in comms.values():
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
