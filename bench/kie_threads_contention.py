"""SmolLM2 decode tokens/s at TP = 1 with and without a busy process on the machine, for
the engine's default thread count against `--blas-threads 1`, side by side (each round
runs every configuration once, in turn; min / median / max over the rounds).

The busy process is `python -c "while 1: pass"`, started before the configurations that
name it and killed after them.  `--engine DIR` runs the kie_engine of another checkout
(the "before" of an A/B).

    python bench/kie_threads_contention.py --rounds 5 --json bench/results/kie_threads_contention.json
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [("quiet", "default", []), ("quiet", "1 thread", ["--blas-threads", "1"]),
           ("busy", "default", []), ("busy", "1 thread", ["--blas-threads", "1"])]


def one_run(engine, extra, tokens):
    """(tokens/s, the summary's thread note) of one generate run."""
    env = dict(os.environ, PYTHONPATH=engine + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "KIE_BLAS_THREADS"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "kie_engine", "generate", "--model", "smollm2", "--prompt",
           "The capital of France is", "--max-new-tokens", str(tokens), "--ignore-eos"] + extra
    # cwd = the checkout: `python -m` puts the working directory ahead of PYTHONPATH
    p = subprocess.run(cmd, env=env, cwd=engine, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(p.stderr)
    line = p.stdout.strip().splitlines()[-1]
    m = re.search(r"decode ([0-9.]+) tokens/s", line)
    return float(m.group(1)), line.split("dtp_delay=0, ")[-1].rstrip("]")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--engine", default=ROOT, help="checkout whose kie_engine runs (default: this one)")
    ap.add_argument("--json", help="write the runs and their statistics here")
    a = ap.parse_args()
    runs = {f"{load}, {name}": [] for load, name, _ in CONFIGS}
    notes = {}
    loads = []
    for r in range(a.rounds):
        for busy in (False, True):
            hog = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if busy else None
            try:
                if hog:
                    time.sleep(0.5)  # let it take its core
                loads.append(os.getloadavg()[0])
                for load, name, extra in CONFIGS:
                    if (load == "busy") != busy:
                        continue
                    tps, note = one_run(a.engine, extra, a.tokens)
                    runs[f"{load}, {name}"].append(tps)
                    notes[f"{load}, {name}"] = note
                    print(f"round {r + 1} {load:5s} {name:8s} {tps:6.2f} tokens/s  [{note}]", flush=True)
            finally:
                if hog:
                    hog.kill()
                    hog.wait()
    stats = {k: {"min": min(v), "median": statistics.median(v), "max": max(v)} for k, v in runs.items()}
    print("\nconfiguration           min   median   max  (tokens/s)")
    for k, s in stats.items():
        print(f"{k:20s} {s['min']:7.2f} {s['median']:7.2f} {s['max']:7.2f}   [{notes[k]}]")
    print(f"load average (1 min) at the rounds: {min(loads):.2f}-{max(loads):.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "engine": a.engine, "tokens": a.tokens,
                       "runs": runs, "stats": stats, "notes": notes,
                       "loadavg": [min(loads), max(loads)]}, f, indent=1)


if __name__ == "__main__":
    main()
