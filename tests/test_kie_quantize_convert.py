"""`convert --quantize` (kie_engine/formats/gguf_write.py) and the GGUF loader's raw block access
(GGUFCheckpoint.raw_tensor): small Llama GGUF files from tests/_gguf_files.py, widths
that hold K blocks (256) and widths that do not, re-stored per scheme; every output
tensor read back with gguf-py's dequantizer and with ours, the values near the source,
the metadata copied, and the model's logits near the source model's."""
import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # the kie extra (CI installs it)
pytest.importorskip("tokenizers")

from _gguf_files import write_llama  # noqa: E402
from kie_engine.formats import quant as Q  # noqa: E402
from kie_engine.errors import CheckpointError, UnsupportedFormatError  # noqa: E402
from kie_engine.formats.gguf_io import GGUFCheckpoint, gguf_name  # noqa: E402
from kie_engine.formats.gguf_write import plan_types, quantize_gguf  # noqa: E402
from kie_engine.reference.model import Model, load_weights  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 256-wide hidden size: every matrix can hold K blocks except none; 8 layers so that the
# Q4_K_M recipe's 6-bit layers (first and last eighth, every third between) are a mix.
CFG = dict(hidden_size=256, intermediate_size=320, num_hidden_layers=8, num_attention_heads=4,
           num_key_value_heads=2, head_dim=64, vocab_size=288)
# relative error of a value re-stored in each type (its step, against the row's largest value)
TOL = {"F32": 0, "Q8_0": 0.01, "Q6_K": 0.04, "Q4_0": 0.15, "Q4_1": 0.12, "Q4_K": 0.15}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("src") / "src.gguf")
    values = write_llama(path, seed=7, cfg=CFG)
    return path, values


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    root = tmp_path_factory.mktemp("out")
    out = {}
    for scheme in ("q8_0", "q4_0", "q4_1", "q4_k"):
        path = str(root / f"{scheme}.gguf")
        out[scheme] = (path, quantize_gguf(source[0], path, scheme))
    return out


def test_plan_follows_the_documented_recipes():
    dims = {"token_embd.weight": ([576, 100], 8), "output_norm.weight": ([576], 0)}
    for i in range(30):
        dims[f"blk.{i}.attn_v.weight"] = ([576, 192], 3)
        dims[f"blk.{i}.ffn_down.weight"] = ([1536, 576], 3)
        dims[f"blk.{i}.ffn_up.weight"] = ([576, 1536], 3)
    p = plan_types("q4_k", dims, 30)
    assert p["output_norm.weight"] == Q.F32
    assert p["token_embd.weight"] == Q.Q8_0                       # tied output: Q6_K, 576 wide -> Q8_0
    six = [i for i in range(30) if p[f"blk.{i}.ffn_down.weight"] == Q.Q6_K]
    assert six == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert all(p[f"blk.{i}.ffn_down.weight"] == Q.Q4_K for i in range(30) if i not in six)
    assert all(p[f"blk.{i}.attn_v.weight"] == (Q.Q8_0 if i in six else Q.Q4_1) for i in range(30))
    assert all(p[f"blk.{i}.ffn_up.weight"] == Q.Q4_1 for i in range(30))
    p = plan_types("q4_0", dims, 30)
    assert p["token_embd.weight"] == Q.Q8_0 and p["blk.0.ffn_up.weight"] == Q.Q4_0
    with pytest.raises(ValueError, match="q5_0"):
        plan_types("q5_0", dims, 30)


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "q4_1", "q4_k"])
def test_every_tensor_reads_back_with_gguf_py(source, converted, scheme):
    src_path, values = source
    path, kinds = converted[scheme]
    r = gguf.GGUFReader(path)
    ck = GGUFCheckpoint(path)
    assert set(kinds.values()) <= set(TOL)
    if scheme == "q4_k":
        assert {"Q4_K", "Q6_K"} <= set(kinds.values())
    for t in r.tensors:
        assert t.tensor_type.name == kinds[t.name], t.name
        raw = np.asarray(t.data)
        want = gguf.quants.dequantize(raw, t.tensor_type).reshape(len(raw) if raw.ndim > 1 else 1, -1)
        mine = Q.dequantize(raw.reshape(want.shape[0], -1).view(np.uint8), int(t.tensor_type), want.shape[1])
        np.testing.assert_array_equal(mine, want, err_msg=t.name)
    for hf, v in values.items():
        got = ck.tensor(hf)
        tol = TOL[kinds[gguf_name(hf)]]
        err = np.abs(got - v).max(axis=-1) / np.maximum(np.abs(v).max(axis=-1), 1e-30)
        assert (err <= tol).all(), (hf, kinds[gguf_name(hf)], err.max())


def test_metadata_and_model_carry_over(source, converted):
    src_path, _ = source
    a, b = gguf.GGUFReader(src_path), gguf.GGUFReader(converted["q8_0"][0])
    for key, f in a.fields.items():
        if key.startswith("GGUF.") or key == "general.file_type":
            continue
        assert key in b.fields and b.fields[key].contents() == f.contents(), key
    assert b.fields["general.file_type"].contents() == 7
    ids = [1, 5, 90, 33, 7, 260, 2]
    src = GGUFCheckpoint(src_path)
    want = Model(src.config, load_weights(src)).prefill(ids, all_logits=True)
    for scheme, tol in (("q8_0", 0.02), ("q4_k", 0.25)):
        ck = GGUFCheckpoint(converted[scheme][0])
        got = Model(ck.config, load_weights(ck)).prefill(ids, all_logits=True)
        assert np.abs(got - want).max() <= tol * np.abs(want).max(), scheme


def test_raw_tensor_rows(converted):
    path, kinds = converted["q4_k"]
    ck = GGUFCheckpoint(path)
    for hf in ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
               "model.layers.3.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight", "model.norm.weight"):
        full = ck.tensor(hf)
        raw, t, cols = ck.raw_tensor(hf)
        assert Q.NAMES[t] == kinds[gguf_name(hf)] and cols == full.shape[-1]
        np.testing.assert_array_equal(Q.dequantize(raw, t, cols).reshape(full.shape), full)
        if full.ndim == 2:
            part, _, _ = ck.raw_tensor(hf, slice(64, 128))
            np.testing.assert_array_equal(Q.dequantize(part, t, cols), full[64:128])
    # a slice of a matrix outside Q and K is a view of the mapped file, not a copy
    part, _, _ = ck.raw_tensor("model.layers.2.mlp.up_proj.weight", slice(0, 32))
    assert not part.flags.owndata and part.base is not None
    # the stored order: llama.cpp's permutation of whole rows, per head
    stored, _, _ = ck.raw_tensor("model.layers.3.self_attn.q_proj.weight", hf_order=False)
    hf_rows, _, _ = ck.raw_tensor("model.layers.3.self_attn.q_proj.weight")
    from kie_engine.formats.gguf_io import unpermute_rows
    np.testing.assert_array_equal(stored[unpermute_rows(stored.shape[0], 64)], hf_rows)


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "kie_engine", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def test_cli(source, tmp_path):
    src_path, _ = source
    out = str(tmp_path / "cli.gguf")
    r = _cli("convert", "--model", src_path, "--quantize", "q4_k", "--out", out)
    assert r.returncode == 0, r.stderr
    assert "Q4_K" in r.stdout and os.path.isfile(out) and not os.path.exists(out + ".part")
    r = _cli("convert", "--model", src_path, "--quantize", "q8_0", "--out", src_path)
    assert r.returncode == 2 and "overwrite the source" in r.stderr
    r = _cli("convert", "--model", str(tmp_path), "--quantize", "q8_0", "--out", out)
    assert r.returncode == 2 and "GGUF file" in r.stderr
    r = _cli("convert", "--model", src_path, "--quantize", "q5_0", "--out", out)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_errors_are_typed(source, tmp_path):
    with pytest.raises(UnsupportedFormatError):
        quantize_gguf(str(tmp_path), str(tmp_path / "x.gguf"), "q8_0")
    with pytest.raises(CheckpointError):
        quantize_gguf(source[0], source[0], "q8_0")
