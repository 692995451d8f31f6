"""The packed multi-input kernels (kq_matmul_mat) against the single-input one on one
thread: GMAC/s and weight GB/s per number of inputs, on SmolLM2's gate/up (1536x576) and
down (576x1536) shapes, Q4_1 by default; weights streamed from memory (distinct copies
filling --footprint MB) and in cache (one copy, in L2, again and again).  One input runs
kq_matvec_mat, as the token step does.  min / median / max over --rounds rounds, the
input counts taking turns within each round.

    python bench/cpu_kq_inputs.py --out bench/results/cpu_kq_inputs_q4_1.json
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kie_engine.formats import quant as Q  # noqa: E402
from kie_engine.cpu import kernels as K  # noqa: E402


def _aligned(a):
    buf = np.empty(a.nbytes + 64, np.uint8)
    off = (-buf.ctypes.data) % 64
    out = buf[off:off + a.nbytes]
    out[:] = a
    return out


def run_once(code, mats, rows, xs, acts, y):
    nt = xs.shape[0]
    t = time.perf_counter()
    for w in mats:
        if nt == 1:
            K.matvec_packed(code, w, rows, xs[0], act=acts, out=y[0])
        else:
            K.matmul(code, w, rows, xs, out=y, acts=acts)
    return time.perf_counter() - t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--type", default="Q4_1", choices=["Q4_1", "Q4_0", "Q8_0"])
    p.add_argument("--inputs", default="1,2,4,8,16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--footprint", type=int, default=160, help="MB of distinct copies for the from-memory rows")
    p.add_argument("--out")
    a = p.parse_args(argv)
    t = Q.CODES[a.type]
    counts = [int(n) for n in a.inputs.split(",")]
    rng = np.random.default_rng(0)
    report = {"type": a.type, "kernels": K.level(), "rounds": a.rounds, "results": {},
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    for rows, cols in ((1536, 576), (576, 1536)):
        code, packed = K.pack(t, Q.quantize(rng.standard_normal((rows, cols)).astype(np.float32), t), cols)
        copies = [_aligned(packed) for _ in range(max(1, (a.footprint << 20) // packed.nbytes))]
        where = {"memory": copies, "cache": [copies[0]] * len(copies)}
        xs = {n: rng.standard_normal((n, cols)).astype(np.float32) for n in counts}
        acts = {n: K.prepare_acts(code, xs[n]) if n > 1 else K.prepare_act(t, xs[n][0]) for n in counts}
        got = {(w, n): [] for w in where for n in counts}
        for w, mats in where.items():
            ys = {n: np.zeros((n, rows), np.float32) for n in counts}
            run_once(code, mats, rows, xs[counts[0]], acts[counts[0]], ys[counts[0]])
            for r in range(a.rounds):
                for n in counts:
                    got[w, n].append(run_once(code, mats, rows, xs[n], acts[n], ys[n]) / len(mats))
        for (w, n), ts in got.items():
            med = statistics.median(ts)
            gmac = sorted(rows * cols * n / s / 1e9 for s in ts)
            row = {"gmac_per_s": {"min": gmac[0], "median": statistics.median(gmac), "max": gmac[-1]},
                   "weight_gb_per_s_median": packed.nbytes / med / 1e9}
            report["results"][f"{rows}x{cols} {w} {n} inputs"] = row
            print(f"{rows}x{cols} from {w}, {n:2d} inputs: {gmac[0]:.1f} / {row['gmac_per_s']['median']:.1f} / "
                  f"{gmac[-1]:.1f} GMAC/s, weights at {row['weight_gb_per_s_median']:.1f} GB/s", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
