"""kccl.Communicator: the typed wrapper over the C communicator.

Collectives block until the result is in `recv` and return `recv`.  In place
when `recv` is omitted (all_reduce) or is the same object as `send`.  Every
failure is a KcclError subclass (see kccl.errors); after a peer dies, aborts
or mismatches, the communicator is broken for good and further calls raise
KcclInvalidUsage: build a new one from a new unique id."""
import enum
import os

import numpy as np

from . import config as _config
from ._buffers import NAMES, NUMPY_CODES, resolve
from ._native import ffi, lib
from .errors import KcclInvalidArgument, KcclInvalidUsage, error_for

UNIQUE_ID_BYTES = lib.KCCL_UNIQUE_ID_BYTES


class Op(enum.IntEnum):
    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4


SUM, PROD, MAX, MIN, AVG = Op.SUM, Op.PROD, Op.MAX, Op.MIN, Op.AVG
_OPS = {int(o): int(o) for o in Op}
_OPS.update({o.name.lower(): int(o) for o in Op})


def _op_code(op):
    code = _OPS.get(op) if isinstance(op, (int, np.integer, str)) and not isinstance(op, bool) else None
    if code is None:
        raise KcclInvalidArgument(f"unknown reduction op {op!r}; use kccl.SUM, PROD, MAX, MIN or AVG")
    return code


def _raise(rc):
    raise error_for(rc, ffi.string(lib.kcclGetLastError(ffi.NULL)).decode(errors="replace"))


class UniqueId(bytes):
    """The 128-byte id that names a communicator; send it to every rank (it pickles)."""

    def __new__(cls, data):
        data = bytes(data)
        if len(data) != UNIQUE_ID_BYTES:
            raise KcclInvalidArgument(f"a unique id has {UNIQUE_ID_BYTES} bytes, got {len(data)}")
        return super().__new__(cls, data)

    def __repr__(self):
        return f"UniqueId({self[16:32].hex()})"


def get_unique_id():
    uid = ffi.new("kcclUniqueId *")
    rc = lib.kcclGetUniqueId(uid)
    if rc:
        _raise(rc)
    return UniqueId(ffi.buffer(uid)[:])


def _as_int(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise KcclInvalidArgument(f"{what} must be an int, got {type(value).__name__}")
    return int(value)


_ndarray = np.ndarray
_from_buffer = ffi.from_buffer
_allreduce = lib.kcclAllReduce
_allreduce_start = lib.kcclAllReduceStart
_allreduce_wait = lib.kcclAllReduceWait
_allreduce_test = lib.kcclAllReduceTest
_NULL = ffi.NULL
_NPCODES = NUMPY_CODES
_NO_HOT = (None,) * 7
HOT_MAX_BYTES = 1 << 20  # all_reduce remembers the buffers of its last call up to this size


def _prepare(send, recv):
    """(send, recv, dtype, send ptr, recv ptr, count, code) for a numpy pair the
    fast path takes, else _NO_HOT (the general path then says what is wrong)."""
    code = _NPCODES.get(send.dtype)
    if code is None or type(recv) is not _ndarray or not recv.flags.writeable:
        return _NO_HOT
    try:
        if recv is send:
            sp = rp = _from_buffer(send)
        elif recv.dtype == send.dtype and recv.nbytes == send.nbytes:
            sp = _from_buffer(send)
            rp = _from_buffer(recv)
        else:
            return _NO_HOT
    except ValueError:  # not C-contiguous
        return _NO_HOT
    return (send, recv, send.dtype, sp, rp, send.size, code)


class AllReduceHandle:
    """An all-reduce started by Communicator.all_reduce_start.  wait() blocks until the
    result is in recv and returns recv (again at once on later calls); test() never
    blocks and says whether it has completed (completing it when every peer's data
    is there); done is test() as a property.  A peer that died or aborted raises
    KcclRemoteError from either; after close() or abort() of the communicator they
    raise KcclInvalidUsage."""
    __slots__ = ("_owner", "_comm", "_req", "recv", "_finished")

    def __init__(self, owner, comm, req, recv):
        self._owner, self._comm, self._req, self.recv = owner, comm, req, recv
        self._finished = False

    def _live(self):
        if self._owner._comm is not self._comm:
            raise KcclInvalidUsage(f"the communicator of this all_reduce_start is {self._owner._why_closed}")
        return self._comm

    def wait(self):
        if not self._finished:
            rc = _allreduce_wait(self._live(), self._req)
            if rc:
                _raise(rc)
            self._finished = True
        return self.recv

    def test(self):
        if not self._finished:
            out = self._owner._done
            rc = _allreduce_test(self._live(), self._req, out)
            if rc:
                _raise(rc)
            self._finished = bool(out[0])
        return self._finished

    @property
    def done(self):
        return self.test()

    def __repr__(self):
        return f"<kccl.AllReduceHandle {self._req} {'done' if self._finished else 'pending'}>"


class Communicator:
    """A group of `nranks` processes on one host, this process being `rank`.

    Communicator(nranks, unique_id, rank, config=None): collective, blocks until all
    ranks joined.  config: {setting: value} overriding the KCCL_* environment
    (see `python -m kccl.config`)."""

    def __init__(self, nranks, unique_id, rank, *, config=None):
        self._comm = None
        self._hot = _NO_HOT
        self._why_closed = "never initialised"
        nranks = _as_int(nranks, "nranks")
        rank = _as_int(rank, "rank")
        if nranks < 1:
            raise KcclInvalidArgument(f"nranks must be >= 1, got {nranks}")
        if not 0 <= rank < nranks:
            raise KcclInvalidArgument(f"rank {rank} out of range for nranks={nranks}")
        if not isinstance(unique_id, (bytes, bytearray, memoryview)):
            raise KcclInvalidArgument(f"unique_id must be a kccl.UniqueId (bytes), got {type(unique_id).__name__}")
        uid = ffi.new("kcclUniqueId *")
        ffi.buffer(uid)[:] = UniqueId(unique_id)
        cfg = _config.native(ffi, config)
        pcomm = ffi.new("kcclComm_t *")
        rc = lib.kcclCommInitRankConfig(pcomm, nranks, uid[0], rank, cfg)
        if rc:
            _raise(rc)
        self._comm = pcomm[0]
        self._rank, self._size = rank, nranks
        self._pid = os.getpid()
        self._req = ffi.new("uint64_t *")
        self._done = ffi.new("int *")

    @classmethod
    def from_mpi(cls, mpi_comm, *, config=None):
        """All ranks of an mpi4py communicator (all on one host) become a KCCL communicator."""
        from mpi4py import MPI
        hosts = mpi_comm.allgather(MPI.Get_processor_name())
        if len(set(hosts)) != 1:
            raise KcclInvalidUsage(f"the host transport needs every rank on one host; ranks run on {sorted(set(hosts))}")
        uid = get_unique_id() if mpi_comm.Get_rank() == 0 else None
        uid = mpi_comm.bcast(bytes(uid) if uid is not None else None, root=0)
        return cls(mpi_comm.Get_size(), UniqueId(uid), mpi_comm.Get_rank(), config=config)

    # -- properties -----------------------------------------------------------------
    @property
    def rank(self):
        return self._rank

    @property
    def size(self):
        return self._size

    @property
    def closed(self):
        return self._comm is None

    def _handle(self):
        comm = self._comm
        if comm is None:
            raise KcclInvalidUsage(f"communicator is closed ({self._why_closed})")
        return comm

    def __repr__(self):
        state = "closed" if self._comm is None else "open"
        return f"<kccl.Communicator rank {getattr(self, '_rank', '?')}/{getattr(self, '_size', '?')} {state}>"

    # -- collectives ----------------------------------------------------------------
    def all_reduce(self, send, recv=None, op=SUM, *, dtype=None):
        """recv[i] = send_0[i] op send_1[i] op ... (rank order on every rank). Returns recv.

        Decode calls this with the same small arrays every step, so the arrays and
        pointers of the last call of at most kccl.communicator.HOT_MAX_BYTES are remembered (which
        keeps those arrays referenced, and unresizable, until a call with other
        arrays or close()); dtype and writability are still checked every call."""
        if recv is None:
            recv = send
        if type(send) is _ndarray and dtype is None and (type(op) is Op or type(op) is int):
            hot = self._hot
            if not (send is hot[0] and recv is hot[1] and send.dtype is hot[2] and hot[1].flags.writeable):
                hot = _prepare(send, recv)
                if hot[1] is not None and send.nbytes <= HOT_MAX_BYTES:
                    self._hot = hot
            _s, _r, _d, sp, rp, n, code = hot
            opc = _OPS.get(op)
            comm = self._comm
            if sp is not None and opc is not None and comm is not None:
                rc = _allreduce(sp, rp, n, code, opc, comm, _NULL)
                if rc:
                    _raise(rc)
                return recv
        return self._all_reduce_general(send, recv, op, dtype)

    def all_reduce_start(self, send, recv=None, op=SUM, *, dtype=None):
        """Starts an all-reduce and returns at once with an AllReduceHandle; its wait()
        puts the result in recv (in place when recv is omitted) and returns recv.

        send is copied before this returns (reuse it freely); recv must not be read
        until wait().  Operations complete in start order (waiting for one completes
        every older one).  At most config max_outstanding (KCCL_MAX_OUTSTANDING,
        default 1) may be started and not waited (KcclInvalidUsage beyond), a
        message holds at most KCCL_BUFFER_BYTES, and blocking collectives are
        refused while any is outstanding."""
        if recv is None:
            recv = send
        comm = self._handle()
        opc = _op_code(op)
        if type(send) is _ndarray and dtype is None:
            hot = _prepare(send, recv)
            sp, rp, n, code = hot[3], hot[4], hot[5], hot[6]
            if sp is None:
                sp, rp, n, code = self._reduce_pair(send, recv, dtype)
        else:
            sp, rp, n, code = self._reduce_pair(send, recv, dtype)
        req = self._req
        rc = _allreduce_start(sp, rp, n, code, opc, comm, req)
        if rc:
            _raise(rc)
        return AllReduceHandle(self, comm, req[0], recv)

    def _all_reduce_general(self, send, recv, op, dtype):
        comm = self._handle()
        opc = _op_code(op)
        sp, rp, n, code = self._reduce_pair(send, recv, dtype)
        rc = lib.kcclAllReduce(sp, rp, n, code, opc, comm, _NULL)
        if rc:
            _raise(rc)
        return recv

    def _reduce_pair(self, send, recv, dtype):
        """(send ptr, recv ptr, count, dtype code) for an all-reduce of send into recv
        (recv is send: in place), with every check and its message."""
        inplace = recv is send
        sp, n, code, _ = resolve(send, dtype, inplace, "recv" if inplace else "send")
        if inplace:
            return sp, sp, n, code
        rp, rn, rcode, _ = resolve(recv, dtype, True, "recv")
        self._same_dtype(code, rcode)
        if rn != n:
            raise KcclInvalidArgument(f"recv has {rn} elements, send {n}: all_reduce needs equal sizes")
        return sp, rp, n, code

    @staticmethod
    def _same_dtype(a, b):
        if a != b:
            raise KcclInvalidArgument(f"send is {NAMES[a]} but recv is {NAMES[b]}")

    def all_gather(self, send, recv=None, *, dtype=None):
        """recv = concatenation of every rank's send, in rank order.  recv=None allocates
        (numpy sends): shape (size, *send.shape)."""
        comm = self._handle()
        if recv is None:
            recv = self._alloc_like(send, (self._size,) + np.shape(send), dtype)
        sp, n, code, _ = resolve(send, dtype, False, "send")
        rp, rn, rcode, _ = resolve(recv, dtype, True, "recv")
        self._same_dtype(code, rcode)
        if rn != n * self._size:
            raise KcclInvalidArgument(f"all_gather: recv has {rn} elements, needs size*send = {n * self._size}")
        rc = lib.kcclAllGather(sp, rp, n, code, comm, _NULL)
        if rc:
            _raise(rc)
        return recv

    def reduce_scatter(self, send, recv=None, op=SUM, *, dtype=None):
        """Rank r receives block r of the reduction of every rank's send (size equal blocks).
        recv=None allocates (numpy sends): send.size // size elements."""
        comm = self._handle()
        opc = _op_code(op)
        sp, n, code, _ = resolve(send, dtype, False, "send")
        if n % self._size:
            raise KcclInvalidArgument(f"reduce_scatter: send has {n} elements, not a multiple of size={self._size}")
        if recv is None:
            recv = self._alloc_like(send, (n // self._size,), dtype)
        rp, rn, rcode, _ = resolve(recv, dtype, True, "recv")
        self._same_dtype(code, rcode)
        if rn * self._size != n:
            raise KcclInvalidArgument(f"reduce_scatter: recv has {rn} elements, needs send/size = {n // self._size}")
        rc = lib.kcclReduceScatter(sp, rp, rn, code, opc, comm, _NULL)
        if rc:
            _raise(rc)
        return recv

    def broadcast(self, buf, root=0, *, dtype=None):
        """root's buf is copied into every other rank's buf (in place). Returns buf."""
        comm = self._handle()
        root = _as_int(root, "root")
        if not 0 <= root < self._size:
            raise KcclInvalidArgument(f"root {root} out of range for size={self._size}")
        p, n, code, _ = resolve(buf, dtype, True, "buf")
        rc = lib.kcclBroadcast(p, p, n, code, root, comm, _NULL)
        if rc:
            _raise(rc)
        return buf

    def barrier(self):
        rc = lib.kcclBarrier(self._handle(), _NULL)
        if rc:
            _raise(rc)

    def bench_all_reduce(self, send, recv=None, op=SUM, iters=1000, *, dtype=None):
        """Mean microseconds of `iters` back-to-back all-reduces timed inside C."""
        comm = self._handle()
        opc = _op_code(op)
        sp, rp, n, code = self._reduce_pair(send, send if recv is None else recv, dtype)
        out = ffi.new("double *")
        rc = lib.kcclBenchAllReduce(sp, rp, n, code, opc, comm, _as_int(iters, "iters"), out)
        if rc:
            _raise(rc)
        return out[0]

    @staticmethod
    def _alloc_like(send, shape, dtype):
        if isinstance(send, np.ndarray) and dtype is None:
            return np.empty(shape, dtype=send.dtype)
        raise KcclInvalidArgument("pass recv explicitly unless send is a numpy array and dtype is None")

    # -- life cycle -----------------------------------------------------------------
    def async_error(self):
        """None while usable, else the KcclError that broke the communicator."""
        out = ffi.new("kcclResult_t *")
        rc = lib.kcclCommGetAsyncError(self._handle(), out)
        if rc:
            _raise(rc)
        return None if out[0] == 0 else error_for(int(out[0]), "communicator failed earlier")

    def abort(self):
        """Local and immediate: peers blocked in a collective with this rank get KcclRemoteError."""
        comm, self._comm = self._comm, None
        self._hot = _NO_HOT
        if comm is not None:
            self._why_closed = "aborted"
            lib.kcclCommAbort(comm)

    def close(self):
        """Releases the communicator (idempotent)."""
        comm, self._comm = self._comm, None
        self._hot = _NO_HOT
        if comm is not None:
            self._why_closed = "closed"
            lib.kcclCommDestroy(comm)

    def __enter__(self):
        self._handle()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()

    def __del__(self):
        # Not in a forked child: the handle belongs to the parent's mappings.
        if getattr(self, "_comm", None) is not None and getattr(self, "_pid", None) == os.getpid():
            self.close()
