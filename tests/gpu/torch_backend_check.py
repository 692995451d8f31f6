"""torch.distributed with backend="kccl" on CUDA tensors, on the GPU machine: every
collective (and point-to-point, and the coalesced, async and future forms) on CUDA tensors
gives bit for bit what the same group's CPU path gives on the same inputs; collectives
run on the current stream (a non-default stream too), Work.wait() orders the caller's
stream without blocking the host, a CUDA graph captures them (replays checked against the
CPU path), a mismatch is raised on every rank; then the latency of a 4 KB float32
all_reduce, eager and inside a CUDA graph.

    mpiexec -n 2 python tests/gpu/torch_backend_check.py --json out.json   # bench/gpu/torch_run.sh

Ranks share the GPUs they see (rank % count): two ranks on one GPU need MPS.  With two
ranks every reduction is one operation rounded once (half types summed in float32 on both
paths), so all results must be equal to the bit; with more ranks the sums of the GPU
path and the host path run in the same rank order too.  --device cpu runs the same
script with "device" tensors on the CPU (the GPU-only checks skipped): a dry run of the
script itself where no GPU is.  Exit status 0 only when everything passed."""
import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # the deprecated collective names are what is checked

OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")
GPU_TYPES = ("float32", "float16", "bfloat16")            # reduced by KCCL's GPU path
HOST_TYPES = ("int32", "int64", "float64", "bool", "int8")  # reduced through host memory
SIZES = (0, 1, 7, 1024, 4097, 65536, 1 << 20)            # elements


class Checks:
    def __init__(self, rank):
        self.rank, self.passed, self.failed = rank, 0, []

    def equal(self, name, got, want):
        import torch
        got, want = [t.cpu() for t in got], [t.cpu() for t in want]
        bad = [i for i, (a, b) in enumerate(zip(got, want))
               if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b)]
        if len(got) != len(want) or bad:
            i = bad[0] if bad else 0
            self.failed.append(f"{name}: output {i} differs: {got[i].flatten()[:5].tolist() if got else None} vs "
                               f"{want[i].flatten()[:5].tolist() if want else None}")
        else:
            self.passed += 1

    def true(self, name, cond, detail=""):
        if cond:
            self.passed += 1
        else:
            self.failed.append(f"{name}: {detail}")

    def run(self, name, fn):
        try:
            fn()
        except Exception as e:
            self.failed.append(f"{name}: raised {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            traceback.print_exc()


def data(dtype, n, rank, salt, op="SUM"):
    import torch
    g = torch.Generator().manual_seed(hash((rank, salt, n, str(dtype))) & 0x7FFFFFFF)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < 0.5
    if dtype.is_floating_point:
        if op == "PRODUCT":
            v = (torch.rand(n, generator=g) + 0.5) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
        else:
            v = torch.randn(n, generator=g) * 4
        return v.to(dtype)
    return torch.randint(-100 if op != "PRODUCT" else -3, 100 if op != "PRODUCT" else 4, (n,), generator=g).to(dtype)


def collectives(ck, dev, rank, world):
    """Every collective on `dev` against the same call on CPU tensors, bit for bit."""
    import torch
    import torch.distributed as dist
    R = dist.ReduceOp
    cpu = torch.device("cpu")

    def both(name, fn):
        """fn(device) -> list of output tensors; run on dev then on the CPU, compared."""
        def go():
            got = fn(dev)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            ck.equal(name, got, fn(cpu))
        ck.run(name, go)

    for tname in GPU_TYPES + HOST_TYPES:
        dt = getattr(torch, tname)
        for op in OPS:
            if dt == torch.bool and op == "AVG":
                continue
            for n in SIZES if tname in ("float32", "bfloat16") else (1, 4097, 65536):
                def ar(d, dt=dt, op=op, n=n):
                    x = data(dt, n, rank, 1, op).to(d)
                    dist.all_reduce(x, op=getattr(R, op))
                    return [x]
                both(f"all_reduce/{tname}/{op}/{n}", ar)
            if tname in ("float32", "float16", "int32"):
                def red(d, dt=dt, op=op):
                    x = data(dt, 999, rank, 2, op).to(d)
                    dist.reduce(x, dst=world - 1, op=getattr(R, op))
                    return [x]
                both(f"reduce/{tname}/{op}", red)
                for n in (1, 4096, 1 << 18):
                    def rs(d, dt=dt, op=op, n=n):
                        x = data(dt, n * world, rank, 3, op).to(d)
                        out = torch.empty(n, dtype=dt, device=d)
                        dist.reduce_scatter_tensor(out, x, op=getattr(R, op))
                        lst = [data(dt, n, rank, 30 + i, op).to(d) for i in range(world)]
                        out2 = torch.empty(n, dtype=dt, device=d)
                        dist.reduce_scatter(out2, lst, op=getattr(R, op))
                        return [out, out2]
                    both(f"reduce_scatter/{tname}/{op}/{n}", rs)
    for tname in ("float32", "bfloat16", "int8", "bool", "int64"):
        dt = getattr(torch, tname)
        for n in (0, 1, 4097, 1 << 20):
            def moves(d, dt=dt, n=n):
                x = data(dt, n, rank, 4).to(d)
                b = data(dt, n, rank, 5).to(d)
                dist.broadcast(b, src=world - 1)
                ag = torch.empty(n * world, dtype=dt, device=d)
                dist.all_gather_into_tensor(ag, x)
                lst = [torch.empty(n, dtype=dt, device=d) for _ in range(world)]
                dist.all_gather(lst, x)
                g = [torch.empty(n, dtype=dt, device=d) for _ in range(world)] if rank == 0 else None
                dist.gather(x, g, dst=0)
                sc = torch.empty(n, dtype=dt, device=d)
                dist.scatter(sc, [data(dt, n, 0, 6 + i).to(d) for i in range(world)] if rank == 0 else None, src=0)
                a2a = torch.empty(n * world, dtype=dt, device=d)
                dist.all_to_all_single(a2a, data(dt, n * world, rank, 7).to(d))
                splits = [(i + rank) % 3 for i in range(world)]
                rsplits = [(rank + i) % 3 for i in range(world)]  # rank i sends (rank + i) % 3 rows here
                v = torch.empty(sum(rsplits), dtype=dt, device=d)
                dist.all_to_all_single(v, data(dt, sum(splits), rank, 8).to(d), output_split_sizes=rsplits,
                                       input_split_sizes=splits)
                outs = [torch.empty(3, dtype=dt, device=d) for _ in range(world)]
                dist.all_to_all(outs, [data(dt, 3, rank, 9 + i).to(d) for i in range(world)])
                return [b, ag, *lst, *(g or []), sc, a2a, v, *outs]
            both(f"data_movement/{tname}/{n}", moves)

    def coalesced(d):
        xs = [data(torch.float32, 5, rank, 10).to(d), data(torch.float32, 4096, rank, 11).to(d)]
        dist.all_reduce_coalesced(xs)
        ys = [data(torch.bfloat16, 7, rank, 12).to(d), data(torch.bfloat16, 3, rank, 13).to(d)]
        with dist._coalescing_manager():
            for y in ys:
                dist.all_reduce(y)
        ins = [data(torch.float32, 3, rank, 14).to(d), data(torch.float32, 2, rank, 15).to(d)]
        outs = [[torch.empty(3, device=d), torch.empty(2, device=d)] for _ in range(world)]
        dist.all_gather_coalesced(outs, ins)
        o1, o2 = torch.empty(6 * world, device=d), torch.empty(4, device=d)
        with dist._coalescing_manager():
            dist.all_gather_into_tensor(o1, data(torch.float32, 6, rank, 16).to(d))
        with dist._coalescing_manager():
            dist.reduce_scatter_tensor(o2, data(torch.float32, 4 * world, rank, 17).to(d))
        return [*xs, *ys, *[t for l in outs for t in l], o1, o2]
    both("coalesced forms", coalesced)

    def p2p(d):
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        outs = []
        for n in (1, 4096, 1 << 20):
            x, got = data(torch.float32, n, rank, 20).to(d), torch.empty(n, device=d)
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, got, prv)]):
                w.wait()
            outs.append(got)
            got2 = torch.empty(n, device=d)
            if rank % 2 == 0:
                dist.send(x * 2, nxt, tag=3)
                dist.recv(got2, prv, tag=3)
            else:
                dist.recv(got2, prv, tag=3)
                dist.send(x * 2, nxt, tag=3)
            outs.append(got2)
        return outs
    both("send / recv / batch_isend_irecv", p2p)

    def asyncs(d):
        x = data(torch.float32, 4096, rank, 21).to(d)
        w = dist.all_reduce(x, async_op=True)
        w.wait()
        y = data(torch.bfloat16, 999, rank, 22).to(d)
        fut = dist.all_reduce(y, async_op=True).get_future()
        z = fut.wait()[0]
        return [x, z]
    both("async_op and get_future", asyncs)


def streams(ck, dev, rank, world):
    """A collective on a non-default stream; Work.wait() on another stream, not the host."""
    import torch
    import torch.distributed as dist

    def on_side_stream():
        s = torch.cuda.Stream(dev)
        with torch.cuda.stream(s):
            x = torch.full((1 << 16,), float(rank + 1), device=dev) * 2  # a kernel on s first
            dist.all_reduce(x)
            y = x + 1                                                    # and one after
        torch.cuda.synchronize(dev)
        ck.true("collective on a side stream", bool((y == 2 * world * (world + 1) / 2 + 1).all()), y[:3].tolist())
    ck.run("collective on a side stream", on_side_stream)

    def wait_orders_stream():
        s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
        x = torch.ones(4096, device=dev)
        torch.cuda.synchronize(dev)
        with torch.cuda.stream(s1):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on s1 before the collective
            w = dist.all_reduce(x, async_op=True)
        t0 = time.perf_counter()
        with torch.cuda.stream(s2):
            w.wait()                        # s2 waits for the collective; the host does not
            host_s = time.perf_counter() - t0
            pending = not w.is_completed()
            y = x * 3
        torch.cuda.synchronize(dev)
        ck.true("Work.wait() returns before the GPU is done", host_s < 0.02 and pending,
                f"wait took {host_s * 1e3:.1f} ms, pending={pending}")
        ck.true("Work.wait() orders the waiting stream", bool((y == 3 * world).all()), y[:3].tolist())
        ck.true("is_completed() after the GPU finished", w.is_completed())
    ck.run("Work.wait() stream semantics", wait_orders_stream)


def graphs(ck, dev, rank, world):
    """Collectives captured in one CUDA graph, replayed on new inputs, against the CPU path."""
    import torch
    import torch.distributed as dist
    n = 4096
    x = torch.zeros(n, device=dev)
    h = torch.zeros(n, dtype=torch.bfloat16, device=dev)
    ag = torch.zeros(n * world, device=dev)
    rs = torch.zeros(n // world if n % world == 0 else n, device=dev)
    b = torch.zeros(n, device=dev)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):  # warm up outside the capture (the first call makes the GPU communicator)
        dist.all_reduce(x)
        dist.all_reduce(h, op=dist.ReduceOp.MAX)
        dist.all_gather_into_tensor(ag, x)
        dist.reduce_scatter_tensor(rs, ag[:rs.numel() * world])
        dist.broadcast(b, src=0)
    torch.cuda.current_stream(dev).wait_stream(s)
    torch.cuda.synchronize(dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dist.all_reduce(x)
        dist.all_reduce(h, op=dist.ReduceOp.MAX)
        dist.all_gather_into_tensor(ag, x)
        dist.reduce_scatter_tensor(rs, ag[:rs.numel() * world])
        dist.broadcast(b, src=0)
    for rep in range(3):
        xin, hin, bin_ = data(torch.float32, n, rank, 40 + rep), data(torch.bfloat16, n, rank, 50 + rep), \
            data(torch.float32, n, rank, 60 + rep)
        x.copy_(xin)
        h.copy_(hin)
        b.copy_(bin_)
        g.replay()
        torch.cuda.synchronize(dev)
        cx, ch, cb = xin.clone(), hin.clone(), bin_.clone()
        dist.all_reduce(cx)
        dist.all_reduce(ch, op=dist.ReduceOp.MAX)
        cag = torch.empty(n * world)
        dist.all_gather_into_tensor(cag, cx)
        crs = torch.empty(rs.numel())
        dist.reduce_scatter_tensor(crs, cag[:rs.numel() * world])
        dist.broadcast(cb, src=0)
        ck.equal(f"CUDA graph replay {rep}", [x, h, ag, rs, b], [cx, ch, cag, crs, cb])


def mismatch(ck, dev, rank, world):
    """Ranks that call different collectives on CUDA tensors: every rank raises (at the
    call or the group's next one), and no rank hangs."""
    import torch
    import torch.distributed as dist
    g = dist.new_group(backend="kccl")
    x = torch.ones(16 if rank == 0 else 32, device=dev)
    errors = []
    for _ in range(2):
        try:
            dist.all_reduce(x, group=g)
            torch.cuda.synchronize(dev)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
            break
    ck.true("a mismatch raises on every rank", errors and "mismatch" in errors[0], errors or "nothing raised")
    dist.destroy_process_group(g)


def latency(dev, rank, world, iters, rounds, comm):
    """Median (min, max) us per 4 KB float32 all_reduce: eager (dist.all_reduce back to back,
    then a synchronize), in a CUDA graph (100 all_reduces captured, replayed), and KCCL's own
    Python Communicator on the same tensor, eager, for reference."""
    import torch
    import torch.distributed as dist
    x = torch.ones(1024, device=dev)
    out = {}

    def eager():
        for _ in range(iters):
            dist.all_reduce(x)

    def direct():
        for _ in range(iters):
            comm.all_reduce(x)

    per_graph = 100
    g = None
    if dev.type == "cuda":
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            dist.all_reduce(x)
        torch.cuda.current_stream(dev).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(per_graph):
                dist.all_reduce(x)

    def graph():
        for _ in range(max(1, iters // per_graph)):
            g.replay()

    cases = {"eager dist.all_reduce": (eager, iters), "kccl.Communicator.all_reduce": (direct, iters)}
    if g is not None:
        cases["CUDA graph"] = (graph, max(1, iters // per_graph) * per_graph)
    from mpi4py import MPI
    for name, (fn, calls) in cases.items():
        fn()  # warm
        vals = []
        for _ in range(rounds):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            MPI.COMM_WORLD.Barrier()
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            vals.append(MPI.COMM_WORLD.allreduce((time.perf_counter() - t0) / calls * 1e6, op=MPI.MAX))
        out[name] = {"median_us": statistics.median(vals), "min_us": min(vals), "max_us": max(vals),
                     "rounds_us": vals}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    from mpi4py import MPI
    import torch
    import torch.distributed as dist
    world_comm = MPI.COMM_WORLD
    rank, world = world_comm.Get_rank(), world_comm.Get_size()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(world_comm.bcast(29500 + os.getpid() % 1000 if rank == 0 else None)))
    if args.device == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    import kccl
    import kccl.torch  # noqa: F401
    dist.init_process_group("kccl", rank=rank, world_size=world)
    ck = Checks(rank)
    t0 = time.time()
    collectives(ck, dev, rank, world)
    if dev.type == "cuda":
        ck.run("streams", lambda: streams(ck, dev, rank, world))
        ck.run("graphs", lambda: graphs(ck, dev, rank, world))
    comm = kccl.Communicator.from_mpi(world_comm, device=dev.index if dev.type == "cuda" else None)
    lat = latency(dev, rank, world, args.iters, args.rounds, comm)
    comm.close()
    ck.run("mismatch", lambda: mismatch(ck, dev, rank, world))
    dist.destroy_process_group()
    all_checks = world_comm.gather({"rank": rank, "passed": ck.passed, "failed": ck.failed}, root=0)
    if rank == 0:
        for c in all_checks:
            for f in c["failed"]:
                print(f"FAIL rank {c['rank']}: {f}")
        passed = sum(c["passed"] for c in all_checks)
        failed = sum(len(c["failed"]) for c in all_checks)
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        print(f"4 KB float32 all_reduce, {world} ranks on {name} (median, min-max us over {args.rounds} rounds):")
        for k, v in lat.items():
            print(f"  {k:<32} {v['median_us']:8.2f}  ({v['min_us']:.2f}-{v['max_us']:.2f})")
        print(f"TORCH GPU CHECK ({world} ranks, {args.device}): {passed} passed, {failed} failed "
              f"in {time.time() - t0:.0f} s", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": name, "ranks": world, "torch": torch.__version__, "passed": passed,
                           "failed": [f"rank {c['rank']}: {x}" for c in all_checks for x in c["failed"]],
                           "latency_4KB": lat, "command": " ".join(sys.argv)}, f, indent=1)
        sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
