"""kccl.Communicator: the typed wrapper over the C communicator.

Collectives block until the result is in `recv` and return `recv`.  In place
when `recv` is omitted (all_reduce) or is the same object as `send`.  Every
failure is a KcclError subclass (see kccl.errors); after a peer dies, aborts
or mismatches, the communicator is broken for good and further calls raise
KcclInvalidUsage: build a new one from a new unique id.

A communicator takes its buffers through one adapter picked when it is built:
HostBuffers (numpy and other CPU buffers, blocking calls) or CudaBuffers (GPU
arrays on its device, stream-ordered calls).  A collective is then: resolve the
buffers and the stream through the adapter, call C, check the result."""
import enum
import os

import numpy as np

from . import placement as _placement
from ._buffers import NO_PAIR, HostBuffers, check_same_dtype, prepare_numpy_pair
from . import _cuda_buffers
from ._cuda_buffers import CudaBuffers, library_of
from ._native import ffi, lib
from .errors import KcclInvalidArgument, KcclInvalidUsage, check as _check, error_for

UNIQUE_ID_BYTES = lib.KCCL_UNIQUE_ID_BYTES


class Op(enum.IntEnum):
    SUM = lib.kcclSum
    PROD = lib.kcclProd
    MAX = lib.kcclMax
    MIN = lib.kcclMin
    AVG = lib.kcclAvg


SUM, PROD, MAX, MIN, AVG = Op.SUM, Op.PROD, Op.MAX, Op.MIN, Op.AVG
_OPS = {int(o): int(o) for o in Op}
_OPS.update({o.name.lower(): int(o) for o in Op})


def _resolve_op(op):
    """The kcclRedOp_t code of an Op, its int value, or its name ("sum", ...)."""
    code = _OPS.get(op) if isinstance(op, (int, np.integer, str)) and not isinstance(op, bool) else None
    if code is None:
        raise KcclInvalidArgument(f"unknown reduction op {op!r}; use kccl.SUM, PROD, MAX, MIN or AVG")
    return code


def _as_int(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise KcclInvalidArgument(f"{what} must be an int, got {type(value).__name__}")
    return int(value)


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
    _check(lib.kcclGetUniqueId(uid))
    return UniqueId(ffi.buffer(uid)[:])


def gpu_support():
    """(built with CUDA, number of CUDA devices this process sees)."""
    built, devices = ffi.new("int *"), ffi.new("int *")
    _check(lib.kcclGetGpuSupport(built, devices))
    return bool(built[0]), int(devices[0])


def cuda_build_plan():
    """What the build decided about the CUDA transport and why, as kccl/_build_cuda.decide
    said when this library was compiled: {"mode": KCCL_CUDA then, "nvcc", "driver",
    "build", "why"}."""
    import json
    return json.loads(ffi.string(lib.kccl_cuda_build_plan()).decode())


def _resolve_device(device):
    """-1 (host) for None, else a CUDA ordinal from an int, "cuda:N" / "N", or a torch.device."""
    if device is None:
        return -1
    if isinstance(device, bool):
        raise KcclInvalidArgument("device must be a CUDA device ordinal, not a bool")
    if isinstance(device, (int, np.integer)):
        idx = int(device)
    elif isinstance(device, str):
        text = device.strip().lower()
        text = text[5:] if text.startswith("cuda:") else text
        if not text.isdigit():
            raise KcclInvalidArgument(f"device={device!r}: expected an ordinal like 0 or 'cuda:0'")
        idx = int(text)
    elif getattr(device, "type", None) == "cuda":  # torch.device
        idx = device.index if device.index is not None else 0
    else:
        raise KcclInvalidArgument(f"device must be an int, 'cuda:N' or a torch.device, not {type(device).__name__}")
    if idx < 0:
        raise KcclInvalidArgument(f"device={idx}: CUDA ordinals are >= 0 (None selects the host transport)")
    return idx


# The all_reduce fast path (numpy arrays on a host communicator) binds what it uses to
# module globals: each attribute lookup it avoids is a measurable part of a call.
_ndarray = np.ndarray
_allreduce = lib.kcclAllReduce
_allreduce_start = lib.kcclAllReduceStart
_allreduce_wait = lib.kcclAllReduceWait
_allreduce_test = lib.kcclAllReduceTest
_NULL = ffi.NULL
HOT_MAX_BYTES = 1 << 20  # all_reduce remembers the buffers of its last call up to this size


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
            if rc:  # tested inline: calling _check on every wait would cost more than the test
                _check(rc)
            self._finished = True
        return self.recv

    def test(self):
        if not self._finished:
            out = self._owner._done
            rc = _allreduce_test(self._live(), self._req, out)
            if rc:
                _check(rc)
            self._finished = bool(out[0])
        return self._finished

    @property
    def done(self):
        return self.test()

    def __repr__(self):
        return f"<kccl.AllReduceHandle {self._req} {'done' if self._finished else 'pending'}>"


class GpuAllReduceHandle:
    """An all-reduce started on a GPU communicator (stream-ordered).  wait(stream=None)
    makes `stream` (default: the current stream of recv's library) wait for the sum and
    returns recv at once: read it in stream order, or after synchronizing.  A second
    wait returns recv and enqueues nothing."""
    __slots__ = ("_owner", "_comm", "_req", "recv", "_waited")

    def __init__(self, owner, comm, req, recv):
        self._owner, self._comm, self._req, self.recv = owner, comm, req, recv
        self._waited = False

    def wait(self, stream=None):
        if self._waited:
            return self.recv
        if self._owner._comm is not self._comm:
            raise KcclInvalidUsage(f"the communicator of this all_reduce_start is {self._owner._why_closed}")
        st = self._owner._buffers.resolve_stream(stream, library_of(self.recv))
        _check(lib.kcclAllReduceWaitStream(self._comm, self._req, st))
        self._waited = True
        return self.recv

    def __repr__(self):
        return f"<kccl.GpuAllReduceHandle {self._req} {'waited' if self._waited else 'pending'}>"


ANY_SOURCE = lib.KCCL_ANY_SOURCE


class P2PHandle:
    """A send or receive started by Communicator.send_start / recv_start.  wait() blocks
    until it has completed and returns its buffer; test() never blocks and says whether
    it has (both move every outstanding send and receive of the communicator along).
    source: the rank a completed receive came from (the sender for a send).  A peer
    that died, aborted or failed raises KcclRemoteError; after close() or abort() of
    the communicator they raise KcclInvalidUsage."""
    __slots__ = ("_owner", "_comm", "_req", "buf", "source", "_finished")

    def __init__(self, owner, comm, req, buf):
        self._owner, self._comm, self._req, self.buf = owner, comm, req, buf
        self.source, self._finished = None, False

    def _live(self):
        if self._owner._comm is not self._comm:
            raise KcclInvalidUsage(f"the communicator of this send / receive is {self._owner._why_closed}")
        return self._comm

    def wait(self):
        if not self._finished:
            src = self._owner._source
            _check(lib.kcclP2PWait(self._live(), self._req, src))
            self.source, self._finished = int(src[0]), True
        return self.buf

    def test(self):
        if not self._finished:
            done, src = self._owner._done, self._owner._source
            _check(lib.kcclP2PTest(self._live(), self._req, done, src))
            if done[0]:
                self.source, self._finished = int(src[0]), True
        return self._finished

    @property
    def done(self):
        return self.test()

    def __repr__(self):
        return f"<kccl.P2PHandle {self._req} {'done' if self._finished else 'pending'}>"


class Communicator:
    """A group of `nranks` processes on one host, this process being `rank`.

    Communicator(nranks, unique_id, rank, config=None, device=None): collective, blocks
    until all ranks joined.  config: {setting: value} overriding the KCCL_* environment
    (see `python -m kccl.config`).  device=None: the host transport (numpy / CPU
    buffers, blocking calls); device=N: the GPU transport on CUDA device N (torch CUDA
    tensors, CuPy arrays; calls are stream-ordered and return once enqueued)."""

    def __init__(self, nranks, unique_id, rank, *, config=None, device=None):
        self._comm = None
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
        # Imported here, not at module level: `python -m kccl.config` runs that module as
        # __main__ after importing the package, and runpy warns when the package has
        # already imported it under its own name.
        from . import config as _config
        settings = _config.resolve(config)
        cfg = _config.native_from(ffi, settings)
        device = _resolve_device(device)
        if device >= 0:
            built, ndev = gpu_support()
            if not built:
                raise KcclInvalidUsage("device=%d asked for, but this kccl was built without CUDA (reinstall "
                                       "where nvcc and a GPU driver are, or with KCCL_CUDA=1)" % device)
            if device >= ndev:
                raise KcclInvalidArgument(f"device={device}: this process sees {ndev} CUDA device(s)")
        cfg.device = device
        if device >= 0:  # host replicas serve the host transport's slots; GPU flags are the GPU path's
            pl, plan_note = _placement.one_copy(ffi, "GPU communicator: no host replicas")
        else:
            pl, plan_note = _placement.native(ffi, nranks, rank, settings["KCCL_TOPO"][0],
                                              settings["KCCL_TOPO_FILE"][0])
        pcomm = ffi.new("kcclComm_t *")
        _check(lib.kcclCommInitRankPlacement(pcomm, nranks, uid[0], rank, cfg, pl))
        self._open(pcomm[0], nranks, rank, device, plan_note)

    def _open(self, comm, nranks, rank, device, plan_note):
        """Binds this object to the C communicator `comm` and picks its buffer adapter."""
        self._comm = comm
        self._rank, self._size, self._device = rank, nranks, device
        self._buffers = CudaBuffers(device) if device >= 0 else HostBuffers()
        self._plan_note = plan_note
        self._hot = NO_PAIR
        self._pid = os.getpid()
        self._req = ffi.new("uint64_t *")
        self._done = ffi.new("int *")
        self._source = ffi.new("int *")

    @classmethod
    def from_mpi(cls, mpi_comm, *, config=None, device=None):
        """All ranks of an mpi4py communicator become a KCCL communicator.  Ranks on one
        host (kccl.hosts: same /dev/shm, or same KCCL_HOST_ID) give a Communicator; ranks
        on several hosts a kccl.hierarchical.HierarchicalCommunicator (KCCL inside each
        host, MPI between hosts; host buffers only).
        device: None (host transport), a CUDA ordinal for this rank, or "local": this
        rank's index among the ranks of its host, modulo the GPUs it sees (one GPU per
        rank when there are enough; several ranks per GPU otherwise, as under MPS)."""
        from . import config as _config
        from . import hosts as _hosts
        settings = _config.resolve(config)
        keys = mpi_comm.allgather(_hosts.host_key(settings))
        if len(set(keys)) != 1:
            if device is not None:
                raise KcclInvalidUsage(f"ranks on {len(set(keys))} hosts: a communicator over several hosts takes "
                                       "host buffers only (device=None); its GPU form is designed, not built")
            from .hierarchical import HierarchicalCommunicator
            return HierarchicalCommunicator(mpi_comm, _hosts.HostLayout(keys),
                                            lambda intra, extra: cls._from_mpi_one_host(intra, {**(config or {}),
                                                                                                **extra}, None),
                                            settings)
        return cls._from_mpi_one_host(mpi_comm, config, device)

    @classmethod
    def _from_mpi_one_host(cls, mpi_comm, config, device):
        if isinstance(device, str) and device.strip().lower() == "local":
            ndev = gpu_support()[1]
            if ndev == 0:
                raise KcclInvalidUsage("device='local': this process sees no CUDA device")
            device = mpi_comm.Get_rank() % ndev
        uid = get_unique_id() if mpi_comm.Get_rank() == 0 else None
        uid = mpi_comm.bcast(bytes(uid) if uid is not None else None, root=0)
        return cls(mpi_comm.Get_size(), UniqueId(uid), mpi_comm.Get_rank(), config=config, device=device)

    # -- properties -----------------------------------------------------------------
    @property
    def rank(self):
        return self._rank

    @property
    def size(self):
        return self._size

    @property
    def device(self):
        """The CUDA device of a GPU communicator, None for a host one."""
        return self._device if self._device >= 0 else None

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
    def all_reduce(self, send, recv=None, op=SUM, *, dtype=None, stream=None):
        """recv[i] = send_0[i] op send_1[i] op ... (rank order on every rank). Returns recv.

        Decode calls this with the same small arrays every step, so the arrays and
        pointers of the last call of at most kccl.communicator.HOT_MAX_BYTES are remembered (which
        keeps those arrays referenced, and unresizable, until a call with other
        arrays or close()); dtype and writability are still checked every call."""
        if recv is None:
            recv = send
        if type(send) is _ndarray and dtype is None and stream is None and (type(op) is Op or type(op) is int):
            hot = self._hot
            if not (send is hot[0] and recv is hot[1] and send.dtype is hot[2] and hot[1].flags.writeable):
                hot = prepare_numpy_pair(send, recv)
                if hot[1] is not None and send.nbytes <= HOT_MAX_BYTES:
                    self._hot = hot
            _s, _r, _d, sp, rp, n, code = hot
            opc = _OPS.get(op)
            comm = self._comm
            if sp is not None and opc is not None and comm is not None:
                rc = _allreduce(sp, rp, n, code, opc, comm, _NULL)
                if rc:  # tested inline: a call to _check would be ~5% of this path
                    _check(rc)
                return recv
        if type(send) is _cuda_buffers.TORCH_TENSOR and dtype is None and stream is None \
                and type(self._buffers) is HostBuffers:
            # CPU torch tensors on a host communicator: the pointers of the last pair are
            # remembered (HostBuffers.torch_pair); the check of that memory is inlined here
            # because each torch attribute read costs about as much as the all-reduce itself
            opc = _OPS.get(op) if type(op) is Op or type(op) is int else None
            comm = self._comm
            if opc is not None and comm is not None:
                h = self._buffers._torch_pair
                if (h[0]() is send and h[1]() is recv and send.data_ptr() == h[2] and send.numel() == h[3]
                        and send.dtype is h[4] and send.is_contiguous() and recv is send):
                    sp, rp, n, code = h[6]
                else:
                    sp, rp, n, code = self._buffers.torch_pair(send, recv)
                rc = _allreduce(sp, rp, n, code, opc, comm, _NULL)
                if rc:
                    _check(rc)
                return recv
        if type(send) is _cuda_buffers.TORCH_TENSOR and dtype is None and stream is None \
                and type(self._buffers) is CudaBuffers:
            # torch tensors on a GPU communicator, torch's current stream (eager decode)
            bufs, comm = self._buffers, self._handle()
            sp, rp, n, code = bufs.torch_pair(send, recv)
            opc = _OPS.get(op) if type(op) is Op or type(op) is int else None
            rc = _allreduce(sp, rp, n, code, _resolve_op(op) if opc is None else opc, comm, bufs.torch_stream())
            if rc:
                _check(rc)
            return recv
        if _cuda_buffers.TORCH_TENSOR is None and type(send).__module__ == "torch":
            _cuda_buffers._torch_codes()  # binds torch.Tensor for the fast paths above
        comm, bufs = self._handle(), self._buffers
        opc = _resolve_op(op)
        sp, rp, n, code, library = bufs.resolve_pair(send, recv, dtype)
        _check(lib.kcclAllReduce(sp, rp, n, code, opc, comm, bufs.resolve_stream(stream, library)))
        return recv

    def all_reduce_start(self, send, recv=None, op=SUM, *, dtype=None, stream=None):
        """Starts an all-reduce and returns at once with an AllReduceHandle; its wait()
        puts the result in recv (in place when recv is omitted) and returns recv.

        send is copied before this returns (reuse it freely); recv must not be read
        until wait().  Operations complete in start order (waiting for one completes
        every older one).  At most config max_outstanding (KCCL_MAX_OUTSTANDING,
        default 1) may be started and not waited (KcclInvalidUsage beyond), a
        message holds at most KCCL_BUFFER_BYTES, and blocking collectives are
        refused while any is outstanding.

        On a GPU communicator it is stream-ordered (kcclAllReduceStartStream): the
        sum runs on the communicator's side stream after the work on `stream` (default:
        the current stream of the array's library), any size; the handle's
        wait(stream=...) makes that stream wait for it, returns at once, and can be
        captured in a CUDA graph with the start."""
        if recv is None:
            recv = send
        comm, bufs, req = self._handle(), self._buffers, self._req
        opc = _resolve_op(op)
        sp, rp, n, code, library = bufs.resolve_pair(send, recv, dtype)
        st = bufs.resolve_stream(stream, library)
        if self._device >= 0:
            _check(lib.kcclAllReduceStartStream(sp, rp, n, code, opc, comm, st, req))
            return GpuAllReduceHandle(self, comm, req[0], recv)
        rc = _allreduce_start(sp, rp, n, code, opc, comm, req)
        if rc:
            _check(rc)
        return AllReduceHandle(self, comm, req[0], recv)

    def all_gather(self, send, recv=None, *, dtype=None, stream=None):
        """recv = concatenation of every rank's send, in rank order.  recv=None allocates
        (numpy sends; torch / CuPy on a GPU communicator): shape (size, *send.shape)."""
        comm, bufs = self._handle(), self._buffers
        if recv is None:
            recv = bufs.alloc_like(send, (self._size,) + tuple(np.shape(send)), dtype)
        sp, n, code, library = bufs.resolve_buffer(send, dtype, False, "send")
        rp, rn, rcode, _ = bufs.resolve_buffer(recv, dtype, True, "recv")
        check_same_dtype(code, rcode)
        if rn != n * self._size:
            raise KcclInvalidArgument(f"all_gather: recv has {rn} elements, needs size*send = {n * self._size}")
        _check(lib.kcclAllGather(sp, rp, n, code, comm, bufs.resolve_stream(stream, library)))
        return recv

    def reduce_scatter(self, send, recv=None, op=SUM, *, dtype=None, stream=None):
        """Rank r receives block r of the reduction of every rank's send (size equal blocks).
        recv=None allocates (numpy sends; torch / CuPy on a GPU communicator): send.size // size elements."""
        comm, bufs = self._handle(), self._buffers
        opc = _resolve_op(op)
        sp, n, code, library = bufs.resolve_buffer(send, dtype, False, "send")
        if n % self._size:
            raise KcclInvalidArgument(f"reduce_scatter: send has {n} elements, not a multiple of size={self._size}")
        if recv is None:
            recv = bufs.alloc_like(send, (n // self._size,), dtype)
        rp, rn, rcode, _ = bufs.resolve_buffer(recv, dtype, True, "recv")
        check_same_dtype(code, rcode)
        if rn * self._size != n:
            raise KcclInvalidArgument(f"reduce_scatter: recv has {rn} elements, needs send/size = {n // self._size}")
        _check(lib.kcclReduceScatter(sp, rp, rn, code, opc, comm, bufs.resolve_stream(stream, library)))
        return recv

    def broadcast(self, buf, root=0, *, dtype=None, stream=None):
        """root's buf is copied into every other rank's buf (in place). Returns buf."""
        comm, bufs = self._handle(), self._buffers
        root = _as_int(root, "root")
        if not 0 <= root < self._size:
            raise KcclInvalidArgument(f"root {root} out of range for size={self._size}")
        p, n, code, library = bufs.resolve_buffer(buf, dtype, True, "buf")
        _check(lib.kcclBroadcast(p, p, n, code, root, comm, bufs.resolve_stream(stream, library)))
        return buf

    def barrier(self, *, stream=None):
        """Host communicator: blocks until every rank arrived.  GPU communicator:
        stream-ordered (work after it on `stream` (default: the legacy default stream)
        starts once every rank's stream reached it)."""
        comm = self._handle()
        _check(lib.kcclBarrier(comm, self._buffers.resolve_stream(stream, None)))

    # -- point-to-point (host communicators) -------------------------------------------
    def _peer(self, peer, any_ok):
        if any_ok and peer is None:
            return ANY_SOURCE
        peer = _as_int(peer, "peer")
        if not (0 <= peer < self._size or (any_ok and peer == ANY_SOURCE)):
            raise KcclInvalidArgument(f"peer {peer} out of range for size={self._size}")
        return peer

    def _p2p_buffer(self, buf, dtype, writable):
        """A message moves bytes: a buffer of a type KCCL does not reduce (uint16, bool, ...)
        goes as its bytes."""
        try:
            return self._buffers.resolve_buffer(buf, dtype, writable, "buf")
        except KcclInvalidArgument:
            if dtype is not None:
                raise
            return self._buffers.resolve_buffer(buf, "uint8", writable, "buf")

    def send_start(self, buf, peer, *, tag=0, dtype=None):
        """Starts sending buf to rank `peer` and returns a P2PHandle at once.  buf must
        stay unchanged until the handle completes (its last piece is in the peer's ring:
        that may be before the peer receives it).  Messages from one rank to another
        are received in the order they were sent, matched by tag."""
        comm = self._handle()
        p, n, code, _ = self._p2p_buffer(buf, dtype, False)
        _check(lib.kcclSendStart(p, n, code, self._peer(peer, False), _as_int(tag, "tag"), comm, self._req))
        return P2PHandle(self, comm, self._req[0], buf)

    def recv_start(self, buf, peer=None, *, tag=0, dtype=None):
        """Starts receiving into buf the next message with `tag` from rank `peer` (None or
        kccl.ANY_SOURCE: from any rank; the handle's source says which) and returns a
        P2PHandle at once.  The message must have buf's byte count (else
        KcclRemoteError on both sides)."""
        comm = self._handle()
        p, n, code, _ = self._p2p_buffer(buf, dtype, True)
        _check(lib.kcclRecvStart(p, n, code, self._peer(peer, True), _as_int(tag, "tag"), comm, self._req))
        return P2PHandle(self, comm, self._req[0], buf)

    def send(self, buf, peer, *, tag=0, dtype=None):
        """Sends buf to rank `peer` (blocking: returns once buf may be reused).  Returns buf."""
        return self.send_start(buf, peer, tag=tag, dtype=dtype).wait()

    def recv(self, buf, peer=None, *, tag=0, dtype=None):
        """Receives the next message with `tag` from rank `peer` (None: any rank) into buf,
        blocking.  Returns buf."""
        return self.recv_start(buf, peer, tag=tag, dtype=dtype).wait()

    # -- device-side API (GPU communicators) ----------------------------------------------
    def dev_comm(self):
        """The kcclDevComm (kccl_device.cuh) as bytes, to pass by value to a kernel
        that calls kcclDevAllReduce (e.g. as a CuPy RawKernel argument)."""
        out = ffi.new("char[]", lib.KCCL_DEV_COMM_BYTES)
        _check(lib.kcclCommGetDevComm(self._handle(), out, lib.KCCL_DEV_COMM_BYTES))
        return ffi.buffer(out)[:]

    def gpu_flag_replicas(self):
        """Per-L2-partition flag replicas of this GPU communicator (KCCL_GPU_FLAG_REPLICAS):
        {"requested": bool, "enabled": bool (every rank's calibration found two L2 groups),
        "note": what this rank's calibration found, or why the replicas are disabled}.
        KcclInvalidUsage on a host communicator."""
        state = ffi.new("int *")
        note = ffi.new("char[]", 512)
        _check(lib.kcclCommGpuFlagReplicas(self._handle(), state, note, 512))
        return {"requested": state[0] != 0, "enabled": state[0] == 1,
                "note": ffi.string(note).decode(errors="replace")}

    def topo_info(self):
        """How this rank's replicas are placed: {"ndomains", "domain", "replicas" (remote
        replicas it writes), "bound" (1 verified on their NUMA nodes, 0 unverified, -1
        failed), "pushes", "replica_reads", "note" (the binding, from C), "plan" (why this
        placement: "KCCL_TOPO=off", "one domain: one copy", "domain 1 of 2", ...), "hosts" (1:
        every rank on this host; see kccl.hierarchical), "host" (0)}."""
        info = ffi.new("kcclTopoInfo_t *")
        _check(lib.kcclCommTopoInfo(self._handle(), info))
        return {"ndomains": info.ndomains, "domain": info.domain, "replicas": info.replicas,
                "bound": info.bound, "pushes": int(info.pushes), "replica_reads": int(info.replicaReads),
                "note": ffi.string(info.note).decode(errors="replace"), "plan": self._plan_note,
                "hosts": 1, "host": 0}

    # -- life cycle -----------------------------------------------------------------
    def async_error(self):
        """None while usable, else the KcclError that broke the communicator."""
        out = ffi.new("kcclResult_t *")
        _check(lib.kcclCommGetAsyncError(self._handle(), out))
        return None if out[0] == lib.kcclSuccess else error_for(int(out[0]), "communicator failed earlier")

    def expect_long_wait(self):
        """This rank's next blocking collective on this communicator will wait long (for a
        peer busy elsewhere, e.g. in a network leg): its waits sleep at once instead of
        spinning and yielding first, leaving the core to the ranks doing the work.  For that
        one collective (kcclCommExpectLongWait)."""
        _check(lib.kcclCommExpectLongWait(self._handle()))

    def abort(self):
        """Local and immediate: peers blocked in a collective with this rank get KcclRemoteError."""
        comm, self._comm = self._comm, None
        self._hot = NO_PAIR
        self._buffers.forget()
        if comm is not None:
            self._why_closed = "aborted"
            lib.kcclCommAbort(comm)

    def close(self):
        """Releases the communicator (idempotent)."""
        comm, self._comm = self._comm, None
        self._hot = NO_PAIR
        self._buffers.forget()
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
