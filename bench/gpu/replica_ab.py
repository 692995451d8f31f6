"""GPU flag replicas off vs on (KCCL_GPU_FLAG_REPLICAS), side by side in one run.

    mpiexec -n 8 --oversubscribe python bench/gpu/replica_ab.py [--sizes 8K,64K,1M] [--rounds 60] [--json F]

Two GPU communicators over the same ranks, both forced two-shot (KCCL_ALGO=twoshot:
the one-shot LL path has no separate flags, so replicas cannot change it): "off"
with one copy of every flag, "on" with a copy near each L2 partition, calibrated at
its init.  Whether "on" really uses them is asked of every rank and printed; when a
calibration refused them, "on" runs with one copy and the table is an A/A control.

Latency is a dependent chain of in-place bf16 averages (values stay bounded, so a
captured chain can be replayed forever) captured in CUDA graphs: per call =
(t(K) - t(K/4)) / (3K/4), so the graph launch and the ranks' start skew cancel
(as bench/allreduce_cuda.py does).  Rounds interleave the two communicators, the
order alternating, so a drifting machine slows both alike; a round's value is the
median of --reps replays, averaged over the ranks.  on/off is the median over
rounds of the per-round ratio, with a bootstrap 95 % interval over rounds
(benchlib.median_ci); "on faster" counts rounds with ratio < 1.  #wrong counts
elements of a separate, un-timed sum of small integers that differ from the
exact answer (both communicators, every size)."""
import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: benchlib
from benchlib import capture_graph, cuda_rank_device, fmt_size, median_ci, parse_size, sign_test_p  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8K,64K,1M", help="message sizes in bytes (bf16), comma-separated")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--reps", type=int, default=3, help="replays of each graph per round (median)")
    ap.add_argument("-K", type=int, default=64, help="calls per chain (a multiple of 4)")
    ap.add_argument("--json", help="write the table, the per-round values and the notes here")
    a = ap.parse_args()
    if a.K < 4 or a.K % 4 or a.rounds < 2 or a.reps < 1:
        ap.error("K: a multiple of 4 (>= 4); rounds >= 2; reps >= 1")
    sizes = [parse_size(s) for s in a.sizes.split(",")]

    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank, nranks = world.Get_rank(), world.Get_size()
    got = cuda_rank_device(world, "replica_ab.py")
    if got is None:
        return 2
    torch, dev, ndev = got
    import kccl
    per_gpu = sum(1 for r in range(nranks) if r % ndev == 0)

    comms = {}
    for name, rep in (("off", 0), ("on", 1)):
        comms[name] = kccl.Communicator.from_mpi(
            world, device=dev, config={"KCCL_ALGO": "twoshot", "KCCL_GPU_FLAG_REPLICAS": rep})
    states = world.gather({k: c.gpu_flag_replicas() for k, c in comms.items()}, root=0)

    tdt = torch.bfloat16
    es = 2
    K, Kq = a.K, a.K // 4
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed_us(fn):
        world.Barrier()
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) * 1e3

    rows, raw = [], {}
    for nbytes in sizes:
        count = max(1, nbytes // es)
        nbytes = count * es
        # correctness: small integers, exact in bf16, summed by each communicator
        i = torch.arange(count, device="cuda")
        want = sum(((i * 7 + r * 3) % 5 + 1) for r in range(nranks)).to(tdt)
        wrong = {}
        for name, c in comms.items():
            v = ((i * 7 + rank * 3) % 5 + 1).to(tdt)
            c.all_reduce(v)
            torch.cuda.synchronize()
            wrong[name] = int((v != want).sum())
        g = torch.Generator(device="cuda").manual_seed(1234 + rank)
        x = {name: (torch.rand(count, generator=g, device="cuda") + 1).to(tdt) for name in comms}

        def chain(name, k):
            c, buf = comms[name], x[name]
            return lambda: [c.all_reduce(buf, op=kccl.AVG) for _ in range(k)]

        graphs = {name: (capture_graph(chain(name, K)), capture_graph(chain(name, Kq))) for name in comms}
        for name in comms:  # warm: a few replays of each
            for _ in range(2):
                timed_us(graphs[name][0].replay)
                timed_us(graphs[name][1].replay)
        per = {name: [] for name in comms}
        for r in range(a.rounds):
            for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                gK, gq = graphs[name]
                tK, tq = [], []
                for _ in range(a.reps):
                    tK.append(timed_us(gK.replay))
                    tq.append(timed_us(gq.replay))
                per[name].append((statistics.median(tK) - statistics.median(tq)) / (3 * K / 4))
        del graphs
        allper = world.gather(per, root=0)
        wrongs = world.gather(wrong, root=0)
        if rank == 0:
            rounds = {name: [statistics.mean(p[name][r] for p in allper) for r in range(a.rounds)] for name in comms}
            ratio = [on / off for on, off in zip(rounds["on"], rounds["off"])]
            med, lo, hi = median_ci(ratio)
            k_faster = sum(1 for q in ratio if q < 1)
            w = {name: sum(wr[name] for wr in wrongs) for name in comms}
            rows.append(dict(bytes=nbytes, count=count, off_us=statistics.median(rounds["off"]),
                             on_us=statistics.median(rounds["on"]), ratio=med, ci95=[lo, hi],
                             on_faster_rounds=k_faster, rounds=a.rounds, sign_test_p=sign_test_p(k_faster, a.rounds),
                             wrong_off=w["off"], wrong_on=w["on"]))
            raw[fmt_size(nbytes)] = dict(off_us=rounds["off"], on_us=rounds["on"],
                                         per_rank={name: [p[name] for p in allper] for name in comms})

    for c in comms.values():
        c.close()
    if rank != 0:
        return 0

    on_states = [s["on"] for s in states]
    enabled = all(s["enabled"] for s in on_states)
    if enabled:
        verdict = "enabled on every rank"
    else:
        why = next(s["note"] for s in on_states if not s["enabled"])
        verdict = f"NOT IN USE, so this table is an A/A control: {why}"
    assert not any(s["off"]["requested"] for s in states)
    print(f"# KCCL {kccl.__version__} flag replicas off vs on: {nranks} ranks on {ndev} GPU(s) "
          f"({torch.cuda.get_device_name(dev)}), {per_gpu} rank(s) on GPU 0; two-shot all-reduce, bf16 avg, in place")
    print(f"# dependent chains in CUDA graphs, per call = (t(K) - t(K/4)) / (3K/4), K={K}; {a.rounds} interleaved "
          f"rounds (order alternates), median of {a.reps} replays each; us per call: mean over ranks, median over rounds")
    print(f"# flag replicas: {verdict}")
    for r, s in enumerate(on_states):
        print(f"#   rank {r}: {s['note']}")
    hdr = (f"{'size':>8} | {'off_us':>8} {'on_us':>8} | {'on/off':>6} {'95% CI':>13} | {'on faster':>9} "
           f"{'sign p':>6} | {'#wrong':>6}")
    print(hdr)
    print("#" + "-" * (len(hdr) - 1))
    for row in rows:
        ci = f"{row['ci95'][0]:.3f}-{row['ci95'][1]:.3f}"
        faster = f"{row['on_faster_rounds']}/{row['rounds']}"
        print(f"{fmt_size(row['bytes']):>8} | {row['off_us']:8.2f} {row['on_us']:8.2f} | {row['ratio']:6.3f} "
              f"{ci:>13} | {faster:>9} {row['sign_test_p']:6.3f} | {row['wrong_off'] + row['wrong_on']:>6}", flush=True)
    bad = sum(r["wrong_off"] + r["wrong_on"] for r in rows)
    print(f"# results checked: {bad} wrong {'OK' if bad == 0 else 'FAILED'}")
    if a.json:
        meta = dict(command=" ".join(["mpiexec", "-n", str(nranks), "python"] + sys.argv), nranks=nranks, gpus=ndev,
                    per_gpu=per_gpu, gpu=torch.cuda.get_device_name(dev), K=K, rounds=a.rounds, reps=a.reps,
                    replicas_enabled=enabled, verdict=verdict, notes=[s["note"] for s in on_states],
                    date=time.strftime("%Y-%m-%d %H:%M:%S"), host=platform.node())
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows, rounds=raw), f, indent=1)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
