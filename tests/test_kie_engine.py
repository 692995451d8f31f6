"""The engine's inputs and outputs: checkpoint errors that name the file and field, the
CLI (init, generate with 1 and 2 ranks, clear errors), sampling, the safetensors codec."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tokenizers")  # the kie extra (CI installs it)

from kie_engine.formats.checkpoint import Checkpoint
from kie_engine.formats.config import ModelConfig, preset
from kie_engine.errors import (CheckpointError, CheckpointNotFoundError, ConfigError, KieError, PromptTooLongError)
from kie_engine.generate import Sampling, generate, sample
from kie_engine.formats.init import write_checkpoint
from kie_engine.formats.safetensors_io import SafetensorsFile, float32_to_bf16_bits, to_float32, write
from kie_engine.reference.sharded import load_model

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



def _without_warnings(stderr):
    """stderr less the one-line settings warnings that a stray KIE_*/KCCL_* variable in the
    caller's environment prints before anything else: those are not the error under test."""
    return "\n".join(l for l in stderr.splitlines() if " WARN " not in l)

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


def _cli(*args, n=1, timeout=120, text=True, **env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("KIE_BLAS_THREADS",) + kthreads.STANDARD_VARS}
    env.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_extra)
    cmd = [sys.executable, "-m", "kie_engine", *args]
    if n > 1:
        cmd = ["mpiexec", "-n", str(n)] + cmd
    return subprocess.run(cmd, env=env, capture_output=True, text=text, timeout=timeout)


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


# -- streaming: every token reaches the output (issue: bytes held back were never flushed) ----------

from hypothesis import given, strategies as st  # noqa: E402

from kie_engine.generate import check_request, printable  # noqa: E402
from kie_engine.formats.tokenizer import StreamDecoder, byte_level_tokenizer  # noqa: E402

_BYTE_TK = byte_level_tokenizer()
# bytes that make and break UTF-8 sequences, often, plus <s> / </s> (skipped) and anything
_UTF8_BITS = st.sampled_from([0x41, 0x28, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0xFF, 0x80, 256, 257])


@given(st.lists(st.one_of(_UTF8_BITS, st.integers(0, 257)), max_size=40))
def test_stream_decoder_gives_out_every_byte(ids):
    """The pieces, then flush(), are the whole text: bytes that do not decode as U+FFFD,
    none lost, none repeated; and no piece is taken back later (each is final)."""
    sd = StreamDecoder(_BYTE_TK)
    out = "".join(sd.push(i) for i in ids) + sd.flush()
    assert out == bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_stream_decoder_holds_back_only_what_may_still_complete():
    sd = StreamDecoder(_BYTE_TK)
    euro = "€".encode()
    assert sd.push(ord("a")) == "a"
    assert sd.push(euro[0]) == "" and sd.push(euro[1]) == ""  # half a character: wait for the rest
    assert sd.push(euro[2]) == "€"
    assert sd.push(0xFF) == "" and sd.push(0xFF) == "\ufffd"  # an invalid byte is out once the next comes
    assert sd.flush() == "\ufffd"  # and the last one at the end
    assert sd.flush() == ""


def test_printable_escapes_control_characters():
    assert printable("a\rb\x05\x7f\n\tc\ufffd") == "a\\x0db\\x05\\x7f\n\tc\ufffd"


def test_cli_streams_every_generated_token(tmp_path):
    """The text between the prompt and the summary is the decoded tokens, all of them (a
    random model emits many bytes that are not UTF-8: they show as U+FFFD)."""
    d = str(tmp_path / "m")
    write_checkpoint(preset("tiny", dtp_delay=1), d, seed=0)
    p = _cli("generate", "--model", d, "--prompt", "def fib(", "--max-new-tokens", "64", "--ignore-eos",
             "--blas-threads", "1", text=False)
    assert p.returncode == 0, p.stderr
    ids = load_tokenizer_ids(d, "def fib(")
    tokens = generate(load_model(Checkpoint(d)), ids, 64).tokens
    text = bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
    assert len(tokens) == 64
    body, summary = p.stdout.decode("utf-8").rsplit("\n[", 1)
    assert body == "def fib(" + printable(text)
    assert "63 tokens" in summary


def load_tokenizer_ids(d, prompt):
    from kie_engine.formats.tokenizer import load_tokenizer
    return load_tokenizer(os.path.join(d, "tokenizer.json")).encode(prompt).ids


# -- the CLI checks everything before it prints anything ----------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
    (["--max-new-tokens", "600"], "context holds 512"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--seed", "-1"], f"--seed must be an integer in 0..{2**64 - 1}, got -1"),
    (["--seed", str(2**64)], "--seed must be an integer in"),
    (["--blas-threads", "0"], "--blas-threads='0'"),
])
def test_cli_refuses_before_printing(tiny, args, message):
    p = _cli("generate", "--model", tiny, "--prompt", "hi", *args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stdout == "", p.stdout  # not even the prompt
    assert _without_warnings(p.stderr).startswith("error: ") and message in p.stderr, p.stderr


def test_check_request():
    check_request(10, 1, 11)
    with pytest.raises(ValueError, match=">= 1"):
        check_request(10, 0, 100)
    with pytest.raises(ValueError, match="integer"):
        check_request(10, 2.5, 100)
    with pytest.raises(PromptTooLongError, match="context holds 11"):
        check_request(10, 2, 11)


def _option_help(text):
    """{option: its help text} from an argparse --help."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^  (-[-\w]+(?:, --[-\w]+)?)((?: [A-Z_]+)?)(.*)$", line)
        if m:
            cur = m.group(1).split(", ")[-1]
            out[cur] = m.group(3).strip()
        elif cur and line.startswith("   ") and line.strip():
            out[cur] = (out[cur] + " " + line.strip()).strip()
        else:
            cur = None
    return out


@pytest.mark.parametrize("cmd", ["init", "generate", "serve", "perplexity"])
def test_every_cli_option_has_help(cmd):
    p = _cli(cmd, "--help")
    assert p.returncode == 0, p.stderr
    helps = _option_help(p.stdout)
    assert "--model" in helps or "--config" in helps, p.stdout
    assert all(helps.values()), {k: v for k, v in helps.items() if not v}


def test_generate_serve_and_perplexity_take_the_same_engine_flags():
    """One argparse group (lane.add_lane_args) says which model runs where, for all three."""
    want = {"--model", "--device", "--kernel", "--threads", "--blas-threads", "--kv-cache"}
    for cmd in ("generate", "serve", "perplexity"):
        p = _cli(cmd, "--help")
        assert p.returncode == 0, p.stderr
        assert "model and engine:" in p.stdout and want <= set(_option_help(p.stdout)), (cmd, p.stdout)


def test_a_lane_opens_with_its_flags(tiny):
    """Lane takes the engine flags: the thread count (--threads over --blas-threads) and the
    KV cache type reach the native engine; close() frees it."""
    import argparse
    from kie_engine.lanes.start import Lane
    try:
        from kie_engine.cpu.engine import require_native
        require_native()
    except Exception as e:
        pytest.skip(f"no native CPU engine: {e}")
    a = argparse.Namespace(model=tiny, device="cpu", kernel=None, threads="1", blas_threads="2", kv_cache="f32")
    lane = Lane(a, (1, 0))
    assert lane.kernel == "native" and lane.model is None
    model = lane.load(16)
    try:
        assert (model.threads, model.kv, model.max_seq) == (1, "f32", 16)
        assert (lane.threads, lane.why) == (1, "--threads 1")
    finally:
        lane.close()
    with pytest.raises(KieError, match="--threads='0'"):
        Lane(argparse.Namespace(**{**vars(a), "threads": "0"}), (1, 0))


def test_readme_says_what_laneformer_is():
    text = open(os.path.join(ROOT, "README.md")).read()
    assert re.search(r"Laneformer[^.]*(is|means|=)[^.]*Llama", text), "the README never defines Laneformer"


# -- init: no silent overwrite, written as it is made ---------------------------------------------

def test_init_refuses_a_non_empty_directory_unless_forced(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    p = _cli("init", "--config", "tiny", "--out", str(d))
    assert p.returncode == 2 and "not empty" in p.stderr and "--force" in p.stderr, p.stderr
    assert sorted(os.listdir(d)) == ["notes.txt"]
    (d / "model-00002-of-00002.safetensors").write_bytes(b"stale shard")
    p = _cli("init", "--config", "tiny", "--out", str(d), "--force")
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(d)) == ["config.json", "model.safetensors", "notes.txt", "tokenizer.json"]
    Checkpoint(str(d))  # the stale shard is gone, so this loads
    p = _cli("init", "--config", "tiny", "--out", str(d / "notes.txt"))
    assert p.returncode == 2 and "not a directory" in p.stderr


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_streamed_checkpoint_holds_the_seeded_weights(tmp_path, dtype, monkeypatch):
    """Written a few rows at a time (blocks far smaller than a tensor), the file holds what
    random_tensors makes for the seed."""
    import kie_engine.formats.init as kinit
    monkeypatch.setattr(kinit, "BLOCK_BYTES", 4096)
    cfg = preset("tiny").replace(torch_dtype=dtype)
    d = write_checkpoint(cfg, str(tmp_path / "m"), seed=3)
    want = kinit.random_tensors(cfg, seed=3)
    ck = Checkpoint(d)
    for name, w in want.items():
        w = to_float32(float32_to_bf16_bits(w), "BF16") if dtype == "bfloat16" else w
        assert np.array_equal(ck.tensor(name), w.reshape(ck.tensor(name).shape)), name


def test_init_memory_stays_far_below_the_weights(tmp_path):
    """init of `small` (675 MB of float32 weights) peaks far below them: blocks are written
    as they are made (whole tensors in memory took 11.8 GB for 2b)."""
    # VmHWM: this process's own peak (ru_maxrss would include the forking parent's size)
    code = ("import re, sys; from kie_engine.__main__ import main; r = main(sys.argv[1:]); "
            "print(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code, "init", "--config", "small", "--out", str(tmp_path / "s")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    peak_mb = int(p.stdout.split()[-1]) / 1024
    weights_mb = preset("small").n_params * 4 / 1e6
    assert peak_mb < weights_mb / 3, f"peak {peak_mb:.0f} MB for {weights_mb:.0f} MB of float32 weights"


def test_progress_bar_draws_on_terminals_only():
    import io
    from kie_engine.formats.init import Progress
    s = io.StringIO()
    pb = Progress(1000, "writing", stream=s, enabled=True)
    for _ in range(10):
        pb.add(100)
    pb.close()
    assert "100%" in s.getvalue() and s.getvalue().endswith("\n") and "[" + "#" * 30 + "]" in s.getvalue()
    quiet = io.StringIO()  # not a terminal
    pb = Progress(1000, "writing", stream=quiet)
    pb.add(1000)
    pb.close()
    assert quiet.getvalue() == ""


# -- BLAS threads per rank: cores / ranks on the node, overridable ---------------------------------

from kie_engine.lanes import threads as kthreads  # noqa: E402


def test_plan_threads():
    two = frozenset({0, 1})
    assert kthreads.plan_threads(two, [two]) == 2                     # alone: every CPU
    assert kthreads.plan_threads(two, [two, two]) == 1                # 2 ranks share 2 CPUs
    assert kthreads.plan_threads(two, [two] * 4) == 1                 # oversubscribed: still 1
    eight = frozenset(range(8))
    assert kthreads.plan_threads(eight, [eight] * 2) == 4
    assert kthreads.plan_threads(eight, [eight] * 3) == 2
    # bound apart by the launcher: each rank its own CPUs
    assert kthreads.plan_threads({0, 1, 2, 3}, [{0, 1, 2, 3}, {4, 5, 6, 7}]) == 4


def test_choose_threads_overrides():
    assert kthreads.choose("3", environ={"KIE_BLAS_THREADS": "5"})[0] == 3  # the flag first
    assert kthreads.choose(None, environ={"KIE_BLAS_THREADS": " 5 "})[0] == 5
    mine = kthreads.my_cpus()
    assert kthreads.choose(None, [mine, mine], environ={}, idle=len(mine))[0] == max(1, len(mine) // 2)
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(KieError, match="KIE_BLAS_THREADS"):
            kthreads.choose(None, environ={"KIE_BLAS_THREADS": bad})
        with pytest.raises(KieError, match="--blas-threads"):
            kthreads.choose(bad, environ={})


def test_set_blas_threads_reaches_the_loaded_blas():
    """In a fresh process (the count is per process): numpy's BLAS reports what was set."""
    code = ("import numpy, json; from kie_engine.lanes import threads as t; "
            "print(json.dumps([t.set_blas_threads(1), t.set_blas_threads(3), t.blas_threads_now()]))")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    one, three, now = json.loads(p.stdout)
    assert one and set(one.values()) == {1}, one  # a BLAS was found and took it
    assert set(three.values()) == {3} and now == three


def _threads_in_summary(stdout, with_why=False):
    m = re.search(r"(\d+) (?:BLAS )?threads? per rank \(([^()]*)\)(.*)\]", stdout)  # BLAS: --kernel numpy
    assert m and not m.group(3), stdout  # the BLAS took the count
    return (int(m.group(1)), m.group(2)) if with_why else int(m.group(1))


def test_cli_sizes_blas_threads_per_rank(tiny):
    """TP = 1 gets this process's CPUs (fewer only when it says the machine is busy), TP = 2
    half each (at least 1), KIE_BLAS_THREADS wins."""
    cpus = len(os.sched_getaffinity(0))
    args = ("generate", "--model", tiny, "--prompt", "x", "--max-new-tokens", "2")
    p = _cli(*args)
    assert p.returncode == 0, p.stderr
    n, why = _threads_in_summary(p.stdout, with_why=True)
    assert n == cpus or (1 <= n < cpus and ("busy" in why or "quota" in why)), p.stdout
    p = _cli(*args, n=2)
    assert p.returncode == 0, p.stderr
    assert _threads_in_summary(p.stdout) <= max(1, cpus // 2)
    p = _cli(*args, KIE_BLAS_THREADS="1")
    assert _threads_in_summary(p.stdout) == 1


def test_cli_says_when_threads_outnumber_the_cpus(tiny):
    """More threads than this process's CPUs is allowed (the pool's waits then give the core
    up at once) but said in the summary; as many as the CPUs is not."""
    cpus = len(os.sched_getaffinity(0))
    args = ("generate", "--model", tiny, "--prompt", "x", "--max-new-tokens", "2")
    p = _cli(*args, "--threads", str(cpus + 1))
    assert p.returncode == 0, p.stderr
    n, why = _threads_in_summary(p.stdout, with_why=True)
    assert n == cpus + 1 and f"more than this rank's {cpus} CPU" in why, p.stdout
    p = _cli(*args, "--threads", str(cpus))
    assert p.returncode == 0, p.stderr
    assert "more than" not in _threads_in_summary(p.stdout, with_why=True)[1], p.stdout


def test_cli_names_the_flag_that_gave_the_thread_count(tiny):
    """`--threads N` was reported as "(--blas-threads)"."""
    args = ("generate", "--model", tiny, "--prompt", "x", "--max-new-tokens", "2")
    for flags, why in ((("--threads", "1"), "--threads 1"), (("--blas-threads", "1"), "--blas-threads 1"),
                       (("--threads", "1", "--blas-threads", "2"), "--threads 1")):
        p = _cli(*args, *flags)
        assert p.returncode == 0, p.stderr
        assert _threads_in_summary(p.stdout, with_why=True) == (1, why), p.stdout
    p = _cli(*args, "--threads", "1", "--kernel", "numpy")  # there the count is the BLAS's
    assert p.returncode == 0, p.stderr
    assert "1 BLAS thread per rank (--threads 1)" in p.stdout, p.stdout
    p = _cli(*args, "--threads", "0")
    assert p.returncode == 2 and "--threads" in p.stderr and "--blas-threads" not in p.stderr, p.stderr


@pytest.mark.parametrize("var", kthreads.STANDARD_VARS)
def test_cli_honours_the_standard_thread_variables(tiny, var):
    """issue 33: OMP_NUM_THREADS=1 was overridden by the engine's own count."""
    args = ("generate", "--model", tiny, "--prompt", "x", "--max-new-tokens", "2")
    p = _cli(*args, **{var: "1"})
    assert p.returncode == 0, p.stderr
    assert _threads_in_summary(p.stdout, with_why=True) == (1, f"{var}=1")
    p = _cli(*args, **{var: "many"})
    assert p.returncode == 2 and var in p.stderr and p.stdout == "", p.stderr


def test_choose_reads_the_standard_variables_library_specific_first():
    assert kthreads.choose(None, environ={"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS=3")
    assert kthreads.choose(None, environ={"OMP_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "2"}) == \
        (2, "OPENBLAS_NUM_THREADS=2")
    assert kthreads.choose(None, environ={"OMP_NUM_THREADS": "4,2"})[0] == 4  # OpenMP's nested form
    assert kthreads.choose(None, environ={"OMP_NUM_THREADS": "3", "KIE_BLAS_THREADS": "5"})[0] == 5
    assert kthreads.choose("6", environ={"OMP_NUM_THREADS": "3"})[0] == 6
    with pytest.raises(KieError, match="MKL_NUM_THREADS"):
        kthreads.choose(None, environ={"MKL_NUM_THREADS": "0"})


def test_choose_ignores_the_variables_the_engine_wrote_itself():
    """set_blas_threads exports its count for BLAS libraries loaded later; a later choose()
    (another pool sizing itself) must not read it back as the user's."""
    code = ("import os; from kie_engine.lanes import threads as t; t.set_blas_threads(1); "
            "print(t.choose(None, idle=len(t.my_cpus()), quota=len(t.my_cpus()))[0], os.environ['OMP_NUM_THREADS'])")
    env = {k: v for k, v in os.environ.items() if k not in ("KIE_BLAS_THREADS",) + kthreads.STANDARD_VARS}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [str(len(os.sched_getaffinity(0))), "1"]


def test_choose_gives_busy_cpus_fewer_threads(monkeypatch):
    """issue 33: with one busy process on 2 cores, 2 BLAS threads decoded 19x slower than 1."""
    monkeypatch.setattr(kthreads, "my_cpus", lambda: frozenset({0, 1}))
    def n(idle, quota=2.0, ranks=1):
        return kthreads.choose(None, [frozenset({0, 1})] * ranks, environ={}, idle=idle, quota=quota)
    assert n(2.0)[0] == 2 and n(1.85)[0] == 2            # quiet, or nearly: every CPU
    assert n(1.0) == (1, "2 CPUs / 1 rank, 1.0 of them idle: the machine is busy")
    assert n(0.0)[0] == 1                                 # never 0
    assert n(2.0, quota=1.0) == (1, "2 CPUs / 1 rank, CPU quota 1")
    eight = frozenset(range(8))
    monkeypatch.setattr(kthreads, "my_cpus", lambda: eight)
    assert kthreads.choose(None, [eight, eight], environ={}, idle=5.0, quota=8.0)[0] == 2  # 5 idle / 2 ranks
    assert kthreads.choose(None, [eight, eight], environ={}, idle=8.0, quota=8.0)[0] == 4


def test_idle_cpus_sees_a_busy_process():
    cpu = min(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile 1: pass"])
    try:
        import time
        time.sleep(0.5)
        idle = kthreads.idle_cpus({cpu}, seconds=0.3)
    finally:
        hog.kill()
        hog.wait()
    assert idle is not None and 0.0 <= idle < 0.5, idle
