"""GPU buffers for GPU communicators: torch CUDA tensors, CuPy arrays and
anything else with `__cuda_array_interface__` (or CUDA DLPack), as (device
pointer, element count, KCCL dtype code); and the CUDA stream a call runs on.

Nothing here imports torch or CuPy unless the caller passed one of theirs.
bfloat16: torch.bfloat16 tensors directly; CuPy has no bfloat16, so pass
uint16 storage with dtype="bfloat16"."""
import ctypes

from ._buffers import (BFLOAT16, FLOAT16, FLOAT32, FLOAT64, INT8, INT32, INT64, ITEMSIZE, UINT8, UINT32, UINT64,
                       apply_dtype)
from .errors import KcclInvalidArgument

_TYPESTR = {"|i1": INT8, "|u1": UINT8, "<i4": INT32, "<u4": UINT32, "<i8": INT64, "<u8": UINT64,
            "<f2": FLOAT16, "<f4": FLOAT32, "<f8": FLOAT64}
_TORCH = None  # torch dtype -> code, filled on first use


def _torch_codes():
    global _TORCH
    if _TORCH is None:
        import torch
        _TORCH = {torch.int8: INT8, torch.uint8: UINT8, torch.int32: INT32, torch.int64: INT64,
                  torch.float16: FLOAT16, torch.float32: FLOAT32, torch.float64: FLOAT64,
                  torch.bfloat16: BFLOAT16}
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


def resolve(obj, dtype, writable, what):
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


# -- DLPack (e.g. JAX arrays): read the DLTensor inside the capsule without consuming it -----------

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DL_CODES = {(0, 8): INT8, (1, 8): UINT8, (0, 32): INT32, (1, 32): UINT32, (0, 64): INT64, (1, 64): UINT64,
             (2, 16): FLOAT16, (2, 32): FLOAT32, (2, 64): FLOAT64, (4, 16): BFLOAT16}
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _from_dlpack(obj, dtype, what):
    try:
        cap = obj.__dlpack__()
        addr = _get_pointer(cap, b"dltensor")
    except Exception as e:
        raise KcclInvalidArgument(f"{what}: cannot view {type(obj).__name__} through DLPack: {e}") from None
    # DLManagedTensor starts with its DLTensor; the capsule (not consumed) frees it when dropped.
    t = _DLTensor.from_address(addr)
    if t.device.device_type not in (2, 13):
        raise KcclInvalidArgument(f"{what} is not on a CUDA device (DLPack device type {t.device.device_type})")
    if t.dtype.lanes != 1:
        raise KcclInvalidArgument(f"{what} has vector lanes ({t.dtype.lanes}), which KCCL does not take")
    shape = [t.shape[i] for i in range(t.ndim)]
    itemsize = t.dtype.bits // 8
    if t.strides:
        strides = tuple(t.strides[i] * itemsize for i in range(t.ndim))
        if _nelems(shape) > 1 and strides != _c_strides(shape, itemsize):
            raise KcclInvalidArgument(f"{what} is not C-contiguous (DLPack strides {strides})")
    nbytes = itemsize * _nelems(shape)
    code = _apply_dtype(_DL_CODES.get((t.dtype.code, t.dtype.bits)), itemsize, nbytes, dtype,
                        f"DLPack type ({t.dtype.code}, {t.dtype.bits})", what)
    return (t.data or 0) + t.byte_offset, nbytes // ITEMSIZE[code], code, t.device.device_id, "dlpack"


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
