"""Greedy decode and prefill on the CPU: KIE's native engine against llama.cpp
(llama-cpp-python, the optional [bench] extra) on the same GGUF file, same thread
count, rounds alternating in one run; min / median / max over the rounds.

Each round runs every configuration once, each in a fresh process (so neither engine's
thread pool or caches are warm from the other's): llama.cpp with T threads, KIE with
T threads (TP = 1), and with --tp 2 also KIE as 2 ranks x 1 thread under mpiexec.
Every run decodes --tokens tokens after the same prompt, ignoring EOS, and reports
its decode tokens/s (prompt excluded).

--prompt-tokens N[,N...] adds, per N, the prefill tokens/s of an N-token prompt and
the decode tokens/s after it, both engines on the same token ids (bench/cpu_prompt_rows.py),
and once KIE's chunked prefill against its token-by-token prefill.  --concurrent N adds
the server's aggregate tokens/s with N streamed requests at once against one alone,
through the official openai client (bench/cpu_serve_concurrent.py); --concurrent-only runs
those rows alone.

Also measured in the same run: the machine's read bandwidth for a weight stream (a plain
read of 256 MB of packed weights on T threads, C-timed: bench/cpu_kq_stream.c) and its copy
bandwidth (numpy copies, read + written), and for each decode row the bytes streamed per
token (weights a decode step reads, plus the KV cache read at the mean position) times
tokens/s as a share of each.  Then, once, a per-stage profile of the KIE step.

    python bench/decode_cpu.py --baseline llama.cpp                    # SmolLM2 Q4_1, 2 threads, 5 rounds
    python bench/decode_cpu.py --baseline llama.cpp --prompt-tokens 128,589,2000 --concurrent 4
    python bench/decode_cpu.py --model q8.gguf --baseline llama.cpp --tp 2 --out bench/results/x.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

PROMPT = "The history of the bicycle begins in the early nineteenth century, when"


def _env(threads):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[v] = "1"
    return env


# -- one run of each engine (a child process) ------------------------------------------------

def run_llama(path, threads, tokens, prompt):
    """llama.cpp's greedy decode: prompt evaluated, then `tokens` single-token evals each
    followed by an argmax of its logits (what KIE's loop does per token)."""
    import numpy as np
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, n_batch=512,
                verbose=False, logits_all=False)
    ids = llm.tokenize(prompt.encode(), add_bos=False)
    llm.reset()
    vocab = llm.n_vocab()

    def last_logits():  # llama-cpp-python 0.3 keeps no scores without logits_all: read the context's
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))
    llm.eval(ids)
    tok = int(np.argmax(last_logits()))
    out = [tok]
    t = time.perf_counter()
    for _ in range(tokens - 1):
        llm.eval([tok])
        tok = int(np.argmax(last_logits()))
        out.append(tok)
    dt = time.perf_counter() - t
    return {"tokens_per_s": (tokens - 1) / dt, "tokens": out}


def run_kie_cli(path, threads, tokens, prompt, ranks):
    """KIE through its CLI (so the run is exactly what a user gets), parsing the timing line."""
    cmd = [sys.executable, "-m", "kie_engine", "generate", "--model", path, "--prompt", prompt,
           "--max-new-tokens", str(tokens), "--ignore-eos", "--threads", str(threads)]
    if ranks > 1:
        cmd = ["mpiexec", "-n", str(ranks)] + cmd
    p = subprocess.run(cmd, env=_env(threads), capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr}")
    line = p.stdout.rsplit("\n[", 1)[1]
    tps = float(line.split("decode ", 1)[1].split(" tokens/s", 1)[0])
    return {"tokens_per_s": tps, "summary": "[" + line.strip()}


def _child(args):
    if args.child == "llama":
        print(json.dumps(run_llama(args.model, args.threads, args.tokens, args.prompt)))
    else:
        import cpu_prompt_rows
        cpu_prompt_rows.child(args.child, args.model, args.threads, int(args.prompt_tokens))


def run_child(kind, path, threads, tokens, prompt):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--model", path, "--threads", str(threads),
           "--tokens", str(tokens), "--prompt", prompt]
    p = subprocess.run(cmd, env=_env(threads), capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise SystemExit(f"{kind} run failed:\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# -- measurements in this process -----------------------------------------------------------

def copy_bandwidth(threads, nbytes=256 << 20, reps=5):
    """Best of `reps` parallel copies (each thread its own src -> dst), bytes read +
    written per second."""
    import numpy as np
    n = nbytes // 4 // threads
    pairs = [(np.ones(n, np.float32), np.empty(n, np.float32)) for _ in range(threads)]
    for s, d in pairs:
        np.copyto(d, s)
    best = 0.0
    for _ in range(reps):
        barrier = threading.Barrier(threads + 1)
        done = threading.Barrier(threads + 1)

        def work(s, d):
            barrier.wait()
            np.copyto(d, s)
            done.wait()
        ts = [threading.Thread(target=work, args=p) for p in pairs]
        for t in ts:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        done.wait()
        dt = time.perf_counter() - t0
        for t in ts:
            t.join()
        best = max(best, 2 * n * 4 * threads / dt)
    return best


def read_bandwidth(threads, rounds=8):
    """(best, median) bytes/s of a plain read of 256 MB of SmolLM2-shaped packed weights on
    `threads` pinned threads (bench/cpu_kq_stream.c, huge pages)."""
    import tempfile
    from cpu_kq_layout import build
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "kq_stream")
        build(exe)
        out = subprocess.run([exe, "3", "1536", "576", str(threads), str(rounds), "read"], check=True,
                             capture_output=True, text=True).stdout
    best = float(out.split("best ")[1].split(" GB/s")[0])
    med = float(out.split("median ")[1].split(" GB/s")[0])
    return best * 1e9, med * 1e9


def stage_bytes(ck):
    """Weight bytes each profiled stage of a TP = 1 step reads (the stored tensors' sizes)."""
    cfg = ck.config

    def nb(name):
        return ck.raw_tensor(name, hf_order=False)[0].nbytes
    out = {"norm+qkv": 0, "o": 0, "gate_up": 0, "down": 0}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out["norm+qkv"] += sum(nb(p + f"self_attn.{x}_proj.weight") for x in "qkv")
        out["o"] += nb(p + "self_attn.o_proj.weight")
        out["gate_up"] += nb(p + "mlp.gate_proj.weight") + nb(p + "mlp.up_proj.weight")
        out["down"] += nb(p + "mlp.down_proj.weight")
    out["head"] = nb("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
    return out


def stream_bytes(path, tokens, prompt_len, threads):
    """(weight bytes a step reads, KV bytes read at the mean position, file size, profile);
    the profile also holds each weight stage's GB/s ("GBps": its bytes / its seconds)."""
    from kie_engine.cpu.engine import CpuModel
    from kie_engine.formats.sources import open_checkpoint
    ck = open_checkpoint(path)
    cfg = ck.config
    m = CpuModel(ck, max_seq=prompt_len + tokens + 1, threads=threads)
    info = m.info()
    mean_pos = prompt_len + tokens / 2
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * mean_pos * 2  # f16
    ids = ck.tokenizer().encode(prompt).ids if (prompt := PROMPT) else []
    tok = int(m.prefill(ids).argmax())
    m.set_profiling(True)
    t = time.perf_counter()
    for _ in range(tokens - 1):
        tok = int(m.decode_step(tok).argmax())
    dt = time.perf_counter() - t
    prof = m.profile()
    m.close()
    prof["tokens_per_s_in_process"] = (tokens - 1) / dt
    if hasattr(ck, "raw_tensor"):
        prof["GBps"] = {k: b / prof[k] / 1e9 for k, b in stage_bytes(ck).items() if prof.get(k)}
    return info["weight_bytes"], int(kv), os.path.getsize(ck.path), prof, info


def _stats(xs):
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "all": xs}


def _serve_rows(a):
    """The server's rows (--concurrent): N streamed requests at once against one alone, and
    the batch-size histogram of its /metrics."""
    from cpu_serve_concurrent import rounds as serve_rounds
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from _serve import ServerProcess, metric, parse_metrics
    srv = ServerProcess("--threads", str(a.threads), model=a.model)  # the engine's threads, as the rows above
    try:
        serve = serve_rounds(srv.url, srv.name, a.concurrent, a.serve_tokens, a.rounds,
                             log=lambda m: print(m, flush=True), reader=a.client_reader)
        c = srv.conn()
        c.request("GET", "/metrics")
        samples = parse_metrics(c.getresponse().read().decode())[0]
        steps = metric(samples, "kie_batch_size_per_step_count")
        serve["metrics_batch"] = {
            "steps": steps, "rows": metric(samples, "kie_batch_rows_total"),
            "mean_sequences_per_step": metric(samples, "kie_batch_size_per_step_sum") / max(steps, 1),
            "steps_with_at_most": {dict(ls)["le"]: v for (n, ls), v in samples.items()
                                   if n == "kie_batch_size_per_step_bucket"}}
    finally:
        srv.terminate()
    return serve


def _serve_stats(serve):
    for k in ("alone_tokens_per_s", "together_tokens_per_s", "ratio", "ttft_idle_s", "ttft_mid_batch_s", "ttft_ratio"):
        serve[k] = _stats(serve[k])


def _print_serve(a, serve):
    rt, ag, al = serve["ratio"], serve["together_tokens_per_s"], serve["alone_tokens_per_s"]
    tr = serve["ttft_ratio"]
    print(f"server, {a.concurrent} at once: {ag['median']:.0f} tokens/s aggregate against {al['median']:.0f} alone: "
          f"{rt['min']:.2f} / {rt['median']:.2f} / {rt['max']:.2f}x; texts as alone: {serve['texts_as_alone']}; "
          f"time to first token mid-batch / idle {tr['min']:.2f} / {tr['median']:.2f} / {tr['max']:.2f}")


def _concurrent_only(a, load):
    """--concurrent-only: the server rows alone (a few minutes less than the whole run)."""
    serve = _serve_rows(a)
    _serve_stats(serve)
    _print_serve(a, serve)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "threads": a.threads, "rounds": a.rounds, "concurrent": serve,
                       "loadavg_before": load, "loadavg_after": os.getloadavg(),
                       "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}, f, indent=1)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="a GGUF file or short name (default smollm2: Q4_1)")
    p.add_argument("--baseline", choices=["llama.cpp", "none"], default="none")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tp", type=int, default=1, help="also run KIE as this many ranks x 1 thread (2: the TP target)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--prompt-tokens", default="",
                   help="comma-separated prompt lengths: prefill tokens/s and decode after it, both engines")
    p.add_argument("--concurrent", type=int, default=0,
                   help="N streamed requests at once through the server against one alone (KIE)")
    p.add_argument("--serve-tokens", type=int, default=128, help="completion tokens per request of --concurrent")
    p.add_argument("--client-reader", choices=["raw", "typed"], default="raw",
                   help="how the --concurrent rows' openai client reads a stream: its raw streaming response, "
                        "json per event (default), or its typed chunk objects (over twice the client's CPU on the "
                        "server's cores; bench/cpu_serve_concurrent.py)")
    p.add_argument("--concurrent-only", action="store_true",
                   help="with --concurrent: only the server rows (no decode, prefill or bandwidth rows)")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    from kie_engine.formats.sources import resolve
    a.model = resolve(a.model)
    if a.child:
        return _child(a)
    if a.baseline == "llama.cpp":
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise SystemExit("--baseline llama.cpp needs llama-cpp-python: pip install -e '.[bench]'")
    load = os.getloadavg()
    if a.concurrent_only:
        if not a.concurrent:
            raise SystemExit("--concurrent-only needs --concurrent N")
        return _concurrent_only(a, load)
    from kie_engine.formats.sources import open_checkpoint
    prompt_len = len(open_checkpoint(a.model).tokenizer().encode(a.prompt).ids)
    configs = []
    if a.baseline == "llama.cpp":
        configs.append(("llama.cpp", lambda: run_child("llama", a.model, a.threads, a.tokens, a.prompt)))
    configs.append((f"kie tp1 x{a.threads}", lambda: run_kie_cli(a.model, a.threads, a.tokens, a.prompt, 1)))
    if a.tp > 1:
        configs.append((f"kie tp{a.tp} x1", lambda: run_kie_cli(a.model, 1, a.tokens, a.prompt, a.tp)))
    import cpu_prompt_rows as pr
    lengths = [int(n) for n in a.prompt_tokens.split(",") if n.strip()]
    for n in lengths:  # prefill and decode after an n-token prompt
        if a.baseline == "llama.cpp":
            configs.append((f"llama.cpp {n}-token prompt", lambda n=n: pr.run("prompt-llama", a.model, a.threads, n, _env(a.threads))))
        configs.append((f"kie tp1 x{a.threads} {n}-token prompt", lambda n=n: pr.run("prompt-kie", a.model, a.threads, n, _env(a.threads))))
    results = {name: [] for name, _ in configs}
    extra, prompt_rows = {}, {}
    for r in range(a.rounds):
        for name, fn in configs:
            out = fn()
            if "prefill_tokens_per_s" in out:
                row = prompt_rows.setdefault(name, {"prefill": [], "decode": []})
                row["prefill"].append(out["prefill_tokens_per_s"])
                row["decode"].append(out["decode_tokens_per_s"])
                print(f"round {r}: {name}: prefill {out['prefill_tokens_per_s']:.1f} tokens/s, decode after it "
                      f"{out['decode_tokens_per_s']:.1f} tokens/s", flush=True)
                continue
            results[name].append(out["tokens_per_s"])
            extra.setdefault(name, out.get("summary") or "")
            print(f"round {r}: {name}: {out['tokens_per_s']:.1f} tokens/s", flush=True)
    results = {k: v for k, v in results.items() if v}
    parity = {n: pr.run("prompt-parity", a.model, a.threads, n, _env(a.threads)) for n in lengths}
    serve = None
    if a.concurrent:
        serve = _serve_rows(a)
    bw = copy_bandwidth(a.threads)
    rbw, rbw_med = read_bandwidth(a.threads)
    wbytes, kvbytes, fsize, prof, info = stream_bytes(a.model, a.tokens, prompt_len, a.threads)
    per_token = wbytes + kvbytes
    rows = {}
    for name, xs in results.items():
        st = _stats(xs)
        st["bytes_per_token"] = per_token
        st["share_of_copy_bw"] = per_token * st["median"] / bw
        st["share_of_read_bw"] = per_token * st["median"] / rbw
        rows[name] = st
    prompts = {}
    for n in lengths:
        k = prompt_rows[f"kie tp1 x{a.threads} {n}-token prompt"]
        row = {"kie_prefill": _stats(k["prefill"]), "kie_decode_after": _stats(k["decode"]), "parity": parity[n]}
        if a.baseline == "llama.cpp":
            ll = prompt_rows[f"llama.cpp {n}-token prompt"]
            row["llama_prefill"], row["llama_decode_after"] = _stats(ll["prefill"]), _stats(ll["decode"])
            row["prefill_kie_over_llama"] = _stats([x / y for x, y in zip(k["prefill"], ll["prefill"])])
            row["decode_after_kie_over_llama"] = _stats([x / y for x, y in zip(k["decode"], ll["decode"])])
        prompts[n] = row
    ratios = {}
    base = results.get("llama.cpp")
    kie1 = results[f"kie tp1 x{a.threads}"]
    if base:
        ratios["kie_tp1_over_llama"] = _stats([k / b for k, b in zip(kie1, base)])
    if a.tp > 1:
        ratios[f"kie_tp{a.tp}_over_tp1"] = _stats([t / k for t, k in zip(results[f"kie tp{a.tp} x1"], kie1)])
    if serve:
        _serve_stats(serve)
    report = {"model": a.model, "file_bytes": fsize, "threads": a.threads, "tokens": a.tokens, "rounds": a.rounds,
              "prompt_tokens": prompt_len, "copy_bandwidth_Bps": bw, "read_bandwidth_Bps": rbw,
              "read_bandwidth_median_Bps": rbw_med, "prompt_rows": prompts, "concurrent": serve,
              "weight_bytes_per_token": wbytes,
              "kv_bytes_per_token_mean": kvbytes, "rows": rows, "ratios": ratios, "kie_info": info,
              "kie_stage_seconds_per_token": prof, "kie_summary": extra, "loadavg_before": load,
              "loadavg_after": os.getloadavg(), "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    print(f"read bandwidth {rbw / 1e9:.1f} GB/s (median {rbw_med / 1e9:.1f}), copy bandwidth {bw / 1e9:.1f} GB/s; "
          f"{per_token / 1e6:.1f} MB streamed per token (weights {wbytes / 1e6:.1f} MB + KV {kvbytes / 1e6:.2f} MB)")
    for name, st in rows.items():
        print(f"{name:>14}: {st['min']:.1f} / {st['median']:.1f} / {st['max']:.1f} tokens/s (min/median/max), "
              f"{100 * st['share_of_read_bw']:.0f}% of read bandwidth, {100 * st['share_of_copy_bw']:.0f}% of copy bandwidth")
    for n, row in prompts.items():
        kp = row["kie_prefill"]
        line = f"{n}-token prompt: KIE prefill {kp['min']:.0f} / {kp['median']:.0f} / {kp['max']:.0f} tokens/s"
        if "llama_prefill" in row:
            lp, rt = row["llama_prefill"], row["prefill_kie_over_llama"]
            line += (f", llama.cpp {lp['min']:.0f} / {lp['median']:.0f} / {lp['max']:.0f}, KIE / llama.cpp "
                     f"{rt['min']:.2f} / {rt['median']:.2f} / {rt['max']:.2f}")
        kd = row["kie_decode_after"]
        line += f"; decode after it: KIE {kd['median']:.0f}"
        if "llama_decode_after" in row:
            line += f", llama.cpp {row['llama_decode_after']['median']:.0f}"
        par = row["parity"]
        line += (f"; chunked vs token by token: max rel. diff {par['max_rel_diff']:.2g}, argmax equal "
                 f"{par['argmax_equal']}, 16 greedy tokens equal {par['greedy_16_equal']}")
        print(line)
    if serve:
        _print_serve(a, serve)
    for k, st in ratios.items():
        print(f"{k}: {st['min']:.2f} / {st['median']:.2f} / {st['max']:.2f}")
    skip = ("steps", "tokens_per_s_in_process", "GBps")
    gbps = prof.get("GBps", {})
    total = sum(v for k, v in prof.items() if k not in skip)
    print("KIE per stage (ms/token): " + ", ".join(
        f"{k} {1e3 * v:.2f}" + (f" ({gbps[k]:.1f} GB/s)" if k in gbps else "") for k, v in prof.items()
        if k not in skip) + f"; total {1e3 * total:.2f}")
    print(f"load average before {load[0]:.1f}, after {report['loadavg_after'][0]:.1f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
