"""The HTTP server against the CLI, in one run, on SmolLM2 (one process, one BLAS thread
each unless --blas-threads says otherwise):

1. decode tokens/s through the API (a streamed /v1/completions, timed by the client from
   its first to its last token) against the CLI's own decode tokens/s (`generate`, same
   prompt, same token count, --ignore-eos), rounds interleaved (the order alternates); the
   ratio per round.  The same request's decode rate inside the server (its inter-token
   latency histogram, /metrics) is recorded too: client rate / engine rate is the HTTP
   path's own cost, measured over the same seconds, which the machine's load cannot skew;
   Then the same pair run at the same time: the CLI starts, and once its first token is out
   the API request goes; both decode side by side under the same load (the CLI runs alone
   for the API's prefill at the start, the API alone for as long at the end);
2. time to first token of a short chat prompt, seen by the client (request sent to first
   content chunk), with the engine idle;
3. 8 clients that send a streamed chat request at the same moment: the FIFO queue runs
   them one by one; each one's wait (to its first token) and total time, in arrival order.

    python bench/serve_bench.py                       # 5 rounds, 128 tokens
    python bench/serve_bench.py --rounds 5 --tokens 128 --out-dir bench/results
    python bench/serve_bench.py --only ttft --rounds 9  # figure 2 alone (a minute)

Writes serve_api_vs_cli_tokens_per_s.json, serve_ttft_short_prompt.json and
serve_queue_8_clients_wait.json (min / median / max over the rounds, the load average)."""
import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from _serve import ServerProcess, metric, parse_metrics, request  # noqa: E402

PROMPT = "Once upon a time"


def stats(xs):
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "all": xs}


def cli_tokens_per_s(tokens, threads):
    p = subprocess.run([sys.executable, "-m", "kie_engine", "generate", "--model", "smollm2", "--prompt", PROMPT,
                        "--max-new-tokens", str(tokens), "--ignore-eos", "--blas-threads", str(threads)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    if p.returncode:
        raise SystemExit(p.stderr)
    return float(re.search(r"decode ([\d.]+) tokens/s", p.stdout).group(1))


def cli_alongside(server, body, tokens, threads):
    """(CLI tokens/s, API tokens/s) of one CLI run and one API request decoding at once."""
    p = subprocess.Popen([sys.executable, "-u", "-m", "kie_engine", "generate", "--model", "smollm2", "--prompt",
                          PROMPT, "--max-new-tokens", str(tokens), "--ignore-eos", "--blas-threads", str(threads)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    out = b""
    while len(out) <= len(PROMPT):  # the prompt is echoed first; then the first token
        chunk = p.stdout.read1(4096)
        if not chunk:
            raise SystemExit(p.stderr.read().decode())
        out += chunk
    _, times, _ = stream(server, "/v1/completions", body)
    rest, err = p.communicate(timeout=900)
    if p.returncode:
        raise SystemExit(err.decode())
    cli = float(re.search(r"decode ([\d.]+) tokens/s", (out + rest).decode()).group(1))
    return cli, (len(times) - 1) / (times[-1] - times[0])


def stream(server, path, body):
    """(seconds to the first content chunk, [arrival time of each content chunk], sent time)."""
    c = http.client.HTTPConnection(*server.host_port, timeout=900)
    t0 = time.perf_counter()
    c.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    times, buf = [], b""
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            data = ev[len(b"data: "):]
            if data == b"[DONE]":
                continue
            j = json.loads(data)
            ch = j["choices"][0] if j.get("choices") else {}
            if ch.get("text") or ch.get("delta", {}).get("content"):
                times.append(time.perf_counter())
    c.close()
    return times[0] - t0, times, t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--queue-tokens", type=int, default=32)
    ap.add_argument("--blas-threads", type=int, default=1)
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--only", choices=["all", "ttft"], default="all",
                    help="ttft: only figure 2 (writes serve_ttft_short_prompt.json alone)")
    a = ap.parse_args()
    load = {"start": os.getloadavg()}
    server = ServerProcess("--blas-threads", str(a.blas_threads), "--max-queue", "16")
    try:
        name = server.name
        cli, api, ratio = [], [], []
        body = {"model": name, "prompt": PROMPT, "max_tokens": a.tokens, "ignore_eos": True, "temperature": 0}
        stream(server, "/v1/completions", {**body, "max_tokens": 8})  # warm
        engine, overhead = [], []

        def itl():
            m = parse_metrics(request(server, "GET", "/metrics")[2])[0]
            return metric(m, "kie_inter_token_latency_seconds_count"), metric(m, "kie_inter_token_latency_seconds_sum")

        for r in range(a.rounds if a.only == "all" else 0):
            if r % 2:
                c = cli_tokens_per_s(a.tokens, a.blas_threads)
            n0, s0 = itl()
            _, times, _ = stream(server, "/v1/completions", body)
            n1, s1 = itl()
            if r % 2 == 0:
                c = cli_tokens_per_s(a.tokens, a.blas_threads)
            if len(times) != a.tokens:
                raise SystemExit(f"{len(times)} content chunks for {a.tokens} tokens: the rate would be wrong")
            s = (len(times) - 1) / (times[-1] - times[0])
            e = (n1 - n0) / (s1 - s0)
            cli.append(c)
            api.append(s)
            ratio.append(s / c)
            engine.append(e)
            overhead.append(s / e)
            print(f"round {r}: CLI {c:.2f} tokens/s, API {s:.2f} tokens/s, API/CLI {s / c:.3f}; engine inside the "
                  f"server {e:.2f} tokens/s, API/engine {s / e:.4f}", flush=True)

        both_cli, both_api, both_ratio = [], [], []
        for r in range(a.rounds if a.only == "all" else 0):
            c, s = cli_alongside(server, body, a.tokens, a.blas_threads)
            both_cli.append(c)
            both_api.append(s)
            both_ratio.append(s / c)
            print(f"at once, round {r}: CLI {c:.2f} tokens/s, API {s:.2f} tokens/s, API/CLI {s / c:.3f}", flush=True)

        ttft = []
        short = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
        stream(server, "/v1/chat/completions", short)  # warm: the first chat request may start the template's renderer
        for r in range(a.rounds):
            time.sleep(0.2)
            ttft.append(stream(server, "/v1/chat/completions", short)[0])
        print("TTFT (short chat prompt), s:", [round(x, 4) for x in ttft], flush=True)

        queue_rounds = []
        qbody = {"model": name, "messages": [{"role": "user", "content": "Tell me a story."}],
                 "max_tokens": a.queue_tokens, "ignore_eos": True, "temperature": 0}
        for r in range(a.rounds if a.only == "all" else 0):
            barrier, out = threading.Barrier(8), [None] * 8

            def client(i):
                barrier.wait()
                out[i] = stream(server, "/v1/chat/completions", qbody)

            ts = [threading.Thread(target=client, args=(i,)) for i in range(8)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            order = sorted(out, key=lambda o: o[1][0])  # served order
            waits = [o[0] for o in order]
            totals = [o[1][-1] - o[2] for o in order]
            queue_rounds.append({"wait_s": waits, "total_s": totals})
            print(f"8 clients round {r}: waits (served order) {[round(w, 2) for w in waits]} s", flush=True)
    finally:
        rc, _ = server.terminate()
    load["end"] = os.getloadavg()
    common = {"model": "smollm2 (SmolLM2-135M-Instruct Q4_1 GGUF)", "blas_threads": a.blas_threads,
              "rounds": a.rounds, "load_average_1_5_15": load, "server_exit": rc,
              "command": "python bench/serve_bench.py " + " ".join(sys.argv[1:])}
    os.makedirs(a.out_dir, exist_ok=True)
    ttft_figure = {**common, "prompt": "Hi (chat)", "ttft_s": stats(ttft)}
    if a.only == "ttft":
        with open(os.path.join(a.out_dir, "serve_ttft_short_prompt.json"), "w") as f:
            json.dump(ttft_figure, f, indent=1)
        print(f"TTFT min {min(ttft) * 1e3:.1f} median {statistics.median(ttft) * 1e3:.1f} max "
              f"{max(ttft) * 1e3:.1f} ms; load {load}")
        return
    figures = {
        "serve_api_vs_cli_tokens_per_s.json": {**common, "tokens": a.tokens, "prompt": PROMPT,
                                               "cli_tokens_per_s": stats(cli), "api_tokens_per_s": stats(api),
                                               "api_over_cli": stats(ratio),
                                               "engine_in_server_tokens_per_s": stats(engine),
                                               "api_over_engine_same_request": stats(overhead),
                                               "at_the_same_time": {"cli_tokens_per_s": stats(both_cli),
                                                                    "api_tokens_per_s": stats(both_api),
                                                                    "api_over_cli": stats(both_ratio)}},
        "serve_ttft_short_prompt.json": ttft_figure,
        "serve_queue_8_clients_wait.json": {
            **common, "tokens_each": a.queue_tokens,
            "wait_s_by_position": [stats([q["wait_s"][k] for q in queue_rounds]) for k in range(8)],
            "total_s_by_position": [stats([q["total_s"][k] for q in queue_rounds]) for k in range(8)]},
    }
    for fname, fig in figures.items():
        with open(os.path.join(a.out_dir, fname), "w") as f:
            json.dump(fig, f, indent=1)
    r = figures["serve_api_vs_cli_tokens_per_s.json"]["api_over_cli"]
    print(f"API/CLI tokens/s: min {r['min']:.3f} median {r['median']:.3f} max {r['max']:.3f}; "
          f"TTFT median {statistics.median(ttft) * 1e3:.1f} ms; load {load}")


if __name__ == "__main__":
    main()
