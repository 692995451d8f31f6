"""The prompt rows of bench/decode_cpu.py (--prompt-tokens N): prefill tokens/s of an
N-token prompt, then decode tokens/s after it, for llama.cpp and for KIE, each run a
fresh process on the same token ids; and once, KIE's chunked prefill against its token
by token prefill (the logits' largest relative difference, the argmax, the greedy
tokens after each)."""
import json
import os
import subprocess
import sys
import time

import numpy as np

DECODE = 32  # tokens decoded after the prompt


def prompt_ids(n, seed=0):
    """n token ids both engines take (SmolLM2's vocabulary: 49152), the same every run"""
    return [int(t) for t in np.random.default_rng(seed).integers(100, 40000, n)]


def _llama(path, threads, ids):
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=len(ids) + DECODE + 16,
                verbose=False, logits_all=False)  # n_batch: llama-cpp-python's default (512), its fastest here
    vocab = llm.n_vocab()

    def last():
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))
    llm.eval(ids[:8])  # warm-up, then the prompt from an empty cache
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids)
    prefill = time.perf_counter() - t
    tok = int(np.argmax(last()))
    t = time.perf_counter()
    for _ in range(DECODE):
        llm.eval([tok])
        tok = int(np.argmax(last()))
    return {"prefill_tokens_per_s": len(ids) / prefill, "decode_tokens_per_s": DECODE / (time.perf_counter() - t)}


def _kie(path, threads, ids):
    from kie_engine.cpu.engine import CpuModel
    from kie_engine.formats.sources import open_checkpoint
    m = CpuModel(open_checkpoint(path), max_seq=len(ids) + DECODE + 16, threads=threads)
    m.prefill(ids[:8])
    m.reset()
    t = time.perf_counter()
    logits = m.prefill(ids)
    prefill = time.perf_counter() - t
    tok = int(np.argmax(logits))
    t = time.perf_counter()
    for _ in range(DECODE):
        tok = int(np.argmax(m.decode_step(tok)))
    return {"prefill_tokens_per_s": len(ids) / prefill, "decode_tokens_per_s": DECODE / (time.perf_counter() - t)}


def _parity(path, threads, ids):
    """KIE's chunked prefill against token by token on the same engine."""
    from kie_engine.cpu.engine import CpuModel
    from kie_engine.generate import generate
    from kie_engine.formats.sources import open_checkpoint
    m = CpuModel(open_checkpoint(path), max_seq=len(ids) + 32, threads=threads)
    a = m.prefill(ids)
    m.reset()
    b = m.prefill(ids, chunk=1)
    ga = generate(m, ids, 16).tokens
    gb = generate(m, ids, 16, prefill_chunk=1).tokens
    return {"max_rel_diff": float(np.abs(a - b).max() / np.abs(b).max()), "argmax_equal": int(a.argmax()) == int(b.argmax()),
            "bitwise_equal": bool(np.array_equal(a, b)), "greedy_16_equal": ga == gb, "kernels": m.info()["kernels"]}


CHILDREN = {"prompt-llama": _llama, "prompt-kie": _kie, "prompt-parity": _parity}


def child(kind, path, threads, n):
    print(json.dumps(CHILDREN[kind](path, threads, prompt_ids(n))))


def run(kind, path, threads, n, env):
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_cpu.py"), "--child", kind,
           "--model", path, "--threads", str(threads), "--prompt-tokens", str(n)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise SystemExit(f"{kind} ({n} tokens) failed:\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])
