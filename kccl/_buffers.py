"""Turning Python buffers into (pointer, element count, KCCL dtype code), and the
buffer adapter of host communicators (HostBuffers).

Accepted: C-contiguous objects with the buffer protocol (numpy arrays first,
bytes/bytearray/memoryview/array.array), and CPU tensors that speak DLPack
(torch.Tensor and friends, zero-copy: through numpy.from_dlpack, or, for types numpy
lacks such as torch.bfloat16, through the DLPack description itself).  numpy has
no bfloat16: pass an ml_dtypes.bfloat16 array, or uint16 storage with
dtype="bfloat16"."""
import sys
import weakref

import numpy as np

from ._native import ffi, lib
from .errors import KcclInvalidArgument

from ._dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, INT8, INT32, INT64, UINT8, UINT32, UINT64

ITEMSIZE = {INT8: 1, UINT8: 1, INT32: 4, UINT32: 4, INT64: 8, UINT64: 8,
            FLOAT16: 2, FLOAT32: 4, FLOAT64: 8, BFLOAT16: 2}
NAMES = {INT8: "int8", UINT8: "uint8", INT32: "int32", UINT32: "uint32", INT64: "int64", UINT64: "uint64",
         FLOAT16: "float16", FLOAT32: "float32", FLOAT64: "float64", BFLOAT16: "bfloat16"}

# numpy dtype -> code (keys are np.dtype objects: a dict lookup is the fast path)
NUMPY_CODES = {np.dtype(n): c for c, n in NAMES.items() if n != "bfloat16"}


def numpy_code(dt):
    """The code of numpy dtype dt, or None.  ml_dtypes' bfloat16 joins NUMPY_CODES when the
    first such array comes: importing ml_dtypes takes about half a second, and a process
    that has a bfloat16 array has imported it already."""
    code = NUMPY_CODES.get(dt)
    if code is None and dt.name == "bfloat16":
        ml = sys.modules.get("ml_dtypes")
        if ml is not None and dt == np.dtype(ml.bfloat16):
            NUMPY_CODES[dt] = code = BFLOAT16
    return code

# struct-module format characters of plain buffers -> code
_FORMAT_CODES = {"b": INT8, "B": UINT8, "i": INT32, "I": UINT32, "q": INT64, "Q": UINT64,
                 "e": FLOAT16, "f": FLOAT32, "d": FLOAT64}
_FORMAT_CODES.update({"l": INT64 if np.dtype("l").itemsize == 8 else INT32,
                      "L": UINT64 if np.dtype("L").itemsize == 8 else UINT32})
_ALIASES = {"half": FLOAT16, "fp16": FLOAT16, "bf16": BFLOAT16, "float": FLOAT32, "fp32": FLOAT32,
            "double": FLOAT64, "fp64": FLOAT64}


def resolve_dtype(dtype):
    """A KCCL dtype code from a name, a numpy dtype/type or an int code."""
    if isinstance(dtype, int) and not isinstance(dtype, bool) and dtype in ITEMSIZE:
        return dtype
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        for code, name in NAMES.items():
            if key == name:
                return code
        if key in _ALIASES:
            return _ALIASES[key]
    try:
        code = numpy_code(np.dtype(dtype))
    except TypeError:
        code = None
    if code is None:
        raise KcclInvalidArgument(f"unsupported dtype {dtype!r}; supported: {', '.join(NAMES.values())}")
    return code


def apply_dtype(native, itemsize, nbytes, dtype, label, what, bf16_hint):
    """The dtype code of a buffer holding `native` items (None: a type KCCL lacks), or of the
    explicit `dtype`, which must have the buffer's item size and divide its bytes. `label`
    names the buffer's type in an error: a string, or a function called only then (naming
    it costs microseconds that a call which raises nothing should not pay)."""
    if callable(label):
        label_of = label
    else:
        def label_of():
            return label
    if dtype is None:
        if native is None:
            raise KcclInvalidArgument(f"{what} holds {label_of()}, which KCCL does not handle; supported: "
                                      f"{', '.join(NAMES.values())} ({bf16_hint})")
        return native
    code = resolve_dtype(dtype)
    if native is not None and native != code and ITEMSIZE[code] != itemsize:
        raise KcclInvalidArgument(f"{what} holds {label_of()} ({itemsize}-byte items) but dtype={dtype!r} has "
                                  f"{ITEMSIZE[code]}-byte items")
    if nbytes % ITEMSIZE[code]:
        raise KcclInvalidArgument(f"{what} has {nbytes} bytes, not a multiple of {NAMES[code]}'s size")
    return code


def _as_array(obj, what):
    """Anything we accept, as a numpy array (no copy) or a memoryview."""
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__cuda_array_interface__"):
        raise KcclInvalidArgument(f"{what} is a GPU array: the host transport takes CPU buffers")
    if hasattr(obj, "__dlpack__") and not isinstance(obj, (bytes, bytearray, memoryview)):
        try:
            return np.from_dlpack(obj)
        except Exception as e:
            numpy_says = e
        # numpy has no bfloat16 (and refuses some layouts): read the DLPack description itself
        from . import _dlpack
        try:
            view = _dlpack.read(obj)
        except Exception:
            raise KcclInvalidArgument(f"{what}: cannot view {type(obj).__name__} through DLPack: "
                                      f"{numpy_says}") from None
        if view.device_type not in (_dlpack.KDL_CPU, _dlpack.KDL_CUDA_HOST):
            raise KcclInvalidArgument(f"{what} is not in host memory (DLPack device type {view.device_type}): "
                                      "the host transport takes CPU buffers")
        return view
    try:
        return memoryview(obj)
    except TypeError:
        raise KcclInvalidArgument(
            f"{what} must be a buffer (numpy array, bytearray, memoryview, DLPack tensor), "
            f"not {type(obj).__name__}") from None


def _label(arr):
    return str(arr.dtype) if isinstance(arr, np.ndarray) else f"format {arr.format!r}"


def _resolve_dlpack(view, dtype, what):
    if view.lanes != 1:
        raise KcclInvalidArgument(f"{what} has vector lanes ({view.lanes}), which KCCL does not take")
    if not view.c_contiguous:
        raise KcclInvalidArgument(f"{what} is not C-contiguous (shape {view.shape}, strides {view.strides}); "
                                  "pass a contiguous copy")
    code = apply_dtype(view.code, view.itemsize, view.nbytes, dtype, view.label, what,
                       "bfloat16: torch.bfloat16, or uint16 storage with dtype='bfloat16'")
    ptr = ffi.cast("void *", view.address) if view.nbytes else ffi.NULL
    return ptr, view.nbytes // ITEMSIZE[code], code, view


def resolve_host_buffer(obj, dtype, writable, what):
    """(cdata, count, code, keep) for obj; `keep` keeps the buffer (or its DLPack capsule)
    alive while the pointer is in use."""
    arr = _as_array(obj, what)
    if not isinstance(arr, (np.ndarray, memoryview)):
        return _resolve_dlpack(arr, dtype, what)
    if isinstance(arr, np.ndarray):
        if not arr.flags.c_contiguous:
            raise KcclInvalidArgument(f"{what} is not C-contiguous (shape {arr.shape}, strides {arr.strides}); "
                                      "pass np.ascontiguousarray(...)")
        if writable and not arr.flags.writeable:
            raise KcclInvalidArgument(f"{what} is read-only")
        native = numpy_code(arr.dtype)
        itemsize, nbytes = arr.dtype.itemsize, arr.nbytes
    else:
        if not arr.c_contiguous:
            raise KcclInvalidArgument(f"{what} is not C-contiguous")
        if writable and arr.readonly:
            raise KcclInvalidArgument(f"{what} is read-only ({type(obj).__name__})")
        native = _FORMAT_CODES.get(arr.format.lstrip("@=<"))
        itemsize, nbytes = arr.itemsize, arr.nbytes
    code = apply_dtype(native, itemsize, nbytes, dtype, lambda: _label(arr), what,
                       "bfloat16 via ml_dtypes or dtype='bfloat16'")
    ptr = ffi.from_buffer(arr) if nbytes else ffi.NULL  # writability was checked above
    return ptr, nbytes // ITEMSIZE[code], code, arr


NO_PAIR = (None,) * 7
# bound once: all_reduce_start and a cold all_reduce call prepare_numpy_pair on every call
_ndarray = np.ndarray
_from_buffer = ffi.from_buffer


def prepare_numpy_pair(send, recv):
    """(send, recv, dtype, send ptr, recv ptr, count, code) for a numpy send and recv that
    need no further check, else NO_PAIR (the general path then says what is wrong)."""
    code = NUMPY_CODES.get(send.dtype) or numpy_code(send.dtype)
    if code is None or type(recv) is not _ndarray or not recv.flags.writeable:
        return NO_PAIR
    try:
        if recv is send:
            sp = rp = _from_buffer(send)
        elif recv.dtype == send.dtype and recv.nbytes == send.nbytes:
            sp = _from_buffer(send)
            rp = _from_buffer(recv)
        else:
            return NO_PAIR
    except ValueError:  # not C-contiguous
        return NO_PAIR
    return (send, recv, send.dtype, sp, rp, send.size, code)


def check_same_dtype(send_code, recv_code):
    if send_code != recv_code:
        raise KcclInvalidArgument(f"send is {NAMES[send_code]} but recv is {NAMES[recv_code]}")


class BufferAdapter:
    """What a communicator asks of its buffers: resolve_buffer(obj, dtype, writable, what)
    -> (void* cdata, count, dtype code, library), resolve_stream(stream, library) -> the
    stream argument of the C call, alloc_like(send, shape, dtype) -> a recv for send.
    `what` names the argument in error messages."""
    __slots__ = ()

    def forget(self):
        """Drops whatever the adapter remembers of earlier calls (at close)."""

    def resolve_pair(self, send, recv, dtype):
        """(send ptr, recv ptr, count, code, library) for a reduction of send into recv
        (recv is send: in place)."""
        inplace = recv is send
        sp, n, code, library = self.resolve_buffer(send, dtype, inplace, "send (in place)" if inplace else "send")
        if inplace:
            return sp, sp, n, code, library
        rp, rn, rcode, _ = self.resolve_buffer(recv, dtype, True, "recv")
        check_same_dtype(code, rcode)
        if rn != n:
            raise KcclInvalidArgument(f"recv has {rn} elements, send {n}: all_reduce needs equal sizes")
        return sp, rp, n, code, library


_NO_TORCH_PAIR = (lambda: None, lambda: None, None, None, None, None, None)


def remembered_torch_pair(h, send, recv):
    """What remember_torch_pair stored in h for this pair of torch tensors, while both are
    the same objects with the same storage, size, dtype and layout; else None."""
    if (h[0]() is send and h[1]() is recv and send.data_ptr() == h[2] and send.numel() == h[3]
            and send.dtype is h[4] and send.is_contiguous()
            and (recv is send or (recv.data_ptr() == h[5] and recv.numel() == h[3] and recv.dtype is h[4]
                                  and recv.is_contiguous()))):
        return h[6]
    return None


def remember_torch_pair(send, recv, resolved):
    """The record remembered_torch_pair checks (weak references: no tensor is kept alive)."""
    return (weakref.ref(send), weakref.ref(recv), send.data_ptr(), send.numel(), send.dtype, recv.data_ptr(),
            resolved)
_cast_ptr = ffi.cast
_TORCH_HOST_CODES = None


def _torch_host_codes():
    """torch dtype -> KCCL code (torch is imported by then: a tensor was passed)."""
    global _TORCH_HOST_CODES
    if _TORCH_HOST_CODES is None:
        import torch
        _TORCH_HOST_CODES = {torch.int8: INT8, torch.uint8: UINT8, torch.int32: INT32, torch.uint32: UINT32,
                             torch.int64: INT64, torch.uint64: UINT64, torch.float16: FLOAT16,
                             torch.bfloat16: BFLOAT16, torch.float32: FLOAT32, torch.float64: FLOAT64}
    return _TORCH_HOST_CODES


def _overlap(a, b):
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class HostBuffers(BufferAdapter):
    """Host communicators: CPU buffers (see resolve_host_buffer), blocking calls without a stream."""
    __slots__ = ("_torch_pair",)

    def __init__(self):
        self._torch_pair = _NO_TORCH_PAIR

    def forget(self):
        self._torch_pair = _NO_TORCH_PAIR

    def torch_pair(self, send, recv):
        """(send ptr, recv ptr, count, code) of two CPU torch tensors (recv is send: in place).
        Resolving a tensor through DLPack costs several microseconds, more than the
        all-reduce of a few KB, and decode passes the same tensors every step: the last
        pair is remembered by weak reference and reused while both still have the same
        storage, size, dtype and layout; anything else is resolved and checked in full."""
        hit = remembered_torch_pair(self._torch_pair, send, recv)
        if hit is not None:
            return hit
        codes = _torch_host_codes()
        code = codes.get(send.dtype)
        if (code is not None and send.is_cpu and send.is_contiguous() and not send.requires_grad
                and (recv is send or (recv.dtype is send.dtype and recv.is_cpu and recv.is_contiguous()
                                      and not recv.requires_grad and recv.numel() == send.numel()))):
            # checked as resolve_pair would, without its DLPack round trip
            n = send.numel()
            sp = _cast_ptr("void *", send.data_ptr()) if n else ffi.NULL
            rp = sp if recv is send else (_cast_ptr("void *", recv.data_ptr()) if n else ffi.NULL)
            if recv is not send and n and _overlap(send, recv):
                sp, rp, n, code, _ = self.resolve_pair(send, recv, None)  # let C say what is wrong
        else:
            sp, rp, n, code, _ = self.resolve_pair(send, recv, None)
        self._torch_pair = remember_torch_pair(send, recv, (sp, rp, n, code))
        return sp, rp, n, code

    def resolve_buffer(self, obj, dtype, writable, what):
        # The view may be dropped: the memory behind ptr belongs to obj, which the caller holds.
        ptr, n, code, _view = resolve_host_buffer(obj, dtype, writable, what)
        return ptr, n, code, None

    def resolve_pair(self, send, recv, dtype):
        if type(send) is _ndarray and dtype is None:  # numpy needs fewer checks
            pair = prepare_numpy_pair(send, recv)
            if pair[3] is not None:
                return pair[3], pair[4], pair[5], pair[6], None
        return BufferAdapter.resolve_pair(self, send, recv, dtype)

    def resolve_stream(self, stream, library=None):
        if stream is not None:
            raise KcclInvalidArgument("stream= is for GPU communicators (device=N); host collectives block")
        return ffi.NULL

    def alloc_like(self, send, shape, dtype):
        if isinstance(send, np.ndarray) and dtype is None:
            return np.empty(shape, dtype=send.dtype)
        if type(send).__module__ == "torch" and type(send).__name__ in ("Tensor", "Parameter") and dtype is None:
            import torch  # already imported: send is one of its tensors
            if send.device.type != "cpu":
                raise KcclInvalidArgument(f"send is on {send.device}: the host transport takes CPU tensors")
            return torch.empty(shape, dtype=send.dtype)
        raise KcclInvalidArgument("pass recv explicitly unless send is a numpy array or a CPU torch tensor "
                                  "and dtype is None")
