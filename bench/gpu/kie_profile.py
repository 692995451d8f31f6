"""A few decode steps of KIE's GPU engine on random weights, between
cudaProfilerStart and cudaProfilerStop, for Nsight Compute to time each kernel of
the step (the rest of the run, weights and prefill included, is not profiled), or
with --prefill the batched prefill of the context alone:

    ncu --profile-from-start off --graph-profiling node --csv --page raw \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        python3 bench/gpu/kie_profile.py --kernel graph --context 128 > ncu.csv
    python3 bench/gpu/kie_profile.py --summarize ncu.csv --preset 2b

--summarize reads such a CSV (one decode step's kernels, in launch order) and prints
the time per kind of op (qkv, attention, o, gate_up, down, head, pick) summed over
the layers, with the bytes each read from DRAM and the bandwidth that makes."""
import argparse
import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/


def run(a):
    import torch

    import decode_gpu as dg
    import kie_bench
    from kie_engine.formats.config import preset

    torch.cuda.set_device(0)
    cfg = preset(a.preset)
    w = dg.lane_weights(cfg, torch.device("cuda", 0))
    m = dg.kie_engine(cfg, w, None, a.context + a.steps + 16, kernel=a.kernel)
    if a.prefill:  # the batched prefill of the context, once warm, is what is profiled
        ids = list(range(a.context))
        m.prefill(ids)
        m.reset()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        m.prefill(ids)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        m.close()
        return
    m.prefill(list(range(a.context)))
    kie_bench.bench_steps(m, 4)  # captures the step's graph, warms up
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    kie_bench.bench_steps(m, a.steps)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    m.close()


def summarize(path, layers):
    rows = []
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]
    rd = csv.DictReader(lines)
    for r in rd:
        name = r.get("Kernel Name", "")
        t = r.get("gpu__time_duration.sum", "")
        if not name or not t or not t.replace(".", "", 1).replace(",", "").isdigit():
            continue  # the units row
        rows.append((name, float(t.replace(",", "")), float((r.get("dram__bytes_read.sum") or "0").replace(",", ""))))
    per_step = 5 * layers + 2
    if len(rows) < per_step:
        print(f"{len(rows)} kernels in {path}: fewer than one step's {per_step}")
        return
    rows = rows[:per_step]
    kinds = ["qkv", "attention", "o", "gate_up", "down"] * layers + ["head", "pick"]
    tot = {}
    for k, (name, ns, b) in zip(kinds, rows):
        t = tot.setdefault(k, [0.0, 0.0, name])
        t[0] += ns / 1e3
        t[1] += b
    all_us = sum(v[0] for v in tot.values())
    print(f"{'op':10s} {'us/step':>9s} {'MB read':>9s} {'GB/s':>8s}  kernel")
    for k, (us, b, name) in tot.items():
        print(f"{k:10s} {us:9.1f} {b / 1e6:9.1f} {b / us / 1e3 if us else 0:8.0f}  {name[:60]}")
    print(f"{'sum':10s} {all_us:9.1f}  (each kernel alone, serialized by the profiler)")


def stall_sources(path, top):
    """Nsight Compute's source page (`--page source --csv --print-source sass`, gzipped or not): each
    stall reason's share of the warp samples, then the `top` instructions by samples."""
    import gzip

    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        lines = f.readlines()
    start = next(i for i, l in enumerate(lines) if l.startswith('"Address"'))
    rows = [r for r in csv.DictReader(lines[start:]) if r["Address"].startswith("0x")]
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    every = "Warp Stall Sampling (All Samples)"
    n = lambda r, k: int((r[k] or "0").replace(",", ""))
    total = sum(n(r, every) for r in rows)
    print(f"{len(rows)} instructions, {total} warp samples")
    for k in sorted(reasons, key=lambda k: -sum(n(r, k) for r in rows)):
        v = sum(n(r, k) for r in rows)
        if v * 200 >= total:
            print(f"  {k[6:]:18s} {v:8d} {100 * v / total:5.1f} %")
    print(f"the {top} instructions with the most samples (index, samples, executed, reasons):")
    for i in sorted(sorted(range(len(rows)), key=lambda i: -n(rows[i], every))[:top]):
        r = rows[i]
        why = sorted(((n(r, k), k[6:]) for k in reasons), reverse=True)[:2]
        print(f"  {i:6d} {n(r, every):7d} {n(r, 'Instructions Executed'):9d}  {r['Source'].strip()[:56]:56s} "
              + ", ".join(f"{k} {v}" for v, k in why if v))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="2b")
    ap.add_argument("--kernel", default="graph", choices=["graph", "mono"])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--prefill", action="store_true", help="profile the batched prefill of the context instead")
    ap.add_argument("--summarize", metavar="CSV")
    ap.add_argument("--stall-sources", metavar="CSV", help="summarize Nsight Compute's source page of one kernel")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    if a.stall_sources:
        stall_sources(a.stall_sources, a.top)
    elif a.summarize:
        from kie_engine.formats.config import preset
        summarize(a.summarize, preset(a.preset).num_hidden_layers)
    else:
        run(a)


if __name__ == "__main__":
    main()
