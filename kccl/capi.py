"""kccl.h for native code that works on communicators made in Python.

A C or CUDA extension (KIE's GPU engine and KCCL's benchmarks in bench/native are
two) links libkccl.so (kccl.paths.LIB), the library this package's module links
too: the loader maps it once, so the extension's kccl.h calls reach the copy that
made the communicator (its state, CUDA kernels and last-error text).

    h = kccl.capi.handle(comm)                  # the kcclComm_t, an int
    fn = kccl.capi.function("kcclAllReduce")   # for code that cannot link: the address, an int
    ptr, count, dtype, lib = kccl.capi.buffer(comm, x, writable=True)
    kccl.capi.check(rc)                         # KcclError for a failed kccl.h result
    code = kccl.capi.dtype_code("bfloat16")     # the kcclDataType_t of a name, numpy dtype or code

Cast the ints to the C types on the other side (cffi: ffi.cast("void *", h))."""
from ._buffers import NAMES as _NAMES, resolve_dtype as _resolve_dtype
from ._cuda_buffers import CudaBuffers as _CudaBuffers
from ._native import ffi as _ffi, lib as _lib
from .errors import check as _check
from .errors import KcclInvalidArgument

__all__ = ["function", "handle", "buffer", "device_buffer", "stream", "check", "last_error", "dtype_code", "DTYPE_NAMES"]

# kcclDataType_t code -> the name the Python API takes for it ("float32", "bfloat16", ...)
DTYPE_NAMES = dict(_NAMES)


def function(name):
    """The address of the kccl.h function `name` (e.g. "kcclAllReduce") in this package's library."""
    if not isinstance(name, str) or not name.startswith("kccl") or not callable(getattr(_lib, name, None)):
        raise KcclInvalidArgument(f"{name!r} is not a function of kccl.h")
    return int(_ffi.cast("uintptr_t", _ffi.addressof(_lib, name)))


def handle(comm):
    """The kcclComm_t of an open Communicator (KcclInvalidUsage once closed)."""
    return int(_ffi.cast("uintptr_t", comm._handle()))


def buffer(comm, obj, *, dtype=None, writable=False, what="buf"):
    """(address, element count, kcclDataType_t code, library) of an array the way comm's
    collectives take it: numpy and other CPU buffers on a host communicator, GPU arrays
    on its device for a GPU one, with the same checks and messages.  library names the
    array's GPU library ("torch", "cupy", None) for stream()."""
    ptr, n, code, library = comm._buffers.resolve_buffer(obj, dtype, writable, what)
    return int(_ffi.cast("uintptr_t", ptr)), n, code, library


def device_buffer(comm, obj, *, dtype=None, writable=False, what="buf"):
    """buffer() for the device API (kccl_device.cuh), whose kernels take GPU arrays
    whatever the communicator: a GPU array, on comm's device for a GPU communicator
    (a host one is left for the library to refuse)."""
    ptr, n, code, library = _CudaBuffers(comm._device).resolve_buffer(obj, dtype, writable, what)
    return int(_ffi.cast("uintptr_t", ptr)), n, code, library


def stream(comm, stream=None, library=None, *, device=False):
    """The stream argument of a kccl.h call on comm, as an int (0: the legacy default
    stream; a host communicator refuses any stream but None).  device=True: a stream
    for a device-API kernel, whatever the communicator."""
    bufs = _CudaBuffers(comm._device) if device else comm._buffers
    return int(_ffi.cast("uintptr_t", bufs.resolve_stream(stream, library)))


def check(rc):
    """Raises the KcclError subclass of a non-zero kcclResult_t, with the library's error text."""
    _check(rc)


def last_error():
    """The calling thread's last error text in this package's library."""
    return _ffi.string(_lib.kcclGetLastError(_ffi.NULL)).decode(errors="replace")


def dtype_code(dtype):
    """The kcclDataType_t code of a type name ("float32", "bf16"), a numpy dtype or a code,
    as the collectives' dtype= takes it (KcclInvalidArgument for a type KCCL lacks)."""
    return _resolve_dtype(dtype)
