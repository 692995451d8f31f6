"""Point-to-point (kcclSend / kcclRecv, Communicator.send / recv and their split phase):
messages of any size through the per-pair rings, tags and any-source matching in send
order, the private buffer for messages a receive looks past, mismatches, timeouts, dead
and aborted peers, and sends kept moving by a rank that waits in a collective."""
import threading
import time

import numpy as np
import pytest

import conftest
import kccl
from _harness import assert_all_ok

DETECT_S = 2.0


def make_pair(p2p_bytes=4096, timeout_ms=3000):
    return conftest.make_pair(timeout_ms, {"p2p_bytes": p2p_bytes})


@pytest.fixture
def pair():
    c0, c1 = make_pair()
    yield c0, c1
    c0.close()
    c1.close()


def drive(*handles, limit_s=10.0):
    """Tests every handle until all are done: one thread moves both ranks' pieces."""
    t0 = time.monotonic()
    while not all([h.test() for h in handles]):
        assert time.monotonic() - t0 < limit_s, "no progress"
    return [h.wait() for h in handles]


# 4096-byte rings: 4 slots of 1024 bytes, 960 of them data
@pytest.mark.parametrize("nbytes", [0, 1, 56, 959, 960, 961, 3840, 3841, 100000])
def test_any_size_arrives_whole(pair, nbytes):
    c0, c1 = pair
    x = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
    y = np.full(nbytes, 7, np.uint8)
    s, r = drive(c0.send_start(x, 1), c1.recv_start(y, 0))
    assert s is x and r is y and np.array_equal(x, y)


def test_small_send_is_done_when_started_and_buffer_reusable(pair):
    c0, c1 = pair
    x = np.arange(100, dtype=np.float32)
    h = c0.send_start(x, 1)
    assert h.test()  # it fitted the free slots
    x[:] = -1       # reusing the buffer changes nothing that was sent
    y = c1.recv(np.zeros(100, np.float32), 0)
    assert np.array_equal(y, np.arange(100, dtype=np.float32))


def test_tags_match_in_send_order_and_any_source(pair):
    c0, c1 = pair
    a, b, c = np.full(4, 1.0), np.full(4, 2.0), np.full(4, 3.0)
    sends = [c0.send_start(a, 1, tag=1), c0.send_start(b, 1, tag=2), c0.send_start(c, 1, tag=1)]
    r2 = c1.recv_start(np.zeros(4), 0, tag=2)       # looks past the first tag-1 message
    r1 = c1.recv_start(np.zeros(4), None, tag=1)    # any source: the first tag-1 message
    r1b = c1.recv_start(np.zeros(4), 0, tag=1)      # then the second
    drive(r2, r1, r1b, *sends)
    assert r2.buf[0] == 2.0 and r1.buf[0] == 1.0 and r1b.buf[0] == 3.0
    assert r1.source == 0 and r2.source == 0


def test_a_large_message_looked_past_is_kept_until_its_receive(pair):
    c0, c1 = pair
    big = np.arange(50000, dtype=np.int64)
    hs = [c0.send_start(big, 1, tag=7), c0.send_start(np.ones(3), 1, tag=8)]
    small = c1.recv_start(np.zeros(3), 0, tag=8)
    drive(small, *hs)  # the tag-7 message had to be read out of the ring first
    late = c1.recv_start(np.zeros(50000, np.int64), 0, tag=7)
    assert late.test() and np.array_equal(late.wait(), big)  # already here


def test_blocking_send_and_recv_in_threads_large(pair):
    c0, c1 = pair
    x = np.random.default_rng(1).random(300000)
    y = np.zeros_like(x)
    t = threading.Thread(target=c0.send, args=(x, 1))
    t.start()
    c1.recv(y, 0)
    t.join()
    assert np.array_equal(x, y)


def test_size_mismatch_breaks_the_communicator_on_both_sides(pair):
    c0, c1 = pair
    c0.send_start(np.zeros(4), 1).wait()
    with pytest.raises(kccl.KcclRemoteError, match="mismatch.*32 bytes"):
        c1.recv(np.zeros(5), 0)
    with pytest.raises(kccl.KcclRemoteError, match="rank 1 .* failed.*mismatch"):
        c0.send(np.zeros(100000), 1)  # waits on the receiver, which failed
    with pytest.raises(kccl.KcclInvalidUsage):
        c1.recv(np.zeros(4), 0)


def test_bad_arguments_are_refused(pair):
    c0, c1 = pair
    x = np.zeros(4)
    with pytest.raises(kccl.KcclInvalidArgument, match="this rank"):
        c0.send(x, 0)
    with pytest.raises(kccl.KcclInvalidArgument, match="out of range"):
        c0.send(x, 2)
    with pytest.raises(kccl.KcclInvalidArgument, match="out of range"):
        c0.recv(x, -5)
    with pytest.raises(kccl.KcclInvalidArgument):
        c0.recv(np.zeros(4)[::2], 1)  # not contiguous
    h = c0.send_start(x, 1)
    h.wait()
    from kccl._native import ffi, lib
    from kccl.capi import handle
    comm = ffi.cast("kcclComm_t", handle(c0))
    assert lib.kcclP2PWait(comm, h._req, ffi.NULL) == lib.kcclInvalidArgument  # reported once already
    assert lib.kcclSend(ffi.NULL, 4, lib.kcclFloat64, 1, comm, ffi.NULL) == lib.kcclInvalidArgument
    assert lib.kcclSend(ffi.cast("void *", x.ctypes.data), 4, 42, 1, comm, ffi.NULL) == lib.kcclInvalidArgument
    c1.recv(np.zeros(4), 0)  # the pair still works


def test_wait_times_out_and_test_never_blocks():
    c0, c1 = make_pair(timeout_ms=300)
    try:
        h = c1.recv_start(np.zeros(4), 0)
        t0 = time.monotonic()
        assert not h.test()
        assert time.monotonic() - t0 < 0.1
        with pytest.raises(kccl.KcclTimeout, match="receive from rank 0"):
            h.wait()
        assert 0.25 < time.monotonic() - t0 < 3.0
    finally:
        c0.close()
        c1.close()


def test_a_rank_waiting_in_a_collective_keeps_its_sends_moving():
    """Rank 0 starts a send of several rings and enters an all-reduce; rank 1 receives it
    whole before it joins that all-reduce.  Only rank 0's wait in the collective can move
    the rest of the message."""
    c0, c1 = make_pair(timeout_ms=5000)
    try:
        big = np.arange(200000, dtype=np.int32)
        got = np.zeros_like(big)
        out = {}

        def rank0():
            h = c0.send_start(big, 1)
            x = np.ones(4)
            c0.all_reduce(x)
            out["sum"] = x[0]
            h.wait()

        t = threading.Thread(target=rank0)
        t.start()
        c1.recv(got, 0)
        y = np.ones(4)
        c1.all_reduce(y)
        t.join()
        assert np.array_equal(got, big) and out["sum"] == 2.0
    finally:
        c0.close()
        c1.close()


def test_use_after_close(pair):
    c0, c1 = pair
    h = c1.recv_start(np.zeros(2), 0)
    c1.close()
    with pytest.raises(kccl.KcclInvalidUsage):
        h.wait()
    with pytest.raises(kccl.KcclInvalidUsage):
        c1.send(np.zeros(2), 0)


def test_gpu_communicators_refuse_point_to_point():
    built, devices = kccl.gpu_support()
    if not (built and devices):
        pytest.skip("needs a GPU communicator")
    with kccl.Communicator(1, kccl.get_unique_id(), 0, device=0) as c:
        from kccl._native import ffi, lib
        from kccl.capi import handle
        comm = ffi.cast("kcclComm_t", handle(c))
        assert lib.kcclSend(ffi.NULL, 0, lib.kcclUint8, 0, comm, ffi.NULL) == lib.kcclInvalidUsage


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_of_ranks_many_rounds(farms, n):
    res = farms.farm().run("call", range(n), per_worker=[{"rank": r} for r in range(n)], module="_p2p_tasks",
                           func="ring", uid=bytes(kccl.get_unique_id()), nranks=n, rounds=60, seed=n,
                           p2p_bytes=4096)
    assert_all_ok(res)


@pytest.mark.parametrize("what", ["recv", "send", "any"])
def test_a_dead_peer_makes_the_wait_raise_within_2s(spawn_farm, what):
    farm = spawn_farm(2)
    uid = bytes(kccl.get_unique_id())
    farm.submit(1, "call", module="_p2p_tasks", func="victim", uid=uid, nranks=2, rank=1, how="kill")
    farm.submit(0, "call", module="_p2p_tasks", func="survivor", uid=uid, nranks=2, rank=0, victim=1, what=what)
    assert farm.wait_note(1) == "joined"
    time.sleep(0.3)
    t_kill = farm.kill(1)
    out = farm.result(0)
    assert out["type"] == "KcclRemoteError" and "rank 1" in out["msg"] and "died" in out["msg"], out
    assert out["t1"] - t_kill < DETECT_S
    assert out["after"] == "KcclInvalidUsage"


def test_an_aborted_peer_makes_the_wait_raise(farms):
    farm = farms.farm()
    uid = bytes(kccl.get_unique_id())
    farm.submit(1, "call", module="_p2p_tasks", func="victim", uid=uid, nranks=2, rank=1, how="abort")
    farm.submit(0, "call", module="_p2p_tasks", func="survivor", uid=uid, nranks=2, rank=0, victim=1, what="recv")
    v, s = farm.result(1), farm.result(0)
    assert s["type"] == "KcclRemoteError" and "abort" in s["msg"], s
    assert s["t1"] - v["t_abort"] < DETECT_S
