"""Rank-side scenarios of the kccl.torch tests (run by tests/_torch_ranks.py):
    python tests/_torch_scenarios.py SCENARIO RANK WORLD INIT_METHOD ARGS_JSON
Each prints "RESULT <json>" last; a scenario that finds a problem says so in its
result instead of raising, so that every rank keeps calling the same collectives."""
import datetime
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

import kccl.torch  # noqa: F401  (registers "kccl")

R = dist.ReduceOp
warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename
SHM = "/dev/shm"


def shm_names(settle=4.0):
    """kccl-* names in /dev/shm that stay there for `settle` seconds (other tests' ranks
    may be in the middle of an init, whose names live for moments)."""
    deadline = time.monotonic() + settle
    while True:
        names = sorted(n for n in os.listdir(SHM) if n.startswith("kccl-"))
        if not names or time.monotonic() > deadline:
            return names
        time.sleep(0.1)


def init(method, rank, world, backend="kccl", timeout=30.0):
    kw = {} if method == "env://" else {"rank": rank, "world_size": world}
    dist.init_process_group(backend, init_method=method, timeout=datetime.timedelta(seconds=timeout), **kw)


def scenario_compare(rank, world, method, args):
    import _torch_compare
    return _torch_compare.scenario_compare(rank, world, method, args, init)


# ------------------------------------------------------------------------------------------

def scenario_refusals(rank, world, method, args):
    """Unsupported ops raise at once, on every rank, and the group still works after; the
    backend serves "cuda" too, and where no GPU communicator can be made (a CPU-only
    build) the first CUDA collective's init fails alike on every rank."""
    init(method, rank, world)
    out = {"devices": sorted(d.type for d in dist.group.WORLD._device_types)}
    t = torch.ones(4)
    for name, fn in [("BAND", lambda: dist.all_reduce(t.to(torch.int32), op=R.BAND)),
                     ("PREMUL_SUM", lambda: dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))),
                     ("complex_max", lambda: dist.all_reduce(torch.ones(2, dtype=torch.complex64), op=R.MAX)),
                     ("bool_avg", lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool), op=R.AVG)),
                     ("float8", lambda: dist.all_reduce(torch.ones(2).to(torch.float8_e4m3fn))),
                     ("kccl_tag", lambda: dist.send(t, dst=(rank + 1) % world, tag=-2**31))]:
        t0 = time.monotonic()
        try:
            fn()
            out[name] = "no error"
        except Exception as e:
            out[name] = [type(e).__name__, str(e).splitlines()[0][:300], time.monotonic() - t0]
    t0 = time.monotonic()
    try:
        kccl.torch._ext.make_gpu_comm(dist.group.WORLD._get_backend(torch.device("cpu")), 0)
        out["gpu_comm"] = "made"
    except Exception as e:
        out["gpu_comm"] = [type(e).__name__, str(e).splitlines()[0][:300], time.monotonic() - t0]
    x = torch.full((3,), float(rank))
    dist.all_reduce(x)
    out["after"] = x.tolist()
    dist.destroy_process_group()
    out["shm"] = shm_names()
    return out


def scenario_p2p(rank, world, method, args):
    """send / recv / isend / irecv / batch_isend_irecv / recv from any source / object
    lists, with tags, any size and dtype, non-contiguous tensors, futures; a send left
    unwaited still reaches its receiver (the background thread keeps it moving)."""
    init(method, rank, world)
    out = {}
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    # tags: two messages to the next rank, received in the other order
    a, b = torch.full((3,), 10.0 * rank + 1), torch.full((3,), 10.0 * rank + 2)
    ws = [dist.isend(a, nxt, tag=1), dist.isend(b, nxt, tag=2)]
    g1, g2 = torch.zeros(3), torch.zeros(3)
    dist.recv(g2, prv, tag=2)
    dist.recv(g1, prv, tag=1)
    for w in ws:
        w.wait()
    out["tags"] = [g1[0].item(), g2[0].item()]
    # any size and dtype, several rings, a non-contiguous receive
    sizes = {"bool": (torch.bool, 5), "int16": (torch.int16, 1 << 20), "bfloat16": (torch.bfloat16, 70001),
             "complex64": (torch.complex64, 3), "float64": (torch.float64, 0)}
    ok = {}
    for name, (dt, n) in sizes.items():
        src = (torch.arange(n) % 7 + rank).to(dt) if dt != torch.complex64 else torch.full((n,), rank + 1j)
        got = torch.empty(n, dtype=dt)
        ws = [dist.irecv(got, prv), dist.isend(src, nxt)]
        for w in ws:
            w.wait()
        want = (torch.arange(n) % 7 + prv).to(dt) if dt != torch.complex64 else torch.full((n,), prv + 1j)
        ok[name] = bool(torch.equal(got, want))
    m = torch.arange(12.0).reshape(3, 4) + rank
    tgt = torch.zeros(4, 3).t()  # non-contiguous
    ws = [dist.irecv(tgt, prv, tag=4), dist.isend(m, nxt, tag=4)]
    for w in ws:
        w.wait()
    ok["noncontiguous"] = bool(torch.equal(tgt, torch.arange(12.0).reshape(3, 4) + prv))
    out["sizes"] = ok
    # a batch: every rank sends a large tensor to the next, receives the previous one's
    big = torch.full((1 << 20,), float(rank))
    got = torch.zeros(1 << 20)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, big, nxt), dist.P2POp(dist.irecv, got, prv)])
    out["batch_works"] = len(works)
    works[0].get_future().wait()
    out["batch"] = got[0].item() == prv and got[-1].item() == prv
    # any source: rank 0 receives from everyone
    if rank == 0:
        srcs = sorted(dist.recv(torch.zeros(2), tag=6) for _ in range(world - 1))
        out["any"] = srcs
    else:
        dist.send(torch.ones(2), 0, tag=6)
    # objects
    if rank == 0:
        dist.send_object_list([{"a": 1}, "two"], dst=1)
    elif rank == 1:
        lst = [None, None]
        dist.recv_object_list(lst, src=0)
        out["objects"] = lst
    # an isend never waited while its sender sleeps: the receiver still gets it all
    dist.barrier()
    if rank == 0:
        w = dist.isend(torch.ones(1 << 21), 1, tag=8)  # 8 MB: many rings
        time.sleep(args.get("sleep", 1.5))
        out["wait_started"] = time.time()
        w.wait()
    elif rank == 1:
        t = torch.zeros(1 << 21)
        dist.recv(t, 0, tag=8)
        out["recv_done"] = time.time()
        out["recv_ok"] = bool((t == 1).all())
    dist.barrier()
    dist.destroy_process_group()
    out["shm"] = shm_names()
    return out


def scenario_p2p_dead(rank, world, method, args):
    """The last rank dies; rank 0 waits in a receive from it, rank 1 in a send larger than
    the ring to it (world 3), each must raise within 2 s, naming the rank."""
    init(method, rank, world)
    victim = world - 1
    dist.barrier()
    if rank == victim:
        time.sleep(0.5)
        with open(args["death_file"], "w") as f:
            f.write(repr(time.time()))
        os._exit(9)
    try:
        if rank == 0:
            dist.recv(torch.zeros(4), victim)
        else:
            dist.send(torch.zeros(1 << 20), victim)
        return {"raised": None}
    except Exception as e:
        raised_at = time.time()
        with open(args["death_file"]) as f:
            died_at = float(f.read())
        return {"raised": type(e).__name__, "msg": str(e)[:500], "after_death": raised_at - died_at}


def scenario_groups(rank, world, method, args):
    """Subgroups, a gloo group beside a kccl default group, and (args.default == "gloo")
    a kccl group beside a gloo default group; "cpu:kccl,cuda:nccl" when asked."""
    init(method, rank, world, backend=args.get("default", "kccl"))
    out = {"backend": dist.get_backend()}
    other = "gloo" if args.get("default", "kccl") != "gloo" else "kccl"
    side = dist.new_group(backend=other)
    sub_ranks = [r for r in range(world) if r % 2 == 0]
    sub = dist.new_group(ranks=sub_ranks, backend="kccl")
    x = torch.full((5,), float(rank + 1))
    dist.all_reduce(x)
    out["world"] = x[0].item()
    y = torch.full((5,), float(rank + 1))
    dist.all_reduce(y, group=side)
    out["side"] = y[0].item()
    out["side_backend"] = dist.get_backend(side)
    if rank in sub_ranks:
        z = torch.full((5,), float(rank + 1))
        dist.all_reduce(z, group=sub)
        out["sub"] = z[0].item()
        out["sub_rank"] = dist.get_rank(sub)
    # the subgroup's kccl communicator is its own: interleave it with the world's
    for i in range(3):
        dist.all_reduce(x)
        if rank in sub_ranks:
            dist.all_reduce(z, group=sub)
    dist.barrier()
    dist.destroy_process_group()
    out["shm"] = shm_names()
    return out


def scenario_async(rank, world, method, args):
    """The peer delays its contribution; the async all_reduce must return at once and
    complete later (overlap), through KCCL's split phase."""
    init(method, rank, world)
    delay = args.get("delay", 0.5)
    out = {}
    x = torch.full((256,), float(rank + 1))
    dist.barrier()
    if rank == 0:
        t0 = time.monotonic()
        work = dist.all_reduce(x, async_op=True)
        out["returned_after"] = time.monotonic() - t0
        out["completed_at_once"] = work.is_completed()
        # compute while the peer is late
        a = torch.randn(64, 64)
        for _ in range(10):
            a = torch.tanh(a @ a * 0.01)
        polls = 0
        while not work.is_completed():
            polls += 1
            time.sleep(0.01)
        out["polls"] = polls
        out["wait"] = work.wait()
        out["done_after"] = time.monotonic() - t0
    else:
        time.sleep(delay)
        work = dist.all_reduce(x, async_op=True)
        work.wait()
    out["sum"] = x[0].item()
    # get_future: completes and carries the tensor
    y = torch.full((8,), float(rank + 1))
    fut = dist.all_reduce(y, async_op=True).get_future()
    res = fut.wait()
    out["future"] = res[0][0].item() if isinstance(res, list) else res[0].item()
    # several in flight (KCCL_MAX_OUTSTANDING, set by the test), waited in reverse order
    ws, ts = [], [torch.full((4,), float(rank + i)) for i in range(4)]
    for t in ts:
        ws.append(dist.all_reduce(t, async_op=True))
    for w in reversed(ws):
        w.wait()
    out["many"] = [t[0].item() for t in ts]
    # a blocking collective after async ones completes them first
    w = dist.all_reduce(torch.ones(4), async_op=True)
    z = torch.ones(3)
    dist.all_reduce(z)
    out["after_blocking"] = [w.is_completed(), z[0].item()]
    # too large for one slot: async_op still works (blocking inside)
    big = torch.ones(args.get("big", 1 << 19))
    dist.all_reduce(big, async_op=True).wait()
    out["big"] = big[0].item()
    out["split_phase"] = kccl.torch.async_started()
    dist.destroy_process_group()
    out["shm"] = shm_names()
    return out


def task_count(settle=2.0, baseline=None):
    """Threads of this process; with baseline, waits up to `settle` s for the count to fall to it."""
    deadline = time.monotonic() + settle
    while True:
        n = len(os.listdir("/proc/self/task"))
        if baseline is None or n <= baseline or time.monotonic() > deadline:
            return n
        time.sleep(0.02)


def error_of(fn):
    try:
        fn()
        return None
    except Exception as e:
        return {"type": type(e).__name__, "msg": str(e)[:400]}


def scenario_futures(rank, world, method, args):
    """get_future() on a pending async all_reduce returns at once; the future completes
    (with nothing but its own wait driving it) when the late peer joins, .then() chains
    on it; an abort fails pending futures; the completer thread ends; a peer that dies
    under a pending future fails it, within 2 s, naming the rank."""
    init(method, rank, world)
    delay = args.get("delay", 0.5)
    out = {}
    g = dist.new_group(backend="kccl")  # for the abort below
    dist.barrier()
    threads_before = task_count()
    x = torch.full((64,), float(rank + 1))
    if rank == 0:
        t0 = time.monotonic()
        work = dist.all_reduce(x, async_op=True)
        fut = work.get_future()
        out["returned_after"] = time.monotonic() - t0
        out["done_at_once"] = fut.done()
        doubled = fut.then(lambda f: f.value()[0] * 2)
        res = fut.wait()  # the only thing that waits: no Work.wait, no other collective
        out["done_after"] = time.monotonic() - t0
        out["value"] = res[0][0].item()
        out["then"] = doubled.wait()[0].item()
        out["work_after_future"] = [work.is_completed(), work.wait(), work.get_future().value()[0][0].item()]
    else:
        time.sleep(delay)
        dist.all_reduce(x, async_op=True).wait()
    # several watched at once, the futures taken in reverse order
    ts = [torch.full((4,), float(rank + i)) for i in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    futs = [w.get_future() for w in reversed(works)]
    torch.futures.wait_all(futs)
    out["many"] = [t[0].item() for t in ts]
    # a future of a finished Work completes at once
    w = dist.all_reduce(torch.ones(2), async_op=True)
    w.wait()
    out["finished_future"] = [w.get_future().done(), w.get_future().value()[0][0].item()]
    dist.barrier()
    out["threads_left"] = task_count(baseline=threads_before) - threads_before
    # abort under a pending future: the future and the Work fail, saying why
    if rank == 0:
        pw = dist.all_reduce(torch.ones(4), group=g, async_op=True)
        pf = pw.get_future()
        chained = pf.then(lambda f: f.value())
        g._get_backend(torch.device("cpu")).abort()
        out["abort"] = [error_of(pf.wait), error_of(chained.wait), error_of(pw.wait)]
        dist.barrier()
    else:
        dist.barrier()  # only after rank 0's abort, so that its error is its own abort's
        g._get_backend(torch.device("cpu")).abort()
    # a peer dies under a pending future
    victim = world - 1
    if rank == victim:
        time.sleep(0.5)
        with open(args["death_file"], "w") as f:
            f.write(repr(time.time()))
        os._exit(9)
    dw = dist.all_reduce(torch.ones(4), async_op=True)
    df = dw.get_future()
    err = error_of(df.wait)
    raised_at = time.time()
    try:
        with open(args["death_file"]) as f:
            out["dead"] = {"error": err, "after_death": raised_at - float(f.read())}
    except FileNotFoundError:  # it failed before the peer died
        out["dead"] = {"error": err, "after_death": -1.0}
    out["dead_work"] = error_of(dw.wait)
    return out


def scenario_dead_peer(rank, world, method, args):
    init(method, rank, world)
    x = torch.ones(1024)
    dist.all_reduce(x)
    victim = world - 1
    if rank == victim:
        time.sleep(0.5)
        with open(args["death_file"], "w") as f:  # when it died, for the survivors' clock
            f.write(repr(time.time()))
        os._exit(9)
    try:
        dist.all_reduce(x)
        return {"raised": None}
    except Exception as e:
        raised_at = time.time()
        with open(args["death_file"]) as f:
            died_at = float(f.read())
        return {"raised": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "msg": str(e)[:500],
                "after_death": raised_at - died_at}


def scenario_mismatch(rank, world, method, args):
    init(method, rank, world)
    t0 = time.monotonic()
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(16))
        else:
            dist.all_reduce(torch.ones(32))
        res = {"raised": None}
    except Exception as e:
        res = {"raised": type(e).__name__, "msg": str(e)[:400], "elapsed": time.monotonic() - t0}
    try:
        dist.destroy_process_group()
    except Exception as e:
        res["destroy"] = str(e)[:200]
    res["shm"] = shm_names()
    return res


def scenario_init_timeout(rank, world, method, args):
    """A kccl group that only `args.alone` creates: its init must give up after the
    group's timeout, with an error."""
    init(method, rank, world, backend="gloo")
    res = {}
    if rank == args["alone"]:
        t0 = time.monotonic()
        try:
            dist.new_group(ranks=list(range(world)), backend="kccl", timeout=datetime.timedelta(seconds=args["timeout"]),
                           use_local_synchronization=True)
            res = {"raised": None}
        except Exception as e:
            res = {"raised": type(e).__name__, "msg": str(e)[:400]}
        res["elapsed"] = time.monotonic() - t0
    else:
        time.sleep(args["timeout"] + 3)
    res["shm"] = shm_names()
    return res


def scenario_lifecycle(rank, world, method, args):
    """init / use / destroy (and abort) of kccl subgroups leave no segment and no thread."""
    init(method, rank, world)
    tasks = []
    for i in range(3):
        g = dist.new_group(backend="kccl")
        x = torch.ones(8)
        dist.all_reduce(x, group=g)
        dist.barrier()
        if i == 2:
            dist.distributed_c10d._abort_process_group(g) if hasattr(dist.distributed_c10d, "_abort_process_group") \
                else g._get_backend(torch.device("cpu")).abort()
        else:
            dist.destroy_process_group(g)
        dist.barrier()
        tasks.append(len(os.listdir("/proc/self/task")))
    shm_live = shm_names()
    dist.destroy_process_group()
    return {"tasks": tasks, "shm_while_world": shm_live, "shm": shm_names(),
            "children": len(open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split())}


def scenario_env_init(rank, world, method, args):
    """env:// (torchrun's and mpiexec's way); the rank comes from RANK or PMI_RANK."""
    backend = args.get("backend", "kccl")
    if "cuda:nccl" in backend and not dist.is_nccl_available():
        backend = backend.replace("cuda:nccl", "cuda:gloo")  # a CPU-only torch has no NCCL
    dist.init_process_group(backend)
    x = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(x)
    out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": x[0].item(),
           "backend": str(dist.get_backend())}
    dist.destroy_process_group()
    out["shm"] = shm_names()
    return out


def main():
    scenario, rank, world, method, args = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], \
        json.loads(sys.argv[5])
    result = globals()["scenario_" + scenario](rank, world, method, args)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
