"""GB/s of the CPU engine's Q8_0 and Q4_1 products streamed from memory, GGUF rows against
the sixteen-row packed layout the engine loads them into (csrc/kq.h), against a plain read
of the same bytes (the machine's read ceiling), on 1 and 2 threads, on SmolLM2's shapes.

Builds bench/cpu_kq_stream.c with the worktree's kernels and runs it once per case
(C-timed, huge pages, threads pinned, each its contiguous share of the rows; best and
median of ROUNDS walks over 256 MB of copies); the cases of one thread count alternate.

    python bench/cpu_kq_layout.py [--rounds 12] [--json bench/results/cpu_kernels_packed_layout.json]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "kie_engine", "cpu", "csrc")
CASES = [(8, 1536, 576), (8, 49152, 576), (3, 1536, 576), (3, 576, 1536)]  # (type, rows, cols)
NAMES = {8: "Q8_0", 3: "Q4_1"}


def build(out):
    srcs = sorted(os.path.join(CSRC, f) for f in os.listdir(CSRC) if f.startswith("kq_") and f.endswith(".c"))
    subprocess.run(["gcc", "-O3", "-I", CSRC, os.path.join(ROOT, "bench", "cpu_kq_stream.c"), *srcs, "-o", out,
                    "-lpthread", "-lm"], check=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--json")
    a = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "kq_stream")
        build(exe)
        for th in [int(t) for t in a.threads.split(",")]:
            for t, r, c in CASES:
                for mode in ("rows", "packed", "read"):
                    out = subprocess.run([exe, str(t), str(r), str(c), str(th), str(a.rounds), mode], check=True,
                                         capture_output=True, text=True).stdout.strip()
                    best = float(out.split("best ")[1].split(" GB/s")[0])
                    med = float(out.split("median ")[1].split(" GB/s")[0])
                    rows.append({"type": NAMES[t], "rows": r, "cols": c, "layout": mode, "threads": th,
                                 "best_GBps": best, "median_GBps": med})
                    print(out, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rounds": a.rounds, "loadavg": os.getloadavg(), "results": rows,
                       "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
