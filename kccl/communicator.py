"""kccl.Communicator: the typed wrapper over the C communicator.

Collectives block until the result is in `recv` and return `recv`.  In place
when `recv` is omitted (all_reduce) or is the same object as `send`.  Every
failure is a KcclError subclass (see kccl.errors); after a peer dies, aborts
or mismatches, the communicator is broken for good and further calls raise
KcclInvalidUsage: build a new one from a new unique id."""
import enum
import os

import numpy as np

from . import placement as _placement
from . import _cuda_buffers as _cu
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


def _device_index(device):
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


def gpu_support():
    """(built with CUDA, number of CUDA devices this process sees)."""
    built, devices = ffi.new("int *"), ffi.new("int *")
    rc = lib.kcclGetGpuSupport(built, devices)
    if rc:
        _raise(rc)
    return bool(built[0]), int(devices[0])


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
        st = ffi.cast("void *", _cu.stream_handle(stream, _cu.library_of(self.recv), self._owner._device))
        rc = lib.kcclAllReduceWaitStream(self._comm, self._req, st)
        if rc:
            _raise(rc)
        self._waited = True
        return self.recv

    def __repr__(self):
        return f"<kccl.GpuAllReduceHandle {self._req} {'waited' if self._waited else 'pending'}>"


class Communicator:
    """A group of `nranks` processes on one host, this process being `rank`.

    Communicator(nranks, unique_id, rank, config=None, device=None): collective, blocks
    until all ranks joined.  config: {setting: value} overriding the KCCL_* environment
    (see `python -m kccl.config`).  device=None: the host transport (numpy / CPU
    buffers, blocking calls); device=N: the GPU transport on CUDA device N (torch CUDA
    tensors, CuPy arrays; calls are stream-ordered and return once enqueued)."""

    def __init__(self, nranks, unique_id, rank, *, config=None, device=None):
        self._comm = None
        self._device = -1
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
        # Imported here, not at module level: `python -m kccl.config` runs that module as
        # __main__ after importing the package, and runpy warns when the package has
        # already imported it under its own name.
        from . import config as _config
        settings = _config.resolve(config)
        cfg = _config.native_from(ffi, settings)
        device = _device_index(device)
        if device >= 0:
            built, ndev = gpu_support()
            if not built:
                raise KcclInvalidUsage("device=%d asked for, but this kccl was built without CUDA (reinstall "
                                       "with nvcc on PATH; KCCL_CUDA=1 makes a missing nvcc an error)" % device)
            if device >= ndev:
                raise KcclInvalidArgument(f"device={device}: this process sees {ndev} CUDA device(s)")
        cfg.device = device
        if device >= 0:  # host replicas serve the host transport's slots; GPU flags are the GPU path's
            pl, self._plan_note = _placement.one_copy(ffi, "GPU communicator: no host replicas")
        else:
            pl, self._plan_note = _placement.native(ffi, nranks, rank, settings["KCCL_TOPO"][0],
                                                    settings["KCCL_TOPO_FILE"][0])
        pcomm = ffi.new("kcclComm_t *")
        rc = lib.kcclCommInitRankPlacement(pcomm, nranks, uid[0], rank, cfg, pl)
        if rc:
            _raise(rc)
        self._comm = pcomm[0]
        self._device = device
        self._rank, self._size = rank, nranks
        self._pid = os.getpid()
        self._req = ffi.new("uint64_t *")
        self._done = ffi.new("int *")

    @classmethod
    def from_mpi(cls, mpi_comm, *, config=None, device=None):
        """All ranks of an mpi4py communicator (all on one host) become a KCCL communicator.
        device: None (host transport), a CUDA ordinal for this rank, or "local": this
        rank's index among the ranks of its host, modulo the GPUs it sees (one GPU per
        rank when there are enough; several ranks per GPU otherwise, as under MPS)."""
        from mpi4py import MPI
        hosts = mpi_comm.allgather(MPI.Get_processor_name())
        if len(set(hosts)) != 1:
            raise KcclInvalidUsage(f"KCCL needs every rank on one host; ranks run on {sorted(set(hosts))}")
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
        return self._all_reduce_general(send, recv, op, dtype, stream)

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
        comm = self._handle()
        opc = _op_code(op)
        if self._device >= 0:
            sp, rp, n, code, st = self._gpu_pair(send, recv, dtype, stream)
            req = self._req
            rc = lib.kcclAllReduceStartStream(sp, rp, n, code, opc, comm, st, req)
            if rc:
                _raise(rc)
            return GpuAllReduceHandle(self, comm, req[0], recv)
        self._no_stream(stream)
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

    def _all_reduce_general(self, send, recv, op, dtype, stream=None):
        comm = self._handle()
        opc = _op_code(op)
        if self._device >= 0:
            sp, rp, n, code, st = self._gpu_pair(send, recv, dtype, stream)
            rc = lib.kcclAllReduce(sp, rp, n, code, opc, comm, st)
            if rc:
                _raise(rc)
            return recv
        self._no_stream(stream)
        sp, rp, n, code = self._reduce_pair(send, recv, dtype)
        rc = lib.kcclAllReduce(sp, rp, n, code, opc, comm, _NULL)
        if rc:
            _raise(rc)
        return recv

    def _reduce_pair(self, send, recv, dtype):
        """(send ptr, recv ptr, count, dtype code) for an all-reduce of send into recv
        (recv is send: in place), with every check and its message."""
        inplace = recv is send
        sp, n, code, _ = resolve(send, dtype, inplace, "send (in place)" if inplace else "send")
        if inplace:
            return sp, sp, n, code
        rp, rn, rcode, _ = resolve(recv, dtype, True, "recv")
        self._same_dtype(code, rcode)
        if rn != n:
            raise KcclInvalidArgument(f"recv has {rn} elements, send {n}: all_reduce needs equal sizes")
        return sp, rp, n, code

    # -- GPU buffers -------------------------------------------------------------------
    def _gpu_buf(self, obj, dtype, writable, what):
        """(void* cdata, count, code, library) of a GPU buffer on this communicator's device."""
        if type(obj) is _ndarray or not _cu.is_cuda_array(obj):
            raise KcclInvalidArgument(f"{what} is {type(obj).__name__} in host memory: this communicator is on "
                                      f"GPU {self._device} and takes torch CUDA tensors or CuPy arrays")
        ptr, n, code, dev, libname = _cu.resolve(obj, dtype, writable, what)
        if dev is not None and dev != self._device:
            raise KcclInvalidArgument(f"{what} is on GPU {dev}, this communicator on GPU {self._device}")
        return ffi.cast("void *", ptr), n, code, libname

    def _gpu_stream(self, stream, libname):
        return ffi.cast("void *", _cu.stream_handle(stream, libname, self._device))

    def _gpu_pair(self, send, recv, dtype, stream):
        inplace = recv is send
        sp, n, code, libname = self._gpu_buf(send, dtype, inplace, "send (in place)" if inplace else "send")
        if inplace:
            return sp, sp, n, code, self._gpu_stream(stream, libname)
        rp, rn, rcode, _ = self._gpu_buf(recv, dtype, True, "recv")
        self._same_dtype(code, rcode)
        if rn != n:
            raise KcclInvalidArgument(f"recv has {rn} elements, send {n}: all_reduce needs equal sizes")
        return sp, rp, n, code, self._gpu_stream(stream, libname)

    def _no_stream(self, stream):
        if stream is not None:
            raise KcclInvalidArgument("stream= is for GPU communicators (device=N); host collectives block")

    def _gpu_alloc_like(self, send, shape):
        mod = type(send).__module__
        if mod.startswith("torch"):
            return send.new_empty(shape)
        if mod.startswith("cupy"):
            import cupy
            with cupy.cuda.Device(self._device):
                return cupy.empty(shape, dtype=send.dtype)
        raise KcclInvalidArgument("pass recv explicitly unless send is a torch tensor or CuPy array")

    @staticmethod
    def _same_dtype(a, b):
        if a != b:
            raise KcclInvalidArgument(f"send is {NAMES[a]} but recv is {NAMES[b]}")

    def all_gather(self, send, recv=None, *, dtype=None, stream=None):
        """recv = concatenation of every rank's send, in rank order.  recv=None allocates
        (numpy sends; torch / CuPy on a GPU communicator): shape (size, *send.shape)."""
        comm = self._handle()
        if self._device >= 0:
            if recv is None:
                recv = self._gpu_alloc_like(send, (self._size,) + tuple(send.shape))
            sp, n, code, libname = self._gpu_buf(send, dtype, False, "send")
            rp, rn, rcode, _ = self._gpu_buf(recv, dtype, True, "recv")
            self._same_dtype(code, rcode)
            if rn != n * self._size:
                raise KcclInvalidArgument(f"all_gather: recv has {rn} elements, needs size*send = {n * self._size}")
            rc = lib.kcclAllGather(sp, rp, n, code, comm, self._gpu_stream(stream, libname))
            if rc:
                _raise(rc)
            return recv
        self._no_stream(stream)
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

    def reduce_scatter(self, send, recv=None, op=SUM, *, dtype=None, stream=None):
        """Rank r receives block r of the reduction of every rank's send (size equal blocks).
        recv=None allocates (numpy sends; torch / CuPy on a GPU communicator): send.size // size elements."""
        comm = self._handle()
        opc = _op_code(op)
        if self._device >= 0:
            sp, n, code, libname = self._gpu_buf(send, dtype, False, "send")
            if n % self._size:
                raise KcclInvalidArgument(f"reduce_scatter: send has {n} elements, not a multiple of size={self._size}")
            if recv is None:
                recv = self._gpu_alloc_like(send, (n // self._size,))
            rp, rn, rcode, _ = self._gpu_buf(recv, dtype, True, "recv")
            self._same_dtype(code, rcode)
            if rn * self._size != n:
                raise KcclInvalidArgument(f"reduce_scatter: recv has {rn} elements, needs send/size = {n // self._size}")
            rc = lib.kcclReduceScatter(sp, rp, rn, code, opc, comm, self._gpu_stream(stream, libname))
            if rc:
                _raise(rc)
            return recv
        self._no_stream(stream)
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

    def broadcast(self, buf, root=0, *, dtype=None, stream=None):
        """root's buf is copied into every other rank's buf (in place). Returns buf."""
        comm = self._handle()
        root = _as_int(root, "root")
        if not 0 <= root < self._size:
            raise KcclInvalidArgument(f"root {root} out of range for size={self._size}")
        if self._device >= 0:
            p, n, code, libname = self._gpu_buf(buf, dtype, True, "buf")
            rc = lib.kcclBroadcast(p, p, n, code, root, comm, self._gpu_stream(stream, libname))
            if rc:
                _raise(rc)
            return buf
        self._no_stream(stream)
        p, n, code, _ = resolve(buf, dtype, True, "buf")
        rc = lib.kcclBroadcast(p, p, n, code, root, comm, _NULL)
        if rc:
            _raise(rc)
        return buf

    def barrier(self, *, stream=None):
        """Host communicator: blocks until every rank arrived.  GPU communicator:
        stream-ordered (work after it on `stream` (default: the legacy default stream)
        starts once every rank's stream reached it)."""
        comm = self._handle()
        if self._device >= 0:
            st = ffi.cast("void *", _cu.stream_handle(stream, None, self._device))
        else:
            self._no_stream(stream)
            st = _NULL
        rc = lib.kcclBarrier(comm, st)
        if rc:
            _raise(rc)

    # -- device-side API (GPU communicators) ----------------------------------------------
    def dev_comm(self):
        """The kcclDevComm (kccl_device.cuh) as bytes, to pass by value to a kernel
        that calls kcclDevAllReduce (e.g. as a CuPy RawKernel argument)."""
        out = ffi.new("char[]", lib.KCCL_DEV_COMM_BYTES)
        rc = lib.kcclCommGetDevComm(self._handle(), out, lib.KCCL_DEV_COMM_BYTES)
        if rc:
            _raise(rc)
        return ffi.buffer(out)[:]

    def gpu_flag_replicas(self):
        """Per-L2-partition flag replicas of this GPU communicator (KCCL_GPU_FLAG_REPLICAS):
        {"requested": bool, "enabled": bool (every rank's calibration found two L2 groups),
        "note": what this rank's calibration found, or why the replicas are disabled}.
        KcclInvalidUsage on a host communicator."""
        state = ffi.new("int *")
        note = ffi.new("char[]", 512)
        rc = lib.kcclCommGpuFlagReplicas(self._handle(), state, note, 512)
        if rc:
            _raise(rc)
        return {"requested": state[0] != 0, "enabled": state[0] == 1,
                "note": ffi.string(note).decode(errors="replace")}

    def device_all_reduce_selftest(self, inputs, outputs, op=SUM, iters=4, blocks=4, *, dtype=None, stream=None):
        """One persistent kernel of `blocks` blocks doing `iters` device-side all-reduces:
        row k of outputs (iters x inputs.size) gets the reduction of every rank's inputs + k.
        Blocks until done."""
        comm = self._handle()
        ip, n, code, libname = self._gpu_buf(inputs, dtype, False, "inputs")
        op_, on, ocode, _ = self._gpu_buf(outputs, dtype, True, "outputs")
        self._same_dtype(code, ocode)
        if on != n * iters:
            raise KcclInvalidArgument(f"outputs has {on} elements, needs iters*inputs = {n * iters}")
        rc = lib.kcclDevAllReduceSelfTest(ip, op_, n, code, _op_code(op), _as_int(iters, "iters"),
                                          _as_int(blocks, "blocks"), comm, self._gpu_stream(stream, libname))
        if rc:
            _raise(rc)
        return outputs

    def bench_device_all_reduce(self, buf, iters=2000, blocks=1, *, dtype=None):
        """Microseconds per call of a dependent chain of device-side all-reduces (in-place
        average of buf) inside one persistent kernel."""
        comm = self._handle()
        p, n, code, _ = self._gpu_buf(buf, dtype, True, "buf")
        out = ffi.new("double *")
        rc = lib.kcclBenchDevAllReduce(p, n, code, _as_int(iters, "iters"), _as_int(blocks, "blocks"), comm, out)
        if rc:
            _raise(rc)
        return out[0]

    def bench_device_all_reduce_phases(self, buf, iters=2000, blocks=1, *, dtype=None):
        """The bench_device_all_reduce chain with block 0's time per call split into
        phases: dict of us for 'pushed' (entry to pushes issued: epoch and input loads),
        'received' (to every peer's line), 'end' (combine, store, barrier), and
        'poll_rounds' per call."""
        comm = self._handle()
        p, n, code, _ = self._gpu_buf(buf, dtype, True, "buf")
        out = ffi.new("double[4]")
        rc = lib.kcclBenchDevAllReducePhases(p, n, code, _as_int(iters, "iters"), _as_int(blocks, "blocks"), comm,
                                             out)
        if rc:
            _raise(rc)
        return {"pushed": out[0], "received": out[1], "end": out[2], "poll_rounds": out[3]}

    def bench_residency(self, blocks, timeout_ms=200, foreign=0, carveout=-1):
        """Collective: can every rank's `blocks` blocks (of a kernel with about the
        collective kernels' footprint) be resident at once?  foreign: a kernel this
        rank launches just before the probe (0 none, 1 without shared memory, 2 with
        40 KB of it).  carveout: the probe kernel's preferred shared-memory carveout in
        percent (-1: the driver's choice).  Returns a dict: seen (arrivals the best-placed block saw before
        its timeout), launched (blocks x ranks), regs (per thread), per_sm (blocks per
        SM by the occupancy calculator), sms (the SM of each of this rank's blocks)."""
        comm = self._handle()
        blocks = _as_int(blocks, "blocks")
        out = ffi.new("int[4]")
        sms = ffi.new("int[]", max(blocks, 1))
        rc = lib.kcclBenchResidency(comm, blocks, _as_int(timeout_ms, "timeout_ms"), _as_int(foreign, "foreign"),
                                    _as_int(carveout, "carveout"), out, sms)
        if rc:
            _raise(rc)
        return {"seen": out[0], "launched": out[1], "regs": out[2], "per_sm": out[3], "sms": list(sms[0:blocks])}

    def bench_flag_hop(self, iters=10000, mode=0):
        """Microseconds for one flag hop between ranks 0 and 1 through device memory
        (0.0 on other ranks, which take no part).  mode 0: release/acquire at system scope,
        pushed; 1: volatile, pushed; 2: relaxed at GPU scope, pushed; 3: volatile, pulled."""
        out = ffi.new("double *")
        rc = lib.kcclBenchFlagHop(self._handle(), _as_int(iters, "iters"), _as_int(mode, "mode"), out)
        if rc:
            _raise(rc)
        return out[0]

    def bench_all_reduce(self, send, recv=None, op=SUM, iters=1000, *, dtype=None):
        """Mean microseconds of `iters` back-to-back all-reduces timed inside C."""
        comm = self._handle()
        opc = _op_code(op)
        recv = send if recv is None else recv
        if self._device >= 0:
            sp, rp, n, code, _ = self._gpu_pair(send, recv, dtype, None)
        else:
            sp, rp, n, code = self._reduce_pair(send, recv, dtype)
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

    def topo_info(self):
        """How this rank's replicas are placed: {"ndomains", "domain", "replicas" (remote
        replicas it writes), "bound" (1 verified on their NUMA nodes, 0 unverified, -1
        failed), "pushes", "replica_reads", "note" (the binding, from C), "plan" (why this
        placement: "KCCL_TOPO=off", "one domain: one copy", "domain 1 of 2", ...)}."""
        info = ffi.new("kcclTopoInfo_t *")
        rc = lib.kcclCommTopoInfo(self._handle(), info)
        if rc:
            _raise(rc)
        return {"ndomains": info.ndomains, "domain": info.domain, "replicas": info.replicas,
                "bound": info.bound, "pushes": int(info.pushes), "replica_reads": int(info.replicaReads),
                "note": ffi.string(info.note).decode(errors="replace"), "plan": self._plan_note}

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
