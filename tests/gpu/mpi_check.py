"""GPU correctness check, one process per rank under mpiexec (run on a GPU machine):

    mpiexec -n 4 --oversubscribe python tests/gpu/mpi_check.py [--quick]

Every rank draws every rank's input from (seed, rank), computes the reference
itself (float32 accumulation in rank order, as the kernels do, then rounding
to the data type), runs KCCL on torch CUDA tensors and compares bitwise:
all-reduce (sum/max/min/avg, float32/float16/bfloat16, 4 B to 64 MB, in and
out of place, one-shot/two-shot/auto, unaligned offsets), eager and replayed
from a captured CUDA graph; all-gather, broadcast, reduce-scatter; the
device-side API inside a persistent kernel; its group form (kcclDevAllReduceGroup)
as the monokernel calls it, checked on the device, and a group call cancelled
while its peer never comes; CuPy arrays.  A two-shot communicator
with per-L2-partition flag replicas (KCCL_GPU_FLAG_REPLICAS=1) runs the
all-reduce cases, a replayed graph, all-gather, broadcast and reduce-scatter too
(whether its calibration enabled them is printed).  Prints one line per
failure and a final `GPU CHECK: n passed, m failed` on rank 0; exit 1 on any failure."""
import argparse
import os
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

import kccl
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import kccl_bench  # noqa: E402  (bench/kccl_bench.py; builds its extension on first use)

world = MPI.COMM_WORLD
RANK, N = world.Get_rank(), world.Get_size()
TDT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FAILS = []
PASSED = [0]


def rng_input(seed, r, count, dtype):
    g = torch.Generator().manual_seed(seed * 1000 + r)
    x = torch.randn(count, generator=g, dtype=torch.float32) * 4
    return x.to(TDT[dtype])


def reference(inputs, op):
    """float32 accumulation in rank order, then the data type (the kernels' contract)."""
    acc = inputs[0].float().clone()
    for x in inputs[1:]:
        xf = x.float()
        if op == "sum" or op == "avg":
            acc = acc + xf
        elif op == "max":
            acc = torch.maximum(acc, xf)
        elif op == "min":
            acc = torch.minimum(acc, xf)
    if op == "avg":
        acc = acc / len(inputs)
    return acc.to(inputs[0].dtype)


def check(name, got, want):
    got = got.cpu()
    same = torch.equal(got.view(torch.uint8) if got.dtype != torch.uint8 else got,
                       want.view(torch.uint8) if want.dtype != torch.uint8 else want) if got.numel() else True
    if not same:
        diff = (got.float() - want.float()).abs()
        bad = int((got.view(torch.int16 if got.element_size() == 2 else torch.int32)
                   != want.view(torch.int16 if want.element_size() == 2 else torch.int32)).sum())
        i = int(diff.argmax()) if diff.numel() else 0
        FAILS.append(f"rank {RANK} {name}: {bad}/{got.numel()} differ; worst at {i}: got {got[i].item()} "
                     f"want {want[i].item()}")
    else:
        PASSED[0] += 1


OPS = {"sum": kccl.SUM, "max": kccl.MAX, "min": kccl.MIN, "avg": kccl.AVG}


_caps = {}


def oneshot_cap(c, count, dtype):
    """The one-shot kernel's capacity: 256 KB of inbox, but at most as many
    blocks as fit on the GPU beside the peers' with SMs to spare.  A
    forced one-shot beyond it must be a typed error (found once, then cached)."""
    if id(c) not in _caps:
        _caps[id(c)] = 256 * 1024
        for cap_kb in (256, 192, 128, 64):
            x = torch.zeros(cap_kb * 1024 // 2, dtype=torch.bfloat16, device="cuda")
            try:
                c.all_reduce(x)
                torch.cuda.synchronize()
                _caps[id(c)] = cap_kb * 1024
                break
            except kccl.KcclInvalidArgument as e:
                assert "at most" in str(e), e
                _caps[id(c)] = 0
    return _caps[id(c)]


def allreduce_cases(comm, comms_by_algo, quick):
    sizes = [4, 8, 12, 16, 100, 1000, 2048, 4096, 8192, 8200, 16384, 65536, 131072, 262144, 1 << 20, 3 << 20,
             (16 << 20) + 48, (24 << 20) + 48, 64 << 20]
    if quick:
        sizes = [4, 12, 1000, 8192, 65536, 262144, 3 << 20, (24 << 20) + 48]  # 24 MB: a full chunk and a large last one
    seed = 1
    for algo, c in comms_by_algo.items():
        for dtype in ("bfloat16", "float32", "float16"):
            es = 4 if dtype == "float32" else 2
            for nbytes in sizes:
                count = max(1, nbytes // es)
                if algo == "oneshot" and count * es > oneshot_cap(c, count, dtype):
                    continue
                for op in (("sum", "max", "min", "avg") if nbytes <= 65536 else ("sum",)):
                    for inplace in (True, False):
                        seed += 1
                        inputs = [rng_input(seed, r, count, dtype) for r in range(N)]
                        want = reference(inputs, op)
                        x = inputs[RANK].cuda()
                        if inplace:
                            c.all_reduce(x, op=OPS[op])
                            torch.cuda.synchronize()
                            check(f"all_reduce {algo} {dtype} {op} {count} in-place", x, want)
                        else:
                            y = torch.full_like(x, float("nan"))
                            c.all_reduce(x, y, op=OPS[op])
                            torch.cuda.synchronize()
                            check(f"all_reduce {algo} {dtype} {op} {count} out-of-place", y, want)
                            check(f"all_reduce {algo} {dtype} {op} {count} send untouched", x, inputs[RANK])
    # Unaligned buffers: offsets of 1 element into a larger allocation.
    for dtype in ("bfloat16", "float32"):
        for count in (7, 1001, 70001):
            seed += 1
            inputs = [rng_input(seed, r, count, dtype) for r in range(N)]
            want = reference(inputs, "sum")
            big = torch.zeros(count + 3, dtype=TDT[dtype], device="cuda")
            x = big[1:1 + count]
            x.copy_(inputs[RANK].cuda())
            comm.all_reduce(x)
            torch.cuda.synchronize()
            check(f"all_reduce unaligned {dtype} {count}", x, want)
            check(f"all_reduce unaligned {dtype} {count} guard", big[0:1].cpu(), torch.zeros(1, dtype=TDT[dtype]))


def graph_cases(comm, tag=""):
    """A captured graph of dependent all-reduces, replayed several times with new inputs."""
    for dtype, count in (("bfloat16", 4096), ("float32", 1 << 20), ("bfloat16", 100003)):
        x = torch.zeros(count, dtype=TDT[dtype], device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up outside capture (as torch recommends)
            comm.all_reduce(x, op=kccl.AVG)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            comm.all_reduce(x, op=kccl.SUM)
            comm.all_reduce(x, op=kccl.AVG)
            comm.all_reduce(x, op=kccl.MAX)
        for rep in range(3):
            seed = 900 + rep * 10 + count % 7
            inputs = [rng_input(seed, r, count, dtype) for r in range(N)]
            a = reference(inputs, "sum")
            b = reference([a] * N, "avg")
            want = reference([b] * N, "max")
            x.copy_(inputs[RANK].cuda())
            g.replay()
            torch.cuda.synchronize()
            check(f"{tag}graph replay {rep} {dtype} {count}", x, want)


def other_collectives(comm, quick, tag=""):
    seed = 5000
    for dtype in ("bfloat16", "float32"):
        for count in ((1, 1000, 1 << 20) if quick else (1, 3, 1000, 65536, 1 << 20, (5 << 20) + 7)):
            seed += 1
            inputs = [rng_input(seed, r, count, dtype) for r in range(N)]
            x = inputs[RANK].cuda()
            out = comm.all_gather(x)
            torch.cuda.synchronize()
            check(f"{tag}all_gather {dtype} {count}", out.reshape(-1), torch.cat(inputs))
            for root in sorted({0, N - 1}):
                y = inputs[RANK].cuda()
                comm.broadcast(y, root=root)
                torch.cuda.synchronize()
                check(f"{tag}broadcast root {root} {dtype} {count}", y, inputs[root])
            full = [rng_input(seed + 7, r, count * N, dtype) for r in range(N)]
            z = comm.reduce_scatter(full[RANK].cuda())
            torch.cuda.synchronize()
            want = reference(full, "sum")[RANK * count:(RANK + 1) * count]
            check(f"{tag}reduce_scatter {dtype} {count}", z, want)
    comm.barrier()
    torch.cuda.synchronize()
    PASSED[0] += 1


def device_api_cases(comm, tiny=False):
    cases = (("bfloat16", 4096, 1, 5), ("float32", 2048, 4, 3), ("float16", 10000, 4, 2), ("bfloat16", 32768, 16, 2))
    for dtype, count, blocks, iters in cases[:1] if tiny else cases:
        seed = 7000 + count
        inputs = [rng_input(seed, r, count, dtype) for r in range(N)]
        outs = torch.full((iters, count), float("nan"), dtype=TDT[dtype], device="cuda")
        kccl_bench.device_all_reduce_selftest(comm, inputs[RANK].cuda(), outs, kccl.SUM, iters=iters, blocks=blocks)
        for k in range(iters):
            contrib = [(x.float() + k).to(TDT[dtype]) for x in inputs]
            check(f"device API {dtype} {count} blocks {blocks} iter {k}", outs[k], reference(contrib, "sum"))


# kcclDevAllReduceGroup as KIE's monokernel calls it (256 callers and a warp that never calls, a named barrier,
# slots counted from the grid's end): dtype, op (None: sum and max in turn), count, calls, blocks, reducers,
# barrier, memory.
GROUP_CASES = (("float32", kccl.SUM, 512, 6, 40, 4, 1, "shared"),  # the monokernel's: a line per caller
               ("float32", kccl.MAX, 2048, 6, 40, 4, 5, "global"),  # the largest call: 4 lines per caller
               ("bfloat16", kccl.SUM, 4096, 6, 8, 8, 3, "shared"),  # every block reduces
               ("bfloat16", kccl.MAX, 1001, 6, 40, 4, 1, "global"),  # a count that ends mid-line
               ("float32", None, 7, 9, 33, 32, 15, "shared"),  # every slot, in a grid past KCCL_DEV_MAX_BLOCKS
               ("bfloat16", None, 513, 6, 40, 2, 2, "global"))  # one element past a line per caller


def gpu_sharing(dev):
    """(the most ranks on one GPU, the fewest SMs of a GPU) in the job: the same on every rank."""
    keys = world.allgather((MPI.Get_processor_name(), dev))
    sms = world.allreduce(torch.cuda.get_device_properties(dev).multi_processor_count, op=MPI.MIN)
    return max(keys.count(k) for k in keys), sms


def device_group_cases(comm, dev, tiny=False):
    """Each rank's kernel checks its results to the bit; any wrong element, changed
    guard byte, failed call or stuck bystander warp fails the case."""
    if N > 8:
        print(f"rank {RANK}: device API group cases skipped (the test's copy handles 8 ranks, not {N})")
        return
    # The kernel takes 168 registers a thread (ptxas, sm_90): one block per SM, and every rank's reducing
    # blocks must be resident together, with a few SMs left for the late ranks' other kernels.
    sharing, sms = gpu_sharing(dev)
    for dtype, op, count, calls, blocks, reducers, barrier, memory in GROUP_CASES[:1] if tiny else GROUP_CASES:
        name = (f"device API group {dtype} {'sum+max' if op is None else op.name.lower()} {count} x{calls} "
                f"{memory} slots {reducers}/{blocks} barrier {barrier}")
        if reducers * sharing > sms - 4:
            if RANK == 0:
                print(f"{name}: skipped ({sharing} ranks x {reducers} reducing blocks on a GPU of {sms} SMs)")
            continue
        try:
            res = kccl_bench.device_all_reduce_group_selftest(comm, dtype, op, count, calls, blocks, reducers,
                                                              barrier=barrier, memory=memory)
        except kccl.KcclError as e:
            FAILS.append(f"rank {RANK} {name}: {type(e).__name__}: {e}")
            return  # the communicator is broken: the later cases would only repeat it
        bad = {k: res[k] for k in ("wrong", "guard", "call_errors", "bystander") if res[k]}
        if res["calls_ok"] != calls * reducers:
            bad["calls_ok"] = f"{res['calls_ok']} of {calls * reducers}"
        if bad:
            if res["wrong"]:
                bad["first wrong"] = (f"slot {res['bad_slot']} call {res['bad_call']} element {res['bad_index']}: "
                                      f"bits {res['bad_got']:#x}, want {res['bad_want']:#x}")
            FAILS.append(f"rank {RANK} {name}: {bad}")
        else:
            PASSED[0] += 1


def device_group_cancel_case(dev, how):
    """Rank 1 never calls; the others' group calls must end through the cancel word
    (how: 'waiting', set by another block's bystander warp while they wait; 'before',
    set before the launch) well within KCCL_TIMEOUT_MS, report KCCL's cancel, and
    leave the communicator broken on every rank: its next call refused on the host."""
    name = f"device API group cancel ({how})"
    if N > 8 or N < 2:
        print(f"rank {RANK}: {name} skipped (needs 2 to 8 ranks)")
        return
    timeout_ms = 10000
    c = kccl.Communicator.from_mpi(world, device=dev, config={"KCCL_TIMEOUT_MS": timeout_ms})
    res = None
    try:
        res = kccl_bench.device_all_reduce_group_selftest(c, "float32", kccl.SUM, 512, 3, 40, 4, cancel=how,
                                                          cancel_after_us=2000)
    except kccl.KcclError as e:
        FAILS.append(f"rank {RANK} {name}: {type(e).__name__}: {e}")
    world.Barrier()  # every caller's host has seen its kernel's failure (and so marked its side failed)
    if res is not None:
        err = res["error"]
        if RANK == 1:
            ok = res["call_errors"] == 0 and res["calls_ok"] == 0
        else:
            ok = (res["call_errors"] == 4 and res["calls_ok"] == 0 and res["ms"] < timeout_ms / 2
                  and isinstance(err, kccl.KcclRemoteError) and "cancelled" in str(err))
        ok = ok and res["bystander"] == 0
        if ok:
            PASSED[0] += 1
        else:
            FAILS.append(f"rank {RANK} {name}: call_errors {res['call_errors']} (code {res['first_code']}), calls_ok "
                         f"{res['calls_ok']}, bystander {res['bystander']}, {res['ms']:.1f} ms, error: {err!r}")
    # Rank 1's watcher turns the callers' failed state into its own stop word within milliseconds.
    deadline = time.time() + 5
    while c.async_error() is None and time.time() < deadline:
        time.sleep(0.01)
    if c.async_error() is None:
        FAILS.append(f"rank {RANK} {name}: the communicator is not broken 5 s later")
    else:
        try:
            c.all_reduce(torch.ones(4, device="cuda"))
            torch.cuda.synchronize()
            FAILS.append(f"rank {RANK} {name}: the next all_reduce was not refused")
        except kccl.KcclError:
            PASSED[0] += 1
    world.Barrier()
    c.close()


def cupy_cases(comm):
    try:
        import cupy
    except ImportError:
        return
    seed = 8000
    for count in (5, 4096, 1 << 20):
        seed += 1
        inputs = [rng_input(seed, r, count, "float32") for r in range(N)]
        x = cupy.asarray(inputs[RANK].numpy())
        comm.all_reduce(x)
        cupy.cuda.get_current_stream().synchronize()
        check(f"cupy all_reduce {count}", torch.from_numpy(cupy.asnumpy(x)), reference(inputs, "sum"))


def bad_input_cases(comm):
    def expect(exc, fn, what):
        try:
            fn()
        except exc:
            PASSED[0] += 1
            return
        except Exception as e:  # wrong type
            FAILS.append(f"rank {RANK} {what}: raised {type(e).__name__}: {e}")
            return
        FAILS.append(f"rank {RANK} {what}: no error")
    x = torch.ones(16, device="cuda")
    expect(kccl.KcclInvalidArgument, lambda: comm.all_reduce(np.ones(4, np.float32)), "numpy on a GPU comm")
    expect(kccl.KcclInvalidArgument, lambda: comm.all_reduce(torch.ones(4)), "CPU tensor on a GPU comm")
    expect(kccl.KcclInvalidArgument, lambda: comm.all_reduce(torch.ones(4, 4, device="cuda").t()), "non-contiguous")
    expect(kccl.KcclInvalidArgument, lambda: comm.all_reduce(torch.ones(4, dtype=torch.int32, device="cuda")),
           "int32 all-reduce")
    expect(kccl.KcclInvalidArgument, lambda: comm.all_reduce(x, torch.ones(8, device="cuda")), "size mismatch")
    expect(kccl.KcclInvalidArgument, lambda: comm.all_reduce(x, torch.ones(16, dtype=torch.float16, device="cuda")),
           "dtype mismatch")
    expect(kccl.KcclInvalidArgument, lambda: comm.all_reduce(x, stream="nope"), "bad stream")
    world.Barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="a few small cases (for compute-sanitizer)")
    args = ap.parse_args()
    t0 = time.time()
    torch.cuda.set_device(0 if torch.cuda.device_count() == 1 else RANK % torch.cuda.device_count())
    dev = torch.cuda.current_device()
    comm = kccl.Communicator.from_mpi(world, device=dev)
    algos = {"auto": comm}
    for algo in ("oneshot", "twoshot"):
        algos[algo] = kccl.Communicator.from_mpi(world, device=dev, config={"KCCL_ALGO": algo})
    rep = kccl.Communicator.from_mpi(world, device=dev, config={"KCCL_ALGO": "twoshot", "KCCL_GPU_FLAG_REPLICAS": 1})
    algos["twoshot+replicas"] = rep
    states = world.gather(rep.gpu_flag_replicas(), root=0)
    if RANK == 0:
        off = [r for r, st in enumerate(states) if not st["enabled"]]
        print("flag replicas: " + ("enabled on every rank" if not off else
                                   f"NOT IN USE (its cases ran with one copy): {states[off[0]]['note']}"))
        print(f"  rank 0: {states[0]['note']}", flush=True)
    if args.tiny:
        for algo, c in algos.items():
            for count in (1000, 70000):
                inputs = [rng_input(count, r, count, "bfloat16") for r in range(N)]
                x = inputs[RANK].cuda()
                c.all_reduce(x)
                torch.cuda.synchronize()
                check(f"tiny {algo} {count}", x, reference(inputs, "sum"))
        y = torch.ones(3000, device="cuda")
        comm.all_gather(y)
        device_api_cases(comm, tiny=True)
        device_group_cases(comm, dev, tiny=True)
        for c in algos.values():
            c.close()
        return report(t0)
    allreduce_cases(comm, algos, args.quick)
    graph_cases(comm)
    graph_cases(rep, "replicas ")
    other_collectives(comm, args.quick)
    other_collectives(rep, args.quick, "replicas ")
    device_api_cases(comm)
    device_group_cases(comm, dev)
    cupy_cases(comm)
    bad_input_cases(comm)
    for how in ("waiting", "before"):
        device_group_cancel_case(dev, how)
    for c in algos.values():
        c.close()
    return report(t0)


def report(t0):
    fails = world.gather(FAILS, root=0)
    passed = world.reduce(PASSED[0], op=MPI.SUM, root=0)
    if RANK == 0:
        allf = [f for fs in fails for f in fs]
        for f in allf[:60]:
            print("FAIL", f)
        print(f"GPU CHECK ({N} ranks, {time.time() - t0:.0f} s): {passed} passed, {len(allf)} failed", flush=True)
        return 1 if allf else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
