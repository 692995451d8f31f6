"""The engine's inputs and outputs: checkpoint errors that name the file and field, the
CLI (init, generate with 1 and 2 ranks, clear errors), sampling, the safetensors codec."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tokenizers")  # the kie extra (CI installs it)

from kie_engine.checkpoint import Checkpoint
from kie_engine.config import ModelConfig, preset
from kie_engine.errors import (CheckpointError, CheckpointNotFoundError, ConfigError, PromptTooLongError)
from kie_engine.generate import Sampling, generate, sample
from kie_engine.init import write_checkpoint
from kie_engine.safetensors_io import SafetensorsFile, float32_to_bf16_bits, to_float32, write
from kie_engine.tp import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint(preset("tiny"), str(tmp_path_factory.mktemp("tiny") / "m"), seed=1)


def _copy(tiny, tmp_path):
    d = str(tmp_path / "m")
    shutil.copytree(tiny, d)
    return d


def _edit_config(d, **kw):
    p = os.path.join(d, "config.json")
    cfg = json.load(open(p))
    cfg.update(kw)
    json.dump(cfg, open(p, "w"))


def test_missing_directory_and_files(tiny, tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint directory"):
        Checkpoint(str(tmp_path / "nope"))
    d = _copy(tiny, tmp_path)
    os.remove(os.path.join(d, "tokenizer.json"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Checkpoint(d).tokenizer_path()
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointNotFoundError, match="safetensors"):
        Checkpoint(d)
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(CheckpointNotFoundError, match="config.json"):
        Checkpoint(d)


def test_config_inconsistent_with_tensors(tiny, tmp_path):
    d = _copy(tiny, tmp_path)
    _edit_config(d, intermediate_size=177)
    with pytest.raises(CheckpointError, match=r"mlp.gate_proj.weight.*shape \[176, 64\].*\[177, 64\]"):
        Checkpoint(d)
    _edit_config(d, intermediate_size=176, num_hidden_layers=5)
    with pytest.raises(CheckpointError, match="model.layers.4.* missing"):
        Checkpoint(d)
    _edit_config(d, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.3"):
        Checkpoint(d)


@pytest.mark.parametrize("field,value,match", [
    ("num_attention_heads", 3, "not a multiple of num_key_value_heads"),
    ("hidden_size", -4, "'hidden_size' must be a positive integer"),
    ("dtp_delay", 9, "'dtp_delay'"),
    ("model_type", "mistral", "only llama-format"),
    ("rope_scaling", {"rope_type": "llama3"}, "rope_scaling"),
    ("eos_token_id", 9999, "outside the vocabulary"),
])
def test_bad_config_fields(tiny, tmp_path, field, value, match):
    d = _copy(tiny, tmp_path)
    _edit_config(d, **{field: value})
    with pytest.raises(ConfigError, match=match) as e:
        Checkpoint(d)
    assert "config.json" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_corrupt_safetensors(tiny, tmp_path):
    d = _copy(tiny, tmp_path)
    p = os.path.join(d, "model.safetensors")
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 100)
    with pytest.raises(CheckpointError, match="model.safetensors.*data offsets"):
        Checkpoint(d)
    with open(p, "wb") as f:
        f.write(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(CheckpointError, match="not JSON"):
        Checkpoint(d)


def test_safetensors_roundtrip_and_bf16(tmp_path):
    x = np.array([1.0, -2.5, 3.14159, 1e-20, 65504.0, 0.0], np.float32)
    bits = float32_to_bf16_bits(x)
    back = to_float32(bits, "BF16")
    import ml_dtypes
    assert np.array_equal(back, x.astype(ml_dtypes.bfloat16).astype(np.float32))  # round to nearest even
    p = str(tmp_path / "t.safetensors")
    write(p, {"a": ("F32", x.reshape(2, 3)), "b": ("BF16", bits)})
    f = SafetensorsFile(p)
    assert np.array_equal(f.raw("a"), x.reshape(2, 3)) and np.array_equal(f.raw("b"), bits)


def test_prompt_longer_than_context(tiny):
    model = load_model(Checkpoint(tiny))
    with pytest.raises(PromptTooLongError, match="context holds 512"):
        model.prefill([1] * 513)
    with pytest.raises(PromptTooLongError):
        generate(model, [1] * 500, 20)


def test_sampling():
    rng = np.random.default_rng(0)
    logits = np.array([0.0, 3.0, 2.9, -1.0, 2.0])
    assert sample(logits, Sampling(), rng) == 1
    assert sample(logits, Sampling(temperature=1.0, top_k=1), rng) == 1
    assert sample(logits, Sampling(temperature=5.0, top_p=1e-6), rng) == 1
    picks = [sample(logits, Sampling(temperature=1.0, top_k=2), rng) for _ in range(300)]
    assert set(picks) == {1, 2}  # top-k keeps exactly the two best
    picks = [sample(logits, Sampling(temperature=1.0, top_p=0.95), rng) for _ in range(500)]  # p = .43 .39 .16 | .02 .01
    assert 0 not in picks and 3 not in picks and {1, 2, 4} <= set(picks)
    with pytest.raises(ValueError):
        Sampling(top_p=0.0)


def test_seeded_generation_is_reproducible_and_stops_on_eos(tiny):
    model = load_model(Checkpoint(tiny))
    s = Sampling(temperature=1.0, top_k=40, top_p=0.95, seed=7)
    a = generate(model, [256, 100], 30, s).tokens
    b = generate(model, [256, 100], 30, s).tokens
    assert a == b and len(a) == 30
    eos = a[5]  # pretend a generated token is EOS: generation stops right there
    c = generate(model, [256, 100], 30, s, eos_id=eos)
    assert c.stopped_on_eos and c.tokens == a[:a.index(eos) + 1]


def _cli(*args, n=1, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "kie_engine", *args]
    if n > 1:
        cmd = ["mpiexec", "-n", str(n)] + cmd
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_cli_init_and_generate(tmp_path):
    d = str(tmp_path / "m")
    p = _cli("init", "--config", "tiny", "--dtp-delay", "1", "--out", d)
    assert p.returncode == 0, p.stderr
    assert json.load(open(os.path.join(d, "config.json")))["dtp_delay"] == 1
    outs = []
    for n in (1, 2):
        p = _cli("generate", "--model", d, "--prompt", "def fib(", "--max-new-tokens", "16", "--ignore-eos", n=n)
        assert p.returncode == 0, p.stderr
        assert p.stdout.startswith("def fib(")
        last = p.stdout.strip().splitlines()[-1]
        assert "prefill" in last and "tokens/s" in last and "ms/token" in last and "15 tokens" in last, p.stdout
        outs.append(p.stdout.rsplit("\n[", 1)[0])
    assert outs[0] == outs[1]  # 2 lanes stream the same text


def test_cli_errors(tiny, tmp_path):
    p = _cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert p.returncode == 2 and "no such checkpoint directory" in p.stderr
    p = _cli("generate", "--model", tiny, "--prompt", "x", n=3)
    assert p.returncode == 2 and "num_attention_heads=4 is not divisible by the 3 ranks" in p.stderr
    p = _cli("generate", "--model", tiny, "--prompt", "x" * 600)
    assert p.returncode == 2 and "context holds 512" in p.stderr
    p = _cli("init", "--config", "huge", "--out", str(tmp_path / "h"))
    assert p.returncode == 2 and "huge" in p.stderr
