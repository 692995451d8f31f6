"""all_reduce correctness over real processes, against a numpy reference computed in rank
order on every rank (see _harness.reduce_reference for the exact contract).

Comparison is exact: integers bitwise, floats by value (the reduction order and the
accumulation type are part of KCCL's contract, so there is nothing to forgive; value
equality only ignores the sign of zero, which max/min of +0 and -0 may pick either way)."""
import time

import pytest
from hypothesis import given, settings, strategies as st

from _harness import ALGOS, CHUNK_BYTES, DTYPES, OPS, assert_all_ok, np_dtype
from _strategies import counts


@st.composite
def allreduce_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    return dict(dtype=dtype, op=draw(st.sampled_from(OPS)),
                count=draw(counts(np_dtype(dtype).itemsize)),
                inplace=draw(st.booleans()), algo=draw(st.sampled_from(ALGOS)),
                seed=draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=80)
@given(case=allreduce_cases())
def test_all_reduce_matches_reference(group, case):
    assert_all_ok(group.run("allreduce", **case), str(case))


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_every_dtype_and_op(group, dtype, algo):
    """Deterministic sweep (so a gap in hypothesis' draws cannot hide a kernel): every
    dtype x op x algorithm at an odd size, plus the two-chunk case for one op."""
    for i, op in enumerate(OPS):
        case = dict(dtype=dtype, op=op, count=1031, inplace=bool(i % 2), algo=algo, seed=1234 + i)
        assert_all_ok(group.run("allreduce", **case), str(case))
    if group.n in (2, 3):
        chunk = CHUNK_BYTES // np_dtype(dtype).itemsize
        case = dict(dtype=dtype, op="SUM", count=chunk + 7, inplace=False, algo=algo, seed=99)
        assert_all_ok(group.run("allreduce", **case), str(case))


@pytest.mark.parametrize("nbytes", [16 * CHUNK_BYTES + 4, 40 * CHUNK_BYTES + 12, 80 * CHUNK_BYTES + 20])
def test_two_shot_of_many_pieces(group, nbytes):
    """A two-shot all-reduce of 16, 40 and 80 pieces of KCCL_CHUNK_BYTES, each message
    with a tail that is no multiple of the piece."""
    if group.n not in (2, 3):
        pytest.skip("one group size is enough for the piece loop")
    case = dict(dtype="float32", op="SUM", count=nbytes // 4, inplace=False, algo="twoshot", seed=nbytes)
    assert_all_ok(group.run("allreduce", **case), str(case))


@pytest.mark.parametrize("count", [0, 1])
@pytest.mark.parametrize("inplace", [False, True])
def test_all_reduce_degenerate_counts(group, count, inplace):
    for algo in ALGOS:
        case = dict(dtype="float32", op="SUM", count=count, inplace=inplace, algo=algo, seed=5)
        assert_all_ok(group.run("allreduce", **case), str(case))


def test_many_small_all_reduces_no_pathological_slowness(farms):
    """8 ranks on (typically) 2 cores: 2000 small all-reduces, every result checked.  The
    time bound only catches a pathological hang/livelock; it is not a benchmark."""
    from _harness import GroupHandle
    g = GroupHandle(farms, 8)
    g.run("barrier", delays=[0.0])  # make sure the group exists before timing
    t0 = time.monotonic()
    results = g.run("small_loop", iters=2000, algo="auto", timeout=90)
    wall = time.monotonic() - t0
    assert_all_ok([problem for _secs, problem in results])
    assert wall < 60, f"2000 small all-reduces on 8 ranks took {wall:.1f} s"
