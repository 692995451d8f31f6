"""Exceptions: one class per KCCL result code, each also a matching builtin,
so `except ValueError` catches a bad argument and `except TimeoutError` a
timeout, as callers of the standard library would expect.  The codes are
kccl.h's kcclResult_t, read from the native module."""
from ._native import ffi, lib

SUCCESS = lib.kcclSuccess
UNHANDLED_CUDA_ERROR = lib.kcclUnhandledCudaError
SYSTEM_ERROR = lib.kcclSystemError
INTERNAL_ERROR = lib.kcclInternalError
INVALID_ARGUMENT = lib.kcclInvalidArgument
INVALID_USAGE = lib.kcclInvalidUsage
REMOTE_ERROR = lib.kcclRemoteError
IN_PROGRESS = lib.kcclInProgress
TIMEOUT = lib.kcclTimeout


class KcclError(Exception):
    """Base of every KCCL error; `.code` is the C result code, `.detail` the text."""

    code = INTERNAL_ERROR

    def __init__(self, detail="", code=None):
        if code is not None:
            self.code = code
        self.detail = detail
        Exception.__init__(self, detail)

    def __str__(self):
        return self.detail


class KcclCudaError(KcclError, RuntimeError):
    code = UNHANDLED_CUDA_ERROR


class KcclSystemError(KcclError, OSError):
    code = SYSTEM_ERROR


class KcclInternalError(KcclError, RuntimeError):
    code = INTERNAL_ERROR


class KcclInvalidArgument(KcclError, ValueError):
    code = INVALID_ARGUMENT


class KcclInvalidUsage(KcclError, RuntimeError):
    """Right arguments, wrong moment: a closed or broken communicator, a reused rank."""

    code = INVALID_USAGE


class KcclRemoteError(KcclError, RuntimeError):
    """A peer died, aborted, closed, or called a different collective."""

    code = REMOTE_ERROR


class KcclInProgress(KcclError, RuntimeError):
    code = IN_PROGRESS


class KcclTimeout(KcclError, TimeoutError):
    code = TIMEOUT


_BY_CODE = {cls.code: cls for cls in (KcclCudaError, KcclSystemError, KcclInternalError, KcclInvalidArgument,
                                      KcclInvalidUsage, KcclRemoteError, KcclInProgress, KcclTimeout)}


def error_for(code, detail):
    """The exception instance for a non-zero result code."""
    cls = _BY_CODE.get(code, KcclError)
    return cls(detail or f"KCCL error {code}", code=code)


def check(rc):
    """Raises the KcclError subclass of a non-zero kcclResult_t, with the C library's text."""
    if rc:
        raise error_for(rc, ffi.string(lib.kcclGetLastError(ffi.NULL)).decode(errors="replace"))
