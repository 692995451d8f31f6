"""GPU buffers for GPU communicators: torch CUDA tensors, CuPy arrays and
anything else with `__cuda_array_interface__` (or CUDA DLPack), as (device
pointer, element count, KCCL dtype code); the CUDA stream a call runs on; and
the buffer adapter of GPU communicators (CudaBuffers).

Nothing here imports torch or CuPy unless the caller passed one of theirs.
bfloat16: torch.bfloat16 tensors directly; CuPy has no bfloat16, so pass
uint16 storage with dtype="bfloat16"."""

import numpy as np

from ._buffers import (BFLOAT16, FLOAT16, FLOAT32, FLOAT64, INT8, INT32, INT64, ITEMSIZE, UINT8, UINT32, UINT64,
                       _NO_TORCH_PAIR, BufferAdapter, apply_dtype, remember_torch_pair, remembered_torch_pair)
from ._native import ffi
from .errors import KcclInvalidArgument

_TYPESTR = {"|i1": INT8, "|u1": UINT8, "<i4": INT32, "<u4": UINT32, "<i8": INT64, "<u8": UINT64,
            "<f2": FLOAT16, "<f4": FLOAT32, "<f8": FLOAT64}
_TORCH = None  # torch dtype -> code, filled on first use
# torch.Tensor and torch's raw current-stream query, set with _TORCH: the all_reduce fast
# path of GPU communicators compares types with `is`, and never imports torch itself.
TORCH_TENSOR = None
_raw_stream = None


def _torch_codes():
    global _TORCH, TORCH_TENSOR, _raw_stream
    if _TORCH is None:
        import torch
        _TORCH = {torch.int8: INT8, torch.uint8: UINT8, torch.int32: INT32, torch.int64: INT64,
                  torch.float16: FLOAT16, torch.float32: FLOAT32, torch.float64: FLOAT64,
                  torch.bfloat16: BFLOAT16}
        TORCH_TENSOR = torch.Tensor
        # The cudaStream_t of the current stream as an int, without building a Stream
        # object (what torch's compiled code calls); torch.cuda.current_stream otherwise.
        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or \
            (lambda dev: torch.cuda.current_stream(dev).cuda_stream)
    return _TORCH


def is_cuda_array(obj):
    t = type(obj)
    if t.__module__.startswith("torch") and getattr(obj, "is_cuda", False):
        return True
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None:
        try:
            return dev()[0] in (2, 13)  # kDLCUDA, kDLCUDAManaged
        except Exception:
            return False
    return False


def _apply_dtype(native, itemsize, nbytes, dtype, label, what):
    return apply_dtype(native, itemsize, nbytes, dtype, label, what,
                       "bfloat16: torch.bfloat16, or uint16 storage with dtype='bfloat16'")


def _nelems(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _c_strides(shape, itemsize):
    out, acc = [], itemsize
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def resolve_cuda_buffer(obj, dtype, writable, what):
    """(pointer int, count, code, device or None, library name) of a GPU buffer."""
    t = type(obj)
    if t.__module__.startswith("torch") and hasattr(obj, "data_ptr"):
        if not obj.is_cuda:
            raise KcclInvalidArgument(f"{what} is a CPU tensor: this communicator is on a GPU")
        if not obj.is_contiguous():
            raise KcclInvalidArgument(f"{what} is not contiguous (shape {tuple(obj.shape)}, strides "
                                      f"{obj.stride()}); pass .contiguous()")
        native = _torch_codes().get(obj.dtype)
        nbytes = obj.numel() * obj.element_size()
        code = _apply_dtype(native, obj.element_size(), nbytes, dtype, str(obj.dtype), what)
        return obj.data_ptr(), nbytes // ITEMSIZE[code], code, obj.device.index, "torch"
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(cai["shape"])
        typestr = cai["typestr"]
        itemsize = int(typestr[2:])
        ptr, readonly = cai["data"]
        strides = cai.get("strides")
        if strides is not None and tuple(strides) != _c_strides(shape, itemsize):
            if _nelems(shape) > 1:
                raise KcclInvalidArgument(f"{what} is not C-contiguous (shape {shape}, strides {tuple(strides)}); "
                                          "pass a contiguous copy")
        if writable and readonly:
            raise KcclInvalidArgument(f"{what} is read-only")
        nbytes = itemsize * _nelems(shape)
        code = _apply_dtype(_TYPESTR.get(typestr), itemsize, nbytes, dtype, typestr, what)
        lib = "cupy" if t.__module__.startswith("cupy") else "cai"
        return (ptr or 0), nbytes // ITEMSIZE[code], code, None, lib
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj, dtype, what)
    raise KcclInvalidArgument(f"{what} must be a GPU array (torch CUDA tensor, CuPy array, or an object with "
                              f"__cuda_array_interface__ or CUDA DLPack), not {t.__name__}")


# -- DLPack (e.g. JAX arrays) --------------------------------------------------------------------------

def _from_dlpack(obj, dtype, what):
    from . import _dlpack
    try:
        v = _dlpack.read(obj)
    except Exception as e:
        raise KcclInvalidArgument(f"{what}: cannot view {type(obj).__name__} through DLPack: {e}") from None
    if v.device_type not in (_dlpack.KDL_CUDA, _dlpack.KDL_CUDA_MANAGED):
        raise KcclInvalidArgument(f"{what} is not on a CUDA device (DLPack device type {v.device_type})")
    if v.lanes != 1:
        raise KcclInvalidArgument(f"{what} has vector lanes ({v.lanes}), which KCCL does not take")
    if not v.c_contiguous:
        raise KcclInvalidArgument(f"{what} is not C-contiguous (DLPack strides {v.strides})")
    code = _apply_dtype(v.code, v.itemsize, v.nbytes, dtype, v.label, what)
    return v.address, v.nbytes // ITEMSIZE[code], code, v.device_id, "dlpack"


def library_of(obj):
    """The library whose current stream serves obj's calls: "torch", "cupy" or None."""
    mod = type(obj).__module__
    return "torch" if mod.startswith("torch") else "cupy" if mod.startswith("cupy") else None


def stream_handle(stream, lib, device):
    """The cudaStream_t (an int) for a call: `stream` as given (int, torch or CuPy stream, or an
    object with __cuda_stream__), else the current stream of the array's library, else 0."""
    if stream is None:
        if lib == "torch":
            import torch
            return torch.cuda.current_stream(device).cuda_stream
        if lib == "cupy":
            import cupy
            return cupy.cuda.get_current_stream().ptr
        return 0
    if isinstance(stream, bool):
        raise KcclInvalidArgument("stream must be a CUDA stream, not a bool")
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return int(stream.cuda_stream)
    if hasattr(stream, "__cuda_stream__"):  # the CUDA stream protocol: (version, handle)
        return int(stream.__cuda_stream__()[1])
    if hasattr(stream, "ptr"):  # cupy.cuda.Stream
        return int(stream.ptr)
    raise KcclInvalidArgument(f"stream must be an int, a torch or CuPy stream, not {type(stream).__name__}")


class CudaBuffers(BufferAdapter):
    """GPU communicators on CUDA device `device`: GPU arrays on that device; a call runs on
    the stream given, else on the current stream of the array's library."""
    __slots__ = ("device", "_torch_pair", "_stream_int", "_stream_ptr")

    def __init__(self, device):
        self.device = device
        self._torch_pair = _NO_TORCH_PAIR
        self._stream_int, self._stream_ptr = 0, ffi.cast("void *", 0)

    def torch_pair(self, send, recv):
        """(send ptr, recv ptr, count, code) of two torch tensors (recv is send: in place).
        Decode passes the same tensors every step, so the last pair is remembered by weak
        reference and reused while both still have the same storage, size, dtype and
        layout; anything else is resolved and checked in full."""
        hit = remembered_torch_pair(self._torch_pair, send, recv)
        if hit is not None:
            return hit
        sp, rp, n, code, _ = self.resolve_pair(send, recv, None)
        self._torch_pair = remember_torch_pair(send, recv, (sp, rp, n, code))
        return sp, rp, n, code

    def torch_stream(self):
        """torch's current stream on this device, as the pointer a call takes."""
        s = _raw_stream(self.device)
        if s != self._stream_int:
            self._stream_int, self._stream_ptr = s, ffi.cast("void *", s)
        return self._stream_ptr

    def forget(self):
        self._torch_pair = _NO_TORCH_PAIR

    def resolve_buffer(self, obj, dtype, writable, what):
        if type(obj) is np.ndarray or not is_cuda_array(obj):
            raise KcclInvalidArgument(f"{what} is {type(obj).__name__} in host memory: this communicator is on "
                                      f"GPU {self.device} and takes torch CUDA tensors or CuPy arrays")
        ptr, n, code, dev, library = resolve_cuda_buffer(obj, dtype, writable, what)
        if dev is not None and dev != self.device:
            raise KcclInvalidArgument(f"{what} is on GPU {dev}, this communicator on GPU {self.device}")
        return ffi.cast("void *", ptr), n, code, library

    def resolve_stream(self, stream, library=None):
        return ffi.cast("void *", stream_handle(stream, library, self.device))

    def alloc_like(self, send, shape, dtype):
        mod = type(send).__module__
        if mod.startswith("torch"):
            return send.new_empty(shape)
        if mod.startswith("cupy"):
            import cupy
            with cupy.cuda.Device(self.device):
                return cupy.empty(shape, dtype=send.dtype)
        raise KcclInvalidArgument("pass recv explicitly unless send is a torch tensor or CuPy array")
