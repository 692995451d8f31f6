"""GB/s of the CPU engine's block-format matvec kernels (kie_engine/cpu/csrc/kq_*.c) on
SmolLM2-135M's matrix shapes, against this machine's copy bandwidth measured side by side.

Every product streams its weights from memory, as a decode step does (the whole model
does not fit the caches): each round walks enough distinct copies of the matrix to fill
--footprint MB, one kq_matvec over all rows per copy, on --threads threads (each takes
a contiguous share of the rows; cffi drops the GIL during the call).  GB/s = weight
bytes read / time.  The copy bandwidth is numpy's copy of a --footprint MB array,
counted as bytes read + bytes written (as STREAM's copy does), on one thread, measured
in every round just before the kernel, so that each round's ratio compares the two
under the same load (this machine is shared).  Each figure is min / median / max over
--rounds rounds (after one warm-up round); the kernels run at the level named (--level;
default the CPU's best).

    python bench/cpu_kernels.py [--types Q4_1,Q8_0] [--threads 1] [--rounds 5] [--json out.json]
    python bench/cpu_kernels.py --in-cache [--json out.json]     (the arithmetic's ceiling, per level)"""
import argparse
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kie_engine.formats import quant as Q  # noqa: E402
from kie_engine.cpu import kernels as K  # noqa: E402

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]  # (rows, cols): q/o, gate/up, down, vocab


def stats(v):
    v = sorted(v)
    return {"min": v[0], "median": v[len(v) // 2], "max": v[-1]}


class Copier:
    """numpy's copy of `mb` MB, one round at a time: GB/s read + written."""

    def __init__(self, mb):
        self.a = np.ones(mb << 18, np.float32)
        self.b = np.empty_like(self.a)

    def round(self):
        t = time.perf_counter()
        np.copyto(self.b, self.a)
        return 2 * self.a.nbytes / (time.perf_counter() - t) / 1e9


def run_kernel(t, rows, cols, footprint_mb, rounds, threads, copier):
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

    gbps, copy, share = [], [], []
    for rnd in range(rounds + 1):
        c = copier.round()
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
        g = mats.nbytes / (time.perf_counter() - t0) / 1e9
        if rnd:  # round 0 warms up
            gbps.append(g)
            copy.append(c)
            share.append(g / c)
    return stats(gbps), stats(copy), stats(share), one.nbytes


def in_cache(t, rows, cols, reps=300, calls=10):
    """GB/s of one matrix read again and again (it stays in L2): what the kernel's
    arithmetic allows on one core, apart from memory.  Best of `reps` timings of `calls`
    products (the best is the figure least disturbed by other processes)."""
    ffi, lib = K.native()
    rng = np.random.default_rng(0)
    w = Q.quantize(rng.standard_normal((rows, cols)).astype(np.float32), Q.CODES[t])
    act = K.prepare_act(t, rng.standard_normal(cols).astype(np.float32))
    y = np.zeros(rows, np.float32)
    pw, pa, py = (ffi.cast("void *", w.ctypes.data), ffi.cast("void *", act.ctypes.data),
                  ffi.cast("float *", y.ctypes.data))
    code, best = K.TYPES[t], float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            lib.kq_matvec(code, pw, cols, pa, py, 0, rows)
        best = min(best, (time.perf_counter() - t0) / calls)
    return w.nbytes / best / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q4_1,Q8_0,Q4_0,Q4_K,Q6_K,F16,BF16,F32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--footprint", type=int, default=256, help="MB of weights walked per round (default 256)")
    ap.add_argument("--level", default=None, help="avx512, avx2 or scalar (default: the CPU's best)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--in-cache", action="store_true",
                    help="instead: each kernel on one 256 x 1536 (or 256 x 576) matrix that stays in L2, "
                         "best of 300, on every level this CPU runs")
    args = ap.parse_args()
    if args.level and not K.set_level(args.level):
        sys.exit(f"error: this CPU or build cannot run level {args.level!r} (it can: {', '.join(K.levels())})")
    if args.in_cache:
        levels = [args.level] if args.level else K.levels()
        res = {"load_before": os.getloadavg()[0], "kernels": []}
        print(f"in L2, one core, best of 300 x 10 products; load {os.getloadavg()[0]:.2f}")
        print(f"{'type':6} {'rows x cols':>12} " + " ".join(f"{lv:>14}" for lv in levels) + "   (GB/s)")
        for t in args.types.split(","):
            rows, cols = (256, 1536) if Q.BLOCKS[Q.CODES[t]][0] == 256 else (256, 576)
            got = {}
            for lv in levels:
                K.set_level(lv)
                got[lv] = in_cache(t, rows, cols)
            res["kernels"].append({"type": t, "rows": rows, "cols": cols, "gbps": got})
            print(f"{t:6} {f'{rows}x{cols}':>12} " + " ".join(f"{got[lv]:14.1f}" for lv in levels))
        res["load_after"] = os.getloadavg()[0]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    copier = Copier(args.footprint)
    res = {"level": K.level(), "threads": args.threads, "rounds": args.rounds, "footprint_mb": args.footprint,
           "load_before": os.getloadavg()[0], "kernels": []}
    print(f"level {K.level()}, {args.threads} thread(s), load {os.getloadavg()[0]:.2f}; copy = numpy copy, "
          f"read + write, in the same rounds")
    print(f"{'type':6} {'rows x cols':>12} {'MB':>6} {'GB/s min/med/max':>17} {'copy GB/s med':>13} "
          f"{'share of copy min/med/max':>26}")
    for t in args.types.split(","):
        for rows, cols in SHAPES:
            if cols % Q.BLOCKS[Q.CODES[t]][0]:
                continue
            g, c, sh, nbytes = run_kernel(t, rows, cols, args.footprint, args.rounds, args.threads, copier)
            res["kernels"].append({"type": t, "rows": rows, "cols": cols, "bytes": nbytes, "gbps": g,
                                   "copy_gbps": c, "share_of_copy": sh})
            print(f"{t:6} {f'{rows}x{cols}':>12} {nbytes / 1e6:6.2f} {g['min']:5.1f}/{g['median']:4.1f}/{g['max']:4.1f} "
                  f"{c['median']:13.1f} {100 * sh['min']:8.0f}%/{100 * sh['median']:3.0f}%/{100 * sh['max']:3.0f}%")
    res["load_after"] = os.getloadavg()[0]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
