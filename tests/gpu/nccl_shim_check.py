"""libkccl_nccl.so under PyTorch, on the GPU machines: every collective torch.distributed's
NCCL backend calls, eager and captured in a CUDA graph, gives bitwise the results of plain
NCCL, and the small all-reduces really went to KCCL.

    python tests/gpu/nccl_shim_check.py                       # 2 ranks, a GPU each
    MPIEXEC="mpiexec --allow-run-as-root" python tests/gpu/nccl_shim_check.py --np 2

The driver runs the same worker twice under MPI, once with plain NCCL and once with the
shim preloaded (KCCL_DEBUG=INFO, whose per-communicator line at close says how many
all-reduces went to KCCL), then compares the two runs' tensors bit for bit, rank by rank.
With two ranks every reduction is a single commutative step, so KCCL and NCCL must agree
to the bit (average too: halving is exact).  Exit status 0 only when everything passed."""
import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = (1, 7, 1000, 4096, 65536, 262144, 1 << 22)  # elements: both sides of the 256 KB routing limit


def worker(outdir):
    from mpi4py import MPI
    import torch
    import torch.distributed as dist

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(world.bcast(29400 + os.getpid() % 1000 if rank == 0 else None)))
    dist.init_process_group("nccl", rank=rank, world_size=size, device_id=dev)
    gen = torch.Generator().manual_seed(1234 + rank)
    out = {}

    def data(n, dtype):
        if dtype == torch.int64:
            return torch.randint(-1000, 1000, (n,), generator=gen).to(dev)
        return (torch.randn(n, generator=gen) * 4).to(dtype).to(dev)

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
           "prod": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.AVG}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        for opname, op in ops.items():
            if dtype == torch.int64 and opname == "avg":
                continue  # not defined for integers in every NCCL
            for n in SIZES:
                x = data(n, dtype)
                dist.all_reduce(x, op=op)
                out[f"all_reduce/{dtype}/{opname}/{n}"] = x.cpu()
    for dtype in (torch.float32, torch.bfloat16):
        for n in (7, 4096, 1 << 20):
            x = data(n, dtype)
            dist.broadcast(x, src=size - 1)
            out[f"broadcast/{dtype}/{n}"] = x.cpu()
            x = data(n, dtype)
            g = torch.empty(n * size, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(g, x)
            out[f"all_gather/{dtype}/{n}"] = g.cpu()
            x = data(n * size, dtype)
            r = torch.empty(n, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(r, x)
            out[f"reduce_scatter/{dtype}/{n}"] = r.cpu()
            x = data(n, dtype)
            dist.reduce(x, dst=0)
            out[f"reduce/{dtype}/{n}"] = x.cpu()
            x = data(n * size, dtype)
            y = torch.empty_like(x)
            dist.all_to_all_single(y, x)
            out[f"all_to_all/{dtype}/{n}"] = y.cpu()
    x = data(4096, torch.float32)
    if rank == 0:
        dist.send(x, dst=1)
    elif rank == 1:
        dist.recv(x, src=0)
    out["send_recv"] = x.cpu()
    dist.barrier()

    # A graph that mixes routed and forwarded calls: bf16 8 KB sums (KCCL), a float32 max
    # (KCCL), a 4 MB sum (the real NCCL) and an all-gather (the real NCCL), replayed on new inputs.
    inp = data(4096, torch.bfloat16)
    big = data(1 << 20, torch.float32)
    gathered = torch.empty(4096 * size, dtype=torch.bfloat16, device=dev)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def step():
        y = inp * 2 + 1
        dist.all_reduce(y)
        z = y.float()
        dist.all_reduce(z, op=dist.ReduceOp.MAX)
        w = big * 0.5
        dist.all_reduce(w)
        dist.all_gather_into_tensor(gathered, y)
        return y, z, w

    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside capture (torch's requirement for NCCL in graphs)
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for i in range(5):
        inp.copy_(data(4096, torch.bfloat16))
        big.copy_(data(1 << 20, torch.float32))
        graph.replay()
        torch.cuda.synchronize()
        for name, t in zip(("y", "z", "w"), outs):
            out[f"graph/{i}/{name}"] = t.cpu()
        out[f"graph/{i}/gathered"] = gathered.cpu()
    torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def bits(t):
    import torch
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}.get(t.dtype)
    return t.view(view) if view else t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker)
    import torch
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from benchlib import mpi_launcher, nccl_shim_runs
    launcher = mpi_launcher(a.np)
    me = os.path.abspath(__file__)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name, pre in nccl_shim_runs():
            d = os.path.join(tmp, name)
            os.makedirs(d)
            p = subprocess.run(launcher + pre + [sys.executable, me, "--worker", d], capture_output=True, text=True,
                               timeout=600)
            print(f"# {name}: exit {p.returncode}")
            if p.returncode:
                print(p.stdout[-4000:] + p.stderr[-4000:])
                print(f"FAIL the {name} run")
                return 1
            runs[name] = (d, p.stdout + p.stderr)
        log = runs["kccl_nccl"][1]
        counts = [tuple(map(int, m)) for m in re.findall(r"rank (\d+) of \d+: (\d+) all-reduces went to KCCL, (\d+)", log)]
        print("# shim: " + "; ".join(line for line in log.splitlines() if "kccl_nccl" in line))
        ranks_routed = {r for r, routed, _ in counts if routed > 0}
        if ranks_routed != set(range(a.np)):
            print(f"FAIL routing: every rank must have sent all-reduces to KCCL; counts {counts}")
            failures += 1
        else:
            print(f"PASS routing: {counts} (rank, to KCCL, to NCCL)")
        for r in range(a.np):
            plain = torch.load(os.path.join(runs["nccl"][0], f"rank{r}.pt"))
            shim = torch.load(os.path.join(runs["kccl_nccl"][0], f"rank{r}.pt"))
            groups = {}
            for key, t in plain.items():
                ok = key in shim and shim[key].dtype == t.dtype and torch.equal(bits(shim[key]), bits(t))
                g = key.split("/")[0]
                groups.setdefault(g, [0, 0])[0 if ok else 1] += 1
                if not ok:
                    diff = (shim[key].double() - t.double()).abs().max().item() if key in shim else "missing"
                    print(f"FAIL rank {r} {key}: max |diff| {diff}")
            for g, (ok, bad) in sorted(groups.items()):
                print(f"{'PASS' if not bad else 'FAIL'} rank {r} {g}: {ok} bitwise equal, {bad} differ")
                failures += bad
    print("ALL PASSED" if not failures else f"{failures} FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
