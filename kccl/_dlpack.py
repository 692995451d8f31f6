"""Reading a DLPack tensor's description (pointer, device, type, shape, strides) from
the capsule its `__dlpack__()` returns, without consuming the capsule: it frees its
DLManagedTensor when dropped, while the data stays owned by the producer's object,
which the caller holds.  numpy.from_dlpack refuses types numpy lacks (bfloat16), and
GPU tensors; this reads any of them."""
import ctypes
from dataclasses import dataclass
from typing import Optional, Tuple

from ._dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, INT8, INT32, INT64, UINT8, UINT32, UINT64

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED = 1, 2, 3, 13


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


# (DLDataTypeCode, bits) -> KCCL dtype code
CODES = {(0, 8): INT8, (1, 8): UINT8, (0, 32): INT32, (1, 32): UINT32, (0, 64): INT64, (1, 64): UINT64,
         (2, 16): FLOAT16, (2, 32): FLOAT32, (2, 64): FLOAT64, (4, 16): BFLOAT16}
_NAMES = {0: "int", 1: "uint", 2: "float", 4: "bfloat", 5: "complex", 6: "bool"}

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


@dataclass
class DLView:
    address: int                  # first element (data + byte_offset)
    device_type: int
    device_id: int
    code: Optional[int]           # KCCL dtype code, None for a type KCCL lacks
    label: str                    # the type in words ("bfloat16", "complex64")
    itemsize: int
    lanes: int
    shape: Tuple[int, ...]
    strides: Optional[Tuple[int, ...]]  # in bytes; None = C-contiguous
    capsule: object               # keep it while the address is in use

    @property
    def nbytes(self):
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def c_contiguous(self):
        if self.strides is None or self.nbytes == 0:
            return True
        want, acc = [], self.itemsize
        for d in reversed(self.shape):
            want.append(acc)
            acc *= d
        return all(s == w or d == 1 for s, w, d in zip(self.strides, reversed(want), self.shape))


def read(obj):
    """The DLView of obj.__dlpack__() (a legacy, unversioned capsule: what a producer
    returns when no max_version is asked for).  Exceptions of the producer pass through."""
    cap = obj.__dlpack__()
    t = _DLTensor.from_address(_get_pointer(cap, b"dltensor"))
    shape = tuple(t.shape[i] for i in range(t.ndim))
    itemsize = t.dtype.bits // 8
    strides = tuple(t.strides[i] * itemsize for i in range(t.ndim)) if t.strides else None
    key = (t.dtype.code, t.dtype.bits)
    return DLView((t.data or 0) + t.byte_offset, t.device.device_type, t.device.device_id, CODES.get(key),
                  f"{_NAMES.get(key[0], f'type code {key[0]} of ')}{key[1]}", itemsize, t.dtype.lanes, shape,
                  strides, cap)
