"""CPU per call of the small hierarchical all-reduce, per rank, beside flat MPI's, on the
simulated layout of bench/hier_allreduce.py (KCCL_HOST_ID = "sim<rank % hosts>", MPICH
cliques, UCX on TCP).  On one machine whose cores the ranks outnumber, a call's latency is
about the CPU all ranks burn per call divided by the cores, so CPU per call is what the
small path's overhead costs.

    python bench/hier_small_cpu.py                       # 4 B, 2 hosts x 2 ranks
    python bench/hier_small_cpu.py --bytes 4K --calls 3000
    python bench/hier_small_cpu.py --profile 0           # cProfile of rank 0's hier calls
    python bench/hier_small_cpu.py --json bench/results/hier_small_cpu_2x2.json

Per rank: user + system CPU (getrusage) per call and wall time per call, for `--calls`
calls of hier.all_reduce(x, y) and of world.Allreduce(x, y), alternating over --rounds."""
import argparse
import cProfile
import json
import os
import pstats
import resource
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import mpi_launcher, parse_size  # noqa: E402


def cpu_s():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def measure(fn, calls):
    c0, t0 = cpu_s(), time.perf_counter()
    for _ in range(calls):
        fn()
    return (cpu_s() - c0) / calls * 1e6, (time.perf_counter() - t0) / calls * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--per-host", type=int, default=2)
    ap.add_argument("--bytes", default="4")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--profile", type=int, default=-1, metavar="RANK", help="cProfile this rank's hier calls")
    args = ap.parse_args()
    if not os.environ.get("HIER_BENCH_CHILD"):
        env = dict(os.environ, MPIR_CVAR_NUM_CLIQUES=str(args.hosts), UCX_TLS="tcp", HIER_BENCH_CHILD="1")
        cmd = mpi_launcher(args.hosts * args.per_host) + [sys.executable, os.path.abspath(__file__)] + sys.argv[1:]
        return subprocess.call(cmd, env=env)
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    os.environ["KCCL_HOST_ID"] = f"sim{rank % args.hosts}"
    import kccl
    hier = kccl.Communicator.from_mpi(world)
    count = max(1, parse_size(args.bytes) // 4)
    x = np.full(count, rank + 1, np.float32)
    y = np.empty_like(x)
    legs = {"hier": lambda: hier.all_reduce(x, y), "mpi": lambda: world.Allreduce(x, y)}
    for fn in legs.values():
        for _ in range(200):
            fn()
    want = size * (size + 1) / 2
    hier.all_reduce(x, y)
    assert (y == want).all(), y[:4]
    res = {k: [] for k in legs}
    for _ in range(args.rounds):
        for name, fn in legs.items():
            world.Barrier()
            res[name].append(measure(fn, args.calls))
    if args.profile >= 0:
        world.Barrier()
        prof = cProfile.Profile() if rank == args.profile else None
        if prof:
            prof.enable()
        for _ in range(args.calls):
            hier.all_reduce(x, y)
        if prof:
            prof.disable()
    every = world.gather(res, root=0)
    if rank == 0:
        print(f"{args.bytes} B float32 sum, {args.hosts} x {args.per_host} ranks, {args.calls} calls x "
              f"{args.rounds} rounds; per rank: CPU us/call (median round), wall us/call")
        for name in legs:
            cells = []
            for r, rr in enumerate(every):
                cpu = sorted(c for c, _w in rr[name])[len(rr[name]) // 2]
                wall = sorted(w for _c, w in rr[name])[len(rr[name]) // 2]
                cells.append(f"r{r} {cpu:6.1f} cpu {wall:6.1f} wall")
            tot = sum(sorted(c for c, _w in rr[name])[len(rr[name]) // 2] for rr in every)
            print(f"{name:5s} " + " | ".join(cells) + f" | total CPU {tot:6.1f} us/call", flush=True)
    if rank == 0 and args.json:
        meta = {"bytes": parse_size(args.bytes), "hosts": args.hosts, "per_host": args.per_host, "calls": args.calls,
                "rounds": args.rounds, "cpus": os.cpu_count(), "loadavg_end": os.getloadavg(),
                "layout": f"KCCL_HOST_ID=sim<rank % {args.hosts}>, MPIR_CVAR_NUM_CLIQUES={args.hosts}, UCX_TLS=tcp"}
        per_rank = {name: [{"cpu_us": [c for c, _w in rr[name]], "wall_us": [w for _c, w in rr[name]]}
                           for rr in every] for name in legs}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "per_rank": per_rank}, f, indent=1)
        print(f"wrote {args.json}")
    if args.profile >= 0 and rank == args.profile:
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(18)
    hier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
