"""GB/s of the CPU engine's block-format matvec kernels (kie_engine/cpu/csrc/kq_*.c) on
SmolLM2-135M's matrix shapes, against this machine's copy bandwidth.

Every product streams its weights from memory, as a decode step does (the whole model
does not fit the caches): each round walks enough distinct copies of the matrix to fill
--footprint MB, one kq_matvec over all rows per copy, on --threads threads (each takes
a contiguous share of the rows; cffi drops the GIL during the call).  GB/s = weight
bytes read / time.  The copy bandwidth is numpy's copy of a --footprint MB array,
counted as bytes read + bytes written (as STREAM's copy does), on one thread.  Each
figure is min / median / max over --rounds rounds; the kernels run at the level named
(--level; default the CPU's best).

    python bench/cpu_kernels.py [--types Q4_1,Q8_0] [--threads 1] [--rounds 5] [--json out.json]"""
import argparse
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kie_engine import quant as Q  # noqa: E402
from kie_engine.cpu import kernels as K  # noqa: E402

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]  # (rows, cols): q/o, gate/up, down, vocab


def stats(v):
    v = sorted(v)
    return {"min": v[0], "median": v[len(v) // 2], "max": v[-1]}


def copy_bandwidth(mb, rounds):
    a = np.ones(mb << 18, np.float32)  # mb MB
    b = np.empty_like(a)
    out = []
    for _ in range(rounds + 1):
        t = time.perf_counter()
        np.copyto(b, a)
        out.append(2 * a.nbytes / (time.perf_counter() - t) / 1e9)
    return stats(out[1:])


def run_kernel(t, rows, cols, footprint_mb, rounds, threads):
    ffi, lib = K.native()
    rng = np.random.default_rng(0)
    one = Q.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, Q.CODES[t])
    copies = max(1, (footprint_mb << 20) // one.nbytes)
    mats = np.empty((copies,) + one.shape, np.uint8)
    mats[:] = one
    x = rng.standard_normal(cols).astype(np.float32)
    act = K.prepare_act(t, x)
    y = np.zeros(rows, np.float32)
    code = K.TYPES[t]
    pa, py = ffi.cast("void *", act.ctypes.data), ffi.cast("float *", y.ctypes.data)
    ptrs = [ffi.cast("void *", mats[i].ctypes.data) for i in range(copies)]
    bounds = [rows * k // threads for k in range(threads + 1)]

    def work(k, order):
        for p in order:
            lib.kq_matvec(code, p, cols, pa, py, bounds[k], bounds[k + 1])

    out = []
    for rnd in range(rounds + 1):
        order = ptrs[rnd % 2::2] + ptrs[1 - rnd % 2::2]  # not the order just read (no cache reuse)
        if threads == 1:
            t0 = time.perf_counter()
            work(0, order)
        else:
            ths = [threading.Thread(target=work, args=(k, order)) for k in range(threads)]
            t0 = time.perf_counter()
            for th in ths:
                th.start()
            for th in ths:
                th.join()
        dt = time.perf_counter() - t0
        if rnd:  # round 0 warms up
            out.append(mats.nbytes / dt / 1e9)
    return stats(out), one.nbytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q4_1,Q8_0,Q4_0,Q4_K,Q6_K,F16,BF16,F32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--footprint", type=int, default=256, help="MB of weights walked per round (default 256)")
    ap.add_argument("--level", default=None, help="avx512, avx2 or scalar (default: the CPU's best)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.level and not K.set_level(args.level):
        sys.exit(f"error: this CPU or build cannot run level {args.level!r} (it can: {', '.join(K.levels())})")
    copy = copy_bandwidth(args.footprint, args.rounds)
    res = {"level": K.level(), "threads": args.threads, "rounds": args.rounds, "footprint_mb": args.footprint,
           "copy_gbps": copy, "load": os.getloadavg()[0], "kernels": []}
    print(f"level {K.level()}, {args.threads} thread(s), load {os.getloadavg()[0]:.2f}; "
          f"numpy copy (read + write) {copy['median']:.1f} GB/s (min {copy['min']:.1f}, max {copy['max']:.1f})")
    print(f"{'type':6} {'rows x cols':>12} {'MB':>7} {'GB/s min/med/max':>20} {'% copy':>7}")
    for t in args.types.split(","):
        for rows, cols in SHAPES:
            if cols % Q.BLOCKS[Q.CODES[t]][0]:
                continue
            s, nbytes = run_kernel(t, rows, cols, args.footprint, args.rounds, args.threads)
            share = s["median"] / copy["median"]
            res["kernels"].append({"type": t, "rows": rows, "cols": cols, "bytes": nbytes, "gbps": s,
                                   "share_of_copy": share})
            print(f"{t:6} {f'{rows}x{cols}':>12} {nbytes / 1e6:7.2f} "
                  f"{s['min']:6.1f}/{s['median']:5.1f}/{s['max']:5.1f} {100 * share:6.0f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
