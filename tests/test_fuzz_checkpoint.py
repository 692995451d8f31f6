"""Fuzzing a Hugging Face-style checkpoint directory: the safetensors header
(kie_engine/formats/safetensors_io.py), config.json (kie_engine/formats/config.py), tokenizer.json
(kie_engine/formats/tokenizer.py) and tokenizer_config.json (kie_engine/formats/checkpoint.py: special
tokens and the chat template).

A small valid directory (kie_engine.formats.init, the tiny preset) is mutated, one file per test:
JSON files by replacing or deleting a random node of their tree with random JSON (and by
byte flips), the safetensors file through its header's JSON and its length field.  Then
everything the engine reads from a directory is read (config, every tensor, tokenizer
encode/decode, the chat template rendered), under tests/_fuzz.bounded (time and
address-space limits).  It must work or raise a KieError naming a file of the directory.

Run longer: HYPOTHESIS_PROFILE=fuzz-long (see tests/_fuzz.py)."""
import json
import os
import shutil
import struct

import pytest
from hypothesis import given, strategies as st

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from _fuzz import bounded, examples  # noqa: E402
from kie_engine.formats.checkpoint import Checkpoint, expected_shapes  # noqa: E402
from kie_engine.formats.config import ModelConfig, preset  # noqa: E402
from kie_engine.errors import ConfigError, CheckpointError, KieError  # noqa: E402
from kie_engine.formats.init import write_checkpoint  # noqa: E402

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
EDGE = [-1, 0, 1, 2, 7, 8, 255, 256, 2**31 - 1, 2**31, 2**32, 2**53, 2**63 - 1, 2**63, 2**64, 10**30]

json_values = st.recursive(
    st.none() | st.booleans() | st.sampled_from(EDGE) | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt") / "tiny")
    write_checkpoint(preset("tiny").replace(torch_dtype="float32"), d)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE}, f)
    load_all(d)
    return d


def load_all(d):
    ck = Checkpoint(d)
    for name in expected_shapes(ck.config):
        ck.tensor(name)
    tk = ck.tokenizer()
    ids = tk.encode("hello wörld").ids
    tk.decode(ids)
    t = ck.chat_template()
    if t is not None:
        t.time_limit = 5.0
        t.encode(tk, "hi")
    return ck


def check(d):
    """Loads directory d under bounds: fine, or a KieError naming one of its files."""
    try:
        with bounded(30.0):
            load_all(d)
    except KieError as e:
        assert isinstance(e, ValueError), repr(e)
        assert str(e).startswith(d), str(e)
        return e
    return None


def _copy(valid, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("c") / "ck")
    shutil.copytree(valid, d)
    return d


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _mutate(tree, data, n_max=3):
    """Replaces or deletes up to n_max random nodes of a JSON tree (in place; returns it)."""
    for _ in range(data.draw(st.integers(1, n_max), label="n_nodes")):
        paths = list(_paths(tree))
        path = data.draw(st.sampled_from(paths), label="path")
        if not path:
            tree = data.draw(json_values, label="root")
            continue
        parent = tree
        for k in path[:-1]:
            parent = parent[k]
        if data.draw(st.booleans(), label="delete") and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(json_values, label="value")
    return tree


def _rewrite_json(d, name, data):
    path = os.path.join(d, name)
    with open(path) as f:
        tree = json.load(f)
    text = json.dumps(_mutate(tree, data))
    if data.draw(st.booleans(), label="flip"):
        b = bytearray(text.encode())
        for _ in range(data.draw(st.integers(1, 4), label="n_flips")):
            b[data.draw(st.integers(0, len(b) - 1), label="pos")] = data.draw(st.integers(0, 255), label="byte")
        text = bytes(b)
    with open(path, "wb") as f:
        f.write(text if isinstance(text, bytes) else text.encode())


@examples(150)
@given(data=st.data())
def test_config_json(valid, tmp_path_factory, data):
    d = _copy(valid, tmp_path_factory)
    _rewrite_json(d, "config.json", data)
    check(d)


@examples(100)
@given(data=st.data())
def test_tokenizer_json(valid, tmp_path_factory, data):
    d = _copy(valid, tmp_path_factory)
    _rewrite_json(d, "tokenizer.json", data)
    check(d)


@examples(80)
@given(data=st.data())
def test_tokenizer_config_json(valid, tmp_path_factory, data):
    d = _copy(valid, tmp_path_factory)
    _rewrite_json(d, "tokenizer_config.json", data)
    check(d)


def _header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), f.read()


def _write_safetensors(path, header, data, n=None):
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text) if n is None else n) + text + data)


@examples(200)
@given(data=st.data())
def test_safetensors_header(valid, tmp_path_factory, data):
    d = _copy(valid, tmp_path_factory)
    path = os.path.join(d, "model.safetensors")
    header, body = _header(path)
    names = sorted(k for k in header if k != "__metadata__")
    for _ in range(data.draw(st.integers(1, 3), label="n_changes")):
        name = data.draw(st.sampled_from(names), label="tensor")
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", None]), label="field")
        if field is None:
            header[name] = data.draw(json_values, label="entry")
        elif field == "dtype" and isinstance(header[name], dict):
            header[name] = dict(header[name], dtype=data.draw(st.sampled_from(["F32", "BF16", "F16", "I64", "U8",
                                                                              "F64", ""]) | json_values))
        elif isinstance(header[name], dict) and isinstance(header[name].get(field), list):
            old = list(header[name][field])
            i = data.draw(st.integers(0, max(len(old) - 1, 0)), label="index")
            if old:
                old[i] = data.draw(st.sampled_from(EDGE) | json_values, label="number")
            header[name] = dict(header[name], **{field: old})
    n = data.draw(st.none() | st.sampled_from(EDGE[1:]), label="length")
    _write_safetensors(path, header, body, n if n is None or n < 2**64 else None)
    check(d)


@pytest.mark.parametrize("case", ["list", "deep", "dup", "huge_dims", "wrap_dims", "float_offsets",
                                  "string_offsets", "list_dtype", "negative_dims", "overlap", "metadata",
                                  "not_utf8", "dims_too_many"])
def test_safetensors_cases(valid, tmp_path, case):
    """Headers the fuzzing found crashing (before the fix) or passing unchecked."""
    d = str(tmp_path / "ck")
    shutil.copytree(valid, d)
    path = os.path.join(d, "model.safetensors")
    header, body = _header(path)
    name = "model.norm.weight"
    e = header[name]
    text = None
    if case == "list":
        text = b"[1, 2]"
    elif case == "deep":
        text = b"[" * 100000 + b"]" * 100000
    elif case == "dup":
        text = json.dumps(header).encode()[:-1] + b', "' + name.encode() + b'": ' + json.dumps(e).encode() + b"}"
    elif case == "huge_dims":
        header[name] = dict(e, shape=[2**70])
    elif case == "wrap_dims":
        header[name] = dict(e, shape=[2**32, 2**32, 0 + 4], data_offsets=[e["data_offsets"][0]] * 2)
    elif case == "float_offsets":
        header[name] = dict(e, data_offsets=[float(v) for v in e["data_offsets"]])
    elif case == "string_offsets":
        header[name] = dict(e, data_offsets=[str(v) for v in e["data_offsets"]])
    elif case == "list_dtype":
        header[name] = dict(e, dtype=["F32"])
    elif case == "negative_dims":
        header[name] = dict(e, shape=[-1, -e["shape"][0]])
    elif case == "overlap":
        other = header["model.embed_tokens.weight"]["data_offsets"]
        header[name] = dict(e, data_offsets=[other[0], other[0] + e["data_offsets"][1] - e["data_offsets"][0]])
    elif case == "metadata":
        header["__metadata__"] = [1]
    elif case == "not_utf8":
        text = json.dumps(header).encode().replace(b"model.norm", b"model.\xffnorm")
    elif case == "dims_too_many":
        header[name] = dict(e, shape=[1] * 9 + e["shape"])
    _write_safetensors(path, text if text is not None else header, body)
    err = check(d)
    assert isinstance(err, CheckpointError), (case, err)
    assert str(err).startswith(path + ":"), str(err)


@pytest.mark.parametrize("case", ["deep", "string_theta", "list_theta", "string_hidden", "float_heads",
                                  "huge_context", "huge_int", "bool_tie", "float_bos", "not_utf8", "dup", "inf"])
def test_config_cases(valid, tmp_path, case):
    """config.json values the fuzzing found crashing (before the fix) or passing unchecked."""
    d = str(tmp_path / "ck")
    shutil.copytree(valid, d)
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    text = None
    edits = {"string_theta": {"rope_theta": "abc"}, "list_theta": {"rope_theta": [1]},
             "string_hidden": {"hidden_size": "64", "head_dim": None}, "float_heads": {"num_attention_heads": 4.0},
             "huge_context": {"max_position_embeddings": 2**40}, "huge_int": {"rms_norm_eps": 10**400},
             "bool_tie": {"tie_word_embeddings": "false"}, "float_bos": {"bos_token_id": 1.5}}
    if case in edits:
        cfg.update(edits[case])
    elif case == "deep":
        text = b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    elif case == "not_utf8":
        text = json.dumps(cfg).encode().replace(b"llama", b"ll\xffama")
    elif case == "dup":
        text = json.dumps(cfg).encode()[:-1] + b', "vocab_size": 99}'
    elif case == "inf":
        text = json.dumps(cfg).encode().replace(b'"rope_theta": 10000.0', b'"rope_theta": Infinity')
    with open(path, "wb") as f:
        f.write(text if text is not None else json.dumps(cfg).encode())
    err = check(d)
    assert isinstance(err, ConfigError), (case, err)
    assert str(err).startswith(path + ":"), str(err)


def test_tokenizer_json_cases(valid, tmp_path):
    d = str(tmp_path / "ck")
    shutil.copytree(valid, d)
    path = os.path.join(d, "tokenizer.json")
    for text in (b"[" * 100000 + b"]" * 100000, b"\xff\xfe", b"{}", b'{"model": {"type": "BPE", "vocab": {"a": 0}, '
                                                                    b'"merges": ["a b"]}}'):
        with open(path, "wb") as f:
            f.write(text)
        err = check(d)
        assert isinstance(err, CheckpointError) and str(err).startswith(path + ":"), err


def test_chat_template_jinja_not_utf8(valid, tmp_path):
    d = str(tmp_path / "ck")
    shutil.copytree(valid, d)
    with open(os.path.join(d, "chat_template.jinja"), "wb") as f:
        f.write(b"{{ bos_token }}\xff")
    err = check(d)
    assert isinstance(err, CheckpointError) and "chat_template.jinja" in str(err), err


def test_modelconfig_bounds():
    base = preset("tiny")
    for field, v in (("vocab_size", 2**31), ("max_position_embeddings", 2**40), ("hidden_size", 0)):
        with pytest.raises(ConfigError, match=field):
            base.replace(**{field: v})
    with pytest.raises(ConfigError, match="finite"):
        base.replace(rope_theta=float("inf"))
    ModelConfig(**{**base.__dict__})  # the preset itself is fine


def test_claimed_layers_past_the_tensors(valid, tmp_path):
    """num_hidden_layers = 2^31 - 1 used to make the tensor check list 9 x 2^31 names (hung)."""
    d = str(tmp_path / "ck")
    shutil.copytree(valid, d)
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 2**31 - 1
    with open(path, "w") as f:
        json.dump(cfg, f)
    err = check(d)
    assert isinstance(err, CheckpointError) and "'num_hidden_layers' = 2147483647 layers" in str(err), err


def test_tokenizer_regex_that_backtracks(valid, tmp_path):
    """A tokenizer.json whose Split regex backtracks past Oniguruma's retry limit: encoding
    a prompt used to end 'generate' with a Rust panic and a traceback (PanicException is a
    BaseException); now a CheckpointError naming the file, exit status 2."""
    import subprocess
    import sys
    d = str(tmp_path / "ck")
    shutil.copytree(valid, d)
    path = os.path.join(d, "tokenizer.json")
    with open(path) as f:
        tree = json.load(f)
    tree["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a+)+b"}, "behavior": "Isolated", "invert": False}
    with open(path, "w") as f:
        json.dump(tree, f)
    tk = Checkpoint(d).tokenizer()
    assert tk.encode("ab").ids
    with pytest.raises(CheckpointError, match=f"{path}: the tokenizer failed in encode"):
        tk.encode("a" * 40 + "c")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               RUST_BACKTRACE="0")
    p = subprocess.run([sys.executable, "-m", "kie_engine", "generate", "--model", d, "--prompt", "a" * 40 + "c"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr and path in p.stderr, p.stderr[-1500:]
