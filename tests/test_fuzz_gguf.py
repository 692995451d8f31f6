"""Fuzzing the GGUF reader (kie_engine/formats/gguf_io.py, kie_engine/formats/gguf_check.py).

Every file, however malformed, must either load completely (config, every tensor, the
tokenizer, the chat template rendered) or raise a KieError whose message starts with the
file's path; never another exception, a hang, or an allocation the file's size cannot
justify (each load runs under tests/_fuzz.bounded: a time limit and an address-space
limit of 1 GiB above what the process maps).

Two kinds of input:
* mutations of a small valid file (tests/_gguf_files.write_llama with a byte-level BPE
  tokenizer and a chat template): bytes overwritten, the file cut, and every length,
  count, type, dimension and offset field of the header overwritten with edge values;
* files built field by field (tests/_gguf_files.raw_gguf): huge counts and lengths,
  unknown and nested types, dimensions whose product wraps, offsets past the end,
  misaligned or overlapping, which must each be refused naming the field.

Run longer: HYPOTHESIS_PROFILE=fuzz-long (see tests/_fuzz.py)."""
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, strategies as st

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from _fuzz import bounded, examples  # noqa: E402
from _gguf_files import (kv, kv_array, kv_string, kv_u32, raw_gguf, tensor_info, write_llama,  # noqa: E402
                         gguf_str)
from kie_engine.formats.checkpoint import expected_shapes  # noqa: E402
from kie_engine.errors import CheckpointError, KieError, UnsupportedFormatError  # noqa: E402
from kie_engine.formats.gguf_io import GGUFCheckpoint  # noqa: E402
from kie_engine.formats.tokenizer import _bytes_to_unicode  # noqa: E402

EDGE = [0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 31, 32, 33, 255, 256, 4096, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40,
        2**60, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


def _write_tokenizer(w):
    chars = [_bytes_to_unicode()[b] for b in range(256)]
    merged = [a + b for a, b in zip("abcdefghijklmnopqrstuvwxyzABCD", "bcdefghijklmnopqrstuvwxyzaBCDE")]
    tokens = chars + merged + ["<|im_start|>", "<|im_end|>"]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "smollm")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.merges", [f"{m[0]} {m[1]}" for m in merged])
    w.add_array("tokenizer.ggml.token_type", [1] * 286 + [3, 3])
    w.add_uint32("tokenizer.ggml.bos_token_id", 286)
    w.add_uint32("tokenizer.ggml.eos_token_id", 287)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template",
                 "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """(bytes of a small valid file, [(offset, size)] of its 4- and 8-byte header fields,
    the offset where tensor data starts)."""
    path = str(tmp_path_factory.mktemp("gguf_fuzz") / "valid.gguf")
    write_llama(path, tokenizer=_write_tokenizer)
    r = gguf.GGUFReader(path)
    base = r.data.__array_interface__["data"][0]
    fields = set()
    for f in list(r.fields.values()) + [t.field for t in r.tensors]:
        for part in f.parts:
            if part.nbytes in (4, 8):
                fields.add((part.__array_interface__["data"][0] - base, part.nbytes))
    with open(path, "rb") as fh:
        data = fh.read()
    load_all(path)  # the unmutated file loads
    return data, sorted(fields), r.data_offset


def load_all(path):
    """Everything the engine reads from a GGUF file."""
    ck = GGUFCheckpoint(path)
    for name in expected_shapes(ck.config):
        ck.tensor(name)
    tk = ck.tokenizer()
    template = ck.chat_template()
    if template is not None:
        ids = template.encode(tk, "hello abc")
        # (not tk.get_vocab_size(): a duplicate spelling keeps its first id, leaving a gap)
        assert all(0 <= i < ck.config.vocab_size for i in ids)
        template.end_of_turn(tk)
    return ck


def check_refused_or_loads(path, seconds=20.0):
    """Loads `path` under a time and memory bound: fine, or a KieError naming the file."""
    try:
        with bounded(seconds):
            load_all(path)
    except KieError as e:
        assert isinstance(e, ValueError), repr(e)
        assert str(e).startswith(path + ":"), str(e)
        return e
    return None


def _write(tmp_path, data, name="f.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


# -- mutations of a valid file -------------------------------------------------------------------

@examples(150)
@given(data=st.data())
def test_mutated_bytes(valid, tmp_path_factory, data):
    raw, _fields, data_start = valid
    buf = bytearray(raw)
    n = data.draw(st.integers(1, 8), label="n_bytes")
    for _ in range(n):
        pos = data.draw(st.integers(0, data_start + 64), label="pos")  # the header, and a little data
        buf[pos] = data.draw(st.integers(0, 255), label="byte")
    if data.draw(st.booleans(), label="cut"):
        buf = buf[:data.draw(st.integers(0, len(buf)), label="keep")]
    check_refused_or_loads(_write(tmp_path_factory.mktemp("m"), bytes(buf)))


@examples(200)
@given(data=st.data())
def test_mutated_fields(valid, tmp_path_factory, data):
    """Length, count, type, dimension and offset fields overwritten with edge values."""
    raw, fields, _data_start = valid
    buf = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 3), label="n_fields")):
        off, size = data.draw(st.sampled_from(fields), label="field")
        v = data.draw(st.sampled_from(EDGE) | st.integers(0, 2**64 - 1), label="value") % (1 << (8 * size))
        buf[off:off + size] = v.to_bytes(size, "little")
    check_refused_or_loads(_write(tmp_path_factory.mktemp("f"), bytes(buf)))


def test_the_valid_file_loads(valid, tmp_path):
    raw, _fields, _ = valid
    assert check_refused_or_loads(_write(tmp_path, raw)) is None


@pytest.mark.parametrize("merge, missing", [("a Z", "'Z'"), ("a b", "'ab'")])
def test_merge_of_tokens_outside_the_vocabulary(tmp_path, merge, missing):
    """A merge whose parts or result have no id is refused by name (the tokenizers library
    would raise a bare Exception)."""
    def tokenizer(w):
        chars = [_bytes_to_unicode()[b] for b in range(256)]
        tokens = [c for c in chars if c != "Z"] + ["<|im_start|>", "<|im_end|>"]
        w.add_string("tokenizer.ggml.model", "gpt2")
        w.add_array("tokenizer.ggml.tokens", tokens)
        w.add_array("tokenizer.ggml.merges", [merge])
    path = str(tmp_path / "m.gguf")
    write_llama(path, tokenizer=tokenizer)
    with pytest.raises(CheckpointError, match=f"merges'\\[0\\] = '{merge}': {missing} is not in"):
        GGUFCheckpoint(path).tokenizer()


# -- structure-aware files -----------------------------------------------------------------------

def _refused(tmp_path, data, *words, cls=CheckpointError):
    path = _write(tmp_path, data)
    e = check_refused_or_loads(path, seconds=10.0)
    assert isinstance(e, cls), (e, words)
    for w in words:
        assert w in str(e), (w, str(e))
    return str(e)


ARCH = kv_string("general.architecture", "llama")


def test_bad_magic_version_and_byte_order(tmp_path):
    _refused(tmp_path, raw_gguf([ARCH], magic=b"GGUE"), "not a readable GGUF file", "b'GGUE'")
    _refused(tmp_path, raw_gguf([ARCH], version=1), "GGUF version 1", cls=UnsupportedFormatError)
    _refused(tmp_path, raw_gguf([ARCH], version=3 << 24), "big-endian", cls=UnsupportedFormatError)
    _refused(tmp_path, b"GGUF\x03\0\0", "truncated")
    _refused(tmp_path, b"", "too short")


@pytest.mark.parametrize("which", ["kv_count", "tensor_count"])
@pytest.mark.parametrize("n", [2**20, 2**40, 2**64 - 1])
def test_huge_counts(tmp_path, which, n):
    kw = {"n_kv": n} if which == "kv_count" else {"n_tensors": n}
    _refused(tmp_path, raw_gguf([ARCH], **kw), f"'{which}' = {n}")


@pytest.mark.parametrize("n", [64, 2**31, 2**60, 2**64 - 1])
def test_huge_string_lengths(tmp_path, n):
    key = struct.pack("<Q", n) + b"general.name"
    _refused(tmp_path, raw_gguf([ARCH, key + struct.pack("<I", 8) + gguf_str("x")]), "metadata", "truncated")
    value = kv("general.name", 8, struct.pack("<Q", n) + b"abc")
    _refused(tmp_path, raw_gguf([ARCH, value]), "'general.name'", "truncated")


@pytest.mark.parametrize("item_type", [0, 4, 8, 10])
@pytest.mark.parametrize("n", [2**20, 2**40, 2**63, 2**64 - 1])
def test_huge_array_lengths(tmp_path, item_type, n):
    _refused(tmp_path, raw_gguf([ARCH, kv_array("tokenizer.ggml.tokens", item_type, n, bytes(64))]),
             "'tokenizer.ggml.tokens'")


def test_arrays_past_what_any_model_needs(tmp_path):
    """5 M one-byte entries fit the file, but the gguf package would build a numpy view per
    entry (gigabytes); refused by count."""
    n = 5 << 20
    _refused(tmp_path, raw_gguf([ARCH, kv_array("x.big", 0, n, bytes(n))]), "'x.big'", "array of")


def test_nested_arrays(tmp_path):
    """Arrays of arrays, nested deeper than Python's recursion limit: the gguf package's
    reader recursed once per level (RecursionError)."""
    depth = 5000
    nested = struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 0, 0)
    _refused(tmp_path, raw_gguf([ARCH, kv("x.nested", 9, nested)]), "'x.nested'", "array of arrays")


@pytest.mark.parametrize("t", [13, 99, 2**32 - 1])
def test_unknown_value_types(tmp_path, t):
    _refused(tmp_path, raw_gguf([ARCH, kv("x.odd", t, bytes(8))]), "'x.odd'", f"type id {t}")
    _refused(tmp_path, raw_gguf([ARCH, kv_array("x.odd", t, 1, bytes(8))]), "'x.odd'", f"type id {t}")


def test_bad_keys_names_and_values(tmp_path):
    _refused(tmp_path, raw_gguf([ARCH, kv(b"x.\xff\xfe", 4, bytes(4))]),
             "not UTF-8")
    _refused(tmp_path, raw_gguf([ARCH, ARCH]), "'general.architecture' appears twice")
    _refused(tmp_path, raw_gguf([ARCH, kv("x.flag", 7, b"\x05")]), "'x.flag'", "boolean")
    _refused(tmp_path, raw_gguf([ARCH, kv("general.alignment", 10, struct.pack("<Q", 32))]),
             "'general.alignment'", "UINT32")
    for a in (0, 3, 48):
        _refused(tmp_path, raw_gguf([ARCH, kv_u32("general.alignment", a)]), "'general.alignment'", "power of two")


def test_metadata_of_the_wrong_type(tmp_path):
    """A vocabulary that is not an array of strings, a count that is a string."""
    path = str(tmp_path / "t.gguf")

    def tokens_as_ints(w):
        w.add_string("tokenizer.ggml.model", "gpt2")
        w.add_array("tokenizer.ggml.tokens", [1, 2, 3])
    write_llama(path, tokenizer=tokens_as_ints)
    with pytest.raises(CheckpointError, match=r"'tokenizer.ggml.tokens' is not an array of STRING"):
        GGUFCheckpoint(path).tokenizer()
    write_llama(path, extra_kv={"llama.attention.key_length": ("string", "16")})
    with pytest.raises(CheckpointError, match=r"'llama.attention.key_length' = '16' is not an integer"):
        GGUFCheckpoint(path)


def _f32(name, dims, offset):
    return tensor_info(name, dims, 0, offset)


def test_tensor_dimensions_that_overflow(tmp_path):
    """2^60 elements, and dimensions whose product wraps to 0 in uint64, are refused before
    anything is allocated (check_refused_or_loads runs under an address-space limit)."""
    data = bytes(64)
    _refused(tmp_path, raw_gguf([ARCH], [_f32("token_embd.weight", [2**30, 2**30], 0)], data),
             "'token_embd.weight'", "truncated")
    _refused(tmp_path, raw_gguf([ARCH], [_f32("token_embd.weight", [2**32, 2**32], 0)], data),
             "'token_embd.weight'", "truncated")
    _refused(tmp_path, raw_gguf([ARCH], [_f32("token_embd.weight", [2**63, 2], 0)], data),
             "'token_embd.weight'", "truncated")
    _refused(tmp_path, raw_gguf([ARCH], [tensor_info("t", [1] * 5, 0, 0)], data), "'t'", "5 dimensions")
    _refused(tmp_path, raw_gguf([ARCH], [tensor_info("t", [2**32 - 1] * 1000, 0, 0)], data), "'t'", "dimensions")


def test_tensor_types_and_blocks(tmp_path):
    data = bytes(4096)
    _refused(tmp_path, raw_gguf([ARCH], [tensor_info("t", [32], 2**31, 0)], data), "'t'", "type id 2147483648",
             cls=UnsupportedFormatError)
    _refused(tmp_path, raw_gguf([ARCH], [tensor_info("t", [33, 2], 8, 0)], data), "'t'", "block size 32")


def test_tensor_offsets(tmp_path):
    data = bytes(256)
    _refused(tmp_path, raw_gguf([ARCH], [_f32("a", [8], 2**64 - 32)], data), "'a'", "truncated")
    _refused(tmp_path, raw_gguf([ARCH], [_f32("a", [8], 4)], data), "'a'", "not a multiple of the alignment 32")
    _refused(tmp_path, raw_gguf([ARCH], [_f32("a", [16], 0), _f32("b", [8], 32)], data), "'a' and 'b' overlap")
    _refused(tmp_path, raw_gguf([ARCH], [_f32("a", [8], 0), _f32("a", [8], 32)], data), "'a' appears twice")
    _refused(tmp_path, raw_gguf([ARCH], [tensor_info(b"\xff\xfe", [8], 0, 0)], data), "not UTF-8")


@st.composite
def raw_files(draw):
    """Files built from fields, each drawn from plausible and hostile values."""
    keys = st.sampled_from(["general.architecture", "general.alignment", "llama.block_count",
                            "llama.embedding_length", "tokenizer.ggml.tokens", "x.y"])
    kvs = []
    for _ in range(draw(st.integers(0, 4))):
        t = draw(st.sampled_from([0, 4, 7, 8, 9, 10, 12, 13]))
        if t == 9:
            it = draw(st.sampled_from([0, 4, 8, 9, 13]))
            n = draw(st.sampled_from(EDGE[:12]) | st.sampled_from(EDGE))
            payload = struct.pack("<IQ", it, n) + draw(st.binary(max_size=64))
        elif t == 8:
            payload = struct.pack("<Q", draw(st.sampled_from(EDGE))) + draw(st.binary(max_size=32))
        else:
            payload = draw(st.binary(max_size=16))
        kvs.append(kv(draw(keys), t, payload))
    tensors = []
    for i in range(draw(st.integers(0, 4))):
        dims = draw(st.lists(st.sampled_from(EDGE[:14]) | st.sampled_from(EDGE), max_size=5))
        t = draw(st.sampled_from([0, 1, 3, 8, 12, 30, 2**31]))
        off = draw(st.sampled_from([0, 32, 64, 4, 2**63]) | st.integers(0, 2**64 - 1))
        tensors.append(tensor_info(draw(st.sampled_from(["token_embd.weight", "output.weight", f"t{i}"])), dims,
                                   t, off))
    data = bytes(draw(st.integers(0, 512)))
    kw = {}
    if draw(st.booleans()):
        kw["n_kv"] = draw(st.sampled_from(EDGE))
    if draw(st.booleans()):
        kw["n_tensors"] = draw(st.sampled_from(EDGE))
    return raw_gguf(kvs, tensors, data, **kw)


@examples(300)
@given(data=raw_files())
def test_structured_files(tmp_path_factory, data):
    check_refused_or_loads(_write(tmp_path_factory.mktemp("s"), data), seconds=10.0)


def test_claimed_context_is_not_allocated(tmp_path):
    """A file may claim a context of 2^31 - 1 tokens; generate sizes its buffers for the
    request (it used to build RoPE tables for the whole claimed context: MemoryError)."""
    import subprocess
    import sys
    path = str(tmp_path / "long.gguf")
    write_llama(path, tokenizer=_write_tokenizer, cfg={"max_position_embeddings": 2**31 - 1})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", "import resource, runpy, sys; "
                        "resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.RLIM_INFINITY)); "
                        "sys.argv = ['kie_engine'] + sys.argv[1:]; runpy.run_module('kie_engine', run_name='__main__')",
                        "generate", "--model", path, "--prompt", "abc", "--max-new-tokens", "3", "--ignore-eos"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]


def test_claimed_layers_past_the_tensors(tmp_path):
    """A block_count of 2^31 - 1 (found by test_mutated_bytes) used to make the tensor check
    list 9 x 2^31 names: refused by the count of tensors the file has."""
    path = str(tmp_path / "layers.gguf")
    write_llama(path)
    r = gguf.GGUFReader(path)
    part = r.fields["llama.block_count"].parts[-1]
    off = part.__array_interface__["data"][0] - r.data.__array_interface__["data"][0]
    del r
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(struct.pack("<I", 2**31 - 1))
    e = check_refused_or_loads(path, seconds=10.0)
    assert isinstance(e, CheckpointError) and "'llama.block_count' = 2147483647 layers" in str(e), e


def test_claimed_context_without_max_seq(tmp_path):
    """Loading such a file without a max_seq (as `serve` does): the RoPE tables grow with the
    sequence, and a KV cache that cannot be had is a KieError, not a MemoryError."""
    from kie_engine.errors import KieError
    from kie_engine.generate import generate
    from kie_engine.reference.sharded import load_model
    path = str(tmp_path / "long.gguf")
    write_llama(path, tokenizer=_write_tokenizer, cfg={"max_position_embeddings": 2**31 - 1})
    ck = GGUFCheckpoint(path)
    with pytest.raises(KieError, match="KV cache for a context of 2147483647 tokens"):
        with bounded(60.0):
            load_model(ck)
    model = load_model(ck, max_seq=300)  # past the tables' first 256 positions: they grow
    assert len(generate(model, list(range(1, 250)), 20).tokens) == 20
    assert len(model.cos) == 300
