"""Communicator.all_reduce_start: split-phase all-reduce with several operations in
flight (what DTP decode needs), over real processes and in-process pairs."""
import time

import numpy as np
import pytest

import kccl
from _harness import Group, assert_all_ok

DETECT_S = 2.0  # a dead or aborted peer is reported within ~1 ms; generous on a loaded box


def _ranks(n):
    return [{"rank": r} for r in range(n)]


def _call(farm, n, func, per_worker=None, **kw):
    per = per_worker or _ranks(n)
    return farm.run("call", range(n), per_worker=per, module="_nb_tasks", func=func,
                    uid=bytes(kccl.get_unique_id()), nranks=n, **kw)


@pytest.mark.parametrize("n,depth", [(2, 1), (2, 2), (2, 3), (3, 2), (4, 4), (8, 2), (2, 8)])
def test_stream_with_several_outstanding(farms, n, depth):
    """Hundreds of operations, `depth` in flight, mixed dtypes/sizes (0 .. a whole slot),
    in place and not, with blocking all-reduces between windows: every result exact."""
    assert_all_ok(_call(farms.farm(), n, "nb_stream", depth=depth, iters=300, seed=n * 10 + depth,
                        blocking_every=37))


def test_stream_long_run_wraps_the_sets_many_times(farms):
    assert_all_ok(_call(farms.farm(), 2, "nb_stream", depth=2, iters=3000, seed=7, buffer_bytes=4096))


@pytest.mark.parametrize("n", [2, 3])
def test_waiting_for_the_newest_completes_the_older_ones(farms, n):
    assert_all_ok(_call(farms.farm(), n, "nb_wait_newest_first", depth=4, seed=3))


@pytest.mark.parametrize("kind", ["count", "blocking"])
def test_mismatch_is_reported_on_every_rank(farms, kind):
    res = _call(farms.farm(), 2, "nb_mismatch", odd_rank=1, kind=kind)
    for r, out in enumerate(res):
        assert out["type"] == "KcclRemoteError", f"rank {r}: {out}"
        assert "mismatch" in out["msg"], f"rank {r}: {out}"
    if kind == "blocking":
        assert "all_reduce_start" in res[0]["msg"] + res[1]["msg"]


def test_dead_peer_while_outstanding(spawn_farm):
    n, victim = 3, 2
    farm = spawn_farm(n)
    uid = bytes(kccl.get_unique_id())
    farm.submit(victim, "call", module="_nb_tasks", func="nb_victim", uid=uid, nranks=n, rank=victim, how="kill")
    for r in range(n - 1):
        farm.submit(r, "call", module="_nb_tasks", func="nb_survivor", uid=uid, nranks=n, rank=r)
    assert farm.wait_note(victim) == "started"
    t_kill = farm.kill(victim)
    for r in range(n - 1):
        out = farm.result(r)
        assert out["type"] == "KcclRemoteError", f"rank {r}: {out}"
        assert f"rank {victim}" in out["msg"] and "died" in out["msg"], out
        assert out["first_ok"], "the operation the victim took part in should have completed"
        assert out["t1"] - t_kill < DETECT_S
        assert out["after"] == "KcclInvalidUsage"


def test_abort_while_outstanding(farms):
    n, victim = 2, 1
    farm = farms.farm()
    uid = bytes(kccl.get_unique_id())
    farm.submit(victim, "call", module="_nb_tasks", func="nb_victim", uid=uid, nranks=n, rank=victim, how="abort")
    farm.submit(0, "call", module="_nb_tasks", func="nb_survivor", uid=uid, nranks=n, rank=0)
    v, s = farm.result(victim), farm.result(0)
    assert v["type"] == "KcclInvalidUsage" and "aborted" in v["msg"], v  # its own handle after abort()
    assert s["type"] == "KcclRemoteError" and "abort" in s["msg"], s
    assert s["first_ok"] and s["t1"] - v["t_abort"] < DETECT_S, s


# -- in one process: a pair whose start calls never block ---------------------------------------

def test_pair_results_and_test():
    c0, c1 = make_pair_depth(3)
    try:
        a0, a1 = np.arange(10, dtype=np.float32), np.arange(10, dtype=np.float32) * 10
        h0 = c0.all_reduce_start(a0, np.empty(10, np.float32))
        assert not h0.test() and not h0.done  # rank 1 has not started
        h1 = c1.all_reduce_start(a1, np.empty(10, np.float32))
        assert h0.test() and h1.done
        assert np.array_equal(h0.wait(), a0 * 11) and np.array_equal(h1.wait(), a0 * 11)
        # three in flight on both, results in order
        hs0 = [c0.all_reduce_start(np.full(4, i, np.int64)) for i in range(3)]
        hs1 = [c1.all_reduce_start(np.full(4, 10 * i, np.int64)) for i in range(3)]
        for i in range(3):
            assert (hs0[i].wait() == 11 * i).all() and (hs1[i].wait() == 11 * i).all()
        # MAX and AVG go through the same path
        m0 = c0.all_reduce_start(np.array([1.0, 5.0]), op=kccl.MAX)
        m1 = c1.all_reduce_start(np.array([3.0, 2.0]), op=kccl.MAX)
        assert list(m0.wait()) == [3.0, 5.0] and list(m1.wait()) == [3.0, 5.0]
    finally:
        c0.close()
        c1.close()


def make_pair_depth(depth, timeout_ms=3000):
    import threading
    uid = kccl.get_unique_id()
    out = {}
    cfg = {"timeout_ms": timeout_ms, "max_outstanding": depth}
    t = threading.Thread(target=lambda: out.setdefault(0, kccl.Communicator(2, uid, 0, config=cfg)))
    t.start()
    c1 = kccl.Communicator(2, uid, 1, config=cfg)
    t.join()
    return out[0], c1


def test_too_many_outstanding_is_refused():
    c0, c1 = make_pair_depth(2)
    try:
        x = np.ones(4, np.float32)
        h = [c0.all_reduce_start(x.copy()), c0.all_reduce_start(x.copy())]
        with pytest.raises(kccl.KcclInvalidUsage, match="KCCL_MAX_OUTSTANDING=2"):
            c0.all_reduce_start(x.copy())
        g = [c1.all_reduce_start(x.copy()), c1.all_reduce_start(x.copy())]
        h[0].wait(), g[0].wait()
        h.append(c0.all_reduce_start(x.copy()))  # room again
        g.append(c1.all_reduce_start(x.copy()))
        for a, b in zip(h, g):
            assert (a.wait() == 2).all() and (b.wait() == 2).all()
    finally:
        c0.close()
        c1.close()


def test_blocking_collective_refused_while_outstanding():
    c0, c1 = make_pair_depth(2)
    try:
        h0 = c0.all_reduce_start(np.ones(3))
        for call in (lambda: c0.all_reduce(np.ones(3)), c0.barrier, lambda: c0.broadcast(np.ones(3))):
            with pytest.raises(kccl.KcclInvalidUsage, match="outstanding"):
                call()
        h1 = c1.all_reduce_start(np.ones(3))
        h0.wait(), h1.wait()
        assert (h0.recv == 2).all()
    finally:
        c0.close()
        c1.close()


def test_bad_input(comm1):
    x = np.ones(8, np.float32)
    with pytest.raises(kccl.KcclInvalidArgument):
        comm1.all_reduce_start(x, np.ones(8, np.float64))
    with pytest.raises(kccl.KcclInvalidArgument):
        comm1.all_reduce_start(x, np.ones(9, np.float32))
    with pytest.raises(ValueError):
        comm1.all_reduce_start(x, op="bogus")
    with pytest.raises(kccl.KcclInvalidArgument):
        comm1.all_reduce_start(np.ones((4, 4), np.float32)[:, 1])  # not contiguous
    with pytest.raises(kccl.KcclInvalidArgument):
        comm1.all_reduce_start(x, np.frombuffer(b"\0" * 32, np.float32))  # read-only recv
    with pytest.raises(kccl.KcclInvalidArgument, match="partly overlap"):
        buf = np.zeros(16, np.float32)
        comm1.all_reduce_start(buf[:8], buf[4:12])
    with pytest.raises(kccl.KcclInvalidArgument, match="KCCL_BUFFER_BYTES"):
        comm1.all_reduce_start(np.ones((1 << 20) // 4 + 1, np.float32))
    with pytest.raises(kccl.KcclInvalidArgument, match="max_outstanding|KCCL_MAX_OUTSTANDING"):
        kccl.Communicator(1, kccl.get_unique_id(), 0, config={"max_outstanding": 9})
    with pytest.raises(kccl.KcclInvalidArgument):
        kccl.Communicator(1, kccl.get_unique_id(), 0, config={"max_outstanding": 0})
    # a single rank: the result is ready at once, the handle still behaves
    h = comm1.all_reduce_start(x, np.zeros(8, np.float32), op=kccl.AVG)
    assert h.done and (h.wait() == 1).all()


def test_use_after_close_and_abort():
    c0, c1 = make_pair_depth(2)
    h0 = c0.all_reduce_start(np.ones(3))
    h1 = c1.all_reduce_start(np.ones(3))
    c0.close()
    with pytest.raises(kccl.KcclInvalidUsage, match="closed"):
        h0.wait()
    with pytest.raises(kccl.KcclInvalidUsage, match="closed"):
        h0.test()
    with pytest.raises(kccl.KcclInvalidUsage):
        c0.all_reduce_start(np.ones(3))
    # rank 0 published before closing, so rank 1's operation still completes
    assert (h1.wait() == 2).all()
    h1b = c1.all_reduce_start(np.ones(3))
    with pytest.raises(kccl.KcclRemoteError, match="closed"):
        h1b.wait()
    c1.abort()
    with pytest.raises(kccl.KcclInvalidUsage, match="aborted"):
        h1b.wait()


def test_wait_times_out_and_test_never_blocks():
    c0, c1 = make_pair_depth(2, timeout_ms=300)
    try:
        h = c0.all_reduce_start(np.ones(3))
        t0 = time.monotonic()
        for _ in range(1000):
            assert not h.test()
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(kccl.KcclTimeout):
            h.wait()
        assert 0.25 < time.monotonic() - t0 < 5
        with pytest.raises(kccl.KcclInvalidUsage):  # broken for good
            h.wait()
    finally:
        c0.close()
        c1.close()


def test_c_api_rejects_bad_requests(comm1):
    from kccl._native import ffi, lib
    comm = comm1._comm
    assert lib.kcclAllReduceWait(comm, 0) == lib.kcclInvalidArgument
    assert lib.kcclAllReduceWait(comm, 12345) == lib.kcclInvalidArgument
    done = ffi.new("int *")
    assert lib.kcclAllReduceTest(comm, 1, ffi.NULL) == lib.kcclInvalidArgument
    req = ffi.new("uint64_t *")
    x = np.ones(4, np.float32)
    p = ffi.from_buffer(x)
    assert lib.kcclAllReduceStart(p, p, 4, lib.kcclFloat32, 0, comm, ffi.NULL) == lib.kcclInvalidArgument
    assert lib.kcclAllReduceStart(p, p, 4, 99, 0, comm, req) == lib.kcclInvalidArgument
    assert lib.kcclAllReduceStart(p, p, 4, lib.kcclFloat32, 0, comm, req) == 0
    assert lib.kcclAllReduceTest(comm, req[0], done) == 0 and done[0] == 1
    assert lib.kcclAllReduceWait(comm, req[0]) == 0


def test_split_phase_uses_the_topology_replicas(spawn_farm, tmp_path):
    """Ranks 0,1 and 2,3 in two (fake) L3 domains: a start writes its remote replica, a wait
    polls the replicas of the other domain's peers, and the sums stay exact."""
    from topology.fixtures.fake import fake_l3s
    path = fake_l3s(tmp_path / "two.json", rank_domains=[0, 0, 1, 1])
    iters = 40
    res = _call(spawn_farm(4), 4, "nb_replicas", topo_file=path, iters=iters)
    for r, (why, pushes, reads) in enumerate(res):
        assert why is None, why
        assert pushes == iters and reads == 2 * iters, (r, pushes, reads)


def test_ranks_must_agree_on_max_outstanding():
    """Different buffer-set counts give different segment sizes: init refuses them (the rank
    that maps the other's segment first says why; the other may only see it leave)."""
    import threading
    uid = kccl.get_unique_id()
    err = {}

    def join(rank, depth):
        try:
            kccl.Communicator(2, uid, rank, config={"timeout_ms": 3000, "max_outstanding": depth}).close()
        except kccl.KcclError as e:
            err[rank] = e
    t = threading.Thread(target=join, args=(0, 1))
    t.start()
    join(1, 2)
    t.join()
    assert set(err) == {0, 1}, err
    assert any(isinstance(e, kccl.KcclInvalidUsage) and "KCCL_MAX_OUTSTANDING" in str(e) for e in err.values()), err
