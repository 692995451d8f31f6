"""Hypothesis strategies shared by the test modules (kept out of _harness, which the
workers import)."""
from hypothesis import strategies as st

from _harness import CHUNK_BYTES, ONESHOT_MAX_BYTES


@st.composite
def counts(draw, itemsize, chunk_elems=None, big=True):
    """Element counts: mostly tiny/small and odd, some at auto's one-shot/two-shot crossover,
    some around the 1 MiB chunk boundary (one, two chunks +- a few elements), a few 1-4 MB."""
    chunk = chunk_elems or CHUNK_BYTES // itemsize
    kinds = ["tiny"] * 4 + ["small"] * 3 + ["crossover", "chunk"] + (["big"] if big else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "tiny":
        return draw(st.integers(0, 17))
    if kind == "small":
        return draw(st.integers(18, 5000))
    if kind == "crossover":
        return max(0, ONESHOT_MAX_BYTES // itemsize + draw(st.integers(-2, 2)))
    if kind == "chunk":
        return max(1, draw(st.sampled_from([1, 2])) * chunk + draw(st.integers(-3, 3)))
    return draw(st.integers(CHUNK_BYTES, 4 * CHUNK_BYTES)) // itemsize
