"""How many blocks can every rank keep resident on the GPU at once?

    mpiexec -n 8 --oversubscribe python bench/gpu/residency.py [--foreign 0|1|2] [--late-ms MS] [--json FILE]

KCCL's collective kernels need every rank's blocks resident together (block b
waits for block b of every peer).  On the H200 under MPS, 8 ranks with 22-33
blocks each of the ~80-register kernels timed out although the occupancy
calculator said 3 blocks per SM fit (bench/RESULTS.md).  This probe measures
the real limit instead: every rank launches B blocks of a kernel with the same
footprint (kcclBenchResidency), each block announces itself on rank 0's counter
and waits up to --timeout-ms for the rest.  "seen" is the most arrivals any
block saw: launched when all fit, fewer when some had to wait for others to
leave.  A row is "fits" only when every rank saw every arrival.

--late-ms makes the last rank start that much after the others (whose blocks
are then resident and waiting), and --foreign has it launch a kernel of its own
first, as an application's kernel comes before a collective on its stream:
1 without shared memory, 2 with 40 KB of it.  The SM columns say where the
blocks ran: SMs holding any probe block, SMs holding blocks of two or more
ranks, and the fewest SMs one rank's blocks used.
"""
import argparse
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench/: kccl_bench

import kccl  # noqa: E402
import kccl_bench as kbench  # noqa: E402
from mpi4py import MPI  # noqa: E402


def sm_summary(per_rank_sms):
    """(SMs holding any block, SMs holding blocks of >= 2 ranks, fewest SMs one rank used)."""
    ranks_on = defaultdict(set)
    for r, sms in enumerate(per_rank_sms):
        for sm in sms:
            ranks_on[sm].add(r)
    shared = sum(1 for rs in ranks_on.values() if len(rs) > 1)
    return len(ranks_on), shared, min(len(set(s)) for s in per_rank_sms)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="4,8,12,16,18,20,24,28,32,40,48,64",
                    help="blocks per rank to try, comma-separated")
    ap.add_argument("--timeout-ms", type=int, default=300)
    ap.add_argument("--foreign", type=int, default=0, choices=(0, 1, 2),
                    help="the last rank's own kernel before the probe: 0 none, 1 plain, 2 with 40 KB shared memory")
    ap.add_argument("--late-ms", type=float, default=0.0, help="the last rank starts this much later")
    ap.add_argument("--carveout", type=int, default=-1,
                    help="the probe kernel's preferred shared-memory carveout, percent (-1: the driver's choice)")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    world = MPI.COMM_WORLD
    last = world.rank == world.size - 1
    comm = kccl.Communicator.from_mpi(world, device="local")
    rows = []
    for b in (int(x) for x in a.blocks.split(",")):
        world.Barrier()
        if last and a.late_ms:
            time.sleep(a.late_ms / 1000.0)
        r = kbench.bench_residency(comm, b, a.timeout_ms, a.foreign if last else 0, a.carveout)
        seen = world.allreduce(r["seen"], op=MPI.MIN)
        placed = world.gather(r["sms"], root=0)
        row = dict(blocks_per_rank=b, launched=r["launched"], seen_min=seen, fits=seen == r["launched"],
                   regs=r["regs"], per_sm=r["per_sm"])
        if world.rank == 0:
            row["sms_used"], row["sms_shared"], row["min_sms_of_a_rank"] = sm_summary(placed)
        rows.append(row)
    comm.close()
    if world.rank == 0:
        import torch
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        print(f"# residency probe: {world.size} ranks, {rows[0]['regs']} registers per thread, 256 threads per "
              f"block, calculator {rows[0]['per_sm']} blocks per SM x {sms} SMs = {rows[0]['per_sm'] * sms}; "
              f"last rank {a.late_ms:g} ms late, foreign kernel {a.foreign}, probe carveout {a.carveout}")
        print(f"{'blocks/rank':>11} {'launched':>9} {'seen(min)':>10} {'% of calc':>10} {'SMs used':>9} "
              f"{'SMs shared':>11} {'min SMs/rank':>13}  result")
        for r in rows:
            r["pct_of_calculator"] = 100.0 * r["launched"] / (r["per_sm"] * sms)
            print(f"{r['blocks_per_rank']:>11} {r['launched']:>9} {r['seen_min']:>10} "
                  f"{r['pct_of_calculator']:>9.0f}% {r['sms_used']:>9} {r['sms_shared']:>11} "
                  f"{r['min_sms_of_a_rank']:>13}  {'fits' if r['fits'] else 'DOES NOT FIT'}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(nranks=world.size, sms=sms, timeout_ms=a.timeout_ms, foreign=a.foreign, carveout=a.carveout,
                               late_ms=a.late_ms, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
