"""Bad input: each must raise the documented KcclError subclass with a message that says
what is wrong, and must not touch the buffers or break the communicator.  Most run on
communicators inside the test process (1 rank, or 2 ranks whose init used two threads:
these argument errors are detected before any peer is involved)."""
import os
import sys
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kccl
from kccl._native import ffi, lib
from _harness import shm_names_of, shm_entries
from conftest import make_pair
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import kccl_bench  # noqa: E402  (bench/kccl_bench.py)

BF16 = np.dtype(ml_dtypes.bfloat16)
UNSUPPORTED = [np.int16, np.uint16, np.complex64, np.complex128, np.bool_, object, np.longdouble, "U3",
               "datetime64[s]"]


def ok_after(comm):
    """The communicator still works after the refused call."""
    x = np.arange(5, dtype=np.int32)
    comm.all_reduce(x)
    assert x.tolist() == (np.arange(5) * comm.size).tolist()


# -- exception classes --------------------------------------------------------------------------

def test_exception_hierarchy():
    assert issubclass(kccl.KcclInvalidArgument, ValueError)
    assert issubclass(kccl.KcclInvalidUsage, RuntimeError)
    assert issubclass(kccl.KcclRemoteError, RuntimeError)
    assert issubclass(kccl.KcclTimeout, TimeoutError)
    assert issubclass(kccl.KcclSystemError, OSError)
    for cls, code in [(kccl.KcclInvalidArgument, 4), (kccl.KcclInvalidUsage, 5), (kccl.KcclRemoteError, 6),
                      (kccl.KcclTimeout, 8), (kccl.KcclSystemError, 2), (kccl.KcclInternalError, 3)]:
        assert issubclass(cls, kccl.KcclError) and cls.code == code


def test_error_strings():
    for code in range(9):
        assert ffi.string(lib.kcclGetErrorString(code))
    assert b"unknown" in ffi.string(lib.kcclGetErrorString(99))


# -- dtypes -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dt", UNSUPPORTED, ids=str)
def test_unsupported_dtype(comm1, dt):
    x = np.zeros(4, dtype=dt)
    calls = [lambda: comm1.all_reduce(x), lambda: comm1.all_reduce(x, np.zeros(4, dtype=dt)),
             lambda: comm1.all_gather(x), lambda: comm1.reduce_scatter(x), lambda: comm1.broadcast(x)]
    for call in calls:
        with pytest.raises(kccl.KcclInvalidArgument, match=r"(?i)not reduce|unsupported|dtype|holds"):
            call()
    ok_after(comm1)


@pytest.mark.parametrize("bad", ["int16", "complex64", "bogus", object, np.int16, 42, -1, None.__class__])
def test_unsupported_dtype_keyword(comm1, bad):
    x = np.zeros(8, np.float32)
    with pytest.raises(kccl.KcclInvalidArgument, match=r"(?i)dtype|unsupported"):
        comm1.all_reduce(x, dtype=bad)
    with pytest.raises(kccl.KcclInvalidArgument):
        comm1.broadcast(x, dtype=bad)


def test_dtype_keyword_itemsize_conflict(comm1):
    with pytest.raises(kccl.KcclInvalidArgument, match="byte"):
        comm1.all_reduce(np.zeros(8, np.float32), dtype="float64")


def test_bfloat16_as_uint16_storage(comm1):
    """bfloat16 without ml_dtypes: uint16 storage plus dtype='bfloat16' (documented)."""
    x = np.array([1.5, -2.25, 3.0], BF16)
    out = np.zeros(3, np.uint16)
    comm1.all_reduce(x.view(np.uint16), out, dtype="bfloat16", op=kccl.AVG)
    assert out.view(BF16).tolist() == x.tolist()


def test_mismatched_send_recv_dtype(comm1):
    x = np.arange(6, dtype=np.float32)
    for recv in (np.zeros(6, np.int32), np.zeros(6, np.float64), np.zeros(6, BF16)):
        before = recv.copy()
        with pytest.raises(kccl.KcclInvalidArgument, match=r"float32.*(int32|float64|bfloat16)|byte|elements"):
            comm1.all_reduce(x, recv)
        assert recv.tobytes() == before.tobytes()
        with pytest.raises(kccl.KcclInvalidArgument):
            comm1.all_gather(x, recv)
        with pytest.raises(kccl.KcclInvalidArgument):
            comm1.reduce_scatter(x, recv)
    ok_after(comm1)


# -- layout and writability ---------------------------------------------------------------------

def _noncontig():
    return [np.zeros((8, 8), np.float32)[:, ::2], np.zeros(16, np.int32)[::2],
            np.asfortranarray(np.zeros((3, 4), np.float64)), np.zeros((4, 4), np.float32).T]


@pytest.mark.parametrize("which", range(4))
def test_non_contiguous(comm1, which):
    x = _noncontig()[which]
    good = np.zeros(x.size, x.dtype)
    for call in (lambda: comm1.all_reduce(x), lambda: comm1.all_reduce(x, good),
                 lambda: comm1.all_reduce(good, x), lambda: comm1.all_gather(x),
                 lambda: comm1.all_gather(good, x), lambda: comm1.reduce_scatter(x),
                 lambda: comm1.reduce_scatter(good, x), lambda: comm1.broadcast(x),
                 lambda: kccl_bench.bench_all_reduce(comm1, x, iters=1)):
        with pytest.raises(kccl.KcclInvalidArgument, match="contiguous"):
            call()
    ok_after(comm1)


def test_read_only_recv(comm1):
    x = np.arange(10, dtype=np.float64)
    ro = np.zeros(10, np.float64)
    ro.flags.writeable = False
    for call in (lambda: comm1.all_reduce(x, ro), lambda: comm1.all_gather(x, ro),
                 lambda: comm1.reduce_scatter(x, ro), lambda: comm1.all_reduce(x, bytes(80), dtype="float64")):
        with pytest.raises(kccl.KcclInvalidArgument, match="read-only"):
            call()
    assert not ro.any()
    ok_after(comm1)


def test_read_only_in_place(comm1):
    ro = np.arange(10, dtype=np.int64)
    ro.flags.writeable = False
    for call in (lambda: comm1.all_reduce(ro), lambda: comm1.all_reduce(ro, ro), lambda: comm1.broadcast(ro),
                 lambda: comm1.all_reduce(np.frombuffer(bytes(40), np.int32)),
                 lambda: comm1.broadcast(b"12345678", dtype="uint8")):
        with pytest.raises(kccl.KcclInvalidArgument, match="read-only"):
            call()
    ok_after(comm1)


def test_in_place_errors_name_the_one_buffer_passed(comm1):
    """all_reduce(x) takes one buffer, send: errors about it say so, never `recv`."""
    ro = np.arange(10, dtype=np.int64)
    ro.flags.writeable = False
    for call in (lambda: comm1.all_reduce(ro), lambda: comm1.all_reduce_start(ro),
                 lambda: kccl_bench.bench_all_reduce(comm1, ro, iters=1)):
        with pytest.raises(kccl.KcclInvalidArgument) as e:
            call()
        assert str(e.value).startswith("send (in place) is read-only") and "recv" not in str(e.value), str(e.value)
    with pytest.raises(kccl.KcclInvalidArgument) as e:
        comm1.all_reduce(np.zeros(4, np.complex64))
    assert str(e.value).startswith("send (in place) holds complex64"), str(e.value)
    with pytest.raises(kccl.KcclInvalidArgument, match="^send is float64 but recv is float32"):
        comm1.all_reduce(np.zeros(4), np.zeros(4, np.float32))  # two buffers: both named
    ok_after(comm1)


def test_read_only_send_is_fine(comm1):
    x = np.arange(10, dtype=np.int64)
    x.flags.writeable = False
    out = np.zeros(10, np.int64)
    comm1.all_reduce(x, out)
    assert out.tolist() == list(range(10))
    out2 = np.zeros((1, 10), np.int64)
    comm1.all_gather(x, out2)
    assert out2[0].tolist() == list(range(10))


# -- sizes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_recv", [0, 9, 11, 20])
def test_all_reduce_recv_wrong_size(comm1, n_recv):
    x = np.ones(10, np.float32)
    recv = np.full(n_recv, 3, np.float32)
    with pytest.raises(kccl.KcclInvalidArgument, match="elements"):
        comm1.all_reduce(x, recv)
    assert (recv == 3).all()


def test_all_gather_recv_wrong_size(comm_pair):
    c0, _ = comm_pair
    x = np.ones(10, np.float32)
    for n in (10, 19, 21, 0):  # needs 2 * 10
        recv = np.full(n, 3, np.float32)
        with pytest.raises(kccl.KcclInvalidArgument, match=r"20|elements"):
            c0.all_gather(x, recv)
        assert (recv == 3).all()


def test_reduce_scatter_wrong_sizes(comm_pair):
    c0, _ = comm_pair
    with pytest.raises(kccl.KcclInvalidArgument, match="multiple"):
        c0.reduce_scatter(np.ones(7, np.float32))  # 7 % 2
    for n in (0, 3, 5, 8):  # needs 8 / 2 = 4
        recv = np.full(n, 3, np.float32)
        with pytest.raises(kccl.KcclInvalidArgument, match="elements"):
            c0.reduce_scatter(np.ones(8, np.float32), recv)
        assert (recv == 3).all()


def test_overlapping_buffers(comm1):
    """Partly overlapping send/recv (not the in-place layout) is refused by the C core."""
    buf = np.arange(20, dtype=np.float32)
    before = buf.copy()
    with pytest.raises(kccl.KcclInvalidArgument, match="overlap"):
        comm1.all_reduce(buf[0:10], buf[5:15])
    assert buf.tolist() == before.tolist()


def test_non_buffers(comm1):
    for bad in ([1, 2, 3], "abc", 3.0, None, {"a": 1}):
        with pytest.raises(kccl.KcclInvalidArgument, match="buffer"):
            comm1.all_reduce(bad)

    class FakeGpu:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}

    with pytest.raises(kccl.KcclInvalidArgument, match="GPU"):
        comm1.all_reduce(FakeGpu())
    ok_after(comm1)


def test_plain_buffers_work(comm1):
    """bytearray / memoryview / array.array buffers are accepted (buffer protocol)."""
    import array
    a = array.array("i", [1, 2, 3])
    comm1.all_reduce(a)
    assert list(a) == [1, 2, 3]
    out = bytearray(3)
    comm1.all_reduce(bytearray(b"\x01\x02\x03"), out)
    assert out == bytearray(b"\x01\x02\x03")


def test_numpy_send_with_plain_buffer_recv(comm1):
    """Regression: the numpy fast path once read recv.flags on a non-ndarray recv (AttributeError)."""
    import array
    x = np.arange(4, dtype=np.int32)
    out = array.array("i", [0] * 4)
    comm1.all_reduce(x, memoryview(out))
    assert list(out) == [0, 1, 2, 3]


# -- ops, roots, ranks --------------------------------------------------------------------------

@pytest.mark.parametrize("op", [5, -1, 99, "bogus", None, True, False, 2.5, kccl.SUM.name + "x"])
def test_bad_op(comm1, op):
    x = np.ones(4, np.float32)
    before = x.copy()
    with pytest.raises(kccl.KcclInvalidArgument, match="op"):
        comm1.all_reduce(x, op=op)
    with pytest.raises(kccl.KcclInvalidArgument, match="op"):
        comm1.all_reduce(x, np.zeros(4, np.float32), op=op)
    with pytest.raises(kccl.KcclInvalidArgument, match="op"):
        comm1.reduce_scatter(x, op=op)
    assert x.tolist() == before.tolist()
    ok_after(comm1)


def test_unhashable_op(comm1):
    """Regression: the numpy fast path once let TypeError out for an unhashable op."""
    for op in ([0], {}, {"sum"}):
        with pytest.raises(kccl.KcclInvalidArgument, match="op"):
            comm1.all_reduce(np.ones(4, np.float32), op=op)
        with pytest.raises(kccl.KcclInvalidArgument, match="op"):
            comm1.all_reduce(np.ones(4, np.float32), np.ones(4, np.float32), op=op)
        with pytest.raises(kccl.KcclInvalidArgument, match="op"):
            comm1.reduce_scatter(np.ones(4, np.float32), op=op)


def test_op_spellings(comm1):
    for op in (kccl.SUM, 0, "sum", kccl.Op.MAX, "avg", np.int64(3)):
        x = np.array([1.0, 2.0], np.float64)
        comm1.all_reduce(x, op=op)
        assert x.tolist() == [1.0, 2.0]


def test_root_out_of_range(comm1, comm_pair):
    x = np.ones(4, np.float32)
    for comm, roots in ((comm1, [1, -1, 7]), (comm_pair[0], [2, -1, 100])):
        for root in roots:
            with pytest.raises(kccl.KcclInvalidArgument, match=rf"root.*{root}|{root}.*root"):
                comm.broadcast(x, root=root)
        for root in (True, "0", 0.0, None):
            with pytest.raises(kccl.KcclInvalidArgument, match="root"):
                comm.broadcast(x, root=root)
    ok_after(comm1)


@pytest.mark.parametrize("nranks,rank", [(1, 1), (1, -1), (2, 2), (3, -1), (4, 100)])
def test_rank_out_of_range(nranks, rank):
    with pytest.raises(kccl.KcclInvalidArgument, match="rank"):
        kccl.Communicator(nranks, kccl.get_unique_id(), rank)


@pytest.mark.parametrize("nranks", [0, -1, -100])
def test_nranks_below_one(nranks):
    with pytest.raises(kccl.KcclInvalidArgument, match="nranks"):
        kccl.Communicator(nranks, kccl.get_unique_id(), 0)


def test_nranks_above_c_limit():
    with pytest.raises(kccl.KcclInvalidArgument, match="nranks"):
        kccl.Communicator(5000, kccl.get_unique_id(), 0)


@pytest.mark.parametrize("bad", ["2", 2.0, None, True])
def test_non_int_nranks_and_rank(bad):
    with pytest.raises(kccl.KcclInvalidArgument):
        kccl.Communicator(bad, kccl.get_unique_id(), 0)
    with pytest.raises(kccl.KcclInvalidArgument):
        kccl.Communicator(1, kccl.get_unique_id(), bad if bad is not True else False)


def test_numpy_int_nranks_and_rank_accepted():
    with kccl.Communicator(np.int64(1), kccl.get_unique_id(), np.int32(0)) as c:
        assert (c.size, c.rank) == (1, 0)


# -- unique ids ---------------------------------------------------------------------------------

def test_unique_id_shape():
    uid = kccl.get_unique_id()
    assert isinstance(uid, kccl.UniqueId) and isinstance(uid, bytes) and len(uid) == 128
    assert uid != kccl.get_unique_id()
    import pickle
    assert pickle.loads(pickle.dumps(uid)) == uid


@pytest.mark.parametrize("n", [0, 1, 127, 129, 256])
def test_unique_id_wrong_length(n):
    with pytest.raises(kccl.KcclInvalidArgument, match="128"):
        kccl.UniqueId(b"\0" * n)
    with pytest.raises(kccl.KcclInvalidArgument, match="128"):
        kccl.Communicator(1, b"\0" * n, 0)


@pytest.mark.parametrize("bad", ["x" * 128, 12345, None, [0] * 128])
def test_unique_id_wrong_type(bad):
    with pytest.raises(kccl.KcclInvalidArgument, match="unique"):
        kccl.Communicator(1, bad, 0)


@settings(max_examples=25)
@given(st.binary(min_size=128, max_size=128))
def test_unique_id_random_bytes(data):
    with pytest.raises(kccl.KcclInvalidArgument, match="malformed"):
        kccl.Communicator(1, data, 0, config={"timeout_ms": 500})


@settings(max_examples=60)
@given(pos=st.integers(0, 127), mask=st.integers(1, 255))
def test_unique_id_one_byte_flipped(pos, mask):
    uid = bytearray(kccl.get_unique_id())
    uid[pos] ^= mask
    with pytest.raises(kccl.KcclInvalidArgument, match="malformed"):
        kccl.Communicator(1, bytes(uid), 0, config={"timeout_ms": 500})


def test_unique_id_accepts_bytes_like():
    for make in (bytes, bytearray, lambda u: memoryview(bytes(u))):
        with kccl.Communicator(1, make(kccl.get_unique_id()), 0) as c:  # a fresh id each: ids serve once
            c.barrier()


def test_rank_reused_during_init():
    """Rank 0 of an id is still waiting for rank 1 when rank 0 joins again."""
    uid = kccl.get_unique_id()
    names = shm_names_of(uid, 2)
    first, err = {}, []

    def rank0():
        try:
            first["c"] = kccl.Communicator(2, uid, 0, config={"timeout_ms": 10000})
        except BaseException as e:  # noqa: BLE001
            err.append(e)

    t = threading.Thread(target=rank0)
    t.start()
    deadline = time.monotonic() + 10
    while not (shm_entries() & names) and time.monotonic() < deadline:
        time.sleep(0.005)
    try:
        with pytest.raises(kccl.KcclInvalidUsage, match=r"already|once"):
            kccl.Communicator(2, uid, 0, config={"timeout_ms": 10000})
    finally:
        c1 = kccl.Communicator(2, uid, 1, config={"timeout_ms": 10000})
        t.join()
    assert not err, err
    c0 = first["c"]
    x0, x1 = np.ones(3, np.int32), np.ones(3, np.int32)
    th = threading.Thread(target=c0.all_reduce, args=(x0,))
    th.start()
    c1.all_reduce(x1)
    th.join()
    assert x0.tolist() == x1.tolist() == [2, 2, 2]
    c0.close()
    c1.close()


def test_rank_reused_after_init():
    uid = kccl.get_unique_id()
    with kccl.Communicator(1, uid, 0):
        with pytest.raises(kccl.KcclInvalidUsage):
            kccl.Communicator(1, uid, 0, config={"timeout_ms": 300}).close()


# -- life cycle ---------------------------------------------------------------------------------

def _every_call(c):
    x = np.ones(4, np.float32)
    return [lambda: c.all_reduce(x), lambda: c.all_reduce(x, np.zeros(4, np.float32)),
            lambda: c.all_gather(x), lambda: c.reduce_scatter(x), lambda: c.broadcast(x),
            lambda: c.barrier(), lambda: c.async_error(), lambda: kccl_bench.bench_all_reduce(c, x, iters=2),
            lambda: c.__enter__()]


@pytest.mark.parametrize("how", ["close", "abort"])
def test_use_after_close_or_abort(how):
    c = kccl.Communicator(1, kccl.get_unique_id(), 0)
    assert not c.closed
    getattr(c, how)()
    assert c.closed
    word = "closed" if how == "close" else "abort"
    for call in _every_call(c):
        with pytest.raises(kccl.KcclInvalidUsage, match=word):
            call()
    c.close()  # idempotent, also after abort
    c.abort()
    c.close()
    assert "closed" in repr(c)


def test_context_manager_closes():
    with kccl.Communicator(1, kccl.get_unique_id(), 0) as c:
        assert c.rank == 0 and c.size == 1 and not c.closed
        assert c.async_error() is None
    assert c.closed
    with pytest.raises(kccl.KcclInvalidUsage, match="closed"):
        c.all_reduce(np.ones(2, np.float32))

    with pytest.raises(ZeroDivisionError):
        with kccl.Communicator(1, kccl.get_unique_id(), 0) as c2:
            1 / 0
    assert c2.closed


def test_pair_after_close_peer_reports_remote(comm_pair):
    """A peer that closed is reported (not waited for) by a rank that calls a collective."""
    c0, c1 = comm_pair
    c1.close()
    t0 = time.monotonic()
    with pytest.raises(kccl.KcclRemoteError, match=r"rank 1.*closed"):
        c0.all_reduce(np.ones(4, np.float32))
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(kccl.KcclInvalidUsage, match="unusable"):
        c0.all_reduce(np.ones(4, np.float32))
    assert isinstance(c0.async_error(), kccl.KcclRemoteError)


# -- the C API's own checks (the Python wrapper checks most of these first) ----------------------

def _last_error():
    return ffi.string(lib.kcclGetLastError(ffi.NULL)).decode()


def test_c_api_argument_checks(comm1):
    h = comm1._comm
    buf = np.ones(8, np.float32)
    p = ffi.from_buffer(buf)
    other = np.ones(8, np.float32)
    q = ffi.from_buffer(other)
    stream = ffi.cast("void *", 1)
    cases = [
        (lambda: lib.kcclAllReduce(p, p, 8, 10, 0, h, ffi.NULL), "data type"),
        (lambda: lib.kcclAllReduce(p, p, 8, 255, 0, h, ffi.NULL), "data type"),
        (lambda: lib.kcclAllReduce(p, p, 8, 7, 5, h, ffi.NULL), "op"),
        (lambda: lib.kcclAllReduce(p, p, 8, 7, 0, h, stream), "stream"),
        (lambda: lib.kcclAllReduce(ffi.NULL, q, 8, 7, 0, h, ffi.NULL), "NULL"),
        (lambda: lib.kcclAllReduce(p, p, 8, 7, 0, ffi.NULL, ffi.NULL), "communicator"),
        (lambda: lib.kcclBroadcast(p, p, 8, 7, 1, h, ffi.NULL), "root"),
        (lambda: lib.kcclBroadcast(p, p, 8, 7, -1, h, ffi.NULL), "root"),
        (lambda: lib.kcclAllGather(p, ffi.NULL, 8, 7, h, ffi.NULL), "NULL"),
        (lambda: lib.kcclReduceScatter(p, q, 8, 7, 9, h, ffi.NULL), "op"),
        (lambda: lib.kcclBarrier(h, stream), "stream"),
        (lambda: lib.kcclAllReduce(p, p, 1 << 62, 7, 0, h, ffi.NULL), "too large"),
    ]
    for call, word in cases:
        assert call() == lib.kcclInvalidArgument
        assert word.lower() in _last_error().lower(), (word, _last_error())
    # The benchmark extension's C loop checks its own arguments the same way.
    bl = kccl_bench._lib
    assert bl.kb_bench_all_reduce(p, p, 8, 7, 0, h, 0, kccl_bench._ffi.new("double *")) == lib.kcclInvalidArgument
    assert b"iters" in kccl_bench._ffi.string(bl.kb_last_error())
    assert buf.tolist() == [1.0] * 8 and other.tolist() == [1.0] * 8
    ok_after(comm1)


def test_c_api_init_checks():
    uid = ffi.new("kcclUniqueId *")
    assert lib.kcclGetUniqueId(uid) == 0
    pc = ffi.new("kcclComm_t *")
    assert lib.kcclCommInitRank(pc, 0, uid[0], 0) == lib.kcclInvalidArgument
    assert "nranks" in _last_error()
    assert lib.kcclCommInitRank(pc, 2, uid[0], 2) == lib.kcclInvalidArgument
    assert "rank" in _last_error()
    cfg = ffi.new("kcclConfig_t *")
    assert lib.kcclConfigInit(cfg) == 0
    cfg.size = 3
    assert lib.kcclCommInitRankConfig(pc, 1, uid[0], 0, cfg) == lib.kcclInvalidArgument
    assert "size" in _last_error()
    for field, value in (("algo", 3), ("timeout_ms", -1), ("buffer_bytes", 100), ("debug", 7), ("gpu_blocks", -1),
                         ("gpu_blocks", 133), ("gpu_pull", -2), ("gpu_pull", 2), ("gpu_carveout", -2),
                         ("gpu_carveout", 101), ("gpu_ll_threads", 48), ("gpu_ll_threads", 0),
                         ("gpu_ll_threads", 512), ("gpu_ll_hops", -1), ("gpu_ll_hops", 3),
                         ("gpu_chunk_threads", -32), ("gpu_chunk_threads", 48), ("gpu_chunk_threads", 800)):
        assert lib.kcclConfigInit(cfg) == 0
        setattr(cfg, field, value)
        assert lib.kcclCommInitRankConfig(pc, 1, uid[0], 0, cfg) == lib.kcclInvalidArgument, field
    assert lib.kcclGetVersion(ffi.NULL) == lib.kcclInvalidArgument
    v = ffi.new("int *")
    assert lib.kcclGetVersion(v) == 0 and v[0] == kccl.VERSION_CODE


# -- the all_reduce fast path remembers its last buffers: that must not bypass any check ------

def test_remembered_buffer_made_read_only_is_refused():
    with kccl.Communicator(1, kccl.get_unique_id(), 0) as c:
        x = np.ones(8, np.float32)
        c.all_reduce(x)
        c.all_reduce(x)  # now remembered
        x.flags.writeable = False
        with pytest.raises(kccl.KcclInvalidArgument, match="read-only"):
            c.all_reduce(x)
        y = np.zeros(8, np.float32)
        c.all_reduce(x, y)
        y.flags.writeable = False
        with pytest.raises(kccl.KcclInvalidArgument, match="read-only"):
            c.all_reduce(x, y)


def test_remembered_buffer_with_new_dtype_is_rechecked():
    with kccl.Communicator(1, kccl.get_unique_id(), 0) as c:
        x = np.arange(8, dtype=np.int32)
        c.all_reduce(x)
        c.all_reduce(x)  # now remembered
        x.dtype = np.int16  # same object, a dtype KCCL does not reduce: must not slip through
        with pytest.raises(kccl.KcclInvalidArgument, match="int16"):
            c.all_reduce(x)


def test_close_drops_remembered_buffers():
    import gc
    import weakref
    c = kccl.Communicator(1, kccl.get_unique_id(), 0)
    x = np.ones(16, np.float64)
    c.all_reduce(x)
    ref = weakref.ref(x)
    del x
    gc.collect()
    assert ref() is not None  # remembered while open (documented)
    c.close()
    gc.collect()
    assert ref() is None


def test_bench_all_reduce_checks_recv_like_all_reduce():
    with kccl.Communicator(1, kccl.get_unique_id(), 0) as c:
        x = np.ones(64, np.float32)
        with pytest.raises(kccl.KcclInvalidArgument, match="elements"):
            kccl_bench.bench_all_reduce(c, x, np.empty(8, np.float32), iters=2)
        with pytest.raises(kccl.KcclInvalidArgument, match="float64"):
            kccl_bench.bench_all_reduce(c, x, np.empty(64, np.float64), iters=2)
        ro = np.empty(64, np.float32)
        ro.flags.writeable = False
        with pytest.raises(kccl.KcclInvalidArgument, match="read-only"):
            kccl_bench.bench_all_reduce(c, x, ro, iters=2)
        assert kccl_bench.bench_all_reduce(c, x, np.empty(64, np.float32), iters=2) > 0


class _DLPackOnly:
    """A CPU tensor that speaks only DLPack (as torch.Tensor does), wrapping a numpy array."""

    def __init__(self, arr):
        self._arr = arr

    def __dlpack__(self, *args, **kwargs):
        return self._arr.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


def test_dlpack_cpu_tensors_are_reduced_in_place():
    with kccl.Communicator(1, kccl.get_unique_id(), 0) as c:
        base = np.arange(6, dtype=np.float32)
        t = _DLPackOnly(base)
        c.all_reduce(t, op=kccl.AVG)  # 1 rank: avg = identity, written back through the DLPack view
        assert np.array_equal(base, np.arange(6, dtype=np.float32))
        out = np.zeros(6, np.float32)
        c.all_reduce(t, _DLPackOnly(out))
        assert np.array_equal(out, base)
        g = c.all_gather(t, np.zeros(6, np.float32))
        assert np.array_equal(g, base)


def test_last_error_text_is_per_thread():
    """kcclGetLastError belongs to the calling thread: an error in another thread does not
    overwrite it."""
    from kccl._native import ffi, lib

    def last():
        return ffi.string(lib.kcclGetLastError(ffi.NULL)).decode()

    assert lib.kcclCommInitRank(ffi.new("kcclComm_t *"), 0, ffi.new("kcclUniqueId *")[0], 0) == 4
    mine = last()
    assert "nranks=0" in mine
    seen = {}

    def other():
        seen["before"] = last()
        lib.kcclGetVersion(ffi.NULL)  # fails: version is NULL
        seen["after"] = last()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["before"] == ""  # a new thread starts with no error text
    assert "version" in seen["after"]
    assert last() == mine


def test_torch_cpu_bfloat16_tensors():
    """torch.bfloat16 CPU tensors (numpy cannot view them through DLPack): summed in place
    and out of place across two ranks, bitwise as float32 accumulation rounds them."""
    torch = pytest.importorskip("torch")
    c0, c1 = make_pair()
    try:
        xs = [torch.tensor([1.5, -2.0, 3.25, 1e-3, 300.0], dtype=torch.bfloat16) * (r + 1) for r in range(2)]
        want = (xs[0].float() + xs[1].float()).to(torch.bfloat16)
        outs = [torch.zeros(5, dtype=torch.bfloat16) for _ in range(2)]
        errs = []

        def rank0():
            try:
                c0.all_reduce(xs[0], outs[0])
                c0.all_reduce(xs[0])
            except BaseException as e:  # noqa: BLE001
                errs.append(e)
        t = threading.Thread(target=rank0)
        t.start()
        c1.all_reduce(xs[1], outs[1])
        c1.all_reduce(xs[1])
        t.join()
        assert not errs, errs
        for r in range(2):
            assert torch.equal(outs[r], want) and torch.equal(xs[r], want), (r, outs[r], xs[r], want)
    finally:
        c0.close()
        c1.close()


def test_torch_cpu_tensors_refused_clearly(comm1):
    torch = pytest.importorskip("torch")
    b = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(kccl.KcclInvalidArgument, match="not C-contiguous"):
        comm1.all_reduce(b[::2])
    with pytest.raises(kccl.KcclInvalidArgument, match="complex"):
        comm1.all_reduce(torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(kccl.KcclInvalidArgument, match="send is bfloat16 but recv is float16"):
        comm1.all_reduce(b, torch.zeros(8, dtype=torch.float16))
    with pytest.raises(kccl.KcclInvalidArgument, match="cannot view Tensor through DLPack"):
        comm1.all_reduce(torch.zeros(4, requires_grad=True))
    g = comm1.all_gather(b, torch.ones(8, dtype=torch.bfloat16))
    assert torch.equal(g, b)


def test_capi_gives_only_kccl_h_functions_and_open_handles():
    from kccl import capi
    assert capi.function("kcclAllReduce") != 0
    for name in ("kcclNoSuchCall", "malloc", "KCCL_VERSION_CODE", 7):
        with pytest.raises(kccl.KcclInvalidArgument, match="not a function of kccl.h"):
            capi.function(name)
    c = kccl.Communicator(1, kccl.get_unique_id(), 0)
    assert capi.handle(c) != 0
    c.close()
    with pytest.raises(kccl.KcclInvalidUsage, match="closed"):
        capi.handle(c)
