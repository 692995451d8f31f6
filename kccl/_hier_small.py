"""What a repeated small hierarchical all-reduce of the same numpy pair needs, resolved
once (HierarchicalCommunicator.all_reduce's remembered pair).

On 2 simulated hosts x 2 ranks sharing 2 cores a small all-reduce's latency is the CPU
all ranks burn per call divided by the cores, and ~50 us of a leader's ~80 us per call
were Python resolving the same buffers, op, MPI buffer specs and signature again and
again.  A SmallAllReduce holds all of it: the C pointers (both KCCL calls go straight to
the cffi functions), the leaders' (signature, host sum) exchange buffers with their MPI
specs, the signature in place in the block (only the sequence number changes per call),
and the rows the host sums are combined from.  Every check the first call made still
holds for the same objects (same dtype object, same size, C-contiguous: a numpy array
cannot be resized while referenced), except writability, which the caller re-checks."""
import numpy as np
from mpi4py import MPI

from . import _hier_wire as wire
from ._native import ffi

SIG_BYTES = 48  # a collective's signature: six int64 (kind, op, type, count, root, sequence)
_COMBINE = {wire.SUM: np.add, wire.AVG: np.add, wire.PROD: np.multiply, wire.MAX: np.maximum,
            wire.MIN: np.minimum}


class SmallAllReduce:
    __slots__ = ("send", "recv", "dtype", "op", "opc", "local_op", "code", "n", "sp", "rp", "r", "block",
                 "every", "block_data", "block_sig", "sig", "every_sig", "rows", "sums", "combine", "avg",
                 "send_spec", "recv_spec")

    def __init__(self, send, recv, op, opc, code, r, nhosts, leader):
        self.send, self.recv, self.dtype, self.op, self.opc, self.code = send, recv, send.dtype, op, opc, code
        self.local_op = wire.SUM if opc == wire.AVG else opc
        self.n = r.size
        self.r = r  # recv's flat storage view: the leader combines the host sums into it
        self.rp = ffi.from_buffer(recv)
        self.sp = self.rp if recv is send else ffi.from_buffer(send)
        self.combine = _COMBINE[opc]
        self.avg = opc == wire.AVG
        if not leader:
            return
        nb = SIG_BYTES + r.nbytes
        self.block = np.zeros(nb, np.uint8)
        self.every = np.empty((nhosts, nb), np.uint8)
        self.block_data = self.block[SIG_BYTES:].view(r.dtype)
        self.block_sig = self.block[:SIG_BYTES]
        self.sig = self.block_sig.view(np.int64)
        self.sig[:5] = (1, opc, code, self.n, -1)  # kind all_reduce, op, type, count, root; [5]: sequence
        self.every_sig = self.every[:, :SIG_BYTES]
        self.sums = self.every[:, SIG_BYTES:].view(r.dtype)
        self.rows = tuple(self.sums)
        self.send_spec = [self.block, MPI.BYTE]
        self.recv_spec = [self.every, MPI.BYTE]
