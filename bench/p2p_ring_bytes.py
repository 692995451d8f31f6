"""KCCL point-to-point (Communicator.send / recv) with different ring sizes
(KCCL_P2P_BYTES) in one run: two ranks hold one communicator per ring size and take turns
round by round, a ping-pong of each message size on each.

    python bench/p2p_ring_bytes.py --rings 256K,512K,1M,4M --sizes 4K,1M,16M --json out.json

Per size, ring and round: `iters` round trips after a barrier, rank 0's mean.  Reported:
the median (min-max) round trip over the rounds."""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchlib import launch_local_ranks, parse_size, write_json


def rank_main(rank, path, rings, sizes, rounds):
    import numpy as np
    import kccl
    if rank == 0:
        with open(path + ".tmp", "wb") as f:
            f.write(b"".join(bytes(kccl.get_unique_id()) for _ in rings))
        os.rename(path + ".tmp", path)
    else:
        while not os.path.exists(path):
            time.sleep(0.01)
    with open(path, "rb") as f:
        data = f.read()
    comms = {r: kccl.Communicator(2, kccl.UniqueId(data[i * 128:(i + 1) * 128]), rank, config={"p2p_bytes": r})
             for i, r in enumerate(rings)}
    out = []
    for n in sizes:
        x = np.zeros(n, np.uint8)
        iters = max(5, min(2000, (32 << 20) // max(n, 1)))
        res = {r: [] for r in rings}
        for _ in range(rounds):
            for r, c in comms.items():
                c.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    if rank == 0:
                        c.send(x, 1)
                        c.recv(x, 1)
                    else:
                        c.recv(x, 0)
                        c.send(x, 0)
                res[r].append((time.perf_counter() - t0) / iters * 1e6)
        row = {"bytes": n, "iters": iters, **{r: {"median_us": statistics.median(v), "min_us": min(v),
                                                   "max_us": max(v), "rounds_us": v} for r, v in res.items()}}
        out.append(row)
        if rank == 0:
            print(f"  {n:>9} B round trip: " + "  ".join(
                f"{r} {row[r]['median_us']:9.1f} ({row[r]['min_us']:.0f}-{row[r]['max_us']:.0f})" for r in rings)
                + " us", flush=True)
    for c in comms.values():
        c.close()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rings", default="256K,512K,1M,4M")
    ap.add_argument("--sizes", default="4K,1M,16M")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json")
    ap.add_argument("--rank-main", metavar="UID_FILE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rings = args.rings.split(",")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.rank_main:
        return rank_main(int(os.environ["RANK"]), args.rank_main, rings, sizes, args.rounds)
    path = os.path.join(tempfile.mkdtemp(prefix="kccl-p2p-bench-"), "uids")
    result = launch_local_ranks(__file__, 2, ["--rings", args.rings, "--sizes", args.sizes, "--rounds",
                                              str(args.rounds), "--rank-main", path])
    if args.json:
        write_json(args.json, {"command": " ".join(["python"] + sys.argv), "loadavg": os.getloadavg(),
                               "cpus": os.cpu_count(), "rows": result})


if __name__ == "__main__":
    main()
