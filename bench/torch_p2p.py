"""torch.distributed point-to-point with backend="kccl" against gloo, in one run: a
2-rank ping-pong (rank 0 sends, rank 1 receives and sends back) at each size, and the
collectives that can go point-to-point (gather, scatter, all_to_all_single) with kccl
point-to-point, kccl collectives (KCCL all-gather / broadcast) and gloo.  Both backends'
groups live in the same processes and take turns size by size, round by round, so
machine load hits all alike.

    python bench/torch_p2p.py                                  # ping-pong 2 ranks, collectives 2 and 4
    python bench/torch_p2p.py --sizes 4K --rounds 9 --json out.json

Ping-pong: per size and round, `iters` round trips after a barrier; the figure is the
round trip's mean (one-way = half).  Collectives: per size (bytes each rank sends to each
other rank, or holds for gather / scatter) and round, each rank times `iters` calls; the
figure of a round is the slowest rank's mean.  Reported: min / median / max over the
rounds, and the ratio gloo / kccl of the medians."""
import argparse
import json
import os
import statistics
import sys
import time

from benchlib import launch_local_ranks, parse_size, write_json


def stats(v):
    return {"min_us": min(v), "median_us": statistics.median(v), "max_us": max(v), "rounds_us": v}


def rank_main(args):
    import torch
    import torch.distributed as dist
    import kccl.torch
    torch.set_num_threads(1)
    dist.init_process_group("kccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    kgroup = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    meta = dist.new_group(backend="gloo")
    out = {"pingpong": [], "collectives": []}

    def timed(fn, iters):
        dist.barrier(group=meta)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        per = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(per, op=dist.ReduceOp.MAX, group=meta)
        return per.item() * 1e6

    if world == 2 and not args.no_pingpong:
        for size in args.sizes:
            x = torch.zeros(max(1, size // 4))

            def pp(g):
                def one():
                    if rank == 0:
                        dist.send(x, 1, group=g)
                        dist.recv(x, 1, group=g)
                    else:
                        dist.recv(x, 0, group=g)
                        dist.send(x, 0, group=g)
                return one
            fns = {"kccl": pp(kgroup), "gloo": pp(gloo)}
            iters = {"kccl": args.iters, "gloo": max(3, args.iters // 50)}
            for name, f in fns.items():
                timed(f, 3)
            rounds = {n: [] for n in fns}
            for _ in range(args.rounds):
                for name, f in fns.items():
                    rounds[name].append(timed(f, iters[name]))
            row = {"bytes": size, "round_trip": {n: stats(v) for n, v in rounds.items()}}
            row["gloo_over_kccl"] = row["round_trip"]["gloo"]["median_us"] / row["round_trip"]["kccl"]["median_us"]
            out["pingpong"].append(row)
            if rank == 0:
                print(f"  ping-pong {size:>9} B round trip: gloo {row['round_trip']['gloo']['median_us']:9.1f} us  "
                      f"kccl {row['round_trip']['kccl']['median_us']:7.2f} us  gloo/kccl "
                      f"{row['gloo_over_kccl']:6.1f}x", flush=True)

    for size in args.coll_sizes:
        n = max(1, size // 4)

        def gather(g):
            src = torch.ones(n)
            outs = [torch.empty(n) for _ in range(world)] if rank == 0 else None
            return lambda: dist.gather(src, outs, dst=0, group=g)

        def scatter(g):
            out_t = torch.empty(n)
            ins = [torch.ones(n) for _ in range(world)] if rank == 0 else None
            return lambda: dist.scatter(out_t, ins, src=0, group=g)

        def a2a(g):
            src, dst = torch.ones(n * world), torch.empty(n * world)
            return lambda: dist.all_to_all_single(dst, src, group=g)

        for cname, make in (("gather", gather), ("scatter", scatter), ("all_to_all_single", a2a)):
            variants = {"kccl p2p": (kgroup, 0), "kccl collective": (kgroup, 1 << 62), "gloo": (gloo, None)}
            fns = {}
            for vname, (g, thr) in variants.items():
                fns[vname] = (make(g), thr)
            iters = {v: (args.coll_iters if v != "gloo" else max(3, args.coll_iters // 20)) for v in variants}
            rounds = {v: [] for v in variants}
            for vname, (f, thr) in fns.items():
                if thr is not None:
                    kccl.torch.set_p2p_min_bytes(thr)
                timed(f, 2)
            for _ in range(args.rounds):
                for vname, (f, thr) in fns.items():
                    if thr is not None:
                        kccl.torch.set_p2p_min_bytes(thr)
                    rounds[vname].append(timed(f, iters[vname]))
            row = {"collective": cname, "bytes": size, "ranks": world, **{v: stats(r) for v, r in rounds.items()}}
            out["collectives"].append(row)
            if rank == 0:
                print(f"  {cname:<18} {world} ranks {size:>9} B: " +
                      "  ".join(f"{v} {row[v]['median_us']:9.1f}" for v in variants) + " us", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4", help="collectives at these world sizes (ping-pong at 2)")
    ap.add_argument("--sizes", default="4,4K,64K,1M,16M", help="ping-pong message sizes")
    ap.add_argument("--coll-sizes", default="4K,64K,1M,4M", help="bytes per rank of gather / scatter / all-to-all")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=2000, help="ping-pong round trips per round (gloo: / 50)")
    ap.add_argument("--coll-iters", type=int, default=200, help="collective calls per round (gloo: / 20)")
    ap.add_argument("--no-pingpong", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        args.sizes = [parse_size(s) for s in args.sizes.split(",") if s]
        args.coll_sizes = [parse_size(s) for s in args.coll_sizes.split(",") if s]
        return rank_main(args)
    report = {"command": " ".join(["python"] + sys.argv), "loadavg_before": os.getloadavg(), "cpus": os.cpu_count(),
              "by_ranks": {}}
    worlds = [int(w) for w in args.ranks.split(",")]
    for world in sorted(set(worlds + [2])):
        extra = ["--sizes", args.sizes, "--coll-sizes", args.coll_sizes if world in worlds else "", "--rounds",
                 str(args.rounds), "--iters", str(args.iters), "--coll-iters", str(args.coll_iters)]
        if args.no_pingpong:
            extra.append("--no-pingpong")
        print(f"{world} ranks; load average {os.getloadavg()[0]:.1f}", flush=True)
        report["by_ranks"][str(world)] = launch_local_ranks(__file__, world, ["--rank-main"] + extra)
    report["loadavg_after"] = os.getloadavg()
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
