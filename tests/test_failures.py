"""Failure behaviour with real processes: dead peers (SIGKILL), abort, mismatched calls,
timeouts, and what is left in /dev/shm.

Times are compared across processes with time.monotonic() (CLOCK_MONOTONIC is
system-wide on Linux): a kill is timed just before the signal is sent, an error just
after the collective raised, so the measured delay is an upper bound."""
import os
import random
import re
import time

import pytest

import kccl
from _harness import (MISMATCH_KINDS, SHM_DIR, Group, WorkerTaskError, assert_all_ok, shm_entries,
                      shm_names_of)

DETECT_S = 2.0   # the bound for reporting a dead / aborted peer


def names_rank(msg, rank, pid):
    """msg names `rank` as the culprit: "rank 2 ..." (not merely "... while rank 2 waited") or its pid."""
    return bool(re.search(rf"\brank {rank}\b(?! waited)", msg)) or f"pid {pid}" in msg


def _survivor_checks(outs, victim, victim_pid, t_event, what):
    """Every survivor: KcclRemoteError within DETECT_S of the event, and the communicator is
    broken for good.  The dead rank must be named by the first survivor to notice (it cannot
    have seen anything else); that *every* survivor names it is test_every_survivor_names_the_dead_rank."""
    for r, out in outs:
        w = f"{what}, survivor rank {r}"
        assert out["type"] == "KcclRemoteError", f"{w}: {out}"
        delay = out["t_err"] - t_event
        assert delay < DETECT_S, f"{w}: error {delay:.3f} s after the event"
        assert out["after"] == "KcclInvalidUsage", f"{w}: a further call raised {out['after']}"
        assert out["async"] == "KcclRemoteError", f"{w}: async_error() gave {out['async']}"
    named = [r for r, out in outs if names_rank(out["msg"], victim, victim_pid)]
    assert named, f"{what}: no survivor names rank {victim}: {[out['msg'] for _, out in outs]}"


def _rank_kwargs(ranks):
    return [{"rank": r} for r in ranks]


# -- dead peers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n,victim", [(2, 1), (2, 0), (4, 2)])
def test_peer_killed_before_collective(spawn_farm, n, victim):
    farm = spawn_farm(n)
    g = Group(farm, n, algos=("auto",))
    victim_pid = farm.pids[victim]
    t_kill = farm.kill(victim)
    survivors = [r for r in range(n) if r != victim]
    res = farm.run("once", survivors, per_worker=_rank_kwargs(survivors), key=g.key, nranks=n, count=1000)
    _survivor_checks(list(zip(survivors, res)), victim, victim_pid, t_kill, f"rank {victim} killed")

    # the survivors can build a new communicator (new id, ranks renumbered) and use it
    uid = kccl.get_unique_id()
    res = farm.run("new_comm_check", survivors, per_worker=_rank_kwargs(range(len(survivors))),
                   uid=bytes(uid), nranks=len(survivors), count=10_000)
    assert_all_ok(res)


@pytest.mark.parametrize("algo,count", [("twoshot", 700_000), ("oneshot", 300_000)])
def test_peer_killed_during_stream_of_large_all_reduces(spawn_farm, algo, count):
    """Ranks run back-to-back multi-chunk all-reduces; the parent kills one at a random moment."""
    n, victim = 3, random.randrange(3)
    farm = spawn_farm(n)
    g = Group(farm, n, algos=(algo,))
    for r in range(n):
        farm.submit(r, "stream", key=g.key, rank=r, nranks=n, count=count, max_s=60, algo=algo)
    for r in range(n):
        assert farm.wait_note(r, 60) == "started"
    delay = random.uniform(0.0, 0.3)
    time.sleep(delay)
    victim_pid = farm.pids[victim]
    t_kill = farm.kill(victim)
    what = f"rank {victim} killed {delay:.3f} s into the stream"
    outs = [(r, farm.result(r, 60)) for r in range(n) if r != victim]
    for r, out in outs:
        assert out["bad"] is None, f"{what}, rank {r}: {out['bad']}"
        assert out["iters"] >= 1
    _survivor_checks(outs, victim, victim_pid, t_kill, what)


def test_every_survivor_names_the_dead_rank(spawn_farm):
    """Deterministic order: rank 2 dies, rank 0 calls (and fails), then rank 1 calls."""
    n, victim = 3, 2
    farm = spawn_farm(n)
    g = Group(farm, n, algos=("oneshot",))
    victim_pid = farm.pids[victim]
    farm.kill(victim)
    for r in (0, 1):
        (out,) = farm.run("once", [r], rank=r, key=g.key, nranks=n, count=10, algo="oneshot")
        assert out["type"] == "KcclRemoteError", out
        assert names_rank(out["msg"], victim, victim_pid), f"rank {r}: {out['msg']!r}"


def test_a_survivor_that_failed_and_then_died_is_not_named_as_the_dead_rank(spawn_farm):
    """Rank 2 dies; rank 0 calls, fails, and dies too (as a survivor does that leaves with
    os._exit after reporting); then rank 1 calls.  Both peers are dead by then, but rank 0
    only failed because of rank 2, and its segment says so: rank 1 must name rank 2."""
    n = 3
    farm = spawn_farm(n)
    g = Group(farm, n, algos=("oneshot",))
    pid0, pid2 = farm.pids[0], farm.pids[2]
    farm.kill(2)
    (out,) = farm.run("once", [0], rank=0, key=g.key, nranks=n, count=10, algo="oneshot")
    assert out["type"] == "KcclRemoteError" and names_rank(out["msg"], 2, pid2), out
    farm.kill(0)
    (out,) = farm.run("once", [1], rank=1, key=g.key, nranks=n, count=10, algo="oneshot")
    assert out["type"] == "KcclRemoteError", out
    assert names_rank(out["msg"], 2, pid2), f"rank 1: {out['msg']!r}"
    assert not re.match(rf"rank 0 \(pid {pid0}\) died", out["msg"]), f"rank 1: {out['msg']!r}"


def test_kill_every_rank_during_collectives_leaves_no_shm(spawn_farm):
    n = 4
    before = shm_entries()
    farm = spawn_farm(n)
    g = Group(farm, n, algos=("twoshot",))
    for r in range(n):
        farm.submit(r, "stream", key=g.key, rank=r, nranks=n, count=400_000, max_s=60, algo="twoshot")
    for r in range(n):
        farm.wait_note(r, 60)
    time.sleep(random.uniform(0.0, 0.2))
    order = list(range(n))
    random.shuffle(order)
    for r in order:
        farm.kill(r)
        time.sleep(random.uniform(0.0, 0.02))
    left = shm_entries() - before
    assert not left, f"left in /dev/shm after every rank was SIGKILLed: {sorted(left)}"


SEG_MAGIC = (0x4b43434c5345474d).to_bytes(8, "little")  # "KCCLSEGM", first word of a segment header


def initialised_segments(names):
    """Those of names whose segment header is complete (its magic is written last)."""
    done = set()
    for name in names:
        try:
            with open(os.path.join(SHM_DIR, name), "rb") as f:
                if f.read(8) == SEG_MAGIC:
                    done.add(name)
        except OSError:
            pass
    return done


def test_kill_during_init_is_swept(spawn_farm):
    """Init is the one window where names exist in /dev/shm: if every rank dies then, the
    next get_unique_id() (or init) removes the names of the dead creators.  (Killed before
    its header is complete, a segment is only swept once 60 s old, by design: the test
    waits for complete headers.)"""
    farm = spawn_farm(3)
    uid = kccl.get_unique_id()
    names = shm_names_of(uid, 4)
    for r in range(3):  # a 4-rank communicator whose rank 3 never comes
        farm.submit(r, "init_group", key="never", nranks=4, rank=r, uids={"auto": bytes(uid)},
                    config={"timeout_ms": 60000})
    deadline = time.monotonic() + 30
    while len(initialised_segments(names)) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(initialised_segments(names)) == 3, "the three ranks did not create their segments"
    farm.kill_all()
    kccl.get_unique_id()
    assert not (shm_entries() & names), f"not swept: {sorted(shm_entries() & names)}"


def test_init_survives_peers_that_close_at_once(spawn_farm):
    """4 ranks on one CPU join and close at once, repeatedly: no init may fail.  (The race
    hits roughly 1 trial in 5-10 here, so 150 trials miss it with probability < 1e-6.)"""
    n = 4
    farm = spawn_farm(n)
    farm.run("pin", range(n), cpus=[min(os.sched_getaffinity(0))])
    for trial in range(150):
        res = farm.run("init_close", range(n), per_worker=_rank_kwargs(range(n)), uid=bytes(kccl.get_unique_id()),
                       nranks=n)
        assert not any(res), f"trial {trial}: {res}"


# -- mismatched calls ---------------------------------------------------------------------------

def _mismatch(farm, n, kind, delays=None):
    odd = n - 1
    per = [{"rank": r, "delay": (delays or {}).get(r, 0.0)} for r in range(n)]
    res = farm.run("mismatch", range(n), per_worker=per, uid=bytes(kccl.get_unique_id()),
                   nranks=n, kind=kind, odd_rank=odd)
    return [(r, f"rank {r} ({'odd one' if r == odd else 'majority'}, {out['call']})", out)
            for r, out in enumerate(res)]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", [k for k in MISMATCH_KINDS if k != "coll_allgather"])
def test_mismatched_calls(farms, kind, n):
    """One rank calls with a different count / dtype / op / root / collective: every rank
    raises KcclRemoteError, quickly, and recv is left untouched; the message says "mismatch"
    (with 3 ranks only for the ranks that saw the odd call themselves: others may see a
    peer that already failed, see test_every_rank_names_the_mismatch)."""
    outs = _mismatch(farms.farm(), n, kind)
    for r, what, out in outs:
        assert out["type"] == "KcclRemoteError", f"{what}: {out}"
        assert out["unchanged"], f"{what}: recv was modified by the failed call"
        assert out["seconds"] < 5, f"{what}: took {out['seconds']:.2f} s"
        assert out["after"] == "KcclInvalidUsage" and out["async"] == "KcclRemoteError", f"{what}: {out}"
        if n == 2 or r == n - 1:  # the odd rank, and with 2 ranks everyone, saw the other call
            assert "mismatch" in out["msg"].lower(), f"{what}: {out['msg']!r}"
    assert any("mismatch" in out["msg"].lower() for _, _, out in outs)
    detail = [out["msg"] for _, _, out in outs if "mismatch" in out["msg"].lower()][0]
    assert re.search(r"rank \d+ called \w+\(count=\d+", detail), detail  # says who called what


def test_every_rank_names_the_mismatch(farms):
    """Deterministic order: ranks 0 and 2 (the odd one) call at once, rank 1 comes 0.3 s later."""
    outs = _mismatch(farms.farm(), 3, "count0", delays={1: 0.3})
    for r, what, out in outs:
        assert out["type"] == "KcclRemoteError", f"{what}: {out}"
        assert "mismatch" in out["msg"].lower(), f"{what}: {out['msg']!r}"


@pytest.mark.parametrize("kind,odd_call", [("coll_broadcast", r"broadcast\(count=1000, float32, root=0\)"),
                                           ("coll_allgather", r"all_gather\(count=1000, float32\)"),
                                           ("coll_barrier", r"barrier\(\)"),
                                           ("coll_reduce_scatter", r"reduce_scatter\(count=1000, float32, op=sum\)")])
def test_mismatch_message_shows_each_call_with_its_own_arguments(farms, kind, odd_call):
    """An all-reduce has an op and no root, a broadcast a root and no op, an all-gather
    neither, a barrier no arguments: the message shows each call so."""
    outs = _mismatch(farms.farm(), 2, kind)
    for r, what, out in outs:
        msg = out["msg"]
        assert "mismatch" in msg, f"{what}: {msg!r}"
        assert re.search(r"all_reduce\(count=1000, float32, op=sum\)", msg), f"{what}: {msg!r}"
        assert re.search(odd_call, msg), f"{what}: {msg!r}"
        assert "all_reduce(count=1000, float32, op=sum, root" not in msg, msg


def test_mismatched_all_gather_leaves_recv_untouched(farms):
    for r, what, out in _mismatch(farms.farm(), 2, "coll_allgather"):
        assert out["type"] == "KcclRemoteError", f"{what}: {out}"
        assert out["unchanged"], f"{what}: recv was modified by the failed call"


# -- abort --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4])
def test_abort_while_peers_wait(farms, n):
    farm = farms.farm()
    victim = 1
    res = farm.run("abort", range(n), per_worker=_rank_kwargs(range(n)), uid=bytes(kccl.get_unique_id()),
                   nranks=n, victim=victim, delay=0.3, count=5000)
    t_abort = res[victim]["t_abort"]
    assert res[victim]["closed"] and res[victim]["after"] == "KcclInvalidUsage", res[victim]
    waiters = [(r, out) for r, out in enumerate(res) if r != victim]
    for r, out in waiters:
        assert out["type"] == "KcclRemoteError", f"rank {r}: {out}"
        assert out["t_err"] >= t_abort, f"rank {r} failed before the abort: {out}"
        assert out["t_err"] - t_abort < DETECT_S, f"rank {r}: {out['t_err'] - t_abort:.3f} s after abort()"
        assert out["after"] == "KcclInvalidUsage"
    # the first rank to notice can only have seen the abort itself
    assert any("abort" in out["msg"] for _, out in waiters), [out["msg"] for _, out in waiters]


# -- timeouts -----------------------------------------------------------------------------------

def _timeout_round(farm, n, idle, timeout_ms):
    """Ranks != idle all_reduce while rank `idle` joined but never calls; afterwards the idle
    rank calls too.  None when init itself failed (under the short timeout, on a loaded box)."""
    uid = bytes(kccl.get_unique_id())
    cfg = {"timeout_ms": timeout_ms}
    callers = [r for r in range(n) if r != idle]
    farm.submit(idle, "hold", uid=uid, nranks=n, rank=idle, config=cfg)
    for r in callers:
        farm.submit(r, "timeout_caller", uid=uid, nranks=n, rank=r, config=cfg)
    results, init_failed = {}, False
    for r in [idle] + callers:
        try:
            results[r] = farm.result(r, 60)
        except WorkerTaskError:
            init_failed = True
    late = farm.run("release", [idle], call=True)[0] if idle in results else None
    return None if init_failed else ([results[r] for r in callers], late)


def test_peer_that_never_calls_times_out(farms):
    farm = farms.farm()
    timeout_ms = 300
    for _attempt in range(3):
        got = _timeout_round(farm, 2, 1, timeout_ms)
        if got is not None:
            break
    else:
        pytest.fail("init under KCCL_TIMEOUT_MS=300 failed three times")
    (out,), late = got
    assert out["type"] == "KcclTimeout" and out["is_timeout_error"], out
    assert timeout_ms / 1000 * 0.95 <= out["seconds"] < timeout_ms / 1000 + 5, out
    assert re.search(r"ms|KCCL_TIMEOUT_MS", out["msg"]), out["msg"]
    assert out["after"] == "KcclInvalidUsage" and out["async"] == "KcclTimeout", out
    # the rank that never called, calling now, learns at once that its peer gave up
    assert late["type"] == "KcclRemoteError" and late["seconds"] < DETECT_S, late


def test_peer_that_never_calls_times_out_three_ranks(farms):
    """Two callers wait for an idle third rank: the first to hit the deadline raises
    KcclTimeout; the other may instead see that first rank fail (KcclRemoteError)."""
    farm = farms.farm()
    for _attempt in range(3):
        got = _timeout_round(farm, 3, 2, 300)
        if got is not None:
            break
    else:
        pytest.fail("init under KCCL_TIMEOUT_MS=300 failed three times")
    outs, late = got
    types = [o["type"] for o in outs]
    assert "KcclTimeout" in types and set(types) <= {"KcclTimeout", "KcclRemoteError"}, outs
    for o in outs:  # a KcclRemoteError may come any time after the first rank timed out
        assert (0.29 if o["type"] == "KcclTimeout" else 0.0) <= o["seconds"] < 5.3, o
    assert late["type"] == "KcclRemoteError" and late["seconds"] < DETECT_S, late


def test_init_times_out_when_a_rank_never_joins():
    t0 = time.monotonic()
    with pytest.raises(kccl.KcclTimeout, match=r"rank 1.*KCCL_INIT_TIMEOUT_MS"):
        kccl.Communicator(2, kccl.get_unique_id(), 0, config={"init_timeout_ms": 300})
    assert 0.28 <= time.monotonic() - t0 < 5


def test_short_collective_timeout_does_not_bound_init(spawn_farm):
    """Joining has its own bound (KCCL_INIT_TIMEOUT_MS): a rank that comes 1.5 s after its
    peer still joins under KCCL_TIMEOUT_MS=300, and the collective timeout applies after."""
    farm = spawn_farm(2)
    uid = bytes(kccl.get_unique_id())
    cfg = {"timeout_ms": 300}
    farm.submit(0, "init_group", key="late", nranks=2, rank=0, uids={"auto": uid}, config=cfg)
    time.sleep(1.5)
    farm.submit(1, "init_group", key="late", nranks=2, rank=1, uids={"auto": uid}, config=cfg)
    pids = [farm.result(r) for r in (0, 1)]
    assert all(isinstance(p, int) for p in pids), pids
