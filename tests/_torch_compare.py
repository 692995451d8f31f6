"""The differential test of the kccl backend against gloo (run inside the ranks by
tests/_torch_scenarios.py, scenario "compare"): hypothesis draws a call of
torch.distributed (every collective, coalesced and list form, point-to-point form and
object collective the backend serves), a dtype, an op, shapes, a group (the world or a
subgroup) and a form (blocking, async_op=True then wait(), or get_future().wait()); both
backends run it on the same inputs, and the outputs must be

  - equal to gloo's, bit for bit, where the result does not depend on a reduction order:
    data movement, integer and bool reductions, MIN and MAX, and any reduction of two
    ranks but AVG (one operation, rounded once by both);
  - within rounding of gloo's otherwise (KCCL sums half types in float32 and rounds once,
    gloo in the half type), and within rounding of a float64 reference always.

Every rank draws the same cases (derandomized), so all call the same collectives."""
import datetime

import torch
import torch.distributed as dist

import kccl.torch

R = dist.ReduceOp
DTYPES = {"bool": torch.bool, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
          "int32": torch.int32, "int64": torch.int64, "uint16": torch.uint16, "uint32": torch.uint32,
          "uint64": torch.uint64, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float32": torch.float32, "float64": torch.float64, "complex64": torch.complex64}
OPS = {"SUM": R.SUM, "PRODUCT": R.PRODUCT, "MIN": R.MIN, "MAX": R.MAX, "AVG": R.AVG}
REDUCING = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "coalesced_all_reduce",
            "all_reduce_coalesced", "coalesced_reduce_scatter_tensor")
MOVING = ("broadcast", "all_gather", "all_gather_into_tensor", "all_gather_coalesced", "coalesced_all_gather",
          "gather", "scatter", "all_to_all_single", "all_to_all", "send_recv", "isend_irecv", "batch_isend_irecv",
          "recv_any_source", "object_collectives")
COLLS = REDUCING + MOVING
ASYNC_OK = set(COLLS) - {"send_recv", "recv_any_source", "object_collectives", "coalesced_all_reduce",
                         "coalesced_reduce_scatter_tensor", "coalesced_all_gather"}
GLOO_LACKS = {"int16", "uint16", "uint32", "uint64"}


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
    wide = torch.complex128 if dt.is_complex else torch.float64 if dt.is_floating_point else torch.int64
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
    """None when a is within rounding of b for this dtype/op (equal for integers), else why."""
    dt = DTYPES[dtype]
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    if dt.is_floating_point or dt.is_complex:
        rtol = {torch.float16: 4e-3, torch.bfloat16: 3e-2}.get(dt, 1e-5)
        atol = rtol * (8 if op in ("SUM", "AVG", None) else 1)
        wide = torch.complex128 if dt.is_complex else torch.float64
        ok = torch.allclose(a.to(wide), b.to(wide), rtol=rtol, atol=atol)
    else:
        ok = torch.equal(a, b)
    return None if ok else f"{a.flatten()[:6].tolist()} vs {b.flatten()[:6].tolist()}"


def exact_vs_gloo(case, size):
    """Whether kccl's result must equal gloo's bit for bit (see the module's docstring)."""
    if case["coll"] in MOVING:
        return True
    dt = DTYPES[case["dtype"]]
    if not (dt.is_floating_point or dt.is_complex) or case["op"] in ("MIN", "MAX"):
        return True
    return size == 2 and case["op"] in ("SUM", "PRODUCT")


def gloo_takes(case):
    """Whether gloo runs this case (decided alike on every rank: gloo refuses some types
    on one rank only, e.g. at a gather's root)."""
    if case["dtype"] in GLOO_LACKS:
        return False
    dt = DTYPES[case["dtype"]]
    return not (case["op"] == "AVG" and not (dt.is_floating_point or dt.is_complex))


def finish(work, form):
    """Completes an async call the way the case says."""
    if work is None:
        return
    if form == "future":
        work.get_future().wait()
    else:
        work.wait()


def run_case(case, group, grank, gsize, seed):
    """(outputs, expected) of one drawn case on `group` (this rank is grank of gsize)."""
    coll, dtype, shape, op, root, nc, splits, form = (case[k] for k in ("coll", "dtype", "shape", "op", "root",
                                                                        "nc", "splits", "form"))
    root = root % gsize
    asyn = form != "blocking" and coll in ASYNC_OK
    kw = {"group": group, "async_op": True} if asyn else {"group": group}
    inputs = [make(dtype, shape, op, seed, r, noncontig=nc) for r in range(gsize)]
    mine = make(dtype, shape, op, seed, grank, noncontig=nc)
    dt = DTYPES[dtype]
    opv = OPS.get(op, R.SUM)
    gdst = dist.get_global_rank(group, root) if group is not None else root
    nxt, prv = (grank + 1) % gsize, (grank - 1) % gsize
    g_of = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    if coll == "all_reduce":
        finish(dist.all_reduce(mine, op=opv, **kw), form)
        return [mine], [reference_reduce(inputs, dtype, op)]
    if coll in ("coalesced_all_reduce", "all_reduce_coalesced"):
        second = make(dtype, shape[::-1], op, seed, grank, idx=1)
        want2 = reference_reduce([make(dtype, shape[::-1], op, seed, r, idx=1) for r in range(gsize)], dtype, op)
        if coll == "all_reduce_coalesced":
            finish(dist.all_reduce_coalesced([mine, second], op=opv, **kw), form)
        else:
            with dist._coalescing_manager(group=group):
                dist.all_reduce(mine, op=opv, group=group)
                dist.all_reduce(second, op=opv, group=group)
        return [mine, second], [reference_reduce(inputs, dtype, op), want2]
    if coll == "reduce":
        before = mine.clone()
        finish(dist.reduce(mine, dst=gdst, op=opv, **kw), form)
        return [mine], [reference_reduce(inputs, dtype, op) if grank == root else before]
    if coll == "broadcast":
        finish(dist.broadcast(mine, src=gdst, **kw), form)
        return [mine], [inputs[root]]
    if coll == "all_gather":
        outs = [torch.empty(shape, dtype=dt) for _ in range(gsize)]
        finish(dist.all_gather(outs, mine, **kw), form)
        return outs, inputs
    if coll == "all_gather_into_tensor":
        out = torch.empty((gsize * shape[0],) + tuple(shape[1:]), dtype=dt)
        finish(dist.all_gather_into_tensor(out, mine, **kw), form)
        return [out], [torch.cat(inputs)]
    if coll == "all_gather_coalesced":
        second = make(dtype, [3], op, seed, grank, idx=1)
        outs = [[torch.empty(shape, dtype=dt), torch.empty(3, dtype=dt)] for _ in range(gsize)]
        finish(dist.all_gather_coalesced(outs, [mine, second], **kw), form)
        want = [[inputs[r], make(dtype, [3], op, seed, r, idx=1)] for r in range(gsize)]
        return [t for l in outs for t in l], [t for l in want for t in l]
    if coll == "coalesced_all_gather":
        second = make(dtype, [2], op, seed, grank, idx=1)
        out1 = torch.empty((gsize * shape[0],) + tuple(shape[1:]), dtype=dt)
        out2 = torch.empty(2 * gsize, dtype=dt)
        with dist._coalescing_manager(group=group):
            dist.all_gather_into_tensor(out1, mine, group=group)
            dist.all_gather_into_tensor(out2, second, group=group)
        return [out1, out2], [torch.cat(inputs), torch.cat([make(dtype, [2], op, seed, r, idx=1)
                                                             for r in range(gsize)])]
    if coll == "reduce_scatter":
        ins = [make(dtype, shape, op, seed, grank, idx=2 + d) for d in range(gsize)]
        out = torch.empty(shape, dtype=dt)
        finish(dist.reduce_scatter(out, ins, op=opv, **kw), form)
        return [out], [reference_reduce([make(dtype, shape, op, seed, r, idx=2 + grank) for r in range(gsize)],
                                        dtype, op)]
    if coll in ("reduce_scatter_tensor", "coalesced_reduce_scatter_tensor"):
        out = torch.empty((shape[0] // gsize,) + tuple(shape[1:]), dtype=dt)
        if coll == "reduce_scatter_tensor":
            finish(dist.reduce_scatter_tensor(out, mine, op=opv, **kw), form)
        else:
            with dist._coalescing_manager(group=group):
                dist.reduce_scatter_tensor(out, mine, op=opv, group=group)
        return [out], [reference_reduce(inputs, dtype, op).chunk(gsize)[grank]]
    if coll == "gather":
        outs = [torch.empty(shape, dtype=dt) for _ in range(gsize)] if grank == root else None
        finish(dist.gather(mine, outs, dst=gdst, **kw), form)
        return (outs, inputs) if grank == root else ([], [])
    if coll == "scatter":
        ins = [make(dtype, shape, op, seed, root, idx=2 + d) for d in range(gsize)] if grank == root else None
        out = torch.empty(shape, dtype=dt)
        finish(dist.scatter(out, ins, src=gdst, **kw), form)
        return [out], [make(dtype, shape, op, seed, root, idx=2 + grank)]
    if coll == "all_to_all_single":
        # splits[s][d]: rows rank s sends to rank d (None: even split of shape[0] rows)
        sp = [row[:gsize] for row in splits[:gsize]] if splits else None
        rows = (lambda s: sum(sp[s])) if sp else (lambda s: shape[0])
        tail = tuple(shape[1:])
        ins = [make(dtype, (rows(s),) + tail, op, seed, s, idx=7) for s in range(gsize)]
        recv_rows = sum(sp[s][grank] for s in range(gsize)) if sp else shape[0]
        out = torch.empty((recv_rows,) + tail, dtype=dt)
        finish(dist.all_to_all_single(out, ins[grank].clone(),
                                      output_split_sizes=[sp[s][grank] for s in range(gsize)] if sp else None,
                                      input_split_sizes=sp[grank] if sp else None, **kw), form)
        pieces = []
        for s in range(gsize):
            row = sp[s] if sp else [shape[0] // gsize] * gsize
            pieces.append(ins[s][sum(row[:grank]):sum(row[:grank + 1])])
        return [out], [torch.cat(pieces)]
    if coll == "all_to_all":
        ins = [make(dtype, shape, op, seed, grank, idx=10 + d) for d in range(gsize)]
        outs = [torch.empty(shape, dtype=dt) for _ in range(gsize)]
        finish(dist.all_to_all(outs, ins, **kw), form)
        return outs, [make(dtype, shape, op, seed, s, idx=10 + grank) for s in range(gsize)]
    if coll in ("send_recv", "isend_irecv", "batch_isend_irecv", "recv_any_source"):
        # a ring: each rank sends its tensor to the next and receives the previous one's
        got = torch.empty(shape, dtype=dt)
        tag = case["tag"]
        if coll == "batch_isend_irecv":
            ops = [dist.P2POp(dist.isend, mine, g_of(nxt), group, tag),
                   dist.P2POp(dist.irecv, got, g_of(prv), group, tag)]
            for w in dist.batch_isend_irecv(ops):
                finish(w, form)
        elif coll == "isend_irecv":
            ws = [dist.irecv(got, g_of(prv), group=group, tag=tag), dist.isend(mine, g_of(nxt), group=group, tag=tag)]
            for w in ws:
                finish(w, form)
        elif coll == "recv_any_source":
            # rank 0 of the group receives from every other, from any source, in whatever order
            if grank == 0:
                seen = {}
                for _ in range(gsize - 1):
                    t = torch.empty(shape, dtype=dt)
                    src = dist.recv(t, group=group, tag=tag)
                    seen[dist.get_group_rank(group, src) if group is not None else src] = t
                return [seen[r] for r in range(1, gsize)], [make(dtype, shape, op, seed, r, noncontig=nc)
                                                            for r in range(1, gsize)]
            dist.send(mine, g_of(0), group=group, tag=tag)
            return [], []
        else:
            if grank % 2 == 0:
                dist.send(mine, g_of(nxt), group=group, tag=tag)
                dist.recv(got, g_of(prv), group=group, tag=tag)
            else:
                dist.recv(got, g_of(prv), group=group, tag=tag)
                dist.send(mine, g_of(nxt), group=group, tag=tag)
        return [got], [inputs[prv]]
    if coll == "object_collectives":
        objs = [None] * gsize
        dist.all_gather_object(objs, {"rank": grank, "seed": seed}, group=group)
        lst = [("from root", seed)] if grank == root else [None]
        dist.broadcast_object_list(lst, src=gdst, group=group)
        want_objs = [{"rank": r, "seed": seed} for r in range(gsize)]
        ok = objs == want_objs and lst == [("from root", seed)]
        return [torch.tensor([ok])], [torch.tensor([True])]
    raise ValueError(coll)


def scenario_compare(rank, world, method, args, init):
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st
    init(method, rank, world)
    timeout = datetime.timedelta(seconds=30)
    sub_ranks = list(range(0, world, 2)) if world > 2 else [0, 1]
    groups = {"world": (None, dist.new_group(backend="gloo", timeout=timeout)),
              "sub": (dist.new_group(sub_ranks, backend="kccl", timeout=timeout),
                      dist.new_group(sub_ranks, backend="gloo", timeout=timeout))}
    problems, counts = [], {"checked": 0, "gloo_checked": 0, "exact": 0, "async": 0, "sub": 0}

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
            shape = [draw(st.integers(1, 3)) * 12 * 1024]
        else:
            shape = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
        if coll in ("reduce_scatter_tensor", "coalesced_reduce_scatter_tensor"):
            shape[0] = max(shape[0], 1) * 12  # a multiple of every group size drawn
        splits = None
        if coll == "all_to_all_single":
            if draw(st.booleans()):
                shape[0] = shape[0] * 12
            else:
                splits = draw(st.lists(st.lists(st.integers(0, 3), min_size=world, max_size=world),
                                       min_size=world, max_size=world))
        nc = len(shape) >= 2 and draw(st.booleans()) and coll not in ("all_to_all_single",)
        return {"coll": coll, "dtype": dtype, "shape": shape, "op": op, "root": draw(st.integers(0, world - 1)),
                "nc": nc, "splits": splits, "group": draw(st.sampled_from(["world", "world", "sub"])),
                "form": draw(st.sampled_from(["blocking", "wait", "future"])), "tag": draw(st.integers(0, 5)),
                "p2p_min": draw(st.sampled_from([0, 1 << 40]))}

    @settings(max_examples=args.get("examples", 60), derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=cases(), seed=st.integers(0, 2**20))
    def check(case, seed):
        kgroup, ggroup = groups[case["group"]]
        members = sub_ranks if case["group"] == "sub" else list(range(world))
        if rank not in members:
            return
        grank, gsize = members.index(rank), len(members)
        # gather / scatter / all_to_all: point-to-point or KCCL collectives, as drawn
        kccl.torch.set_p2p_min_bytes(case["p2p_min"], kgroup)
        counts["checked"] += 1
        counts["async"] += case["form"] != "blocking" and case["coll"] in ASYNC_OK
        counts["sub"] += case["group"] == "sub"
        try:
            k_out, expected = run_case(case, kgroup, grank, gsize, seed)
        except Exception as e:  # every rank raises alike (argument checks), or reports it
            problems.append(f"{case}: kccl raised {type(e).__name__}: {e}")
            dist.barrier(group=ggroup)
            return
        for a, b in zip(k_out, expected):
            why = close(a, b, case["dtype"], case["op"])
            if why:
                problems.append(f"{case} seed={seed}: kccl vs reference: {why}")
        if not gloo_takes(case):  # a dtype/op gloo lacks: the reference alone
            return
        try:
            g_out, _ = run_case(case, ggroup, grank, gsize, seed)
        except Exception as e:
            problems.append(f"{case}: gloo raised {type(e).__name__}: {e}")
            raise
        counts["gloo_checked"] += 1
        exact = exact_vs_gloo(case, gsize)
        counts["exact"] += exact
        for a, b in zip(k_out, g_out):
            if exact:
                if not (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)):
                    problems.append(f"{case} seed={seed}: kccl differs from gloo (expected bitwise): "
                                    f"{a.flatten()[:6].tolist()} vs {b.flatten()[:6].tolist()}")
            elif why := close(a, b, case["dtype"], case["op"]):
                problems.append(f"{case} seed={seed}: kccl vs gloo: {why}")

    check()
    dist.destroy_process_group()
    return {"problems": problems[:20], **counts}
