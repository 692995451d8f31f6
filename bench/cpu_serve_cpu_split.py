"""Where the CPU goes while `kie_engine serve` streams N requests at once to the official
openai client on the same machine: per completion token, the client's CPU (this process),
the server's event-loop thread and its other threads (the engine's), and the wall time
per engine step (from /metrics), for 1 and N requests at once, rounds alternating.  On a
machine with as many cores as engine threads this shows whether the cores are full.
With --stacks, one server per HTTP stack (serve's --http and --loop), rounds alternating
between them as well; with --client-readers raw,typed, the client's two ways of reading a
stream (bench/cpu_serve_concurrent.py) alternate the same way.

    python bench/cpu_serve_cpu_split.py --concurrent 4 --rounds 5 --out bench/results/cpu_serve_cpu_split_4_streams.json
    python bench/cpu_serve_cpu_split.py --stacks h11/asyncio,httptools/uvloop --rounds 6 \
        --out bench/results/cpu_serve_http_stack_h11_vs_httptools_uvloop.json
    python bench/cpu_serve_cpu_split.py --client-readers typed,raw --rounds 6 \
        --out bench/results/cpu_serve_cpu_split_client_typed_vs_raw.json
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def thread_cpu(pid):
    """{tid: CPU seconds} of a process's threads"""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            s = open(f"/proc/{pid}/task/{t}/stat").read()
        except OSError:  # the thread ended
            continue
        f = s[s.rindex(")") + 2:].split()
        out[int(t)] = (int(f[11]) + int(f[12])) / tick
    return out


def own_cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main():
    from cpu_serve_concurrent import PROMPTS, _client, _stream
    from _serve import ServerProcess
    from kie_engine.formats.sources import resolve

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrent", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out")
    p.add_argument("--stacks", default="",
                   help="comma-separated HTTP/LOOP pairs (e.g. h11/asyncio,httptools/uvloop): a server each, "
                        "rounds alternating; default one server with serve's defaults")
    p.add_argument("--client-readers", default="raw",
                   help="comma-separated, of raw and typed: how the client reads a stream; several alternate")
    a = p.parse_args()
    readers = a.client_readers.split(",")
    bad = [r for r in readers if r not in ("raw", "typed")]
    if bad:
        p.error(f"--client-readers: {bad}: each must be raw or typed")
    stacks = [x.split("/") for x in a.stacks.split(",")] if a.stacks else [None]
    servers = {}
    try:
        for st in stacks:
            args = ["--http", st[0], "--loop", st[1]] if st else []
            servers["/".join(st) if st else "default"] = ServerProcess("--threads", str(a.threads), *args,
                                                                       model=resolve(a.model))
        configs = {(f"{name}, {rd} client" if len(readers) > 1 else name): (servers[name], rd)
                   for name in servers for rd in readers}
        rows = {key: {1: [], a.concurrent: []} for key in configs}
        for name, srv in servers.items():  # warm-up
            _stream(_client(srv.url), srv.name, PROMPTS[0], 16, {}, 0)
        for r in range(a.rounds):
            order = [(key, n) for key in configs for n in (1, a.concurrent)]
            for name, n in (order if r % 2 == 0 else order[::-1]):
                rows[name][n].append(measure(*configs[name], n, a.tokens, PROMPTS))
                print(f"round {r}, {name}, {n} at once: "
                      + ", ".join(f"{k} {v:.3g}" for k, v in rows[name][n][-1].items()), flush=True)
    finally:
        for srv in servers.values():
            srv.terminate()
    median = {name: {n: {k: statistics.median(x[k] for x in v) for k in v[0]} for n, v in by.items()}
              for name, by in rows.items()}
    report = {"command": " ".join(["python"] + sys.argv), "threads": a.threads, "tokens": a.tokens,
              "cpus": len(os.sched_getaffinity(0)), "loadavg": os.getloadavg(),
              "client_readers": readers,
              "rounds": rows if len(rows) > 1 else rows["default"],
              "median": median if len(median) > 1 else median["default"]}
    for name, by in median.items():
        for n, m in by.items():
            print(f"{name}, {n} at once, medians: " + ", ".join(f"{k} {v:.3g}" for k, v in m.items()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


def measure(srv, reader, n, tokens, prompts):
    """n streamed requests at once against srv: tokens/s at the client and the CPU per token of
    the client (this process), the server's event loop (its main thread) and its other threads
    (the engine's), with the wall time per engine step"""
    from cpu_serve_concurrent import _client, _together
    from _serve import metric, parse_metrics
    pid = srv.proc.pid

    def steps():
        c = srv.conn()
        c.request("GET", "/metrics")
        return metric(parse_metrics(c.getresponse().read().decode())[0], "kie_batch_size_per_step_count")

    client = _client(srv.url)
    before, c0, s0, t0 = thread_cpu(pid), own_cpu(), steps(), time.perf_counter()
    out = _together(client, srv.name, (prompts * n)[:n], tokens, reader=reader)
    wall, c1, s1, after = time.perf_counter() - t0, own_cpu(), steps(), thread_cpu(pid)
    toks = sum(v[1] for v in out.values())
    loop = after.get(pid, 0) - before.get(pid, 0)
    rest = sum(v - before.get(t, 0) for t, v in after.items() if t != pid)
    return {"tokens_per_s": toks / wall, "client_ms_per_token": 1e3 * (c1 - c0) / toks,
            "event_loop_ms_per_token": 1e3 * loop / toks, "engine_ms_per_token": 1e3 * rest / toks,
            "wall_ms_per_step": 1e3 * wall / max(s1 - s0, 1), "steps": s1 - s0}


if __name__ == "__main__":
    main()
