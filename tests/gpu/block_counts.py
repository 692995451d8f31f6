"""Which chunked-kernel call fails at which block count (run on a GPU machine):

    mpiexec -n 2 --oversubscribe python tests/gpu/block_counts.py [blocks ...]

Sessions 4-6 saw the chunked kernels time out with twice the default blocks
per rank (8 ranks x 33, 2 ranks x 132); session 7 found why (below).  This runs a short fixed sequence of two-shot
all-reduces (in place, then out of place, at a few sizes) on a fresh
communicator per block count, one call at a time, and prints per block count
the first call that failed and the error (which names the waiting block and
flag stage), or that all passed.  KCCL_TIMEOUT_MS defaults to 3000 here.
Exit 1 when a count that auto would pick fails.

Before each call the last rank sleeps 30 ms and then runs torch kernels of
its own (a fill and a sum, which uses shared memory), so its peers' blocks
are already waiting when its kernels reach the GPU: the case that timed out
with 8 ranks x 22 blocks in session 7: with the driver's shared-memory
carveout a torch kernel of the late rank could not start beside them
(KCCL_GPU_CARVEOUT=100 fixed it; gpu_runtime.cu also keeps SMs free)."""
import os
import sys
import time

import torch
from mpi4py import MPI

import kccl

world = MPI.COMM_WORLD
RANK, N = world.Get_rank(), world.Get_size()
CALLS = [(2, True), (2, False), (1000, True), (1000, False), (3 << 19, True), (3 << 19, False),
         (32 << 20, True)]  # (bf16 elements, in place)


def run(blocks):
    cfg = {"KCCL_ALGO": "twoshot", "KCCL_GPU_BLOCKS": blocks,
           "KCCL_TIMEOUT_MS": int(os.environ.get("KCCL_TIMEOUT_MS", "3000"))}
    comm = kccl.Communicator.from_mpi(world, device=0, config=cfg)
    for i, (count, inplace) in enumerate(CALLS):
        if RANK == N - 1:
            time.sleep(0.03)
        x = torch.full((count,), float(RANK + 1), dtype=torch.bfloat16, device="cuda")
        if RANK == N - 1:
            x.add_(x.float().sum() * 0)  # a reduction kernel (shared memory) on this stream before the call
        y = x if inplace else torch.empty_like(x)
        what = f"call {i} ({count} elements, {'in place' if inplace else 'out of place'})"
        msg = None
        try:
            comm.all_reduce(x) if inplace else comm.all_reduce(x, y)
            torch.cuda.synchronize()
            if comm.async_error() is not None:  # the kernel recorded a failure (a timeout ends it):
                comm.all_reduce(torch.ones(1, device="cuda"))  # the next call raises it with the details
            if not bool((y.float() == N * (N + 1) / 2).all()):
                msg = f"{what} gave wrong values"
        except kccl.KcclError as e:
            msg = f"{what} failed: {e}"
        if world.allreduce(msg is not None, op=MPI.LOR):  # every rank stops at the same call
            comm.abort()
            return msg or f"{what} passed here; a peer failed"
    comm.close()
    return "all passed"


def main(argv):
    counts = [int(a) for a in argv] or ([0, 18, 22] if N > 4 else [0, 128, 132])
    bad_auto = False
    for b in counts:
        verdict = run(b)
        verdicts = world.gather(verdict, root=0)
        if RANK == 0:
            print(f"KCCL_GPU_BLOCKS={b} ({N} ranks):", flush=True)
            for r, v in enumerate(verdicts):
                print(f"  rank {r}: {v}", flush=True)
            bad_auto |= b == 0 and any(v != "all passed" for v in verdicts)
        world.Barrier()
    return 1 if world.bcast(bad_auto, root=0) else 0


if __name__ == "__main__":
    torch.cuda.set_device(0)
    sys.exit(main(sys.argv[1:]))
