"""Multi-rank test harness: real worker processes that serve commands.

A `Farm` spawns worker processes (multiprocessing "spawn" context, so every
worker is a fresh interpreter, as in production).  Each worker waits on its
end of a Pipe for commands `(task_name, kwargs)`, runs the task from TASKS and
sends back ("ok", small_result) or ("error", text, traceback).  A task may also
send ("note", obj) messages while it runs (used to say "the stream started").

Correctness tasks get a seed and parameters; every worker generates *all*
ranks' inputs deterministically from (seed, rank), computes the numpy
reference itself, runs the collective on its own input, and sends back only
None (match) or a short description of the first mismatch.

`Group` is a communicator of size n over workers 0..n-1 of a farm (one per
algorithm: the workers hold a communicator per KCCL_ALGO).  The session's
correctness tests share one farm of 8 workers and build groups of 1, 2, 3, 4
and 8 ranks on it; failure tests that SIGKILL workers spawn their own farm.

This module is imported by the workers: keep its top-level imports cheap
(no pytest, no hypothesis)."""
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback

import numpy as np

DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "bfloat16", "float32", "float64")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
OPS = ("SUM", "PROD", "MAX", "MIN", "AVG")
ALGOS = ("oneshot", "twoshot", "auto")
from kccl.config import BY_NAME as _SETTINGS
CHUNK_BYTES = _SETTINGS["KCCL_CHUNK_BYTES"].default  # the piece a blocking collective moves per step
ONESHOT_MAX_BYTES = _SETTINGS["KCCL_ONESHOT_MAX_BYTES"].default  # auto's crossover
GROUP_TIMEOUT_MS = 20000       # KCCL timeout of the long-lived groups: a hang becomes an error
RUN_TIMEOUT_S = 60.0           # parent-side bound on one command (> GROUP_TIMEOUT_MS)
SHM_DIR = "/dev/shm"
SHM_PREFIX = "kccl-"


# ----------------------------------------------------------------------------------------------
# data: deterministic inputs, numpy references, comparison

def np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def acc_dtype(name):
    """Accumulation type of the reference: float32 for the half types (KCCL's contract)."""
    return np.dtype(np.float32) if name in ("float16", "bfloat16") else np_dtype(name)


def make_input(dtype, op, count, seed, rank):
    """Rank `rank`'s input for (seed, dtype, op): the same on every process."""
    rng = np.random.default_rng([seed, rank, DTYPES.index(dtype), OPS.index(op) if op else 9])
    dt = np_dtype(dtype)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        full = rng.integers(info.min, info.max, size=count, dtype=dt, endpoint=True)
        if op != "PROD":
            return full  # the whole range: sums wrap
        # mostly small factors so products do not all collapse to 0 mod 2^k; some full-range ones
        small = rng.integers(0 if info.min == 0 else -4, 5, size=count).astype(dt)
        return np.where(rng.random(count) < 0.8, small, full)
    if op == "PROD":  # |x| in [0.5, 2]: a product of 8 stays well inside float16's range
        mag = rng.uniform(0.5, 2.0, size=count)
        v = np.where(rng.random(count) < 0.5, -mag, mag)
    else:
        v = rng.standard_normal(count) * 64.0
        u = rng.random(count)
        v[u < 0.02] = 0.0
        v[(u >= 0.02) & (u < 0.03)] = -0.0
        v[(u >= 0.03) & (u < 0.06)] = np.round(v[(u >= 0.03) & (u < 0.06)])
    return v.astype(np.float32).astype(dt) if dtype == "bfloat16" else v.astype(dt)


def _combine(op, acc, x):
    if op in ("SUM", "AVG"):
        return acc + x
    if op == "PROD":
        return acc * x
    if op == "MAX":
        return np.maximum(acc, x)
    if op == "MIN":
        return np.minimum(acc, x)
    raise ValueError(op)


def reduce_reference(dtype, op, inputs, nranks):
    """acc = x0; acc = acc op x1; ... in rank order, in the accumulation type; AVG = sum / nranks
    (floats: true division in the accumulation type; integers: the wrapped sum divided
    truncating toward zero, as C does); then one rounding to the storage type."""
    at = acc_dtype(dtype)
    acc = None
    for x in inputs:  # an iterable: big inputs are generated one at a time
        x = x.astype(at)
        acc = x if acc is None else _combine(op, acc, x)
    if op == "AVG":
        if at.kind == "f":
            acc = acc / at.type(nranks)
        else:
            n = at.type(nranks)
            q = acc // n                                   # floor ...
            q = q + ((acc % n != 0) & (acc < 0)).astype(at)  # ... to truncation
            acc = q
    return acc.astype(np_dtype(dtype))


def all_inputs(dtype, op, count, seed, nranks):
    return (make_input(dtype, op, count, seed, r) for r in range(nranks))


def describe_diff(got, want, what="result"):
    """None when got == want exactly, else a short description.

    Integers: bitwise.  Floats: exact value equality (no NaN is ever produced), which only
    forgives the sign of a zero: max(+0, -0) may legitimately be either."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{what}: shape/dtype {got.shape}/{got.dtype}, expected {want.shape}/{want.dtype}"
    if got.dtype.kind in "iu":
        eq = got == want
    else:
        g, w = got.astype(np.float64), want.astype(np.float64)
        eq = g == w
    if eq.all():
        return None
    bad = np.flatnonzero(~eq.ravel())
    i = int(bad[0])
    return (f"{what}: {bad.size}/{got.size} elements differ; first at [{i}]: "
            f"got {got.ravel()[i]!r}, expected {want.ravel()[i]!r}")


def same_bytes(a, b):
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def sentinel_like(count, dtype):
    """A recv buffer full of a recognisable byte pattern (0xa5: a finite value in every float type)."""
    dt = np_dtype(dtype)
    return np.full(count * dt.itemsize, 0xA5, np.uint8).view(dt)


# ----------------------------------------------------------------------------------------------
# worker side

class _Ctx:
    def __init__(self, conn, index):
        self.conn = conn
        self.index = index      # the worker's index in its farm
        self.comms = {}         # (key, algo) -> Communicator
        self.held = {}          # communicators kept between commands

    def note(self, obj):
        self.conn.send(("note", obj))


def _worker_main(conn, index, block_ml_dtypes):
    if block_ml_dtypes:  # failure-test farms need no bfloat16: importing ml_dtypes costs ~1 s
        sys.modules["ml_dtypes"] = None
    import kccl  # noqa: F401  (import once, up front)
    ctx = _Ctx(conn, index)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        name, kw = msg
        try:
            reply = ("ok", TASKS[name](ctx, **kw))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            reply = ("error", f"{type(e).__name__}: {e}", traceback.format_exc(limit=-6))
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            break
    for c in list(ctx.comms.values()) + list(ctx.held.values()):
        c.close()


def _comm(ctx, key, algo="auto"):
    return ctx.comms[(key, algo)]


def _err(e):
    return {"type": type(e).__name__, "msg": str(e)}


def _outcome(fn):
    """Runs fn() once: {"type": None or the KcclError's class name, "msg": its text,
    "is_timeout_error" (on errors), "t0"/"t1": monotonic times before and after}."""
    import kccl
    t0 = time.monotonic()
    try:
        fn()
        out = {"type": None, "msg": ""}
    except kccl.KcclError as e:
        out = _err(e)
        out["is_timeout_error"] = isinstance(e, TimeoutError)
    out["t0"], out["t1"] = t0, time.monotonic()
    return out


def task_init_group(ctx, key, nranks, rank, uids, config):
    import kccl
    for k in [k for k in ctx.comms if k[0] == key]:
        ctx.comms.pop(k).close()
    for algo, uid in uids.items():
        ctx.comms[(key, algo)] = kccl.Communicator(nranks, kccl.UniqueId(uid), rank,
                                                   config=dict(config, algo=algo))
    return os.getpid()


def task_allreduce(ctx, key, rank, nranks, algo, dtype, op, count, inplace, seed):
    import kccl
    comm = _comm(ctx, key, algo)
    want = reduce_reference(dtype, op, all_inputs(dtype, op, count, seed, nranks), nranks)
    send = make_input(dtype, op, count, seed, rank)
    kop = getattr(kccl, op)
    if inplace:
        buf = send.copy()
        out = comm.all_reduce(buf, op=kop)
        if out is not buf:
            return "in-place all_reduce did not return its buffer"
        return describe_diff(buf, want, f"rank {rank} in-place")
    keep = send.copy()
    recv = sentinel_like(count, dtype)
    out = comm.all_reduce(send, recv, op=kop)
    if out is not recv:
        return "all_reduce did not return recv"
    if not same_bytes(send, keep):
        return f"rank {rank}: all_reduce modified its send buffer"
    return describe_diff(recv, want, f"rank {rank}")


def task_allgather(ctx, key, rank, nranks, dtype, count, inplace, seed, algo="auto"):
    comm = _comm(ctx, key, algo)
    want = np.stack([make_input(dtype, None, count, seed, r) for r in range(nranks)])
    send = make_input(dtype, None, count, seed, rank)
    if inplace:  # send is this rank's block of recv
        recv = sentinel_like(nranks * count, dtype).reshape(nranks, count)
        recv[rank] = send
        out = comm.all_gather(recv[rank], recv)
    else:
        keep = send.copy()
        recv = sentinel_like(nranks * count, dtype).reshape(nranks, count)
        out = comm.all_gather(send, recv)
        if not same_bytes(send, keep):
            return f"rank {rank}: all_gather modified its send buffer"
    if out is not recv:
        return "all_gather did not return recv"
    return describe_diff(recv, want, f"rank {rank} all_gather")


def task_allgather_alloc(ctx, key, rank, nranks, dtype, count, seed):
    """recv=None: all_gather allocates shape (size, *send.shape)."""
    comm = _comm(ctx, key)
    want = np.stack([make_input(dtype, None, count, seed, r).reshape(count, 1) for r in range(nranks)])
    out = comm.all_gather(make_input(dtype, None, count, seed, rank).reshape(count, 1))
    return describe_diff(out, want, f"rank {rank} all_gather(recv=None)")


def task_reduce_scatter(ctx, key, rank, nranks, dtype, op, count, inplace, seed, algo="auto"):
    import kccl
    comm = _comm(ctx, key, algo)
    total = count * nranks
    full = reduce_reference(dtype, op, all_inputs(dtype, op, total, seed, nranks), nranks)
    want = full[rank * count:(rank + 1) * count]
    send = make_input(dtype, op, total, seed, rank)
    kop = getattr(kccl, op)
    if inplace:  # recv is this rank's block of send
        recv = send[rank * count:(rank + 1) * count]
        out = comm.reduce_scatter(send, recv, op=kop)
    else:
        keep = send.copy()
        recv = sentinel_like(count, dtype)
        out = comm.reduce_scatter(send, recv, op=kop)
        if not same_bytes(send, keep):
            return f"rank {rank}: reduce_scatter modified its send buffer"
    if out is not recv:
        return "reduce_scatter did not return recv"
    return describe_diff(recv, want, f"rank {rank} reduce_scatter")


def task_reduce_scatter_alloc(ctx, key, rank, nranks, dtype, op, count, seed):
    import kccl
    comm = _comm(ctx, key)
    total = count * nranks
    full = reduce_reference(dtype, op, all_inputs(dtype, op, total, seed, nranks), nranks)
    out = comm.reduce_scatter(make_input(dtype, op, total, seed, rank), op=getattr(kccl, op))
    return describe_diff(out, full[rank * count:(rank + 1) * count], f"rank {rank} reduce_scatter(recv=None)")


def task_broadcast(ctx, key, rank, nranks, dtype, count, root, seed, algo="auto"):
    comm = _comm(ctx, key, algo)
    want = make_input(dtype, None, count, seed, root)
    buf = make_input(dtype, None, count, seed, rank) if rank == root else sentinel_like(count, dtype)
    out = comm.broadcast(buf, root=root)
    if out is not buf:
        return "broadcast did not return buf"
    return describe_diff(buf, want, f"rank {rank} broadcast(root={root})")


def task_broadcast_roots(ctx, key, rank, nranks, dtype, counts, seed):
    """Every root in turn, for each count."""
    for count in counts:
        for root in range(nranks):
            why = task_broadcast(ctx, key, rank, nranks, dtype, count, root, seed + root)
            if why:
                return f"count={count}: {why}"
    return None


def task_barrier(ctx, key, rank, nranks, delays):
    """Arrive after delays[i] seconds, leave the barrier: (arrive, leave) monotonic times per round."""
    comm = _comm(ctx, key)
    times = []
    for d in delays:
        time.sleep(d)
        t_arrive = time.monotonic()
        comm.barrier()
        times.append((t_arrive, time.monotonic()))
    return times


def task_sequence(ctx, key, rank, nranks, steps):
    """Several different collectives back to back (they share step numbers and buffers)."""
    for i, (kind, kw) in enumerate(steps):
        fn = {"allreduce": task_allreduce, "allgather": task_allgather,
              "reduce_scatter": task_reduce_scatter, "broadcast": task_broadcast}.get(kind)
        if kind == "barrier":
            _comm(ctx, key).barrier()
            continue
        why = fn(ctx, key, rank, nranks, **kw)
        if why:
            return f"step {i} ({kind} {kw}): {why}"
    return None


def task_small_loop(ctx, key, rank, nranks, iters, algo, count=16):
    """iters small in-place all-reduces, each checked: (seconds, first problem or None)."""
    import kccl
    comm = _comm(ctx, key, algo)
    base = np.arange(count, dtype=np.float32)
    expect_base = base * nranks
    tri = nranks * (nranks - 1) // 2
    t0 = time.monotonic()
    problem = None
    for i in range(iters):
        x = base + np.float32(rank + (i % 7))
        comm.all_reduce(x, op=kccl.SUM)
        if problem is None and not np.array_equal(x, expect_base + np.float32(tri + nranks * (i % 7))):
            problem = f"iteration {i}: got {x[:4]}..."
    return time.monotonic() - t0, problem


# -- failure tasks ------------------------------------------------------------------------------

def _fresh(uid, nranks, rank, config, sync=True):
    """A new communicator; sync: a barrier first, so that no rank can fail on purpose while a
    slower one is still in init (which trips the init race of test_init_survives_peers_that_close_at_once)."""
    import kccl
    comm = kccl.Communicator(nranks, kccl.UniqueId(uid), rank, config=config)
    if sync:
        comm.barrier()
    return comm


def _after(comm):
    """What a further call on a broken communicator raises (type name), and async_error()."""
    import kccl
    try:
        comm.all_reduce(np.zeros(4, np.float32))
        after = None
    except kccl.KcclError as e:
        after = type(e).__name__
    try:
        ae = comm.async_error()
        ae = None if ae is None else type(ae).__name__
    except kccl.KcclError as e:
        ae = "raised " + type(e).__name__
    return after, ae


MISMATCH_KINDS = ("count", "count0", "count_chunks", "dtype", "op", "coll_broadcast", "coll_barrier",
                  "coll_reduce_scatter", "root", "coll_allgather")


def task_mismatch(ctx, uid, nranks, rank, kind, odd_rank, delay=0.0, timeout_ms=GROUP_TIMEOUT_MS, config=None):
    """Rank odd_rank calls something different (after `delay` s); returns what this rank saw."""
    import kccl
    comm = _fresh(uid, nranks, rank, dict(config or {}, timeout_ms=timeout_ms))
    time.sleep(delay)
    try:
        odd = rank == odd_rank
        count, dtype, op, call = 1000, np.float32, kccl.SUM, "allreduce"
        root = 0
        if kind == "count" and odd:
            count += 1
        elif kind == "count0" and odd:
            count = 0
        elif kind == "count_chunks":  # several chunks each: detected at the first one
            count = 300_000 + (1 if odd else 0)
        elif kind == "dtype" and odd:
            dtype = np.int32
        elif kind == "op" and odd:
            op = kccl.MAX
        elif kind.startswith("coll_") and odd:
            call = kind[5:]
        elif kind == "root":
            call, root = "broadcast", (1 if odd else 0)
        send = np.arange(count, dtype=dtype) + dtype(rank + 1)
        if call == "allgather":
            recv = np.full((nranks, count), 7, dtype)
        elif call == "reduce_scatter":
            send = np.arange(count * nranks, dtype=dtype)
            recv = np.full(count, 7, dtype)
        elif call == "broadcast":
            recv = send if rank == root else np.full(count, 7, dtype)
        else:
            recv = np.full(count, 7, dtype)
        before = recv.copy()
        calls = {"allreduce": lambda: comm.all_reduce(send, recv, op=op),
                 "allgather": lambda: comm.all_gather(send, recv),
                 "reduce_scatter": lambda: comm.reduce_scatter(send, recv, op=op),
                 "broadcast": lambda: comm.broadcast(recv, root=root),
                 "barrier": comm.barrier}
        out = _outcome(calls[call])
        out["seconds"] = out["t1"] - out["t0"]
        out["unchanged"] = same_bytes(recv, before)
        out["call"] = call
        out["after"], out["async"] = _after(comm)
        return out
    finally:
        comm.close()


def task_abort(ctx, uid, nranks, rank, victim, delay, count):
    comm = _fresh(uid, nranks, rank, {"timeout_ms": GROUP_TIMEOUT_MS})
    try:
        if rank == victim:
            time.sleep(delay)
            t = time.monotonic()
            comm.abort()
            out = {"t_abort": t, "closed": comm.closed}
            out["after"], _ = (_after(comm)[0], None)
            return out
        x = np.ones(count, np.float32)
        out = _outcome(lambda: comm.all_reduce(x))
        out["t_err"] = out["t1"]
        out["after"], out["async"] = _after(comm)
        return out
    finally:
        comm.close()


def task_hold(ctx, uid, nranks, rank, config, name="held"):
    """Join a communicator and keep it (used for a rank that never calls)."""
    if name in ctx.held:
        ctx.held.pop(name).close()
    ctx.held[name] = _fresh(uid, nranks, rank, config)


def task_release(ctx, name="held", call=False):
    """Close a held communicator; call=True first tries an all_reduce on it."""
    comm = ctx.held.pop(name)
    out = {}
    if call:
        out = _outcome(lambda: comm.all_reduce(np.ones(8, np.float32)))
        out["seconds"] = out["t1"] - out["t0"]
    comm.close()
    return out


def task_timeout_caller(ctx, uid, nranks, rank, config):
    """Join, then all_reduce while some peer never calls."""
    comm = _fresh(uid, nranks, rank, config)
    try:
        out = _outcome(lambda: comm.all_reduce(np.ones(1000, np.float32)))
        out["seconds"] = out["t1"] - out["t0"]
        out["after"], out["async"] = _after(comm)
        return out
    finally:
        comm.close()


def task_once(ctx, key, rank, nranks, count, algo="auto"):
    """One all_reduce (expected to fail): what was raised, and when (monotonic)."""
    comm = _comm(ctx, key, algo)
    x = np.ones(count, np.float32)
    out = _outcome(lambda: comm.all_reduce(x))
    out["t_err"] = out["t1"]
    out["after"], out["async"] = _after(comm)
    return out


def task_stream(ctx, key, rank, nranks, count, max_s, algo="auto"):
    """Back-to-back checked all-reduces until an error or max_s; notes "started" after the first."""
    import kccl
    comm = _comm(ctx, key, algo)
    x = np.full(count, rank + 1, np.float32)
    recv = np.empty_like(x)
    want = np.float32(nranks * (nranks + 1) // 2)
    i, bad = 0, None
    t_end = time.monotonic() + max_s
    try:
        while True:
            comm.all_reduce(x, recv)
            i += 1
            if bad is None and not (recv == want).all():
                bad = f"iteration {i}: wrong sum"
            if i == 1:
                ctx.note("started")
            if time.monotonic() > t_end:
                return {"type": None, "msg": "", "iters": i, "bad": bad}
    except kccl.KcclError as e:
        out = _err(e)
    out["t_err"], out["iters"], out["bad"] = time.monotonic(), i, bad
    out["after"], out["async"] = _after(comm)
    return out


def task_new_comm_check(ctx, uid, nranks, rank, count):
    """A brand-new communicator (e.g. among survivors): one checked all_reduce, then close."""
    comm = _fresh(uid, nranks, rank, {"timeout_ms": GROUP_TIMEOUT_MS})
    try:
        x = np.full(count, rank + 1, np.float64)
        comm.all_reduce(x)
        want = nranks * (nranks + 1) / 2
        return None if (x == want).all() else f"rank {rank}: got {x[:4]}, expected {want}"
    finally:
        comm.close()


def task_pin(ctx, cpus):
    os.sched_setaffinity(0, set(cpus))


def task_init_close(ctx, uid, nranks, rank, timeout_ms=GROUP_TIMEOUT_MS):
    """Join a communicator and close it at once: None, or what init raised."""
    import kccl
    try:
        _fresh(uid, nranks, rank, {"timeout_ms": timeout_ms}, sync=False).close()
    except kccl.KcclError as e:
        return f"{type(e).__name__}: {e}"
    return None


def task_call(ctx, module, func, **kw):
    """Runs module.func(ctx, **kw) from another test-task module (kept out of this file)."""
    import importlib
    return getattr(importlib.import_module(module), func)(ctx, **kw)


# -- topology placement (replicas) ---------------------------------------------------------------

TOPO_DTYPES = ("float32", "int64", "float16", "uint8")  # no bfloat16: topology farms block ml_dtypes


def task_topo_join(ctx, uid, nranks, rank, config, name="topo"):
    """Join a communicator with `config` (topology settings) and keep it: its topo_info()."""
    if name in ctx.held:
        ctx.held.pop(name).close()
    comm = ctx.held[name] = _fresh(uid, nranks, rank, config)
    return comm.topo_info()


def task_topo_check(ctx, rank, nranks, seed, name="topo", counts=(1, 7, 300, 2000)):
    """Checked collectives of every kind on the held communicator (small and chunked sizes,
    both all-reduce algorithms through the size crossover); returns (first problem or None,
    topo_info before, topo_info after)."""
    import kccl
    comm = ctx.held[name]
    before = comm.topo_info()
    for dtype in TOPO_DTYPES:
        for count in counts:
            for op in ("SUM", "MAX"):
                want = reduce_reference(dtype, op, all_inputs(dtype, op, count, seed, nranks), nranks)
                got = comm.all_reduce(make_input(dtype, op, count, seed, rank), sentinel_like(count, dtype),
                                      op=getattr(kccl, op))
                why = describe_diff(got, want, f"rank {rank} all_reduce {dtype} {op} n={count}")
                if why:
                    return why, before, comm.topo_info()
            want = np.stack([make_input(dtype, None, count, seed, r) for r in range(nranks)])
            why = describe_diff(comm.all_gather(make_input(dtype, None, count, seed, rank)), want,
                                f"rank {rank} all_gather {dtype} n={count}")
            if why:
                return why, before, comm.topo_info()
            total = count * nranks
            full = reduce_reference(dtype, "SUM", all_inputs(dtype, "SUM", total, seed, nranks), nranks)
            why = describe_diff(comm.reduce_scatter(make_input(dtype, "SUM", total, seed, rank)),
                                full[rank * count:(rank + 1) * count], f"rank {rank} reduce_scatter {dtype} n={count}")
            if why:
                return why, before, comm.topo_info()
            root = (seed + count) % nranks
            buf = make_input(dtype, None, count, seed, rank) if rank == root else sentinel_like(count, dtype)
            why = describe_diff(comm.broadcast(buf, root=root), make_input(dtype, None, count, seed, root),
                                f"rank {rank} broadcast {dtype} n={count}")
            if why:
                return why, before, comm.topo_info()
            comm.barrier()
    return None, before, comm.topo_info()


def task_topo_loop(ctx, rank, nranks, iters, count, name="topo"):
    """iters one-shot all-reduces of `count` float32 (one chunk): topo_info before and after."""
    comm = ctx.held[name]
    x = np.full(count, rank + 1, np.float32)
    recv = np.empty_like(x)
    before = comm.topo_info()
    for _ in range(iters):
        comm.all_reduce(x, recv)
    ok = bool((recv == nranks * (nranks + 1) / 2).all())
    return ok, before, comm.topo_info()


TASKS = {name[5:]: fn for name, fn in list(globals().items()) if name.startswith("task_")}


# ----------------------------------------------------------------------------------------------
# parent side

class HarnessError(AssertionError):
    pass


class Farm:
    """n spawned worker processes, each serving commands on a pipe."""

    def __init__(self, nworkers, *, block_ml_dtypes=False, start_timeout=120.0):
        ctx = mp.get_context("spawn")
        self.n = nworkers
        self.procs, self.conns, self.pids = [], [], []
        self.notes = [[] for _ in range(nworkers)]
        self.broken = None  # reason, once a worker hung, died or the pipes lost sync
        self.dead = set()
        try:
            for i in range(nworkers):
                parent_end, child_end = ctx.Pipe()
                p = ctx.Process(target=_worker_main, args=(child_end, i, block_ml_dtypes),
                                name=f"kccl-test-worker-{i}", daemon=True)
                p.start()
                child_end.close()
                self.procs.append(p)
                self.conns.append(parent_end)
            deadline = time.monotonic() + start_timeout
            for i in range(nworkers):
                msg = self._recv(i, deadline - time.monotonic())
                if msg[0] != "ready":
                    raise HarnessError(f"worker {i} did not start: {msg}")
                self.pids.append(msg[1])
        except BaseException:
            self.kill_all()
            raise

    # -- messaging --------------------------------------------------------------------------
    def _recv(self, i, timeout):
        conn = self.conns[i]
        if not conn.poll(max(0.0, timeout)):
            self.broken = f"worker {i} gave no answer within {timeout:.0f} s"
            raise HarnessError(self.broken)
        try:
            return conn.recv()
        except (EOFError, OSError):
            self.procs[i].join(1)
            self.broken = f"worker {i} (pid {self.procs[i].pid}) died, exit code {self.procs[i].exitcode}"
            raise HarnessError(self.broken) from None

    def submit(self, i, task, **kw):
        if i in self.dead:
            raise HarnessError(f"worker {i} was killed")
        self.conns[i].send((task, kw))

    def result(self, i, timeout=RUN_TIMEOUT_S):
        """The result of worker i's current task (notes are queued in self.notes[i])."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self._recv(i, deadline - time.monotonic())
            if msg[0] == "note":
                self.notes[i].append(msg[1])
                continue
            if msg[0] == "ok":
                return msg[1]
            raise WorkerTaskError(i, msg[1], msg[2] if len(msg) > 2 else "")

    def wait_note(self, i, timeout=RUN_TIMEOUT_S):
        deadline = time.monotonic() + timeout
        while not self.notes[i]:
            msg = self._recv(i, deadline - time.monotonic())
            if msg[0] != "note":
                raise HarnessError(f"worker {i} finished before its note: {msg[:2]}")
            self.notes[i].append(msg[1])
        return self.notes[i].pop(0)

    def run(self, task, workers, per_worker=None, timeout=RUN_TIMEOUT_S, **common):
        """Runs task on every listed worker at once (per_worker[j]: extra kwargs of the j-th);
        returns the list of results; raises after collecting every answer if any task raised."""
        workers = list(workers)
        for j, i in enumerate(workers):
            kw = dict(common)
            if per_worker is not None:
                kw.update(per_worker[j])
            self.submit(i, task, **kw)
        results, errors = [], []
        deadline = time.monotonic() + timeout
        for i in workers:
            try:
                results.append(self.result(i, deadline - time.monotonic()))
            except WorkerTaskError as e:
                errors.append(e)
                results.append(None)
        if errors:
            raise HarnessError("; ".join(str(e) for e in errors) + "\n" + errors[0].tb)
        return results

    # -- processes ------------------------------------------------------------------------
    def kill(self, i):
        """SIGKILL worker i; returns time.monotonic() just before the signal."""
        t = time.monotonic()
        os.kill(self.pids[i], signal.SIGKILL)
        self.procs[i].join(10)
        self.dead.add(i)
        return t

    def kill_all(self):
        for p in self.procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.join(10)
        for c in self.conns:
            c.close()
        self.dead.update(range(len(self.procs)))

    def shutdown(self, timeout=10.0):
        """Asks every worker to exit; kills what is left after timeout."""
        if self.broken is None:
            for i, c in enumerate(self.conns):
                if i not in self.dead:
                    try:
                        c.send(None)
                    except OSError:
                        pass
            deadline = time.monotonic() + timeout
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        self.kill_all()


class WorkerTaskError(Exception):
    def __init__(self, worker, text, tb):
        super().__init__(f"worker {worker}: {text}")
        self.tb = tb


class Group:
    """A communicator of `nranks` ranks (one per algorithm) over workers 0..nranks-1 of a farm."""

    def __init__(self, farm, nranks, algos=ALGOS, timeout_ms=GROUP_TIMEOUT_MS, key=None, config=None):
        import kccl
        self.farm, self.n, self.algos = farm, nranks, tuple(algos)
        self.key = key or f"g{nranks}"
        uids = {a: bytes(kccl.get_unique_id()) for a in self.algos}
        farm.run("init_group", range(nranks), per_worker=[{"rank": r} for r in range(nranks)],
                 key=self.key, nranks=nranks, uids=uids, config=dict(config or {}, timeout_ms=timeout_ms))
        self.broken = False

    def run(self, task, timeout=RUN_TIMEOUT_S, per_rank=None, **kw):
        """One result per rank (per_rank[r]: extra kwargs of rank r); a task that raised marks
        the group broken (rebuilt on next use)."""
        per = [dict({"rank": r}, **(per_rank[r] if per_rank else {})) for r in range(self.n)]
        try:
            return self.farm.run(task, range(self.n), per_worker=per, timeout=timeout,
                                 key=self.key, nranks=self.n, **kw)
        except HarnessError:
            self.broken = True
            raise


class FarmManager:
    """The session's shared farm and its groups, rebuilt when something broke them."""

    def __init__(self, nworkers=8):
        self.nworkers = nworkers
        self._farm = None
        self._groups = {}

    def farm(self):
        if self._farm is not None and self._farm.broken:
            self._farm.kill_all()
            self._farm, self._groups = None, {}
        if self._farm is None:
            self._farm = Farm(self.nworkers)
        return self._farm

    def group(self, nranks):
        farm = self.farm()
        g = self._groups.get(nranks)
        if g is None or g.broken or g.farm is not farm:
            g = self._groups[nranks] = Group(farm, nranks)
        return g

    def shutdown(self):
        if self._farm is not None:
            self._farm.shutdown()
            self._farm = None


class GroupHandle:
    """What a test gets: finds a healthy group of its size at every call."""

    def __init__(self, manager, nranks):
        self.manager, self.n = manager, nranks

    def run(self, task, timeout=RUN_TIMEOUT_S, per_rank=None, **kw):
        return self.manager.group(self.n).run(task, timeout=timeout, per_rank=per_rank, **kw)

    @property
    def farm(self):
        return self.manager.farm()


def assert_all_ok(results, what=""):
    bad = [f"rank {r}: {x}" for r, x in enumerate(results) if x is not None]
    assert not bad, (what + "\n" if what else "") + "\n".join(bad)


def shm_entries():
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


def shm_names_of(uid, nranks):
    """The /dev/shm names of a unique id's segments (token = bytes 16..32, as hex)."""
    token = bytes(uid)[16:32].hex()
    return {f"{SHM_PREFIX}{token}-{r}" for r in range(nranks)}
