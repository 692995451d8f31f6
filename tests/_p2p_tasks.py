"""Worker-side tasks for the point-to-point tests (run through _harness's `call` task:
farm.run("call", ..., module="_p2p_tasks", func=...)).  Every rank derives every
message from (seed, round, sender), so a receiver checks what it got exactly."""
import time

import numpy as np

from _harness import GROUP_TIMEOUT_MS, _fresh, _outcome

DTYPES = ("int8", "int32", "float64", "uint16")


def _message(seed, i, sender, max_bytes):
    rng = np.random.default_rng([seed, i, sender])
    dtype = np.dtype(DTYPES[int(rng.integers(len(DTYPES)))])
    count = int(rng.choice([0, 1, 13, 1000, max_bytes // dtype.itemsize]))
    return rng.integers(0, 100, count).astype(dtype)


def ring(ctx, uid, nranks, rank, rounds, seed, p2p_bytes):
    """Every round each rank sends a message to the next rank and one to the previous
    (different tags, both started before either receive), and receives both; sizes from
    nothing to several rings.  None, or the first wrong message."""
    comm = _fresh(uid, nranks, rank, {"timeout_ms": GROUP_TIMEOUT_MS, "p2p_bytes": p2p_bytes})
    try:
        nxt, prv = (rank + 1) % nranks, (rank - 1) % nranks
        for i in range(rounds):
            up, down = _message(seed, 2 * i, rank, 3 * p2p_bytes), _message(seed, 2 * i + 1, rank, 3 * p2p_bytes)
            want_up, want_down = _message(seed, 2 * i, prv, 3 * p2p_bytes), _message(seed, 2 * i + 1, nxt, 3 * p2p_bytes)
            got_up, got_down = np.empty_like(want_up), np.empty_like(want_down)
            hs = [comm.send_start(up, nxt, tag=1), comm.send_start(down, prv, tag=2),
                  comm.recv_start(got_down, nxt, tag=2), comm.recv_start(got_up, prv, tag=1)]
            for h in reversed(hs):
                h.wait()
            if not (np.array_equal(got_up, want_up) and np.array_equal(got_down, want_down)):
                return f"rank {rank} round {i}: wrong message"
            if i % 7 == 3:
                x = np.full(3, rank + 1, np.int64)
                comm.all_reduce(x)  # collectives between rounds
                if not (x == nranks * (nranks + 1) // 2).all():
                    return f"rank {rank} round {i}: all_reduce between messages is wrong"
        return None
    finally:
        comm.close()


def victim(ctx, uid, nranks, rank, how):
    """Joins, then dies ("kill": tells the parent, which SIGKILLs it) or aborts."""
    comm = _fresh(uid, nranks, rank, {"timeout_ms": GROUP_TIMEOUT_MS, "p2p_bytes": 4096})
    if how == "kill":
        ctx.note("joined")
        time.sleep(600)
    time.sleep(0.2)
    t = time.monotonic()
    comm.abort()
    return {"t_abort": t}


def survivor(ctx, uid, nranks, rank, victim, what):
    """Waits on the victim: a receive from it ("recv"), a send larger than the ring to it
    ("send") or a receive from any source ("any").  What it raised, and when."""
    comm = _fresh(uid, nranks, rank, {"timeout_ms": GROUP_TIMEOUT_MS, "p2p_bytes": 4096})
    try:
        buf = np.zeros(100000, np.uint8)
        if what == "recv":
            out = _outcome(lambda: comm.recv(buf, victim))
        elif what == "send":
            out = _outcome(lambda: comm.send(buf, victim))
        else:
            out = _outcome(lambda: comm.recv(buf, None, tag=9))
        out["after"] = _outcome(lambda: comm.send(buf[:1], victim))["type"]
        return out
    finally:
        comm.close()
