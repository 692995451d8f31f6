"""Reading and writing the safetensors format with numpy alone.

A file is: 8 bytes little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the raw little-endian tensor data (offsets relative to its start).
Reading memory-maps the file, so a lane that needs a slice of a tensor touches
only those pages, and bfloat16 is widened to float32 slice by slice."""
import json
import os
import struct

import numpy as np

from ..errors import CheckpointError
from . import jsonfile

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
           "I64": np.int64, "I32": np.int32}


class SafetensorsFile:
    def __init__(self, path):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 << 20):
                raise CheckpointError(f"{path}: header length {n} does not fit the file ({size} bytes)")
            header = jsonfile.parse(f.read(n), path, CheckpointError, "the header")
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
        self.metadata = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict):
            raise CheckpointError(f"{path}: the header's '__metadata__' is not an object")
        self._data_start = 8 + n
        self._map = np.memmap(path, dtype=np.uint8, mode="r") if size > 8 + n else np.zeros(0, np.uint8)
        self.tensors = {}
        spans = []
        for name, info in header.items():
            dt, shape, (b, e) = _entry(path, name, info)
            nbytes = np.dtype(_DTYPES[dt]).itemsize
            for d in shape:
                nbytes *= d  # Python ints: a product of huge dimensions does not wrap
            if not (b <= e and e - b == nbytes and self._data_start + e <= size):
                raise CheckpointError(f"{path}: tensor {name!r} ({dt}, shape {list(shape)}) has data offsets "
                                      f"{[b, e]} that do not match its size or the file")
            self.tensors[name] = (dt, shape, b)
            if b < e:
                spans.append((b, e, name))
        spans.sort()
        for (_b0, e0, x), (b1, _e1, y) in zip(spans, spans[1:]):
            if b1 < e0:
                raise CheckpointError(f"{path}: tensors {x!r} and {y!r} overlap (data bytes {b1}..{min(e0, _e1)})")

    def raw(self, name):
        """The stored array (bfloat16 as uint16), memory-mapped, read-only."""
        dt, shape, b = self.tensors[name]
        n = int(np.prod(shape, dtype=np.int64))
        start = self._data_start + b
        return self._map[start:start + n * np.dtype(_DTYPES[dt]).itemsize].view(_DTYPES[dt]).reshape(shape)

    def dtype(self, name):
        return self.tensors[name][0]


def _entry(path, name, info):
    """(dtype, shape, (begin, end)) of a header entry, each checked for its JSON type."""
    def bad(what):
        return CheckpointError(f"{path}: tensor {name!r} has a malformed header entry: {what}")
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise bad("expected an object with dtype, shape and data_offsets")
    dt, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dt, str):
        raise bad(f"'dtype' = {str(dt)[:40]}, not a string")
    if dt not in _DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {dt[:40]}, not supported "
                              f"(supported: {', '.join(_DTYPES)})")
    ok = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
    if not isinstance(shape, list) or len(shape) > 8 or not all(ok(d) for d in shape):
        raise bad(f"'shape' = {str(shape)[:40]}, not a list of at most 8 non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(ok(v) for v in offsets):
        raise bad(f"'data_offsets' = {str(offsets)[:40]}, not two non-negative integers")
    return dt, tuple(shape), tuple(offsets)


def to_float32(stored, dtype_name):
    """A float32 copy of (a slice of) a stored tensor."""
    if dtype_name == "BF16":  # bfloat16 is the top half of a float32
        return (np.ascontiguousarray(stored).astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(stored, dtype=np.float32)


def float32_to_bf16_bits(x):
    """Round-to-nearest-even bfloat16 bit patterns (uint16) of a float32 array; every
    float-to-bf16 rounding of the engine goes through here.  A NaN stays a NaN (its top
    half with the quiet bit set: rounding its low half could carry into the exponent and
    make an infinity, or leave a zero mantissa); finite values past bf16's largest round
    to infinity, as in torch and ml_dtypes."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def write(path, tensors, metadata=None):
    """tensors: {name: (dtype name 'F32'|'BF16', array of that storage type)}, written in order."""
    specs = [(name, dt, arr.shape) for name, (dt, arr) in tensors.items()]
    write_stream(path, specs, (arr for _dt, arr in tensors.values()), metadata)


_STORAGE = {"F32": np.float32, "BF16": np.uint16, "F16": np.float16}


def write_stream(path, specs, chunks, metadata=None):
    """Writes a file whose header is known before any data exists: specs is
    [(name, dtype name, shape)] in file order, chunks an iterable of arrays of those
    storage types whose bytes, concatenated, are the tensors' data in that order (a
    tensor may come in any number of chunks, so none need be whole in memory).  The file
    appears under `path` only once complete."""
    header, offset = {}, 0
    for name, dt, shape in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_STORAGE[dt]).itemsize
        header[name] = {"dtype": dt, "shape": [int(d) for d in shape], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
    tmp = path + ".tmp"
    written = 0
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for arr in chunks:
                arr = np.ascontiguousarray(arr)
                if arr.nbytes:
                    f.write(memoryview(arr.reshape(-1)).cast("B"))
                written += arr.nbytes
        if written != offset:
            raise ValueError(f"{path}: the chunks hold {written} bytes, the header promises {offset}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
