"""numpy-facing calls of the block-format kernels (csrc/kq.h), for tests, benchmarks
and Python-side lookups; the decode step calls the C functions directly.

`w` is always the stored bytes of whole rows: a uint8 array (rows, row_bytes), e.g.
from GGUFCheckpoint.raw_tensor()."""
import numpy as np

from ..formats.gguf_types import CODES as TYPES
from ._native import native  # noqa: F401  (re-exported for callers that need ffi, lib)


def _code(t):
    return TYPES[t] if isinstance(t, str) else int(t)


# kq_dispatch.c's levels, fastest first; arm64 runs the portable one
LEVELS = ("avx512", "avx2", "scalar")


def level():
    """The instruction set in use: 'avx512', 'avx2' or 'scalar' (kq.h's kq_level)."""
    ffi, lib = native()
    return ffi.string(lib.kq_level()).decode()


def set_level(name):
    """Use the kernels of `name`; False when this CPU or build cannot run them."""
    _, lib = native()
    return lib.kq_set_level(name.encode()) == 0


def levels():
    """Every level this CPU and build can run, fastest first (the current one is kept)."""
    keep = level()
    out = [n for n in LEVELS if set_level(n)]
    set_level(keep)
    return out


def row_bytes(t, cols):
    _, lib = native()
    return lib.kq_row_bytes(_code(t), cols)


def _rows(w, t, cols):
    rb = row_bytes(t, cols)
    if rb == 0:
        raise ValueError(f"type {t} does not take rows of {cols} values")
    w = np.ascontiguousarray(w, dtype=np.uint8)
    if w.ndim != 2 or w.shape[1] != rb:
        raise ValueError(f"expected (rows, {rb}) bytes of {t} rows of {cols} values, got {w.shape}")
    return w


def prepare_act(t, x):
    """The prepared input of x (float32 vector) for weights of type t, as a uint8 array."""
    ffi, lib = native()
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = lib.kq_act_bytes(_code(t), x.size)
    if n == 0:
        raise ValueError(f"type {t} does not take {x.size} inputs")
    buf = np.empty(n + 64, np.uint8)
    off = (-buf.ctypes.data) % 64
    act = buf[off:off + n]
    lib.kq_prepare_act(_code(t), ffi.cast("float *", x.ctypes.data), x.size, ffi.cast("void *", act.ctypes.data))
    return act


def matvec(t, w, x, r0=0, r1=None, act=None, out=None):
    """w @ x for the rows [r0, r1) of w (stored rows of type t); returns out (float32,
    all rows, only [r0, r1) written when out is given)."""
    ffi, lib = native()
    x = np.ascontiguousarray(x, dtype=np.float32)
    w = _rows(w, t, x.size)
    r1 = w.shape[0] if r1 is None else r1
    if not 0 <= r0 <= r1 <= w.shape[0]:
        raise ValueError(f"row range [{r0}, {r1}) outside 0..{w.shape[0]}")
    act = prepare_act(t, x) if act is None else act
    y = np.zeros(w.shape[0], np.float32) if out is None else out
    lib.kq_matvec(_code(t), ffi.cast("void *", w.ctypes.data), x.size, ffi.cast("void *", act.ctypes.data),
                  ffi.cast("float *", y.ctypes.data), r0, r1)
    return y


PACKED = 0x100  # kq.h's KQ_PACKED: type | PACKED is the sixteen-row packed layout


def pack(t, w, cols):
    """(packed type code, 64-byte aligned uint8 array) of stored rows w in the kernels'
    sixteen-row packed layout (csrc/kq.h); None when type t has no packed form."""
    ffi, lib = native()
    w = _rows(w, t, cols)
    n = lib.kq_packed_bytes(_code(t), w.shape[0], cols)
    if n == 0:
        return None
    buf = np.empty(n + 64, np.uint8)
    off = (-buf.ctypes.data) % 64
    p = buf[off:off + n]
    code = lib.kq_pack(_code(t), ffi.cast("void *", w.ctypes.data), w.shape[0], cols, ffi.cast("void *", p.ctypes.data))
    return code, p


def matvec_packed(code, p, rows, x, r0=0, r1=None, act=None, out=None):
    """matvec on a pack() result of `rows` rows."""
    ffi, lib = native()
    x = np.ascontiguousarray(x, dtype=np.float32)
    r1 = rows if r1 is None else r1
    act = prepare_act(code & ~PACKED, x) if act is None else act
    y = np.zeros(rows, np.float32) if out is None else out
    lib.kq_matvec_mat(code, ffi.cast("void *", p.ctypes.data), rows, x.size, ffi.cast("void *", act.ctypes.data),
                      ffi.cast("float *", y.ctypes.data), r0, r1)
    return y


def dequant(t, w, cols):
    """float32 (rows, cols) of stored rows."""
    ffi, lib = native()
    w = _rows(w, t, cols)
    out = np.empty((w.shape[0], cols), np.float32)
    for r in range(w.shape[0]):
        lib.kq_dequant_row(_code(t), ffi.cast("void *", w[r].ctypes.data), cols,
                           ffi.cast("float *", out[r].ctypes.data))
    return out


def prepare_acts(t, xs):
    """The prepared inputs of the rows of xs (float32, (nt, cols)) for weights of type t
    (packed or not), as one 64-byte aligned uint8 array (kq_acts_bytes)."""
    ffi, lib = native()
    xs = np.ascontiguousarray(xs, dtype=np.float32)
    nt, cols = xs.shape
    n = lib.kq_acts_bytes(_code(t), cols, nt)
    if n == 0:
        raise ValueError(f"type {t} does not take {nt} inputs of {cols} values")
    buf = np.empty(n + 64, np.uint8)
    off = (-buf.ctypes.data) % 64
    acts = buf[off:off + n]
    lib.kq_prepare_acts(_code(t), ffi.cast("float *", xs.ctypes.data), cols, cols, nt, 0, nt,
                        ffi.cast("void *", acts.ctypes.data))
    return acts


def matmul(t, w, rows, xs, r0=0, r1=None, out=None, acts=None):
    """w @ xs.T as (nt, rows) float32, rows [r0, r1) computed (the rest of `out` left as it
    is): w is the stored rows of type t (rows, row bytes) or, for a packed code, pack()'s
    array; one pass over the weights for every input (kq_matmul_mat).  acts: xs already
    prepared (prepare_acts), to time the product alone."""
    ffi, lib = native()
    xs = np.ascontiguousarray(xs, dtype=np.float32)
    nt, cols = xs.shape
    code = _code(t)
    if not code & PACKED:
        w = _rows(w, t, cols)
    r1 = rows if r1 is None else r1
    acts = prepare_acts(code, xs) if acts is None else acts
    y = np.zeros((nt, rows), np.float32) if out is None else out
    lib.kq_matmul_mat(code, ffi.cast("void *", w.ctypes.data), rows, cols, ffi.cast("void *", acts.ctypes.data), nt,
                      ffi.cast("float *", y.ctypes.data), rows, r0, r1)
    return y
