"""KCCL_SLOT_STORES: the collectives give the same exact answers whether a rank fills its
slots with plain or streaming stores (slot_store.c), on pieces large enough (64 KB and
more) for the choice to apply, in place or not, with a tail that is no multiple of a line."""
import pytest

from _harness import CHUNK_BYTES, Group, assert_all_ok, np_dtype

MODES = ("plain", "stream")


@pytest.fixture(scope="module", params=[(m, n) for m in MODES for n in (2, 3)], ids=lambda p: f"{p[0]}-{p[1]}ranks")
def stores_group(request, farms):
    mode, n = request.param
    g = Group(farms.farm(), n, algos=("twoshot", "oneshot"), key=f"stores-{mode}-{n}", config={"slot_stores": mode})
    yield g
    g.farm.run("init_group", range(n), per_worker=[{"rank": r} for r in range(n)], key=g.key, nranks=n, uids={},
               config={})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "float64"])
@pytest.mark.parametrize("inplace", [False, True])
def test_all_reduce(stores_group, dtype, inplace):
    es = np_dtype(dtype).itemsize
    for algo, count in (("twoshot", 20 * CHUNK_BYTES // es + 13), ("twoshot", 3 * CHUNK_BYTES // es + 1),
                        ("oneshot", 2 * CHUNK_BYTES // es + 5)):
        for op in ("SUM", "MAX") if dtype != "int8" else ("SUM", "PROD"):
            case = dict(algo=algo, dtype=dtype, op=op, count=count, inplace=inplace, seed=count + len(op))
            assert_all_ok(stores_group.run("allreduce", **case), str(case))


def test_all_gather_reduce_scatter_broadcast(stores_group):
    count = CHUNK_BYTES // 4 + 3
    assert_all_ok(stores_group.run("allgather", dtype="float32", count=count, inplace=False, seed=1, algo="twoshot"))
    assert_all_ok(stores_group.run("reduce_scatter", dtype="float32", op="SUM", count=CHUNK_BYTES // 2 + 5,
                                   inplace=False, seed=2, algo="twoshot"))
    for root in range(stores_group.n):
        assert_all_ok(stores_group.run("broadcast", dtype="uint8", count=3 * CHUNK_BYTES + 7, root=root, seed=root,
                                       algo="twoshot"))


def test_setting_rejects_unknown_mode():
    import kccl
    with pytest.raises(ValueError, match="KCCL_SLOT_STORES"):
        kccl.Communicator(1, kccl.get_unique_id(), 0, config={"KCCL_SLOT_STORES": "sometimes"})




@pytest.mark.parametrize("mode", MODES)
def test_split_phase_all_reduce(mode):
    """all_reduce_start fills its slot through the same path: two ranks in one process (the
    start calls never block), a 512 KB message, two in flight."""
    import threading

    import numpy as np

    import kccl
    uid, out = kccl.get_unique_id(), {}
    cfg = {"timeout_ms": 5000, "max_outstanding": 2, "slot_stores": mode}
    t = threading.Thread(target=lambda: out.setdefault(0, kccl.Communicator(2, uid, 0, config=cfg)))
    t.start()
    c1 = kccl.Communicator(2, uid, 1, config=cfg)
    t.join()
    c0 = out[0]
    try:
        n = (512 << 10) // 4 + 3
        a = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(4)]
        h0 = [c0.all_reduce_start(a[0]), c0.all_reduce_start(a[2])]
        h1 = [c1.all_reduce_start(a[1]), c1.all_reduce_start(a[3])]
        for i in range(2):
            want = a[2 * i] + a[2 * i + 1]
            assert np.array_equal(h0[i].wait(), want) and np.array_equal(h1[i].wait(), want)
    finally:
        c0.close()
        c1.close()
