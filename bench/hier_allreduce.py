"""All-reduce across simulated hosts: KCCL's hierarchical communicator against flat MPI
on the same layout, side by side, plus the legs it is made of (for bench/hier_model.py).

    python bench/hier_allreduce.py --json bench/results/hier_allreduce_2x2_quiet.json
    python bench/hier_allreduce.py --hosts 2 --per-host 2 -b 4 -e 64M -f 4 --rounds 5

Run without mpiexec it starts itself under mpiexec with hosts x per-host ranks, KCCL_HOST_ID
= "sim<rank % hosts>" on each rank, and MPICH told the same layout (MPIR_CVAR_NUM_CLIQUES =
hosts: shared memory inside a simulated host, the network module between them) with UCX on
TCP only (UCX would otherwise move "inter-node" messages through its own shared memory); the
ranks check that MPICH took the layout before timing anything.

Per size (float32 sum), in one run and alternating within each round:
  hier         kccl.Communicator.from_mpi(world): the HierarchicalCommunicator
  mpi          world.Allreduce (MPICH picks its algorithm; with cliques it may be SMP-aware)
  kccl_local   KCCL all-reduce inside each host (both hosts at once)
  kccl_bcast   KCCL broadcast inside each host
  kccl_rs_ag   KCCL reduce-scatter then all-gather inside each host
  mpi_gather   MPI all-gather of (48-byte signature + message) among one rank per host (the
               small path's inter-host leg while (hosts - 1) x size <= 64 KB)
  mpi_leaders  MPI all-reduce among one rank per host (the small path's inter-host leg above)
  mpi_shards   MPI all-reduce of size/per-host among the ranks of equal local index, all
               local indices at once (the large path's inter-host leg)
A round's time for a leg is the slowest rank's mean per call; the table gives min / median /
max over rounds, and mpi/hier the median of the per-round ratios.  #wrong counts elements of
hier and mpi that differ from the exact answer."""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import fmt_size, mpi_launcher, parse_size  # noqa: E402

LEGS = ["hier", "mpi", "kccl_local", "kccl_bcast", "kccl_rs_ag", "mpi_gather", "mpi_leaders", "mpi_shards"]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--per-host", type=int, default=2)
    ap.add_argument("-b", "--minbytes", default="4")
    ap.add_argument("-e", "--maxbytes", default="64M")
    ap.add_argument("-f", "--stepfactor", type=int, default=4)
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--round-ms", type=float, default=40.0, help="target time of one leg in one round")
    ap.add_argument("--json", metavar="FILE")
    return ap.parse_args(argv)


def relaunch(args, argv):
    env = dict(os.environ, MPIR_CVAR_NUM_CLIQUES=str(args.hosts), UCX_TLS="tcp", HIER_BENCH_CHILD="1")
    cmd = mpi_launcher(args.hosts * args.per_host) + [sys.executable, os.path.abspath(__file__)] + argv
    return subprocess.call(cmd, env=env)


def timed(fn, iters):
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not os.environ.get("HIER_BENCH_CHILD"):
        return relaunch(args, argv)
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    hosts, L = args.hosts, args.per_host
    if size != hosts * L:
        sys.exit(f"started with {size} ranks, expected {hosts} x {L}")
    host, lrank = rank % hosts, rank // hosts
    os.environ["KCCL_HOST_ID"] = f"sim{host}"
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    if sorted(node.allgather(rank)) != [r for r in range(size) if r % hosts == host]:
        sys.exit("MPICH does not see the simulated hosts (MPIR_CVAR_NUM_CLIQUES): flat MPI would not run on the "
                 "same layout")
    import kccl
    load_start = os.getloadavg()
    hier = kccl.Communicator.from_mpi(world)
    intra = world.Split(host, rank)
    local = kccl.Communicator.from_mpi(intra, config=hier.local_config)  # the same waits as hier's own
    leaders = world.Split(0 if lrank == 0 else MPI.UNDEFINED, host)
    shards = world.Split(lrank, host)
    sizes, n = [], parse_size(args.minbytes)
    while n <= parse_size(args.maxbytes):
        sizes.append(n)
        n *= args.stepfactor
    rows = []
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        i = np.arange(count)
        x = ((i * 7 + rank * 3) % 5 + 1).astype(np.float32)
        expect = sum(((i * 7 + r * 3) % 5 + 1) for r in range(size)).astype(np.float32)
        y = np.empty_like(x)
        block = max(1, count // L)
        xs, ys = x[:block].copy(), np.empty(block, np.float32)
        rs_out = np.empty(-(-count // L), np.float32)
        padded = np.zeros(rs_out.size * L, np.float32)
        padded[:count] = x
        blk, every = np.zeros(48 + x.nbytes, np.uint8), np.empty((hosts, 48 + x.nbytes), np.uint8)
        legs = {"hier": lambda: hier.all_reduce(x, y),
                "mpi": lambda: world.Allreduce(x, y),
                "kccl_local": lambda: local.all_reduce(x, y),
                "kccl_bcast": lambda: local.broadcast(y, 0),
                "kccl_rs_ag": lambda: (local.reduce_scatter(padded, rs_out), local.all_gather(rs_out, padded)),
                "mpi_gather": (lambda: leaders.Allgather(blk, every)) if leaders != MPI.COMM_NULL else None,
                "mpi_leaders": (lambda: leaders.Allreduce(x, y)) if leaders != MPI.COMM_NULL else None,
                "mpi_shards": lambda: shards.Allreduce(xs, ys)}
        wrong = {}
        iters = {}
        for name, fn in legs.items():  # warm-up, a check, and iterations for round_ms
            world.Barrier()
            t = timed(fn, 1) if fn else 0.0
            t = min(t, timed(fn, 1)) if fn else 0.0
            if name in ("hier", "mpi"):
                wrong[name] = world.allreduce(int(np.count_nonzero(y != expect)), MPI.SUM)
            iters[name] = max(1, min(5000, int(args.round_ms * 1e3 / max(world.allreduce(t, MPI.MAX), 1e-3))))
        per = {name: [] for name in legs}
        for _ in range(args.rounds):
            for name, fn in legs.items():
                world.Barrier()
                t = timed(fn, iters[name]) if fn else 0.0
                per[name].append(world.allreduce(t, MPI.MAX))
        row = {"bytes": nbytes, "count": count, "iters": iters, "wrong": wrong,
               "us": {k: v for k, v in per.items()},
               "stats": {k: [min(v), statistics.median(v), max(v)] for k, v in per.items()},
               "mpi_over_hier": statistics.median(m / h for m, h in zip(per["mpi"], per["hier"]))}
        rows.append(row)
        if rank == 0:
            s = row["stats"]
            spread = "  ".join(f"{k} " + " ".join(f"{v:9.1f}" for v in s[k]) for k in ("hier", "mpi"))
            legs = " ".join(f"{k} {s[k][1]:8.1f}" for k in LEGS[2:])
            print(f"{fmt_size(nbytes):>5}  {spread}  mpi/hier {row['mpi_over_hier']:5.2f}  legs {legs}  "
                  f"wrong {wrong['hier']}/{wrong['mpi']}", flush=True)
    info = hier.topo_info()
    large_bytes, gather_max = info["large_bytes"], info["gather_max_bytes"]
    hier.close()
    local.close()
    if rank == 0 and args.json:
        meta = {"hosts": hosts, "per_host": L, "rounds": args.rounds, "round_ms": args.round_ms,
                "large_bytes": large_bytes, "gather_max_bytes": gather_max,
                "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                "loadavg_start_end": [load_start, os.getloadavg()], "mpi": MPI.Get_library_version().splitlines()[0],
                "layout": "MPIR_CVAR_NUM_CLIQUES=%d, UCX_TLS=tcp" % hosts}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
