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


# ------------------------------------------------------------------------------------------
# compare: hypothesis-drawn collectives on a kccl and a gloo group, same inputs

DTYPES = {"bool": torch.bool, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
          "int32": torch.int32, "int64": torch.int64, "uint16": torch.uint16, "uint32": torch.uint32,
          "uint64": torch.uint64, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float32": torch.float32, "float64": torch.float64, "complex64": torch.complex64}
OPS = {"SUM": R.SUM, "PRODUCT": R.PRODUCT, "MIN": R.MIN, "MAX": R.MAX, "AVG": R.AVG}
COLLS = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
         "reduce_scatter_tensor", "gather", "scatter", "all_to_all_single", "all_to_all", "coalesced_all_reduce")
REDUCING = {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "coalesced_all_reduce"}


def make(dtype, shape, op, seed, rank, idx=0, noncontig=False):
    """Rank `rank`'s input: the same on every process for the same arguments."""
    g = torch.Generator().manual_seed(hash((seed, rank, idx)) & 0x7FFFFFFF)
    dt = DTYPES[dtype]
    n = 1
    for d in shape:
        n *= d
    if dt == torch.bool:
        v = torch.rand(n, generator=g) < 0.5
    elif dt.is_complex:
        v = torch.complex(torch.randn(n, generator=g), torch.randn(n, generator=g))
    elif dt.is_floating_point:
        v = (torch.rand(n, generator=g) * 1.5 + 0.5) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0) \
            if op == "PRODUCT" else torch.randn(n, generator=g) * 4
        v = v.to(dt)
    else:
        lo, hi = (-3, 4) if op == "PRODUCT" else (-100, 100)
        if dt in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
            lo = 0
        v = torch.randint(lo, hi, (n,), generator=g).to(dt)
    if noncontig and len(shape) >= 2:
        # the same values, laid out transposed: a non-contiguous view of shape `shape`
        return v.reshape(shape).transpose(0, 1).contiguous().transpose(0, 1)
    return v.reshape(shape)


def reference_reduce(xs, dtype, op):
    """The reduction of every rank's input in a wide type, cast back (KCCL's contract:
    half types accumulate in float32; integer AVG truncates)."""
    dt = DTYPES[dtype]
    if dt == torch.bool:
        s = torch.stack([x.to(torch.int64) for x in xs])
        r = {"SUM": s.amax(0), "MAX": s.amax(0), "PRODUCT": s.amin(0), "MIN": s.amin(0)}[op]
        return r.to(torch.bool)
    wide = torch.float64 if (dt.is_floating_point or dt.is_complex) else torch.int64
    if dt.is_complex:
        wide = torch.complex128
    s = torch.stack([x.to(wide) for x in xs])
    if op == "SUM":
        r = s.sum(0)
    elif op == "PRODUCT":
        r = s.prod(0)
    elif op == "MIN":
        r = s.amin(0)
    elif op == "MAX":
        r = s.amax(0)
    else:
        r = s.sum(0)
        r = r / len(xs) if (dt.is_floating_point or dt.is_complex) else torch.div(r, len(xs), rounding_mode="trunc")
    return r.to(dt)


def close(a, b, dtype, op):
    """None when a matches b for this dtype/op, else a short description."""
    dt = DTYPES[dtype]
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if dt.is_floating_point or dt.is_complex:
        rtol = {torch.float16: 4e-3, torch.bfloat16: 3e-2}.get(dt, 1e-5)
        atol = rtol * (8 if op in ("SUM", "AVG", None) else 1)
        ok = torch.allclose(a.to(torch.complex128 if dt.is_complex else torch.float64),
                            b.to(torch.complex128 if dt.is_complex else torch.float64), rtol=rtol, atol=atol)
    else:
        ok = torch.equal(a, b)
    if ok:
        return None
    return f"{a.flatten()[:6].tolist()} vs {b.flatten()[:6].tolist()}"


def run_collective(case, group, rank, world, seed, use_kccl):
    """(outputs, expected) of one drawn case on `group`; outputs a list of tensors."""
    coll, dtype, shape, op, root, nc, splits = (case[k] for k in ("coll", "dtype", "shape", "op", "root", "nc",
                                                                  "splits"))
    inputs = [make(dtype, shape, op, seed, r, noncontig=nc) for r in range(world)]
    mine = inputs[rank].clone() if not nc else make(dtype, shape, op, seed, rank, noncontig=True)
    dt = DTYPES[dtype]
    opv = OPS.get(op, R.SUM)
    if coll == "all_reduce":
        dist.all_reduce(mine, op=opv, group=group)
        return [mine], [reference_reduce(inputs, dtype, op)]
    if coll == "coalesced_all_reduce":
        second = make(dtype, shape, op, seed, rank, idx=1)
        with dist._coalescing_manager(group=group):
            dist.all_reduce(mine, op=opv, group=group)
            dist.all_reduce(second, op=opv, group=group)
        return [mine, second], [reference_reduce(inputs, dtype, op),
                                reference_reduce([make(dtype, shape, op, seed, r, idx=1) for r in range(world)],
                                                 dtype, op)]
    if coll == "reduce":
        before = mine.clone()
        dist.reduce(mine, dst=root, op=opv, group=group)
        return [mine], [reference_reduce(inputs, dtype, op) if rank == root else before]
    if coll == "broadcast":
        dist.broadcast(mine, src=root, group=group)
        return [mine], [inputs[root]]
    if coll == "all_gather":
        outs = [torch.empty(shape, dtype=dt) for _ in range(world)]
        dist.all_gather(outs, mine, group=group)
        return outs, inputs
    if coll == "all_gather_into_tensor":
        out = torch.empty((world * shape[0],) + tuple(shape[1:]), dtype=dt)
        dist.all_gather_into_tensor(out, mine, group=group)
        return [out], [torch.cat(inputs)]
    if coll == "reduce_scatter":
        ins = [make(dtype, shape, op, seed, rank, idx=2 + d) for d in range(world)]
        out = torch.empty(shape, dtype=dt)
        dist.reduce_scatter(out, ins, op=opv, group=group)
        return [out], [reference_reduce([make(dtype, shape, op, seed, r, idx=2 + rank) for r in range(world)],
                                        dtype, op)]
    if coll == "reduce_scatter_tensor":
        out = torch.empty((shape[0] // world,) + tuple(shape[1:]), dtype=dt)
        dist.reduce_scatter_tensor(out, mine, op=opv, group=group)
        full = reference_reduce(inputs, dtype, op)
        return [out], [full.chunk(world)[rank]]
    if coll == "gather":
        outs = [torch.empty(shape, dtype=dt) for _ in range(world)] if rank == root else None
        dist.gather(mine, outs, dst=root, group=group)
        return (outs, inputs) if rank == root else ([], [])
    if coll == "scatter":
        ins = [make(dtype, shape, op, seed, root, idx=2 + d) for d in range(world)] if rank == root else None
        out = torch.empty(shape, dtype=dt)
        dist.scatter(out, ins, src=root, group=group)
        return [out], [make(dtype, shape, op, seed, root, idx=2 + rank)]
    if coll == "all_to_all_single":
        # splits[s][d]: rows rank s sends to rank d (None: even split of shape[0] rows)
        rows = (lambda s: sum(splits[s])) if splits else (lambda s: shape[0])
        tail = tuple(shape[1:])
        ins = [make(dtype, (rows(s),) + tail, op, seed, s, idx=7) for s in range(world)]
        recv_rows = sum(splits[s][rank] for s in range(world)) if splits else shape[0]
        out = torch.empty((recv_rows,) + tail, dtype=dt)
        dist.all_to_all_single(out, ins[rank].clone(), output_split_sizes=[splits[s][rank] for s in range(world)]
                               if splits else None, input_split_sizes=splits[rank] if splits else None, group=group)
        pieces = []
        for s in range(world):
            sp = splits[s] if splits else [shape[0] // world] * world
            pieces.append(ins[s][sum(sp[:rank]):sum(sp[:rank + 1])])
        return [out], [torch.cat(pieces)]
    if coll == "all_to_all":
        ins = [make(dtype, shape, op, seed, rank, idx=10 + d) for d in range(world)]
        outs = [torch.empty(shape, dtype=dt) for _ in range(world)]
        dist.all_to_all(outs, ins, group=group)
        return outs, [make(dtype, shape, op, seed, s, idx=10 + rank) for s in range(world)]
    raise ValueError(coll)


GLOO_LACKS = {"int16", "uint16", "uint32", "uint64"}


def gloo_takes(case):
    """Whether gloo runs this case (decided alike on every rank: gloo refuses some types
    on one rank only, e.g. at a gather's root)."""
    if case["dtype"] in GLOO_LACKS:
        return False
    dt = DTYPES[case["dtype"]]
    return not (case["op"] == "AVG" and not (dt.is_floating_point or dt.is_complex))


def scenario_compare(rank, world, method, args):
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st
    init(method, rank, world)
    gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=15))
    problems, checked, gloo_checked = [], [0], [0]

    @st.composite
    def cases(draw):
        coll = draw(st.sampled_from(COLLS))
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        op = draw(st.sampled_from(sorted(OPS))) if coll in REDUCING else None
        if op == "AVG" and dtype == "bool":
            op = "SUM"
        if DTYPES[dtype].is_complex and op in ("PRODUCT", "MIN", "MAX"):
            op = "SUM"
        big = draw(st.integers(0, 9)) == 0  # sometimes larger than the KCCL slot (the test sets it small)
        if big:
            shape = [draw(st.integers(1, 3)) * world * 1024]
        else:
            shape = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
        if coll in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            shape[0] = max(shape[0], 1) * world if coll == "reduce_scatter_tensor" else shape[0]
        if coll == "all_to_all_single" and not draw(st.booleans()):
            shape[0] = shape[0] * world
            splits = None
        elif coll == "all_to_all_single":
            splits = draw(st.lists(st.lists(st.integers(0, 3), min_size=world, max_size=world),
                                   min_size=world, max_size=world))
        else:
            splits = None
        nc = len(shape) >= 2 and draw(st.booleans()) and coll not in ("all_to_all_single",)
        return {"coll": coll, "dtype": dtype, "shape": shape, "op": op, "root": draw(st.integers(0, world - 1)),
                "nc": nc, "splits": splits}

    @settings(max_examples=args.get("examples", 60), derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=cases(), seed=st.integers(0, 2**20))
    def check(case, seed):
        checked[0] += 1
        try:
            k_out, expected = run_collective(case, None, rank, world, seed, True)
        except Exception as e:  # every rank raises alike (argument checks), or reports it
            problems.append(f"{case}: kccl raised {type(e).__name__}: {e}")
            dist.barrier()
            return
        for a, b in zip(k_out, expected):
            why = close(a, b, case["dtype"], case["op"])
            if why:
                problems.append(f"{case} seed={seed}: kccl vs reference: {why}")
        if not gloo_takes(case):  # a dtype/op gloo lacks: the reference alone
            return
        try:
            g_out, _ = run_collective(case, gloo, rank, world, seed, False)
        except Exception as e:
            problems.append(f"{case}: gloo raised {type(e).__name__}: {e}")
            raise
        gloo_checked[0] += 1
        for a, b in zip(k_out, g_out):
            why = close(a, b, case["dtype"], case["op"])
            if why:
                problems.append(f"{case} seed={seed}: kccl vs gloo: {why}")

    check()
    dist.destroy_process_group()
    return {"problems": problems[:20], "checked": checked[0], "gloo_checked": gloo_checked[0], "shm": shm_names()}


# ------------------------------------------------------------------------------------------

def scenario_refusals(rank, world, method, args):
    """Unsupported ops raise at once, on every rank, and the group still works after."""
    init(method, rank, world)
    out = {}
    t = torch.ones(4)
    for name, fn in [("BAND", lambda: dist.all_reduce(t.to(torch.int32), op=R.BAND)),
                     ("PREMUL_SUM", lambda: dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))),
                     ("send", lambda: dist.send(t, dst=(rank + 1) % world)),
                     ("recv", lambda: dist.recv(t, src=(rank + 1) % world)),
                     ("complex_max", lambda: dist.all_reduce(torch.ones(2, dtype=torch.complex64), op=R.MAX)),
                     ("bool_avg", lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool), op=R.AVG)),
                     ("float8", lambda: dist.all_reduce(torch.ones(2).to(torch.float8_e4m3fn)))]:
        t0 = time.monotonic()
        try:
            fn()
            out[name] = "no error"
        except Exception as e:
            out[name] = [type(e).__name__, str(e).splitlines()[0][:300], time.monotonic() - t0]
    x = torch.full((3,), float(rank))
    dist.all_reduce(x)
    out["after"] = x.tolist()
    dist.destroy_process_group()
    out["shm"] = shm_names()
    return out


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
