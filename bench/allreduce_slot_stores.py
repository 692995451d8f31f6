"""KCCL_SLOT_STORES=auto / plain / stream side by side with MPI, over time: each sample is
tagged with the state the VM is in, so that the two states this machine alternates
between (its vCPUs sharing a cache, or put by the host on different core complexes) are
compared separately.

    mpiexec -n 2 python bench/allreduce_slot_stores.py [--seconds 60] [--sizes 1M,4M,8M,16M] [--json FILE [--samples]]

Every rank holds one communicator per variant.  A sample is: MPI's 1 MB all-reduce timed
over 10 calls (the state tag: ~170-230 us with a shared cache, 600+ without; slow above
--slow-us), then for each size each variant (in an order that rotates from sample to
sample) and MPI in turn, each over calls worth about 32 MB.  Prints each sample, then per state and size the median time per call of each
variant (us) and MPI/variant.  The JSON holds that summary with each variant's spread over
the samples (min, quartiles, max); --samples adds every sample (large: a two-minute run
gives hundreds)."""
import argparse
import json
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import kccl
from benchlib import fmt_size, parse_size, write_json

VARIANTS = ("auto", "plain", "stream")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--sizes", default="1M,4M,8M,16M")
    ap.add_argument("--slow-us", type=float, default=350.0, help="MPI 1 MB time above which a sample is 'slow'")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--samples", action="store_true", help="write every sample into the JSON too")
    a = ap.parse_args()
    w = MPI.COMM_WORLD
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    comms = {v: kccl.Communicator.from_mpi(w, config={"KCCL_SLOT_STORES": v}) for v in VARIANTS}
    bufs = {s: (np.ones(s // 4, np.float32), np.empty(s // 4, np.float32)) for s in sizes}
    tag_in, tag_out = np.ones(1 << 18, np.float32), np.empty(1 << 18, np.float32)
    samples = []
    end = time.time() + a.seconds
    while w.bcast(time.time() < end, root=0):
        w.Allreduce(tag_in, tag_out)
        w.Barrier()
        t = time.perf_counter()
        for _ in range(10):
            w.Allreduce(tag_in, tag_out)
        sample = {"time": time.strftime("%H:%M:%S"), "mpi_1M_us": (time.perf_counter() - t) / 10 * 1e6, "us": {}}
        for s in sizes:
            x, y = bufs[s]
            iters = max(3, (32 << 20) // s)
            row = sample["us"][s] = {}
            k = len(samples) % len(VARIANTS)  # rotated: none always runs right after MPI
            for name in VARIANTS[k:] + VARIANTS[:k] + ("mpi",):
                call = (lambda: w.Allreduce(x, y)) if name == "mpi" else (lambda c=comms[name]: c.all_reduce(x, y))
                call()
                w.Barrier()
                t = time.perf_counter()
                for _ in range(iters):
                    call()
                row[name] = (time.perf_counter() - t) / iters * 1e6
        samples.append(sample)
        if w.rank == 0:
            print(sample["time"], f"MPI 1M {sample['mpi_1M_us']:5.0f} us |",
                  " | ".join(fmt_size(s) + " " + " ".join(f"{n} {v:.0f}" for n, v in sample["us"][s].items())
                             for s in sizes), flush=True)
    for c in comms.values():
        c.close()
    if w.rank != 0:
        return
    summary = summarize(samples, sizes, a.slow_us)
    print(f"# medians per state (slow: MPI 1 MB above {a.slow_us:.0f} us); us per call, then MPI/variant")
    for row in summary:
        med = row["median_us"]
        print(f"{row['state']} {fmt_size(row['bytes']):>4} n={row['samples']:3d} "
              + "  ".join(f"{n} {med[n]:7.0f}" for n in VARIANTS + ("mpi",)) + " | "
              + "  ".join(f"{n} {med['mpi'] / med[n]:.2f}x" for n in VARIANTS))
    if a.json:
        out = {"command": " ".join(["mpiexec -n 2 python"] + sys.argv), "slow_us": a.slow_us, "summary": summary}
        if a.samples:
            out["samples"] = samples
        write_json(a.json, out)


def summarize(samples, sizes, slow_us):
    """Per state ("fast": MPI's 1 MB at most slow_us; "slow") and size: the samples' count,
    each variant's median us per call and its spread [min, 25 %, median, 75 %, max]."""
    summary = []
    for slow in (False, True):
        group = [x for x in samples if (x["mpi_1M_us"] > slow_us) == slow]
        for s in sizes if group else ():
            us = {n: sorted(x["us"][s][n] for x in group) for n in VARIANTS + ("mpi",)}
            summary.append({"state": "slow" if slow else "fast", "bytes": s, "samples": len(group),
                            "median_us": {n: statistics.median(v) for n, v in us.items()},
                            "spread_us": {n: [round(v[0], 1), *(round(q, 1) for q in statistics.quantiles(v, n=4)),
                                              round(v[-1], 1)] for n, v in us.items()}})
    return summary


if __name__ == "__main__":
    main()
