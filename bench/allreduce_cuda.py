"""GPU all-reduce latency and bandwidth (bench/allreduce.py --device cuda).

    mpiexec -n 8 --oversubscribe python bench/allreduce.py --device cuda -d bfloat16 -b 4 -e 64M
    mpiexec -n 8 python bench/allreduce.py --device cuda --compare nccl      # one GPU per rank

Latency is a dependent chain: every call reduces, in place, the result of the
previous one on the same stream, so calls cannot overlap.  Inputs start near
the smallest normal number (2^-125) so a chain of sums never overflows.
- eager: K calls from Python, CUDA events around them, per call = time / K;
- graph: K calls captured into one CUDA graph; per call = (t(K) - t(K/4)) / (3K/4),
  medians of many replays, so the graph launch and the ranks' start skew cancel.
- copy: the same chain and method with a device-to-device copy of the same size,
  the cost of merely touching the bytes once.
#wrong counts elements that differ from the exactly known answer (a separate,
un-timed call on small integers).  hbm_GBps: the memory traffic the algorithm
needs on one GPU per second, summed over the ranks sharing that GPU, to compare
with the copy bandwidth printed at the end.  Two-shot moves (5 - 2 / n) x size
per rank of n: its peers' segments into scratch (read + write, (n - 1) / n),
the reduction of its segment (read 1, write 2 / n: scratch and user buffer),
and the other segments from their owners (read + write, (n - 1) / n); a rank's
own segment is read from its send buffer, not copied (until session 11: 5 x).
With --compare nccl (one GPU per rank only: NCCL refuses several ranks per GPU)
torch.distributed's NCCL all-reduce runs on the same buffers in the same run."""
import json
import math
import os
import platform
import statistics
import sys
import time

from benchlib import capture_graph, cuda_rank_device, fmt_size  # bench/ is on sys.path: allreduce.py imports this module from main()


def main(args, sizes):
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    got = cuda_rank_device(world, "--device cuda")
    if got is None:
        return 2
    torch, dev, ndev = got

    import kccl
    import kccl_bench as kbench

    rank, nranks = world.Get_rank(), world.Get_size()
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    per_gpu = local.allreduce(1 if dev == 0 else 0, op=MPI.SUM)  # ranks sharing GPU 0
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    es = torch.tensor([], dtype=tdt).element_size()
    comm = kccl.Communicator.from_mpi(world, device=dev)
    nccl = None
    if args.compare == "nccl":
        if per_gpu > 1:
            if rank == 0:
                print(f"# --compare nccl skipped: {per_gpu} ranks share a GPU, which NCCL refuses")
        else:
            import torch.distributed as dist
            port = world.bcast(29500 + os.getpid() % 1000 if rank == 0 else None, root=0)
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nranks,
                                    device_id=torch.device("cuda", dev))
            nccl = dist
    # K: calls per chain; each sum multiplies magnitudes by at most nranks.
    bits = max(1, math.ceil(math.log2(max(2, nranks))))
    K = 64 if args.dtype != "float16" else 8
    K = max(4, min(K, (120 if args.dtype != "float16" else 24) // bits) // 4 * 4)
    start_scale = 2.0 ** -125 if args.dtype != "float16" else 2.0 ** -13

    def chain_input(count):
        g = torch.Generator(device="cuda").manual_seed(1234 + rank)
        return ((torch.rand(count, generator=g, device="cuda") + 1) * start_scale).to(tdt)

    def timed(fn, reps):
        ts = []
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(reps):
            pre()
            world.Barrier()
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e3)
        return statistics.median(ts)

    rows = []
    if rank == 0:
        print(f"# KCCL {kccl.__version__} GPU all_reduce, {nranks} ranks on {ndev} GPU(s) "
              f"({torch.cuda.get_device_name(dev)}), {per_gpu} rank(s) per GPU, {args.dtype} sum")
        print(f"# dependent chains of K={K} in-place calls; eager: per call = t/K; graph and copy: "
              f"(t(K) - t(K/4)) / (3K/4); medians of {args.rounds} rounds; us per call, avg over ranks")
        hdr = (f"{'size':>8} {'count':>10} | {'eager':>8} {'graph':>8} {'copy':>7} {'graph/copy':>10} | "
               f"{'nccl_eager':>10} {'nccl_graph':>10} {'nccl/kccl':>9} | {'algbw':>7} {'busbw':>7} {'hbm_GBps':>8}"
               f" | {'#wrong':>6}")
        print(hdr)
        print("#" + "-" * (len(hdr) - 1))
    for nbytes in sizes:
        count = max(1, nbytes // es)
        nbytes = count * es
        x0 = chain_input(count)
        x = x0.clone()
        y = torch.empty_like(x)

        def pre():
            x.copy_(x0)

        # correctness on exactly representable small integers, un-timed
        i = torch.arange(count, device="cuda")
        v = ((i * 7 + rank * 3) % 5 + 1).to(tdt)
        want = sum(((i * 7 + r * 3) % 5 + 1) for r in range(nranks)).to(tdt)
        comm.all_reduce(v)
        torch.cuda.synchronize()
        wrong = int((v != want).sum())

        def kchain(k):
            return lambda: [comm.all_reduce(x) for _ in range(k)]

        def cchain(k):
            def f():
                for _ in range(k // 2):
                    y.copy_(x)
                    x.copy_(y)
            return f

        def graph_of(fn):
            return capture_graph(fn, pre)

        big = nbytes >= (8 << 20)
        reps = max(5, args.rounds // (8 if big else 1))
        # eager
        timed(kchain(K), 3)
        eager = timed(kchain(K), reps) / K
        # graph
        gK, gq = graph_of(kchain(K)), graph_of(kchain(K // 4))
        timed(gK.replay, 3)
        graph = (timed(gK.replay, reps) - timed(gq.replay, reps)) / (3 * K / 4)
        cK, cq = graph_of(cchain(K)), graph_of(cchain(K // 4))
        copy = (timed(cK.replay, reps) - timed(cq.replay, reps)) / (3 * K / 4)
        ne = ng = float("nan")
        if nccl is not None:
            nchain = lambda k: (lambda: [nccl.all_reduce(x) for _ in range(k)])  # noqa: E731
            timed(nchain(K), 3)
            ne = timed(nchain(K), reps) / K
            nK, nq = graph_of(nchain(K)), graph_of(nchain(K // 4))
            ng = (timed(nK.replay, reps) - timed(nq.replay, reps)) / (3 * K / 4)
        del gK, gq, cK, cq
        vals = world.gather((eager, graph, copy, ne, ng, wrong), root=0)
        if rank == 0:
            e, g, c, a, b = (statistics.mean(v[j] for v in vals) for j in range(5))
            w = sum(v[5] for v in vals)
            algbw = nbytes / g / 1e3 if g > 0 else float("nan")
            busbw = algbw * 2 * (nranks - 1) / nranks
            hbm = (5 - 2 / nranks) * nbytes * per_gpu / g / 1e3 if g > 0 else float("nan")
            row = dict(bytes=nbytes, count=count, dtype=args.dtype, nranks=nranks, per_gpu=per_gpu, K=K,
                       eager_us=e, graph_us=g, copy_us=c, nccl_eager_us=None if math.isnan(a) else a,
                       nccl_graph_us=None if math.isnan(b) else b, algbw_GBps=algbw, busbw_GBps=busbw,
                       hbm_GBps=hbm, wrong=w)
            rows.append(row)
            ratio = b / g if not math.isnan(b) else float("nan")
            print(f"{fmt_size(nbytes):>8} {count:>10} | {e:8.2f} {g:8.2f} {c:7.2f} {g / c if c > 0 else 0:10.2f} | "
                  f"{a:10.2f} {b:10.2f} {ratio:9.2f} | {algbw:7.1f} {busbw:7.1f} {hbm:8.0f} | {w:>6}", flush=True)
    # Floors and the device-side API, measured after the table.
    hops = [kbench.bench_flag_hop(comm, 20000, mode) if nranks >= 2 else 0.0 for mode in range(4)]
    dev_rows = []
    for nb in (4096, 8192, 16384):
        cnt = nb // es
        buf = chain_input(cnt) * 0 + 1
        world.Barrier()
        kbench.bench_device_all_reduce(comm, buf, iters=200, blocks=max(1, nb // 8192))
        for blocks in (1, 2, 4, 8):
            if nb // blocks > 8192 or nb // blocks < 512:  # the device API's per-block limit; tiny slices
                continue
            world.Barrier()
            us = kbench.bench_device_all_reduce(comm, buf, iters=4000, blocks=blocks)
            dev_rows.append((nb, blocks, world.allreduce(us, op=MPI.SUM) / nranks))
    # Where the 8 KB device-API call's time goes (block 0 of every rank, averaged).
    buf = chain_input(8192 // es) * 0 + 1
    world.Barrier()
    ph = kbench.bench_device_all_reduce_phases(comm, buf, iters=4000, blocks=4)
    phases = {k: world.allreduce(v, op=MPI.SUM) / nranks for k, v in ph.items()}
    # Copy bandwidth of this GPU: 1 GB device-to-device, bytes read + written; rank 0
    # alone (the number hbm_GBps compares to), then every rank at once.
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def copy_bw(active):
        ts = []
        for _ in range(5):
            world.Barrier()
            if active:
                e0.record()
                b.copy_(a)
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1) / 1e3)
        return 2 * a.numel() / min(ts) / 1e9 if ts else 0.0
    bw_alone = copy_bw(rank == 0)
    bws = world.gather(copy_bw(True), root=0)
    comm.close()
    if rank == 0:
        print("# flag hop between ranks 0 and 1 through device memory, us one way: "
              f"release/acquire.sys push {hops[0]:.3f}, volatile push {hops[1]:.3f}, relaxed.gpu push "
              f"{hops[2]:.3f}, volatile pull {hops[3]:.3f}")
        for nb, blocks, us in dev_rows:
            print(f"# device API (persistent kernel, dependent chain): {fmt_size(nb)} {args.dtype}, {blocks} "
                  f"block(s): {us:.2f} us per all-reduce")
        print(f"# device API 8K, 4 blocks, block 0's phases, us per call: entry->pushed {phases['pushed']:.2f}, "
              f"->received {phases['received']:.2f}, ->end {phases['end']:.2f}; "
              f"{phases['poll_rounds']:.1f} poll rounds per call")
        print(f"# copy bandwidth, 1 GB device-to-device (read + write): rank 0 alone {bw_alone:.0f} GB/s; all "
              f"ranks at once {sum(bws):.0f} GB/s summed ({min(bws):.0f}-{max(bws):.0f} each)")
        big_rows = [r for r in rows if r["bytes"] >= (64 << 20)]
        for r in big_rows:
            print(f"# {fmt_size(r['bytes'])}: two-shot moves {r['hbm_GBps']:.0f} GB/s of the traffic it needs = "
                  f"{100 * r['hbm_GBps'] / bw_alone:.0f} % of the copy bandwidth (ranks per GPU: {per_gpu})")
        bad = sum(r["wrong"] for r in rows)
        print(f"# out of bounds values : {bad} {'OK' if bad == 0 else 'FAILED'}")
        meta = dict(command=" ".join(["mpiexec", "-n", str(nranks), "python"] + sys.argv), nranks=nranks,
                    gpus=ndev, per_gpu=per_gpu, gpu=torch.cuda.get_device_name(dev), K=K,
                    flag_hop_us=dict(zip(("acqrel_sys_push", "volatile_push", "relaxed_gpu_push", "volatile_pull"), hops)), device_api=[dict(bytes=a_, blocks=b_, us=u) for a_, b_, u in dev_rows], device_api_phases_8k=phases,
                    copy_GBps_alone=bw_alone, copy_GBps_sum=sum(bws), date=time.strftime("%Y-%m-%d %H:%M:%S"), host=platform.node(),
                    settings={k: v for k, (v, _s) in kccl.config.resolve().items()})
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(meta=meta, rows=rows), f, indent=1)
        return 0 if bad == 0 else 1
    return 0
