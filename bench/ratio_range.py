"""MPI/KCCL all-reduce ratios over several runs of bench/allreduce.py: this machine is
noisy, so one run's ratio says little without the spread of the others.

    for i in 1 2 3 4 5; do mpiexec -n 2 python bench/allreduce.py -e 1M --json /tmp/ar$i.json; done
    python bench/ratio_range.py /tmp/ar*.json            # per size: min / median / max over the runs
    python bench/ratio_range.py bench/results/host_allreduce_2ranks_5runs.json   # runs kept in one file

A file may hold one run (what --json writes) or several ({"runs": [run, ...]}).

Prints, per size, the median over runs of KCCL's and MPI's time per call (us, each run's
average over ranks), and the ratio MPI/KCCL of each run reduced to its min, median and
max.  Runs must have the same rank count, type and op."""
import argparse
import json
import statistics
import sys

from benchlib import fmt_size


def load(paths):
    runs = []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        runs.extend(doc["runs"] if "runs" in doc else [doc])
    shapes = {(d["meta"]["nranks"], d["rows"][0]["dtype"], d["rows"][0]["op"]) for d in runs if d["rows"]}
    if len(shapes) > 1:
        raise ValueError(f"runs differ in ranks/type/op: {sorted(shapes)}")
    return runs


def summarize(runs):
    """[{bytes, runs, kccl_us, mpi_us, ratio_min, ratio_median, ratio_max}] for every size
    that has an MPI time in at least one run, in size order."""
    by_size = {}
    for doc in runs:
        for r in doc["rows"]:
            if r.get("ratio") is not None:
                by_size.setdefault(r["bytes"], []).append(r)
    out = []
    for n in sorted(by_size):
        rs = by_size[n]
        ratios = [r["ratio"] for r in rs]
        out.append({"bytes": n, "runs": len(rs), "kccl_us": statistics.median(r["kccl_us_avg"] for r in rs),
                    "mpi_us": statistics.median(r["mpi_us_avg"] for r in rs), "ratio_min": min(ratios),
                    "ratio_median": statistics.median(ratios), "ratio_max": max(ratios)})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="--json files of bench/allreduce.py")
    a = ap.parse_args(argv)
    try:
        runs = load(a.runs)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = summarize(runs)
    print(f"# {len(runs)} runs, {runs[0]['meta']['nranks']} ranks; us per call: median over runs; "
          f"MPI/KCCL: min / median / max over runs")
    print(f"{'size':>8} {'runs':>4} {'kccl_us':>9} {'mpi_us':>9} | {'min':>6} {'median':>6} {'max':>6}")
    for r in rows:
        print(f"{fmt_size(r['bytes']):>8} {r['runs']:>4} {r['kccl_us']:9.2f} {r['mpi_us']:9.2f} | "
              f"{r['ratio_min']:6.2f} {r['ratio_median']:6.2f} {r['ratio_max']:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
