"""KCCL against MPI with a busy process on the machine (or without: --no-hog), for KCCL's
adaptive waits against fixed ones (KCCL_SPIN_US=100 KCCL_YIELD_US=2000: the automatic
phases of a core per rank, which turn the backoff off), side by side: each round runs
`mpiexec -n 2 python bench/allreduce.py` once per variant, in turn, with the same busy
process running; min / median / max over the rounds of each size's time and MPI/KCCL.

The busy process is `python -c "while 1: pass"` pinned to the last CPU (--hog-cpu).
`--before DIR` adds a third variant: the kccl (and bench/allreduce.py) of another built
checkout, such as the commit before the backoff.

    python bench/allreduce_contention.py --rounds 5 --json bench/results/allreduce_contention_2ranks.json
    python bench/allreduce_contention.py --rounds 5 --no-hog -e 8K     # the quiet A/B
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import fmt_size, mpi_launcher  # noqa: E402

VARIANTS = [("adaptive", {}), ("fixed", {"KCCL_SPIN_US": "100", "KCCL_YIELD_US": "2000"})]


def one_run(env_extra, args, path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KCCL_")}
    env.update(env_extra)
    bench = os.path.join(env.pop("CHECKOUT", os.path.dirname(HERE)), "bench")
    if "CHECKOUT" in env_extra:
        env["PYTHONPATH"] = env_extra["CHECKOUT"] + os.pathsep + env.get("PYTHONPATH", "")
    cmd = mpi_launcher(2) + [sys.executable, os.path.join(bench, "allreduce.py"), "-b", args.minbytes, "-e",
                             args.maxbytes, "-f", str(args.stepfactor), "-r", str(args.inner_rounds),
                             "-n", str(args.iters), "-w", str(args.warmup), "--json", path]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise RuntimeError(p.stdout + p.stderr)
    with open(path) as f:
        return json.load(f)["rows"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-b", "--minbytes", default="8")
    ap.add_argument("-e", "--maxbytes", default="64K")
    ap.add_argument("-f", "--stepfactor", type=int, default=8)
    ap.add_argument("--inner-rounds", type=int, default=3, help="allreduce.py's -r")
    ap.add_argument("-n", "--iters", type=int, default=2000, help="allreduce.py's -n")
    ap.add_argument("-w", "--warmup", type=int, default=300, help="allreduce.py's -w")
    ap.add_argument("--no-hog", action="store_true", help="no busy process: the quiet A/B")
    ap.add_argument("--hog-cpu", type=int, default=max(os.sched_getaffinity(0)))
    ap.add_argument("--before", metavar="DIR", help="also run the kccl of this built checkout")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.before:
        VARIANTS.append(("before", {"CHECKOUT": os.path.abspath(a.before)}))
    res = {name: {} for name, _ in VARIANTS}  # name -> size -> {"kccl": [...], "mpi": [...], "ratio": [...]}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            hog = None if a.no_hog else subprocess.Popen(
                ["taskset", "-c", str(a.hog_cpu), sys.executable, "-c", "while 1: pass"])
            try:
                if hog:
                    time.sleep(0.3)
                loads.append(os.getloadavg()[0])
                for name, env in VARIANTS:
                    rows = one_run(env, a, os.path.join(tmp, f"{name}.json"))
                    for row in rows:
                        d = res[name].setdefault(row["bytes"], {"kccl": [], "mpi": [], "ratio": []})
                        d["kccl"].append(row["kccl_us_avg"])
                        d["mpi"].append(row["mpi_us_avg"])
                        d["ratio"].append(row["ratio"])
                    print(f"round {r + 1} {name:8s} " + "  ".join(
                        f"{fmt_size(row['bytes'])}: {row['kccl_us_avg']:.1f}/{row['mpi_us_avg']:.1f} us "
                        f"({row['ratio']:.2f}x)" for row in rows), flush=True)
            finally:
                if hog:
                    hog.kill()
                    hog.wait()

    def mmm(v):
        return [min(v), statistics.median(v), max(v)]
    stats = {name: {str(b): {k: mmm(v) for k, v in d.items()} for b, d in sizes.items()} for name, sizes in res.items()}
    what = "no busy process" if a.no_hog else f"a busy process pinned to CPU {a.hog_cpu}"
    print(f"\n2 ranks, {what}; us per call and MPI/KCCL, min / median / max over {a.rounds} rounds")
    for name, sizes in stats.items():
        for b, d in sizes.items():
            k, m, q = d["kccl"], d["mpi"], d["ratio"]
            print(f"{name:8s} {fmt_size(int(b)):>5}: KCCL {k[0]:7.1f} {k[1]:7.1f} {k[2]:7.1f} | MPI {m[0]:7.1f} "
                  f"{m[1]:7.1f} {m[2]:7.1f} | MPI/KCCL {q[0]:.2f} {q[1]:.2f} {q[2]:.2f}")
    print(f"load average (1 min) at the rounds: {min(loads):.2f}-{max(loads):.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": " ".join(["python"] + sys.argv), "hog": None if a.no_hog else a.hog_cpu,
                       "variants": dict(VARIANTS), "stats": stats, "runs": res,
                       "loadavg": [min(loads), max(loads)]}, f, indent=1)


if __name__ == "__main__":
    main()
