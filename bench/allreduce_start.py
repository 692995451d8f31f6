"""Cost of the split-phase all-reduce from Python, against the blocking one, side by side
(rounds alternate the three modes on the same buffers and communicator):

  blocking   comm.all_reduce(x, y)
  start+wait comm.all_reduce_start(x, y).wait()
  depth 2    start call i, then wait call i-1 (two in flight, as DTP delay 1 does)

    python bench/allreduce_start.py --ranks 2 --sizes 4,1K,4K,16K,64K --iters 20000 --rounds 3
"""
import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import parse_size  # noqa: E402  (bench/ is this script's directory)

MODES = ("blocking", "start+wait", "depth 2")


def _worker(uid, nranks, rank, sizes, iters, rounds, q):
    import numpy as np
    import kccl
    with kccl.Communicator(nranks, kccl.UniqueId(uid), rank, config={"max_outstanding": 2}) as comm:
        out = {}
        for nbytes in sizes:
            n = max(1, nbytes // 4)
            x, ys = np.ones(n, np.float32), [np.empty(n, np.float32) for _ in range(2)]
            runs = {m: [] for m in MODES}
            for _ in range(rounds):
                for mode in MODES:
                    comm.barrier()
                    t = time.perf_counter()
                    if mode == "blocking":
                        for _ in range(iters):
                            comm.all_reduce(x, ys[0])
                    elif mode == "start+wait":
                        for _ in range(iters):
                            comm.all_reduce_start(x, ys[0]).wait()
                    else:
                        prev = comm.all_reduce_start(x, ys[1])
                        for i in range(iters - 1):
                            h = comm.all_reduce_start(x, ys[i % 2])
                            prev.wait()
                            prev = h
                        prev.wait()
                    runs[mode].append((time.perf_counter() - t) / iters * 1e6)
                    if not (ys[0] == nranks).all():
                        raise AssertionError(f"wrong sum in mode {mode}")
            out[nbytes] = {m: statistics.median(v) for m, v in runs.items()}
        q.put((rank, out))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="4,1K,4K,16K,64K")
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    import kccl
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    uid = bytes(kccl.get_unique_id())
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(uid, a.ranks, r, sizes, a.iters, a.rounds, q)) for r in range(a.ranks)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(30)
    print(f"# {a.ranks} ranks, float32 sum, us per call from Python (median of {a.rounds} rounds of "
          f"{a.iters} calls; the slowest rank)")
    print("| size | " + " | ".join(MODES) + " |")
    print("|---:|" + "---:|" * len(MODES))
    for nbytes in sizes:
        cells = [max(res[r][nbytes][m] for r in res) for m in MODES]
        print(f"| {nbytes} B | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
