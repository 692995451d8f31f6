"""How many blocks can every rank keep resident on the GPU at once?

    mpiexec -n 8 --oversubscribe python bench/gpu/residency.py [--json FILE]

KCCL's collective kernels need every rank's blocks resident together (block b
waits for block b of every peer).  On the H200 under MPS, 8 ranks with 24-33
blocks each of the ~80-register kernels timed out although the occupancy
calculator said 3 blocks per SM fit (bench/RESULTS.md).  This probe measures
the real limit instead: every rank launches B blocks of a kernel with the same
footprint (kcclBenchResidency), each block announces itself on rank 0's counter
and waits up to --timeout-ms for the rest.  "seen" is the most arrivals any
block saw: launched when all fit, fewer when some had to wait for others to
leave.  A row is "fits" only when every rank saw every arrival.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import kccl  # noqa: E402
from mpi4py import MPI  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="4,8,12,16,18,20,24,28,32,40,48,64",
                    help="blocks per rank to try, comma-separated")
    ap.add_argument("--timeout-ms", type=int, default=300)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    world = MPI.COMM_WORLD
    comm = kccl.Communicator.from_mpi(world, device="local")
    rows = []
    for b in (int(x) for x in a.blocks.split(",")):
        world.Barrier()
        r = comm.bench_residency(b, a.timeout_ms)
        seen = world.allreduce(r["seen"], op=MPI.MIN)
        rows.append(dict(blocks_per_rank=b, launched=r["launched"], seen_min=seen, fits=seen == r["launched"],
                         regs=r["regs"], per_sm=r["per_sm"]))
    comm.close()
    if world.rank == 0:
        import torch
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        print(f"# residency probe: {world.size} ranks, {rows[0]['regs']} registers per thread, 256 threads per "
              f"block, calculator {rows[0]['per_sm']} blocks per SM x {sms} SMs = {rows[0]['per_sm'] * sms}")
        print(f"{'blocks/rank':>11} {'launched':>9} {'seen(min)':>10} {'% of calc':>10}  result")
        for r in rows:
            r["pct_of_calculator"] = 100.0 * r["launched"] / (r["per_sm"] * sms)
            print(f"{r['blocks_per_rank']:>11} {r['launched']:>9} {r['seen_min']:>10} "
                  f"{r['pct_of_calculator']:>9.0f}%  {'fits' if r['fits'] else 'DOES NOT FIT'}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(nranks=world.size, sms=sms, timeout_ms=a.timeout_ms, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
