"""All-reduce latency and bandwidth: KCCL against mpi4py's MPI.Allreduce, side by side.

    mpiexec -n 2 python bench/allreduce.py                  # 4 B .. 64 MB, float32 sum
    mpiexec -n 2 python bench/allreduce.py -b 4 -e 8K -f 2 -w 2000 -n 20000 --json out.json --plot out.png

Both libraries run on the same buffers in the same process, in alternating
rounds (KCCL, MPI, KCCL, MPI, ...), so a noisy machine slows both alike.  For
each size and library a rank takes the median over rounds of the mean time per
call; the table shows min/avg/max of those medians across ranks.  `c_us` is
KCCL timed by a loop inside C (kb_bench_all_reduce in bench/native): the difference to `kccl_us`
is the cost of the Python call.  #wrong counts result elements that differ from
the exactly known answer, KCCL / MPI: 0/0 means both were right everywhere.

--json writes every row and the run's settings; --plot draws latency against size
(both libraries) above the MPI/KCCL ratio, with the one-shot/two-shot crossover marked.
This machine is noisy: compare several runs with bench/ratio_range.py."""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

try:
    from mpi4py import MPI
except ImportError:  # pragma: no cover
    sys.exit("bench/allreduce.py needs mpi4py: python -m pip install -e '.[dev]'")

import kccl
from kccl.capi import DTYPE_NAMES as NAMES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when this file is loaded by path
from benchlib import fmt_size, parse_size  # noqa: E402

OPS = {"sum": kccl.SUM, "prod": kccl.PROD, "max": kccl.MAX, "min": kccl.MIN, "avg": kccl.AVG}
MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}


def numpy_dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def make_inputs(count, dtype, op, rank, nranks):
    """Small integers, so every op's exact answer is known and representable."""
    i = np.arange(count, dtype=np.int64)
    if op == "prod":
        every = np.stack([np.where((i + r) % 3 == 0, 2, 1) for r in range(nranks)])
    else:
        every = np.stack([(i * 7 + r * 3) % 5 + 1 for r in range(nranks)])
    every = every.astype(np.float64)
    expect = {"sum": every.sum(0), "prod": every.prod(0), "max": every.max(0), "min": every.min(0),
              "avg": every.sum(0) / nranks}[op]
    if np.dtype(dtype).kind in "iu" and op == "avg":
        expect = np.trunc(expect)
    return every[rank].astype(dtype), expect.astype(dtype)


def time_calls(fn, iters):
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        fn()
    return (time.perf_counter_ns() - t0) / iters / 1e3


def memcpy_bandwidth(nbytes=64 << 20, reps=5):
    """GB/s of one process copying nbytes (read + write counted once, as algbw)."""
    a = np.ones(nbytes, np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    best = min(time_calls(lambda: np.copyto(b, a), 1) for _ in range(reps))
    return nbytes / best / 1e3


def sizes_between(lo, hi, es, factor):
    sizes, s = [], max(lo, es)
    while s <= hi:
        sizes.append(s - s % es)
        s *= factor
        if factor < 2:
            break
    return sizes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-b", "--minbytes", default="4", help="smallest message (bytes, K/M suffix)")
    ap.add_argument("-e", "--maxbytes", default="64M", help="largest message")
    ap.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier between rows")
    ap.add_argument("-w", "--warmup", type=int, default=1000, help="warm-up calls per size and library")
    ap.add_argument("-n", "--iters", type=int, default=5000, help="calls per timed round (small messages)")
    ap.add_argument("-r", "--rounds", type=int, default=5, help="alternating rounds per size (median taken)")
    ap.add_argument("--round-ms", type=float, default=40.0, help="cap on a round's duration; fewer calls for large sizes")
    ap.add_argument("-d", "--dtype", default="float32", choices=list(NAMES.values()))
    ap.add_argument("-o", "--op", default="sum", choices=list(OPS))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cpu: host buffers vs MPI; cuda: GPU buffers (torch), eager and CUDA graph (bench/allreduce_cuda.py)")
    ap.add_argument("--compare", default=None, choices=["nccl"], help="--device cuda: also time NCCL (one GPU per rank)")
    ap.add_argument("--no-mpi", action="store_true", help="time KCCL only")
    ap.add_argument("--json", metavar="FILE", help="write every row and the run's metadata as JSON")
    ap.add_argument("--plot", metavar="FILE.png", help="latency vs size, both libraries, log-log")
    args = ap.parse_args(argv)

    world = MPI.COMM_WORLD
    rank, nranks = world.Get_rank(), world.Get_size()
    lo, hi = parse_size(args.minbytes), parse_size(args.maxbytes)
    dtype = numpy_dtype(args.dtype)
    es = dtype.itemsize
    if args.device == "cuda":
        if args.dtype not in ("float32", "float16", "bfloat16") or args.op != "sum":
            if rank == 0:
                print("error: --device cuda times float32/float16/bfloat16 sums", file=sys.stderr)
            return 2
        from allreduce_cuda import main as cuda_main
        return cuda_main(args, sizes_between(lo, hi, es, args.stepfactor))
    use_mpi = not args.no_mpi and args.op in MPI_OPS and args.dtype not in ("float16", "bfloat16")
    import kccl_bench as kbench
    comm = kccl.Communicator.from_mpi(world)
    op = OPS[args.op]
    mop = MPI_OPS.get(args.op)

    sizes = sizes_between(lo, hi, es, args.stepfactor)

    if rank == 0:
        print(f"# KCCL {kccl.__version__} all_reduce vs MPI Allreduce ({MPI.Get_library_version().splitlines()[0].strip()})")
        print(f"# {nranks} ranks on {os.cpu_count()} CPUs, {args.dtype} {args.op}, warmup {args.warmup}, "
              f"iters <= {args.iters} x {args.rounds} alternating rounds (<= {args.round_ms:g} ms each)")
        print("# times in us per call: median over rounds, then min/avg/max over ranks; ratio = MPI avg / KCCL avg")
        print("# #wrong K/M: result elements that differ from the exact answer, KCCL / MPI (0/0 = all correct)")
        hdr = (f"{'size':>8} {'count':>10} {'type':>8} | {'kccl_min':>8} {'kccl_avg':>8} {'kccl_max':>8} "
               f"{'c_us':>7} | {'mpi_min':>8} {'mpi_avg':>8} {'mpi_max':>8} | {'mpi/kccl':>8} "
               f"{'algbw':>7} {'busbw':>7} | {'#wrong':>9}")
        print(hdr)
        print("#" + "-" * (len(hdr) - 1))
    rows = []
    for nbytes in sizes:
        count = nbytes // es
        send, expect = make_inputs(count, dtype, args.op, rank, nranks)
        recv = np.zeros_like(send)
        mrecv = np.zeros_like(send)
        kfn = lambda: comm.all_reduce(send, recv, op)  # noqa: E731
        mfn = (lambda: world.Allreduce(send, mrecv, op=mop)) if use_mpi else None  # noqa: E731

        # Warm up, and size the rounds so large messages stay within --round-ms.
        world.Barrier()
        t_one = time_calls(kfn, max(1, min(args.warmup, 3)))
        t_one = world.allreduce(t_one, op=MPI.MAX)  # every rank must make the same number of calls
        warm = int(max(1, min(args.warmup, 200e3 / max(t_one, 1e-3))))
        time_calls(kfn, warm)
        if mfn:
            time_calls(mfn, warm)
        iters = int(max(3, min(args.iters, args.round_ms * 1e3 / max(t_one, 1e-3))))

        wrong_k = int(np.count_nonzero(recv != expect))
        wrong_m = int(np.count_nonzero(mrecv != expect)) if mfn else 0
        kt, mt = [], []
        for _ in range(args.rounds):
            world.Barrier()
            kt.append(time_calls(kfn, iters))
            if mfn:
                world.Barrier()
                mt.append(time_calls(mfn, iters))
        world.Barrier()
        c_us = kbench.bench_all_reduce(comm, send, recv, op, iters=iters)
        wrong_k += int(np.count_nonzero(recv != expect))
        k_med = statistics.median(kt)
        m_med = statistics.median(mt) if mt else float("nan")
        ks = world.gather(k_med, root=0)
        ms = world.gather(m_med, root=0)
        cs = world.gather(c_us, root=0)
        wk = world.reduce(wrong_k, op=MPI.SUM, root=0)
        wm = world.reduce(wrong_m, op=MPI.SUM, root=0)
        if rank == 0:
            kavg, mavg, cavg = sum(ks) / nranks, sum(ms) / nranks, sum(cs) / nranks
            algbw = nbytes / kavg / 1e3 if kavg > 0 else 0.0  # GB/s
            busbw = algbw * 2 * (nranks - 1) / nranks
            ratio = mavg / kavg if mfn else float("nan")
            row = dict(bytes=nbytes, count=count, dtype=args.dtype, op=args.op, nranks=nranks, iters=iters,
                       kccl_us_min=min(ks), kccl_us_avg=kavg, kccl_us_max=max(ks), c_us=cavg,
                       mpi_us_min=min(ms) if mfn else None, mpi_us_avg=mavg if mfn else None,
                       mpi_us_max=max(ms) if mfn else None, ratio=ratio if mfn else None,
                       algbw_GBps=algbw, busbw_GBps=busbw, wrong_kccl=wk, wrong_mpi=wm)
            rows.append(row)
            mcol = (f"{min(ms):8.2f} {mavg:8.2f} {max(ms):8.2f} | {ratio:8.2f}" if mfn
                    else f"{'-':>8} {'-':>8} {'-':>8} | {'-':>8}")
            print(f"{fmt_size(nbytes):>8} {count:>10} {args.dtype:>8} | {min(ks):8.2f} {kavg:8.2f} {max(ks):8.2f} "
                  f"{cavg:7.2f} | {mcol} {algbw:7.2f} {busbw:7.2f} | {wk:>4}/{wm:<4}", flush=True)
    comm.close()
    # Measured last: its 128 MB of copying on one rank would disturb the first rows.
    bw_copy = memcpy_bandwidth() if rank == 0 else None
    if rank == 0:
        print(f"# memcpy bandwidth, one process, 64 MB: {bw_copy:.1f} GB/s (algbw of 1 MB+ rows compares to this)")
        bad = sum(r["wrong_kccl"] + r["wrong_mpi"] for r in rows)
        print(f"# out of bounds values : {bad} {'OK' if bad == 0 else 'FAILED'}")
        meta = dict(command=" ".join(["mpiexec", "-n", str(nranks), "python"] + sys.argv), nranks=nranks,
                    cpus=os.cpu_count(), machine=platform.machine(), processor=platform.processor(),
                    mpi=MPI.Get_library_version().splitlines()[0].strip(), kccl=kccl.__version__,
                    memcpy_GBps=bw_copy, date=time.strftime("%Y-%m-%d %H:%M:%S"),
                    settings={k: v for k, (v, _s) in kccl.config.resolve().items()})
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(meta=meta, rows=rows), f, indent=1)
            print(f"wrote {args.json}")
        if args.plot:
            plot(rows, meta, args.plot)
            print(f"wrote {args.plot}")
        return 0 if bad == 0 else 1
    return 0


def size_label(n):
    """4 -> "4 B", 1024 -> "1 KB", 3 << 20 -> "3 MB" (binary units)."""
    for unit, div in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:g} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:g} B"


def size_ticks(lo, hi):
    """Powers of two from lo to hi: all of them over a narrow range; over a wide one 1, 4
    and 64 of each unit (4 B, 64 B, 1 KB, 4 KB, 64 KB, 1 MB, ...) and the largest, so that
    the labels stay readable and every unit boundary is marked."""
    ticks, t = [], 1
    while t < lo:
        t *= 2
    while t <= hi:
        ticks.append(t)
        t *= 2
    if len(ticks) > 9:
        last = ticks[-1]
        ticks = [x for x in ticks if (x.bit_length() - 1) % 10 in (0, 2, 6)]
        if last >= 4 * ticks[-1]:  # the largest size too, when it has room
            ticks.append(last)
    return ticks


def crossover(meta):
    """(bytes, text): the largest one-shot all-reduce under KCCL_ALGO=auto, else (None, why)."""
    settings = meta.get("settings", {})
    algo = settings.get("KCCL_ALGO", "auto")
    if algo != "auto":
        return None, f"KCCL_ALGO={algo}: every size {algo}"
    n = settings.get("KCCL_ONESHOT_MAX_BYTES", 16384)
    return n, f"one-shot up to {size_label(n)}, two-shot above"


def plot(rows, meta, path):
    """Two panels sharing the size axis: latency per call (log-log) and MPI/KCCL; the
    one-shot/two-shot crossover as a dashed line.  Returns the figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    x = [r["bytes"] for r in rows]
    has_mpi = bool(rows) and rows[0]["mpi_us_avg"] is not None
    fig, (ax, rax) = plt.subplots(2, 1, figsize=(7.5, 6.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax.loglog(x, [r["kccl_us_avg"] for r in rows], "o-", label="KCCL (Python call)")
    ax.loglog(x, [r["c_us"] for r in rows], "s--", label="KCCL (loop in C)")
    if has_mpi:
        ax.loglog(x, [r["mpi_us_avg"] for r in rows], "^-", label="mpi4py MPI.Allreduce")
        rax.semilogx(x, [r["ratio"] for r in rows], "o-", color="tab:green", label="MPI / KCCL")
        rax.axhline(1.0, color="grey", lw=0.8)
    else:
        rax.text(0.5, 0.5, "no MPI run (--no-mpi or an op/type MPI lacks)", transform=rax.transAxes,
                 ha="center", va="center")
    rax.set_xscale("log", base=2)
    cross, cross_text = crossover(meta)
    for a in (ax, rax):
        if cross is not None and x and min(x) <= cross < max(x):
            a.axvline(cross * 2 ** 0.5, color="tab:red", ls=":", lw=1.2,
                      label=cross_text if a is ax else None)
        a.grid(True, which="major", alpha=0.3)
    if x:
        rax.xaxis.set_major_locator(FixedLocator(size_ticks(min(x), max(x))))
    rax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: size_label(int(round(v)))))
    rax.xaxis.set_minor_locator(NullLocator())
    rax.set_xlabel("message size")
    rax.set_ylabel("MPI / KCCL (x)")
    ax.set_ylabel("latency per call (us)")
    title = f"all_reduce, {meta['nranks']} ranks, {rows[0]['dtype']} {rows[0]['op']}" if rows else "all_reduce"
    if cross is None:
        title += f" ({cross_text})"
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


if __name__ == "__main__":
    sys.exit(main())
