"""all_gather, reduce_scatter, broadcast and barrier over real processes, plus mixed
sequences of collectives (they share step numbers and shared-memory buffer sets)."""
import pytest
from hypothesis import given, settings, strategies as st

from _harness import ALGOS, CHUNK_BYTES, DTYPES, OPS, assert_all_ok, np_dtype
from _strategies import counts

SEED = st.integers(0, 2**32 - 1)


# -- all_gather ---------------------------------------------------------------------------------

@settings(max_examples=30)
@given(data=st.data())
def test_all_gather(group, data):
    dtype = data.draw(st.sampled_from(DTYPES), "dtype")
    es = np_dtype(dtype).itemsize
    # per-rank counts around the chunk size (sendcount * itemsize vs KCCL_CHUNK_BYTES); no "big" branch:
    # recv is nranks times larger
    case = dict(dtype=dtype, count=data.draw(counts(es, big=False), "count"),
                inplace=data.draw(st.booleans(), "inplace"), seed=data.draw(SEED, "seed"))
    assert_all_ok(group.run("allgather", **case), str(case))


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("count", [0, 1, 13, CHUNK_BYTES // 4 - 1, CHUNK_BYTES // 4, CHUNK_BYTES // 4 + 1,
                                   2 * CHUNK_BYTES // 4 + 5])
def test_all_gather_sizes(group, count, inplace):
    case = dict(dtype="float32", count=count, inplace=inplace, seed=count)
    assert_all_ok(group.run("allgather", **case), str(case))


def test_all_gather_allocates_recv(group):
    assert_all_ok(group.run("allgather_alloc", dtype="int64", count=33, seed=3))


# -- reduce_scatter -----------------------------------------------------------------------------

@settings(max_examples=30)
@given(data=st.data())
def test_reduce_scatter(group, data):
    dtype = data.draw(st.sampled_from(DTYPES), "dtype")
    es = np_dtype(dtype).itemsize
    # reduce-scatter's chunk is slot_bytes / itemsize / nranks elements of recv
    case = dict(dtype=dtype, op=data.draw(st.sampled_from(OPS), "op"),
                count=data.draw(counts(es, chunk_elems=CHUNK_BYTES // es // group.n, big=False), "count"),
                inplace=data.draw(st.booleans(), "inplace"), seed=data.draw(SEED, "seed"),
                algo=data.draw(st.sampled_from(ALGOS), "algo"))
    assert_all_ok(group.run("reduce_scatter", **case), str(case))


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("op", OPS)
def test_reduce_scatter_every_op(group, op, inplace):
    for dtype, count in (("int32", 0), ("float16", 1), ("bfloat16", 37), ("uint8", 101), ("float64", 7)):
        case = dict(dtype=dtype, op=op, count=count, inplace=inplace, seed=11)
        assert_all_ok(group.run("reduce_scatter", **case), str(case))


@pytest.mark.parametrize("inplace", [False, True])
def test_reduce_scatter_crosses_chunks(group, inplace):
    per_chunk = CHUNK_BYTES // 4 // group.n
    for count in (per_chunk - 1, per_chunk, per_chunk + 1, 2 * per_chunk + 3):
        case = dict(dtype="float32", op="SUM", count=count, inplace=inplace, seed=count)
        assert_all_ok(group.run("reduce_scatter", **case), str(case))


def test_reduce_scatter_allocates_recv(group):
    assert_all_ok(group.run("reduce_scatter_alloc", dtype="float32", op="MAX", count=29, seed=4))


# -- broadcast ----------------------------------------------------------------------------------

@settings(max_examples=30)
@given(data=st.data())
def test_broadcast(group, data):
    dtype = data.draw(st.sampled_from(DTYPES), "dtype")
    case = dict(dtype=dtype, count=data.draw(counts(np_dtype(dtype).itemsize), "count"),
                root=data.draw(st.integers(0, group.n - 1), "root"), seed=data.draw(SEED, "seed"))
    assert_all_ok(group.run("broadcast", **case), str(case))


@pytest.mark.parametrize("dtype", ["uint8", "bfloat16", "float64"])
def test_broadcast_every_root(group, dtype):
    chunk = CHUNK_BYTES // np_dtype(dtype).itemsize
    assert_all_ok(group.run("broadcast_roots", dtype=dtype, counts=[0, 1, 999, chunk + 1], seed=7))


# -- barrier ------------------------------------------------------------------------------------

def test_barrier_waits_for_the_last_rank(group):
    """Ranks arrive at staggered times (each round a different rank is last): nobody may
    leave a barrier before the last rank arrived (times are CLOCK_MONOTONIC, system-wide)."""
    n = group.n
    rounds = 4
    delays = [[0.05 if (k % n) == r else 0.0 for k in range(rounds)] for r in range(n)]
    per_rank = group.run("barrier", per_rank=[{"delays": d} for d in delays])
    for k in range(rounds):
        last_arrival = max(per_rank[r][k][0] for r in range(n))
        first_leave = min(per_rank[r][k][1] for r in range(n))
        assert first_leave >= last_arrival, f"round {k}: a rank left {last_arrival - first_leave:.6f} s early"


def test_barrier_many(group):
    res = group.run("barrier", delays=[0.0] * 200)
    assert len(res) == group.n and all(len(r) == 200 for r in res)


# -- mixed sequences ----------------------------------------------------------------------------

@st.composite
def steps(draw, n):
    out = []
    for _ in range(draw(st.integers(2, 8))):
        kind = draw(st.sampled_from(["allreduce", "allgather", "reduce_scatter", "broadcast", "barrier"]))
        dtype = draw(st.sampled_from(DTYPES))
        es = np_dtype(dtype).itemsize
        seed = draw(SEED)
        if kind == "barrier":
            out.append((kind, {}))
            continue
        big = draw(st.sampled_from([False] * 7 + [True]))  # now and then two chunks
        count = CHUNK_BYTES // es + 1 if big else draw(st.integers(0, 300))
        kw = dict(dtype=dtype, count=count, seed=seed)
        if kind in ("allreduce", "reduce_scatter"):
            kw["op"] = draw(st.sampled_from(OPS))
            kw["inplace"] = draw(st.booleans())
        if kind == "allreduce":
            kw["algo"] = draw(st.sampled_from(ALGOS))
        if kind == "reduce_scatter":
            kw["count"] = min(count, 300)
        if kind == "allgather":
            kw["inplace"] = draw(st.booleans())
        if kind == "broadcast":
            kw["root"] = draw(st.integers(0, n - 1))
        out.append((kind, kw))
    return out


@settings(max_examples=20)
@given(data=st.data())
def test_mixed_sequence(group, data):
    seq = data.draw(steps(group.n), "steps")
    assert_all_ok(group.run("sequence", steps=seq))
