"""Batch-1 decode throughput of the KIE engine: TP = 1, 2, 4 lanes (4 oversubscribes a
2-core machine) x DTP delay 0 / 1, on a model whose float32 weights are far above the
L3 cache, side by side in one run (rounds interleave the configurations; medians).

Also measured in the same run: this machine's memory bandwidth, as the best of one
process and of one process per core streaming a large float32 matrix through BLAS
matrix-vector products (what decode does; both kernels, a @ x and y @ a, the faster
counts); each decode row reports the weight bytes
streamed per token and bytes/time as a fraction of that bandwidth.

BLAS threads are pinned to 1 per rank (OPENBLAS_NUM_THREADS = OMP_NUM_THREADS = 1),
so TP = N uses N threads; one extra row runs TP = 1 with one BLAS thread per core.

    python bench/decode.py                       # makes /tmp/kie-bench-small (preset small) if missing
    python bench/decode.py --model DIR --tokens 32 --rounds 3 --out bench/results/decode.txt
    python bench/decode.py --model smollm2 --lanes 1,3 --delays 0   # a GGUF file or short name works too
"""
import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _pin_blas(threads):
    for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[v] = str(threads)


# -- workers (spawned: BLAS reads its thread count at import) -----------------------------------

def _bw_worker(nbytes, barrier, reps, q):
    """Times both BLAS matrix-vector kernels over one matrix: a @ x (row-major, the
    dot-product kernel) and y @ a (the axpy kernel, what the engine uses)."""
    import numpy as np
    rows = 4096
    a = np.random.default_rng(0).standard_normal((rows, nbytes // 4 // rows), dtype=np.float32)
    x, y = np.ones(a.shape[1], np.float32), np.ones(rows, np.float32)
    a @ x, y @ a  # warm (pages in)
    times = {"a@x": [], "y@a": []}
    for _ in range(reps):
        for kind in times:
            barrier.wait()
            t = time.perf_counter()
            if kind == "a@x":
                a @ x
            else:
                y @ a
            times[kind].append(time.perf_counter() - t)
    q.put((a.nbytes, times))


class _Timed:
    """Wraps a model's lanes to add up the time spent inside sums (blocking sum, or
    wait() of a started one): communication plus waiting for the slower lane."""

    def __init__(self, lanes):
        self.lanes, self.size, self.seconds = lanes, lanes.size, 0.0

    def sum(self, y):
        t = time.perf_counter()
        out = self.lanes.sum(y)
        self.seconds += time.perf_counter() - t
        return out

    def sum_start(self, y):
        h, outer = self.lanes.sum_start(y), self

        class _H:
            def wait(self):
                t = time.perf_counter()
                out = h.wait()
                outer.seconds += time.perf_counter() - t
                return out
        return _H()

    def vocab(self, logits):
        return self.lanes.vocab(logits)


def _decode_worker(model_dir, delay, uid, nranks, rank, tokens, q):
    import numpy as np
    import kccl
    from kie_engine.formats.sources import open_checkpoint
    from kie_engine.lanes.plan import comm_config
    from kie_engine.reference.sharded import load_model
    ckpt = open_checkpoint(model_dir, dtp_delay=delay)
    comm = kccl.Communicator(nranks, kccl.UniqueId(uid), rank, config=comm_config(ckpt.config)) if nranks > 1 else None
    try:
        model = load_model(ckpt, comm, max_seq=256)
        model.lanes = timed = _Timed(model.lanes)
        model.prefill([256, 100, 101, 102])
        tok = 65
        for _ in range(3):  # warm-up steps
            tok = int(np.argmax(model.decode_step(tok)))
        if comm:
            comm.barrier()
        timed.seconds = 0.0
        times = []
        for _ in range(tokens):
            t = time.perf_counter()
            tok = int(np.argmax(model.decode_step(tok)))
            times.append(time.perf_counter() - t)
        if rank == 0:
            q.put((model.w.nbytes_per_token, times, timed.seconds / tokens))
    finally:
        if comm:
            comm.close()


def _paired_worker(model_dir, delays, uid, nranks, rank, tokens, rounds, q):
    """One set of processes and one model; the delay is switched between runs (same
    weights, same memory placement, same communicator), rounds alternating the order."""
    import numpy as np
    import kccl
    from kie_engine.formats.sources import open_checkpoint
    from kie_engine.lanes.plan import comm_config
    from kie_engine.reference.sharded import load_model
    ckpt = open_checkpoint(model_dir, dtp_delay=max(delays))
    comm = kccl.Communicator(nranks, kccl.UniqueId(uid), rank, config=comm_config(ckpt.config)) if nranks > 1 else None
    try:
        model = load_model(ckpt, comm, max_seq=256)
        out = {d: [] for d in delays}
        for rnd in range(rounds):
            for d in (delays if rnd % 2 == 0 else delays[::-1]):
                model.cfg = ckpt.config.replace(dtp_delay=d)
                model.reset()
                model.prefill([256, 100, 101, 102])
                tok = 65
                for _ in range(3):
                    tok = int(np.argmax(model.decode_step(tok)))
                if comm:
                    comm.barrier()
                times = []
                for _ in range(tokens):
                    t = time.perf_counter()
                    tok = int(np.argmax(model.decode_step(tok)))
                    times.append(time.perf_counter() - t)
                out[d].append(statistics.median(times))
        if rank == 0:
            q.put(out)
    finally:
        if comm:
            comm.close()


def paired(model_dir, nranks, delays, tokens, rounds):
    import kccl
    uid = bytes(kccl.get_unique_id())
    return _run(_paired_worker, [(model_dir, delays, uid, nranks, r, tokens, rounds) for r in range(nranks)], 1)[0]


def _run(target, args_per_proc, blas_threads, timeout=900):
    _pin_blas(blas_threads)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=a + (q,)) for a in args_per_proc]
    for p in procs:
        p.start()
    try:
        out = [q.get(timeout=timeout) for _ in range(len(procs) if target is _bw_worker else 1)]
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return out


def bandwidth(nprocs, total_bytes, reps=7):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(nprocs)
    out = _run(_bw_worker, [(total_bytes // nprocs, barrier, reps)] * nprocs, 1)
    total = sum(n for n, _ in out)
    best = 0.0
    for kind in out[0][1]:
        per_rep = [max(t[kind][i] for _, t in out) for i in range(reps)]  # all processes done
        best = max(best, total / min(per_rep))  # the best repetition of the better kernel
    return best


def decode(model_dir, nranks, delay, tokens, blas_threads=1):
    import kccl
    uid = bytes(kccl.get_unique_id())
    ((nbytes, times, in_sums),) = _run(_decode_worker, [(model_dir, delay, uid, nranks, r, tokens) for r in range(nranks)],
                              blas_threads)
    return nbytes, statistics.median(times), in_sums


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/kie-bench-small")
    ap.add_argument("--tokens", type=int, default=32, help="timed decode steps per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lanes", default="1,2,4")
    ap.add_argument("--delays", default="0,1")
    ap.add_argument("--bw-bytes", type=int, default=512 << 20)
    ap.add_argument("--out", help="also write the table here")
    ap.add_argument("--paired", action="store_true",
                    help="only compare the delays, each TP size in one set of processes that switches the delay")
    a = ap.parse_args()
    from kie_engine.formats.sources import SHORT_NAMES, open_checkpoint
    if not os.path.exists(a.model) and a.model not in SHORT_NAMES:
        from kie_engine.formats.config import preset
        from kie_engine.formats.init import write_checkpoint
        write_checkpoint(preset("small"), a.model, seed=0)
    ncores = len(os.sched_getaffinity(0))
    if a.paired:
        delays = [int(d) for d in a.delays.split(",")]
        lines = [f"# bench/decode.py --paired: {a.model}, BLAS threads 1 per rank, {a.tokens} timed tokens x "
                 f"{a.rounds} rounds per delay, one set of processes per TP size; ms/token (median of rounds)",
                 "| TP | " + " | ".join(f"delay {d}" for d in delays) + " | delay 0 / delay d, per round (median) |",
                 "|---:|" + "---:|" * (len(delays) + 1)]
        for n in map(int, a.lanes.split(",")):
            out = paired(a.model, n, delays, a.tokens, a.rounds)
            cells = [f"{1e3 * statistics.median(out[d]):.2f}" for d in delays]
            ratios = ", ".join(f"d{d}: {statistics.median(x / y for x, y in zip(out[delays[0]], out[d])):.3f}"
                               for d in delays[1:])
            lines.append(f"| {n} | " + " | ".join(cells) + f" | {ratios} |")
            lines.append("# raw ms/token per round, TP=%d: " % n + "; ".join(
                f"d{d}: " + ",".join(f"{1e3 * x:.1f}" for x in out[d]) for d in delays))
        text = "\n".join(lines)
        print(text)
        if a.out:
            with open(a.out, "w") as f:
                f.write(f"$ {' '.join(sys.argv)}\n{text}\n")
        return
    configs = [(n, d, 1) for n in map(int, a.lanes.split(",")) for d in map(int, a.delays.split(","))]
    if ncores > 1:
        configs.append((1, 0, ncores))
    bw = {1: [], ncores: []}
    res = {c: [] for c in configs}
    for rnd in range(a.rounds):
        for n in bw:
            bw[n].append(bandwidth(n, a.bw_bytes))
        # odd rounds run the rows in reverse, so no row always follows the same neighbour
        for c in (configs if rnd % 2 == 0 else configs[::-1]):
            nbytes, t, in_sums = decode(a.model, c[0], c[1], a.tokens, c[2])
            res[c].append((nbytes, t, in_sums))
            print(f"round {rnd}: TP={c[0]} delay={c[1]} blas={c[2]}: {1e3 * t:.2f} ms/token", file=sys.stderr, flush=True)
    bw_med = {n: statistics.median(v) for n, v in bw.items()}
    machine = max(bw_med.values())
    cfg = open_checkpoint(a.model).config
    lines = [f"# bench/decode.py: {a.model} ({cfg.n_params / 1e6:.1f} M parameters, float32 compute), batch 1, "
             f"{a.tokens} timed tokens x {a.rounds} rounds, medians; {ncores} cores",
             f"# memory bandwidth (BLAS matvec over {a.bw_bytes >> 20} MiB, best of 2 kernels x 7 per round): 1 process {bw_med[1] / 1e9:.1f} GB/s"
             + (f", {ncores} processes {bw_med[ncores] / 1e9:.1f} GB/s" if ncores > 1 else "")
             + f" -> machine {machine / 1e9:.1f} GB/s",
             "| TP | DTP delay | BLAS threads/rank | ms/token | tokens/s | vs TP=1 d=0 | weight MB/token/rank | "
             "weight MB/token (all) | GB/s | of machine BW | ms/token in sums (rank 0) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = statistics.median(r[1] for r in res[(1, 0, 1)]) if (1, 0, 1) in res else None
    for c in configs:
        t = statistics.median(r[1] for r in res[c])
        in_sums = statistics.median(r[2] for r in res[c])
        per_rank = res[c][0][0]
        total = per_rank * c[0] if c[0] > 1 else per_rank
        gbs = total / t / 1e9
        rel = f"{base / t:.2f}x" if base else "-"
        lines.append(f"| {c[0]} | {c[1]} | {c[2]} | {1e3 * t:.2f} | {1 / t:.2f} | {rel} | {per_rank / 1e6:.0f} | "
                     f"{total / 1e6:.0f} | {gbs:.1f} | {100 * gbs * 1e9 / machine:.0f} % | {1e3 * in_sums:.2f} |")
    pairs = [(c, (c[0], 0, c[2])) for c in configs if c[1] > 0 and (c[0], 0, c[2]) in res]
    if pairs:  # paired per round: delay d vs delay 0 measured minutes apart in the same round
        lines.append("# DTP paired per round (delay 0 time / delay d time; > 1: delay d faster): " + "; ".join(
            f"TP={c[0]} d={c[1]}: median {statistics.median(z[1] / x[1] for x, z in zip(res[c], res[c0])):.3f} ("
            + ",".join(f"{z[1] / x[1]:.2f}" for x, z in zip(res[c], res[c0])) + ")" for c, c0 in pairs))
    lines.append("# raw ms/token per round: " + "; ".join(
        f"TP={c[0]} d={c[1]} b={c[2]}: " + ",".join(f"{1e3 * r[1]:.1f}" for r in res[c]) for c in configs))
    lines.append("# raw GB/s per round: " + "; ".join(
        f"{n} proc: " + ",".join(f"{x / 1e9:.1f}" for x in v) for n, v in bw.items()))
    text = "\n".join(lines)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(f"$ {' '.join(sys.argv)}\n{text}\n")


if __name__ == "__main__":
    main()
