"""Worker-side tasks for the split-phase all-reduce tests (run through _harness's
`call` task: farm.run("call", ..., module="_nb_tasks", func=...)).

Every worker derives every rank's inputs from (seed, op index, rank), so each can
compute the exact reference itself (int64 and float64 sums of small integers are
exact, so the comparison is exact whatever the order)."""
import time

import numpy as np

from _harness import GROUP_TIMEOUT_MS, _fresh, _outcome

DTYPES = ("int64", "float64", "float32", "int32")


def _case(seed, i, nranks, max_count):
    """(dtype, count, inputs of every rank) of the i-th operation."""
    rng = np.random.default_rng([seed, i])
    dtype = np.dtype(DTYPES[int(rng.integers(len(DTYPES)))])
    count = min(int(rng.choice([0, 1, 7, 14, 15, 16, 1000])), max_count // dtype.itemsize)
    if rng.random() < 0.1:  # a whole slot
        count = max_count // dtype.itemsize
    ins = [np.random.default_rng([seed, i, r]).integers(-1000, 1000, count).astype(dtype)
           for r in range(nranks)]
    return dtype, count, ins


def nb_stream(ctx, uid, nranks, rank, depth, iters, seed, buffer_bytes=16384, blocking_every=0):
    """iters all_reduce_start calls with `depth` in flight (the oldest waited once the
    window is full), every result checked; every `blocking_every` ops the window is
    drained and a blocking all_reduce is checked too.  None, or the first problem."""
    comm = _fresh(uid, nranks, rank, {"timeout_ms": GROUP_TIMEOUT_MS, "max_outstanding": depth,
                                      "buffer_bytes": buffer_bytes})
    try:
        window = []

        def retire():
            h, want, i = window.pop(0)
            got = h.wait()
            if got is not h.recv or not np.array_equal(got, want):
                return f"rank {rank} op {i} ({want.dtype}, {want.size}): wrong result"
            return None

        for i in range(iters):
            dtype, count, ins = _case(seed, i, nranks, buffer_bytes)
            want = sum(x.astype(np.float64 if dtype.kind == "f" else np.int64) for x in ins).astype(dtype)
            send = ins[rank].copy()
            inplace = i % 3 == 0
            h = comm.all_reduce_start(send) if inplace else comm.all_reduce_start(send, np.full(count, 7, dtype))
            if not inplace:
                send[:] = 99  # start copied send: scribbling on it now must not matter
            window.append((h, want, i))
            if len(window) == depth and (why := retire()):
                return why
            if blocking_every and i % blocking_every == blocking_every - 1:
                while window:
                    if why := retire():
                        return why
                x = np.full(5, rank + 1, np.int64)
                comm.all_reduce(x)
                if not (x == nranks * (nranks + 1) // 2).all():
                    return f"rank {rank}: blocking all_reduce between split-phase ones is wrong"
        while window:
            if why := retire():
                return why
        return None
    finally:
        comm.close()


def nb_wait_newest_first(ctx, uid, nranks, rank, depth, seed):
    """Start `depth` operations, wait only for the newest: every older one must have
    completed (results in their recv) and report done."""
    comm = _fresh(uid, nranks, rank, {"timeout_ms": GROUP_TIMEOUT_MS, "max_outstanding": depth})
    try:
        hs, wants = [], []
        for i in range(depth):
            _dt, _n, ins = _case(seed, i, nranks, 4096)
            wants.append(sum(x.astype(np.float64 if x.dtype.kind == "f" else np.int64) for x in ins).astype(ins[0].dtype))
            hs.append(comm.all_reduce_start(ins[rank].copy()))
        hs[-1].wait()
        for i, (h, want) in enumerate(zip(hs, wants)):
            if not h.done:
                return f"rank {rank}: op {i} not done after waiting for op {depth - 1}"
            if not np.array_equal(h.recv, want):
                return f"rank {rank}: op {i} wrong after waiting for a newer one"
            h.wait()  # again: returns at once
        return None
    finally:
        comm.close()


def nb_mismatch(ctx, uid, nranks, rank, odd_rank, kind):
    """Rank odd_rank differs: "count" (one more element) or "blocking" (calls the blocking
    all_reduce while the others start split-phase ones).  Returns what this rank saw."""
    comm = _fresh(uid, nranks, rank, {"timeout_ms": GROUP_TIMEOUT_MS, "max_outstanding": 2})
    try:
        odd = rank == odd_rank
        n = 100 + (1 if odd and kind == "count" else 0)
        x = np.ones(n, np.float32)
        if odd and kind == "blocking":
            return _outcome(lambda: comm.all_reduce(x))
        return _outcome(lambda: comm.all_reduce_start(x).wait())
    finally:
        comm.close()


def nb_victim(ctx, uid, nranks, rank, how):
    """Starts one operation, then dies ("kill": tells the parent, which SIGKILLs it) or
    aborts ("abort"), leaving it outstanding.  abort: returns what wait() raises after."""
    comm = _fresh(uid, nranks, rank, {"timeout_ms": GROUP_TIMEOUT_MS, "max_outstanding": 2})
    h = comm.all_reduce_start(np.ones(10, np.float32))
    if how == "kill":
        ctx.note("started")
        time.sleep(600)
    time.sleep(0.2)
    t = time.monotonic()
    comm.abort()
    out = _outcome(h.wait)
    out["t_abort"] = t
    return out


def nb_survivor(ctx, uid, nranks, rank):
    """Starts two operations (the victim starts only the first) and waits for both."""
    comm = _fresh(uid, nranks, rank, {"timeout_ms": GROUP_TIMEOUT_MS, "max_outstanding": 2})
    try:
        x, y = np.ones(10, np.float32), np.ones(10, np.float32)
        h1 = comm.all_reduce_start(x)
        h2 = comm.all_reduce_start(y)
        out = _outcome(lambda: (h1.wait(), h2.wait()))
        out["first_ok"] = bool((x == nranks).all())
        out["after"] = _outcome(lambda: comm.all_reduce_start(x))["type"]
        return out
    finally:
        comm.close()


def nb_replicas(ctx, uid, nranks, rank, topo_file, iters):
    """Two in flight on a communicator with per-domain replicas (a fake topology): exact
    sums, and (replica pushes, replica reads) done by the split-phase calls."""
    comm = _fresh(uid, nranks, rank, {"timeout_ms": GROUP_TIMEOUT_MS, "max_outstanding": 2, "topo_file": topo_file})
    try:
        before = comm.topo_info()
        window = []
        for i in range(iters):
            x = np.full(16, rank + i, np.float32)
            window.append((comm.all_reduce_start(x), i))
            if len(window) == 2:
                h, j = window.pop(0)
                want = nranks * j + nranks * (nranks - 1) // 2
                if not (h.wait() == want).all():
                    return f"rank {rank} op {j}: wrong sum", 0, 0
        for h, j in window:
            h.wait()
        after = comm.topo_info()
        return None, after["pushes"] - before["pushes"], after["replica_reads"] - before["replica_reads"]
    finally:
        comm.close()
