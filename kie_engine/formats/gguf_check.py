"""Structural check of a GGUF file, run over the header and tensor table before the gguf
package's reader sees the file.

That reader trusts the file: it follows claimed string and array lengths, recurses into
nested arrays, multiplies tensor dimensions in wrapping uint64 arithmetic and builds one
numpy view per array element.  A hostile or corrupt file could make it recurse until
RecursionError, spend minutes and gigabytes on a metadata array, or describe a tensor of
2^60 elements.  This module walks the same structure with plain struct reads, bounds every
count and length by the bytes that are left, and refuses with a CheckpointError naming
the file and the field, so that nothing is allocated that the file's size cannot justify.

What is refused: a bad magic, an unknown version or a big-endian file; counts, lengths
and offsets past the end; unknown value types, arrays of arrays, non-UTF-8 keys and
names, duplicate keys or tensor names, a bad general.alignment; more than 4 dimensions,
element counts that overflow, rows that are not whole blocks, tensor type ids the gguf
package does not know, tensor data that is misaligned, overlapping or past the end."""
import mmap
import os
import struct

from ..errors import CheckpointError, UnsupportedFormatError

VERSIONS = (2, 3)            # version 1 had 32-bit counts; the gguf package reads 2 and 3
MAX_DIMS = 4                 # GGML_MAX_DIMS
MAX_TENSORS = 1 << 16        # real models have hundreds to a few thousand
MAX_ARRAY_ITEMS = 1 << 22    # all metadata arrays together: a 256k vocabulary needs ~1M
DEFAULT_ALIGNMENT = 32

STRING, ARRAY, BOOL = 8, 9, 7
# value type id -> struct format of one scalar (little-endian)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
_TYPE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32", 7: "BOOL",
               8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}


class _End(Exception):
    """A read past the end of the file."""

    def __init__(self, offset, end):
        super().__init__(offset, end)
        self.offset, self.end = offset, end


class _Walker:
    def __init__(self, path, buf):
        self.path, self.buf, self.size, self.pos = path, buf, len(buf), 0
        self.where = "the file header"

    def fail(self, msg, cls=CheckpointError):
        raise cls(f"{self.path}: {msg}")

    def need(self, n):
        if n > self.size - self.pos:
            raise _End(self.pos, self.pos + n)

    def unpack(self, fmt):
        s = struct.calcsize(fmt)
        self.need(s)
        v = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += s
        return v

    def string(self, what):
        n = self.unpack("Q")
        self.need(n)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw

    def text(self, what):
        raw = self.string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self.fail(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})")


def check_file(path):
    """Refuses (CheckpointError / UnsupportedFormatError, naming the file and the field) a
    GGUF file whose header or tensor table is malformed; returns None when the gguf
    package can read it without trusting anything the file claims."""
    size = os.path.getsize(path)
    if size == 0:
        raise CheckpointError(f"{path}: empty file, not a GGUF file")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        w = _Walker(path, memoryview(m))
        try:
            _walk(w)
        except _End as e:
            raise CheckpointError(f"{path}: the file ends at byte {size}, inside {w.where} (a read of bytes "
                                  f"{e.offset}..{e.end}): truncated file") from None
        finally:
            w.buf.release()


def _walk(w):
    magic = bytes(w.buf[:4])
    if magic != b"GGUF":
        w.fail(f"not a readable GGUF file: it starts with {magic!r}, not the magic b'GGUF'")
    w.pos = 4
    version = w.unpack("I")
    if version & 0xFFFF == 0 and version:
        w.fail("a big-endian GGUF file; this engine reads little-endian ones only", UnsupportedFormatError)
    if version not in VERSIONS:
        w.fail(f"GGUF version {version}; supported: {', '.join(map(str, VERSIONS))}", UnsupportedFormatError)
    n_tensors, n_kv = w.unpack("Q"), w.unpack("Q")
    if n_tensors > MAX_TENSORS:
        w.fail(f"header field 'tensor_count' = {n_tensors}, more than the {MAX_TENSORS} this engine reads")
    _count_fits(w, "kv_count", n_kv, 13)
    meta = _walk_metadata(w, n_kv)
    _count_fits(w, "tensor_count", n_tensors, 24)
    alignment = _alignment(w, meta)
    tensors = _walk_tensor_table(w, n_tensors)
    w.where = "the tensor data"
    data_start = -(-w.pos // alignment) * alignment
    _check_tensor_data(w, tensors, data_start, alignment)


def _count_fits(w, what, n, least):
    """Each entry takes at least `least` bytes (a length, a type, the smallest value or
    description): a count the rest of the file cannot hold is refused by name."""
    if n * least > w.size - w.pos:
        w.fail(f"header field '{what}' = {n}, but only {w.size - w.pos} bytes follow, room for at most "
               f"{(w.size - w.pos) // least} entries: corrupt or truncated file")


def _walk_metadata(w, n_kv):
    """{key: (type id, scalar value or None)} of every entry."""
    meta, items = {}, 0
    last = None
    for i in range(n_kv):
        w.where = "the metadata, " + (f"in the entry after {last!r}" if last is not None else "in its first entry")
        key = w.text(f"metadata key #{i}" + (f" (after {last!r})" if last is not None else ""))
        if key in meta:
            w.fail(f"metadata key {key!r} appears twice")
        w.where = f"the metadata, in the entry {key!r}"
        t = w.unpack("I")
        value = None
        if t == ARRAY:
            it, n = w.unpack("I"), w.unpack("Q")
            if it == ARRAY:
                w.fail(f"metadata {key!r} is an array of arrays, which GGUF readers do not take")
            if it not in _TYPE_NAMES:
                w.fail(f"metadata {key!r} is an array of value type id {it}, not a GGUF type")
            items += n
            if items > MAX_ARRAY_ITEMS:
                w.fail(f"metadata {key!r} is an array of {n} entries, which brings the metadata's arrays past "
                       f"{MAX_ARRAY_ITEMS} entries, more than any model needs")
            if it == STRING:
                _skip_strings(w, n)
            else:
                s = struct.calcsize(_SCALAR[it])
                w.need(n * s)
                if it == BOOL and n:
                    _check_bools(w, key, bytes(w.buf[w.pos:w.pos + n]))
                w.pos += n * s
        elif t == STRING:
            w.text(f"metadata {key!r}")
        elif t in _SCALAR:
            value = w.unpack(_SCALAR[t])
            if t == BOOL:
                _check_bools(w, key, bytes([value]))
        else:
            w.fail(f"metadata {key!r} has value type id {t}, not a GGUF type")
        meta[key] = (t, value)
        last = key
    return meta


def _skip_strings(w, n):
    """Steps over n strings (lengths only: Metadata.strings decodes them, by key)."""
    if n * 8 > w.size - w.pos:
        raise _End(w.pos, w.pos + n * 8)
    buf, pos, size, unpack = w.buf, w.pos, w.size, struct.Struct("<Q").unpack_from
    for _ in range(n):
        if pos + 8 > size:
            raise _End(pos, pos + 8)
        start = pos + 8
        pos = start + unpack(buf, start - 8)[0]
        if pos > size:
            raise _End(start, pos)
    w.pos = pos


def _check_bools(w, key, raw):
    bad = raw.translate(None, b"\0\1")
    if bad:
        w.fail(f"metadata {key!r} holds the byte {bad[0]} as a boolean (0 or 1 expected)")


def _alignment(w, meta):
    if "general.alignment" not in meta:
        return DEFAULT_ALIGNMENT
    t, a = meta["general.alignment"]
    if t != 4:
        w.fail(f"metadata 'general.alignment' is a {_TYPE_NAMES.get(t, t)}, not a UINT32")
    if a == 0 or a & (a - 1):
        w.fail(f"metadata 'general.alignment' = {a}, not a power of two")
    return a


def _walk_tensor_table(w, n_tensors):
    """[(name, dims, type id, offset)] of every tensor description."""
    tensors, seen = [], set()
    for i in range(n_tensors):
        w.where = f"the tensor table, in entry #{i}" + (f" (after {tensors[-1][0]!r})" if tensors else "")
        name = w.text(f"the name of tensor #{i}")
        if name in seen:
            w.fail(f"tensor {name!r} appears twice in the tensor table")
        seen.add(name)
        w.where = f"the tensor table, in the entry of tensor {name!r}"
        n_dims = w.unpack("I")
        if n_dims > MAX_DIMS:
            w.fail(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
        dims = [w.unpack("Q") for _ in range(n_dims)]
        t, off = w.unpack("I"), w.unpack("Q")
        tensors.append((name, dims, t, off))
    return tensors


def _check_tensor_data(w, tensors, data_start, alignment):
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:  # gguf_io says how to install it
        return
    spans = []
    for name, dims, t, off in tensors:
        shape = list(reversed(dims))
        try:
            qtype = GGMLQuantizationType(t)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            w.fail(f"tensor {name!r} has type id {t}, which is no ggml type this gguf package knows",
                   UnsupportedFormatError)
        n_el = 1
        for d in dims:
            n_el *= d  # Python ints: no wrap-around
        if dims and dims[0] % block:
            w.fail(f"tensor {name!r} ({qtype.name}, {shape}) has rows of {dims[0]} values, not a multiple of its "
                   f"block size {block}")
        nbytes = n_el // block * type_size
        if off % alignment:
            w.fail(f"tensor {name!r} has data offset {off}, not a multiple of the alignment {alignment}")
        start = data_start + off
        if start + nbytes > w.size:
            w.fail(f"tensor {name!r} ({qtype.name}, {shape}) needs bytes {start}..{start + nbytes}, but the file "
                   f"has {w.size} bytes: truncated file")
        spans.append((start, start + nbytes, name))
    spans.sort()
    for (_s0, e0, a), (s1, _e1, b) in zip(spans, spans[1:]):
        if s1 < e0:
            w.fail(f"tensors {a!r} and {b!r} overlap (bytes {s1}..{min(e0, _e1)} belong to both)")
