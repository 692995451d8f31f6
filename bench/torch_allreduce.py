"""torch.distributed.all_reduce of a float32 CPU tensor with gloo and with kccl, in one
run: both groups live in the same processes and take turns size by size, round by
round, so machine load hits both alike.

    python bench/torch_allreduce.py                     # 2 and 4 ranks, 4 B .. 64 MB
    python bench/torch_allreduce.py --ranks 2 --max 64K --rounds 5 --json out.json

Launches the ranks itself (env://).  Per size and round, each rank times `iters`
back-to-back calls after a barrier; the figure of a round is the slowest rank's mean
per call.  Reported: min / median / max over the rounds, for each backend, and the
ratio gloo/kccl of the medians."""
import argparse
import json
import os
import statistics
import sys
import time

from benchlib import launch_local_ranks, parse_size, write_json

SIZES = [4, 64, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def rank_main(args):
    import torch
    import torch.distributed as dist
    import kccl.torch  # noqa: F401
    torch.set_num_threads(1)
    dist.init_process_group("kccl")
    rank = dist.get_rank()
    groups = {"kccl": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    meta = dist.new_group(backend="gloo")  # for the timing reductions, outside the measured groups
    out = []
    for size in [s for s in SIZES if s <= args.max]:
        x = torch.ones(max(1, size // 4), dtype=torch.float32)
        iters = {}
        for name, g in groups.items():  # warm up, and pick iterations for ~target seconds
            for _ in range(3):
                dist.all_reduce(x, group=g)
            t0 = time.perf_counter()
            dist.all_reduce(x, group=g)
            est = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(est, op=dist.ReduceOp.MAX, group=meta)
            iters[name] = int(max(3, min(args.max_iters, args.target / max(est.item(), 1e-7))))
        rounds = {n: [] for n in groups}
        for _ in range(args.rounds):
            for name, g in groups.items():
                dist.barrier(group=meta)
                t0 = time.perf_counter()
                for _ in range(iters[name]):
                    dist.all_reduce(x, group=g)
                per = torch.tensor([(time.perf_counter() - t0) / iters[name]], dtype=torch.float64)
                dist.all_reduce(per, op=dist.ReduceOp.MAX, group=meta)
                rounds[name].append(per.item() * 1e6)
        row = {"bytes": size, "iters": iters}
        for name, v in rounds.items():
            row[name] = {"min_us": min(v), "median_us": statistics.median(v), "max_us": max(v), "rounds_us": v}
        row["gloo_over_kccl"] = row["gloo"]["median_us"] / row["kccl"]["median_us"]
        out.append(row)
        if rank == 0:
            print(f"  {size:>10} B  gloo {row['gloo']['median_us']:10.1f} us  kccl {row['kccl']['median_us']:9.2f} us"
                  f"  (min {row['kccl']['min_us']:.2f} max {row['kccl']['max_us']:.2f})"
                  f"  gloo/kccl {row['gloo_over_kccl']:7.1f}x", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def launch(world, args):
    return launch_local_ranks(__file__, world, ["--rank-main", "--max", str(args.max), "--rounds", str(args.rounds),
                                                "--target", str(args.target), "--max-iters", str(args.max_iters)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--max", type=parse_size, default=64 << 20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--target", type=float, default=0.05, help="seconds per backend, size and round")
    ap.add_argument("--max-iters", type=int, default=5000)
    ap.add_argument("--json")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        return rank_main(args)
    load = os.getloadavg()
    report = {"command": " ".join(["python"] + sys.argv), "loadavg_before": load, "cpus": os.cpu_count(),
              "by_ranks": {}}
    for world in [int(w) for w in args.ranks.split(",")]:
        print(f"{world} ranks, float32, torch.distributed.all_reduce (median us over {args.rounds} rounds); "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
        report["by_ranks"][str(world)] = launch(world, args)
    report["loadavg_after"] = os.getloadavg()
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
