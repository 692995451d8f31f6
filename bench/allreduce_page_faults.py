"""Minor page faults and time per 64 MB float32 all-reduce, KCCL against MPI, alternating
rounds of 4 calls on the same buffers (`getrusage` before and after each round, rank 0).

    mpiexec -n 2 python bench/allreduce_page_faults.py
"""
import resource
import time

import numpy as np
from mpi4py import MPI

import kccl


def timed(world, fn, calls):
    world.Barrier()
    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    for _ in range(calls):
        fn()
    dt = (time.perf_counter() - t0) / calls * 1e6
    return dt, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / calls


def main(rounds=6, calls=4, nbytes=64 << 20):
    world = MPI.COMM_WORLD
    comm = kccl.Communicator.from_mpi(world)
    send = np.ones(nbytes // 4, np.float32)
    recv, mrecv = np.zeros_like(send), np.zeros_like(send)
    for i in range(rounds):
        kt, kf = timed(world, lambda: comm.all_reduce(send, recv), calls)
        mt, mf = timed(world, lambda: world.Allreduce(send, mrecv), calls)
        if world.rank == 0:
            print(f"round {i}: kccl {kt:8.0f} us {kf:7.0f} faults/call | mpi {mt:8.0f} us {mf:7.0f} faults/call",
                  flush=True)
    comm.close()


if __name__ == "__main__":
    main()
