"""KCCL: low-latency collectives over peer-mapped memory.

    uid = kccl.get_unique_id()                      # on one rank, then send it to all
    with kccl.Communicator(nranks, uid, rank) as comm:
        comm.all_reduce(x)                          # in place, sum
        comm.send(x, peer=1); comm.recv(x, peer=0)   # point-to-point
    comm = kccl.Communicator.from_mpi(MPI.COMM_WORLD)
"""
from ._native import lib as _lib
from .communicator import (ANY_SOURCE, AVG, MAX, MIN, PROD, SUM, AllReduceHandle, Communicator, Op, P2PHandle, UniqueId,
                           get_unique_id, gpu_support)
from .errors import (KcclCudaError, KcclError, KcclInProgress, KcclInternalError, KcclInvalidArgument,
                     KcclInvalidUsage, KcclRemoteError, KcclSystemError, KcclTimeout)

__version__ = "0.1.0"
VERSION_CODE = _lib.KCCL_VERSION_CODE

__all__ = ["Communicator", "AllReduceHandle", "P2PHandle", "ANY_SOURCE", "UniqueId", "get_unique_id", "gpu_support", "Op", "SUM", "PROD", "MAX", "MIN", "AVG",
           "KcclError", "KcclCudaError", "KcclSystemError", "KcclInternalError", "KcclInvalidArgument",
           "KcclInvalidUsage", "KcclRemoteError", "KcclInProgress", "KcclTimeout"]
