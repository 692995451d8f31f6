"""KCCL_TOPO=off vs on (and a fake two-domain topology) side by side, on this machine.

    mpiexec -n 2 python bench/topo_onoff.py [--sizes 4,64,1K,8K] [--iters 20000] [--rounds 9] [--json F]

Three communicators over the same ranks, timed in alternating rounds (off, on, fake,
off, on, fake, ...) with bench/native's kb_bench_all_reduce (a loop inside C), so a noisy machine slows
all three alike:
  off   KCCL_TOPO=off: one copy of every flag;
  on    KCCL_TOPO=on (the default): on a machine with one L3 the plan degenerates to one
        copy, so this must equal off within noise;
  fake  a topology file that puts the ranks in different (pretend) L3 domains: every
        publish also pushes a replica with non-temporal stores and readers poll it.  On a
        machine whose "domains" share one L3 this can only cost: it measures the price of
        the replica path, not its benefit.
Per size and configuration a rank takes the median over rounds of the mean us per call;
the table shows the mean of that over ranks.  Every call's result is checked afterwards."""
import argparse
import json
import os
import platform
import statistics
import tempfile

import numpy as np
from mpi4py import MPI

import kccl
import kccl_bench as kbench
from benchlib import parse_size
from topology.fixtures.fake import fake_l3s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4,64,1K,8K")
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json")
    a = ap.parse_args()
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    path = None
    if rank == 0:
        fd, path = tempfile.mkstemp(suffix=".json", prefix="kccl-fake-topo-")
        os.close(fd)
        fake_l3s(path, rank_domains=[r % 2 for r in range(n)])
    path = world.bcast(path, root=0)
    configs = {"off": {"topo": "off"}, "on": {"topo": "on"}, "fake": {"topo_file": path}}
    comms = {k: kccl.Communicator.from_mpi(world, config=v) for k, v in configs.items()}
    world.Barrier()
    if rank == 0:
        os.unlink(path)
    infos = {k: c.topo_info() for k, c in comms.items()}
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    rows = []
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        x = np.full(count, rank + 1, np.float32)
        recv = np.empty_like(x)
        times = {k: [] for k in comms}
        for c in comms.values():
            kbench.bench_all_reduce(c, x, recv, iters=1000)
        for _ in range(a.rounds):
            for k, c in comms.items():
                world.Barrier()
                times[k].append(kbench.bench_all_reduce(c, x, recv, iters=a.iters))
                if not (recv == n * (n + 1) / 2).all():
                    raise SystemExit(f"rank {rank}: wrong result with {k}")
        med = {k: statistics.median(v) for k, v in times.items()}
        allmed = world.gather(med, root=0)
        if rank == 0:
            mean = {k: sum(m[k] for m in allmed) / n for k in comms}
            rows.append({"bytes": nbytes, **{f"{k}_us": mean[k] for k in comms},
                         "off_over_on": mean["off"] / mean["on"], "fake_over_off": mean["fake"] / mean["off"]})
    allinfo = world.gather(infos, root=0)
    for c in comms.values():
        c.close()
    if rank != 0:
        return
    print(f"# {n} ranks, float32 sum, kb_bench_all_reduce x {a.iters} per round, {a.rounds} rounds, "
          f"{platform.node()} ({os.cpu_count()} CPUs)")
    print("# topo_info rank 0: " + "; ".join(f"{k}: ndomains={v['ndomains']} replicas={v['replicas']} "
                                             f"bound={v['bound']}" for k, v in allinfo[0].items()))
    print(f"{'bytes':>6} {'off us':>8} {'on us':>8} {'fake us':>8} {'off/on':>7} {'fake/off':>8}")
    for r in rows:
        print(f"{r['bytes']:>6} {r['off_us']:>8.3f} {r['on_us']:>8.3f} {r['fake_us']:>8.3f} "
              f"{r['off_over_on']:>7.3f} {r['fake_over_off']:>8.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"ranks": n, "iters": a.iters, "rounds": a.rounds, "rows": rows, "topo_info": allinfo}, f, indent=1)


if __name__ == "__main__":
    main()
