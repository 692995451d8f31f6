"""Where the time of a small torch.distributed.all_reduce goes with backend="kccl": the
same float32 all-reduce timed layer by layer, in one run (layers take turns round by
round, so machine load hits all alike):

  kccl C            kcclAllReduce in a C++ loop (the backend's host communicator): the exchange
  backend C++       KcclBackend::allreduce + Work::wait in a C++ loop: + the backend's own code
  pg.allreduce      ProcessGroup.allreduce(...).wait() from Python: + pybind, torch's dispatcher
                    and its Work wrapper
  dist.all_reduce   torch.distributed.all_reduce: + torch's Python checks
  numpy Communicator  kccl.Communicator.all_reduce on a numpy array (its own communicator)

    python bench/torch_small_cost.py --ranks 1,2 --bytes 4096 --rounds 9 --json out.json

With one rank nothing is waited for: each layer's figure is its cost alone.  The ranks are
launched here (env://); per layer and round each rank times `iters` back-to-back calls
after a barrier, and a round's figure is the slowest rank's mean.  Reported: min / median
/ max over the rounds."""
import argparse
import json
import os
import statistics
import sys
import time

from benchlib import launch_local_ranks, write_json

LAYERS = ("kccl C", "backend C++", "pg.allreduce", "dist.all_reduce", "numpy Communicator")


def rank_main(args):
    import numpy as np
    import torch
    import torch.distributed as dist
    import kccl
    import kccl.torch
    torch.set_num_threads(1)
    if args.pin:
        os.sched_setaffinity(0, {int(os.environ["RANK"]) % os.cpu_count()})
    dist.init_process_group("kccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = dist.new_group(backend="gloo")
    uid = [bytes(kccl.get_unique_id()) if rank == 0 else None]
    dist.broadcast_object_list(uid, src=0, group=meta)
    comm = kccl.Communicator(world, kccl.UniqueId(uid[0]), rank)
    n = max(1, args.bytes // 4)
    x = torch.ones(n, dtype=torch.float32)
    a = np.ones(n, dtype=np.float32)
    pg = dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))
    opts = dist.AllreduceOptions()
    opts.asyncOp = False  # as dist.all_reduce(x) asks for it
    ext = kccl.torch._ext

    def pg_loop(iters):
        for _ in range(iters):
            pg.allreduce([x], opts).wait()

    def dist_loop(iters):
        for _ in range(iters):
            dist.all_reduce(x)

    def numpy_loop(iters):
        for _ in range(iters):
            comm.all_reduce(a)

    loops = {"kccl C": lambda it: ext.time_host_allreduce(backend, x, it),
             "backend C++": lambda it: ext.time_backend_allreduce(backend, x, it),
             "pg.allreduce": pg_loop, "dist.all_reduce": dist_loop, "numpy Communicator": numpy_loop}
    for f in loops.values():  # warm up
        f(200)
    rounds = {k: [] for k in LAYERS}
    for _ in range(args.rounds):
        for name in LAYERS:
            dist.barrier(group=meta)
            t0 = time.perf_counter()
            loops[name](args.iters)
            per = torch.tensor([(time.perf_counter() - t0) / args.iters], dtype=torch.float64)
            dist.all_reduce(per, op=dist.ReduceOp.MAX, group=meta)
            rounds[name].append(per.item() * 1e6)
    out = {name: {"min_us": min(v), "median_us": statistics.median(v), "max_us": max(v), "rounds_us": v}
           for name, v in rounds.items()}
    comm.close()
    dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def launch(world, args):
    return launch_local_ranks(__file__, world, ["--rank-main", "--bytes", str(args.bytes), "--rounds", str(args.rounds),
                                                "--iters", str(args.iters)] + (["--pin"] if args.pin else []))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--pin", action="store_true", help="rank r runs on CPU r (mod the CPU count) only")
    ap.add_argument("--json")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        return rank_main(args)
    report = {"command": " ".join(["python"] + sys.argv), "loadavg_before": os.getloadavg(), "cpus": os.cpu_count(),
              "bytes": args.bytes, "pinned": args.pin, "by_ranks": {}}
    for world in [int(w) for w in args.ranks.split(",")]:
        res = launch(world, args)
        report["by_ranks"][str(world)] = res
        print(f"{world} rank(s), {args.bytes} B float32 all_reduce, median (min-max) us over {args.rounds} rounds:")
        prev = None
        for name in LAYERS:
            r = res[name]
            step = "" if prev is None or name == "numpy Communicator" else f"  (+{r['median_us'] - prev:.2f})"
            print(f"  {name:<20} {r['median_us']:7.2f}  ({r['min_us']:.2f}-{r['max_us']:.2f}){step}", flush=True)
            if name != "numpy Communicator":
                prev = r["median_us"]
    report["loadavg_after"] = os.getloadavg()
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
