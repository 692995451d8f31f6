"""The inter-host leg's data: numpy views of any buffer KCCL takes, what MPI is
sent for each KCCL type, and the arithmetic KCCL does that MPI does not.

MPI has no bfloat16 and (portably) no float16 reduction, so half types cross hosts
as float32 and are rounded back once at the end: a host's partial sum is rounded
to the half type by KCCL inside the host, so a hierarchical half-type sum may
differ from the flat one by the one rounding per level (1 ulp per host sum).
AVG is SUM on both legs and one division by the world size at the end,
truncating toward zero for integers (as kccl_native/src/reduce.c's DEF_AVG)."""
import numpy as np
from mpi4py import MPI

from ._buffers import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, INT8, INT32, INT64, ITEMSIZE, NAMES, NUMPY_CODES, UINT8, \
    UINT32, UINT64, numpy_code, resolve_host_buffer
from ._native import ffi, lib

# numpy storage of each KCCL type (bfloat16 as its 16 bits)
STORAGE = {INT8: np.int8, UINT8: np.uint8, INT32: np.int32, UINT32: np.uint32, INT64: np.int64,
           UINT64: np.uint64, FLOAT16: np.float16, FLOAT32: np.float32, FLOAT64: np.float64, BFLOAT16: np.uint16}
HALF = (FLOAT16, BFLOAT16)
MPI_TYPE = {INT8: MPI.INT8_T, UINT8: MPI.UINT8_T, INT32: MPI.INT32_T, UINT32: MPI.UINT32_T,
            INT64: MPI.INT64_T, UINT64: MPI.UINT64_T, FLOAT32: MPI.FLOAT, FLOAT64: MPI.DOUBLE,
            FLOAT16: MPI.FLOAT, BFLOAT16: MPI.FLOAT}  # half types travel as float32
SUM, PROD, MAX, MIN, AVG = lib.kcclSum, lib.kcclProd, lib.kcclMax, lib.kcclMin, lib.kcclAvg
MPI_OP = {SUM: MPI.SUM, PROD: MPI.PROD, MAX: MPI.MAX, MIN: MPI.MIN, AVG: MPI.SUM}
OP_NAMES = {SUM: "sum", PROD: "prod", MAX: "max", MIN: "min", AVG: "avg"}


def view(obj, dtype, writable, what):
    """(numpy storage view of obj, KCCL type code, keep-alive) for any buffer KCCL takes."""
    ptr, n, code, keep = resolve_host_buffer(obj, dtype, writable, what)
    if not n:
        return np.empty(0, STORAGE[code]), code, keep
    arr = np.frombuffer(ffi.buffer(ptr, n * ITEMSIZE[code]), dtype=STORAGE[code])
    return arr, code, keep


def plain_view(obj, dtype, writable):
    """(flat storage view, KCCL type code) of a C-contiguous numpy array of a KCCL type given
    without dtype=, else (None, None): the common case, without view()'s general
    resolution (a few microseconds per buffer, on the small all-reduce's critical path)."""
    if dtype is None and type(obj) is np.ndarray and obj.flags.c_contiguous and (obj.flags.writeable or
                                                                                 not writable):
        code = NUMPY_CODES.get(obj.dtype) or numpy_code(obj.dtype)
        if code is not None:
            flat = obj.reshape(-1)
            return (flat.view(np.uint16) if code == BFLOAT16 else flat), code
    return None, None


def type_name(code):
    return NAMES.get(code, str(code))


def to_wire(block, code):
    """What MPI reduces for `block`: the block itself, or a float32 copy of a half type."""
    if code == BFLOAT16:
        return (block.astype(np.uint32) << 16).view(np.float32)
    if code == FLOAT16:
        return block.astype(np.float32)
    return block


def _f32_to_bf16(f, out):
    u = f.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    out[...] = np.where(nan, ((u >> 16) | np.uint32(0x40)).astype(np.uint16), rounded)


def finish(block, wire, code, op, world_size):
    """After MPI reduced `wire`: AVG's division, and half types rounded back into block."""
    if op == AVG:
        if wire.dtype.kind == "f":
            np.divide(wire, wire.dtype.type(world_size), out=wire)
        else:  # C's truncating division of the (wrapped) sum
            d = wire.dtype.type(world_size)
            q = wire // d
            if wire.dtype.kind == "i":
                q += ((wire % d) != 0) & (wire < 0)
            wire[...] = q
    if code == BFLOAT16:
        _f32_to_bf16(wire, block)
    elif code == FLOAT16:
        block[...] = wire.astype(np.float16)


def identity_like(block, code):
    """An array that adds nothing to `block` under SUM, bit for bit: -0.0 for floats
    (x + -0.0 == x for every x, +0.0 and -0.0 included), 0 for integers."""
    out = np.zeros_like(block)
    if code == BFLOAT16:
        out[...] = 0x8000
    elif code in (FLOAT16, FLOAT32, FLOAT64):
        out[...] = -0.0
    return out
