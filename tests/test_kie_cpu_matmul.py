"""The CPU kernels' products with several inputs at once (csrc/kq.h's kq_matmul_mat: a
prompt's tokens, a batch's sequences): on every SIMD level this CPU runs, every weight
type, GGUF rows and the packed layout, each input's result is bit for bit the
single-input product's (kq_matvec_mat), whatever the other inputs hold (a NaN in one
input reaches that input's outputs only), for any row range and number of inputs."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

pytest.importorskip("gguf")

from kie_engine.formats import quant as Q  # noqa: E402
from kie_engine.cpu import kernels as K  # noqa: E402

try:
    LEVELS = K.levels()
except ImportError as e:  # the extension was not built
    pytest.skip(f"native CPU kernels not built: {e}", allow_module_level=True)

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]
PACKABLE = {"Q8_0", "Q4_0", "Q4_1"}


def _weights(rng, t, rows, cols, packed):
    w = (rng.standard_normal((rows, cols)) * rng.uniform(1e-3, 10, (rows, 1))).astype(np.float32)
    w[::3] += np.float32(1.5)  # rows whose minimum matters (Q4_1, Q4_K)
    raw = Q.quantize(w, Q.CODES[t])
    if packed:
        return K.pack(t, raw, cols)
    return K.TYPES[t], raw


def _alone(code, arr, rows, x, r0, r1, t):
    if code & K.PACKED:
        return K.matvec_packed(code, arr, rows, x, r0, r1)
    return K.matvec(t, arr, x, r0, r1)


@st.composite
def problems(draw):
    t = draw(st.sampled_from(TYPES))
    packed = t in PACKABLE and draw(st.booleans())
    blk = 256 if t in ("Q4_K", "Q6_K") else 32
    cols = draw(st.integers(1, 70)) if t in ("F32", "F16", "BF16") else blk * draw(st.integers(1, 3 if blk == 256 else 20))
    rows = draw(st.integers(1, 40))
    r0 = draw(st.integers(0, rows))
    r1 = draw(st.integers(r0, rows))
    nt = draw(st.integers(1, 11))
    return t, packed, rows, cols, r0, r1, nt, draw(st.integers(0, 2**32 - 1)), draw(st.sampled_from(["normal", "nan", "inf", "zero"]))


@pytest.mark.parametrize("lv", LEVELS)
@settings(max_examples=120, deadline=None)
@given(p=problems())
def test_each_input_gets_the_single_input_bits(lv, p):
    t, packed, rows, cols, r0, r1, nt, seed, kind = p
    rng = np.random.default_rng(seed)
    code, arr = _weights(rng, t, rows, cols, packed)
    xs = rng.standard_normal((nt, cols)).astype(np.float32)
    odd = nt // 2  # one input that is unlike the others
    if kind == "nan":
        xs[odd, cols // 2] = np.nan
    elif kind == "inf":
        xs[odd, 0] = np.inf
    elif kind == "zero":
        xs[odd] = 0
    keep = K.level()
    K.set_level(lv)
    try:
        sentinel = np.float32(-7.25)
        y = K.matmul(code, arr, rows, xs, r0, r1, out=np.full((nt, rows), sentinel, np.float32))
        alone = [_alone(code, arr, rows, x, r0, r1, t) for x in xs]
    finally:
        K.set_level(keep)
    for i in range(nt):
        np.testing.assert_array_equal(y[i, r0:r1], alone[i][r0:r1], err_msg=f"{t} packed={packed} {lv} input {i}")
        if kind in ("nan", "inf") and i != odd:
            assert np.isfinite(y[i, r0:r1]).all()
    assert (y[:, :r0] == sentinel).all() and (y[:, r1:] == sentinel).all()  # rows outside the range untouched


@pytest.mark.parametrize("t,rows,cols", [("Q4_1", 1536, 576), ("Q4_1", 576, 1536), ("Q8_0", 300, 576),
                                         ("Q4_K", 64, 512), ("F16", 40, 576)])
def test_model_shapes_and_many_inputs(t, rows, cols):
    """SmolLM2's widths, a prompt chunk's 64 inputs, rows split as two threads split them."""
    rng = np.random.default_rng(7)
    packed = t in PACKABLE
    code, arr = _weights(rng, t, rows, cols, packed)
    xs = rng.standard_normal((64, cols)).astype(np.float32)
    keep = K.level()
    try:
        for lv in LEVELS:
            K.set_level(lv)
            y = np.zeros((64, rows), np.float32)
            h = rows // 2 // 4 * 4
            for a, b in ((0, h), (h, rows)):
                K.matmul(code, arr, rows, xs, a, b, out=y)
            for i in (0, 5, 63):
                np.testing.assert_array_equal(y[i], _alone(code, arr, rows, xs[i], 0, rows, t), err_msg=lv)
    finally:
        K.set_level(keep)


def test_layout_and_refusals():
    """The prepared inputs (kq_internal.h): each input as prepared alone (q, its 4-sums, (d,
    d * sum q) per block), one after the other, nothing else."""
    ffi, lib = K.native()
    cols, nt = 96, 5
    one = lib.kq_act_bytes(K.TYPES["Q4_1"], cols)
    up = (cols + 63) // 64 * 64
    assert one == 2 * up + (cols // 16 * 4 + 63) // 64 * 64
    assert lib.kq_acts_bytes(K.TYPES["Q4_1"], cols, nt) == nt * one
    assert lib.kq_acts_bytes(K.TYPES["F32"], 10, 3) == 3 * lib.kq_act_bytes(0, 10)
    assert lib.kq_acts_bytes(K.TYPES["Q4_1"] | K.PACKED, cols, nt) == lib.kq_acts_bytes(K.TYPES["Q4_1"], cols, nt)
    assert lib.kq_acts_bytes(6, 64, 2) == 0 and lib.kq_acts_bytes(8, 64, 0) == 0
    xs = np.random.default_rng(1).standard_normal((nt, cols)).astype(np.float32)
    acts = K.prepare_acts("Q8_0", xs)
    parts = [slice(0, cols), slice(up, up + cols), slice(2 * up, 2 * up + cols // 16 * 4)]  # q, 4-sums, (d, d sum q)
    for i in range(nt):
        own, mine = K.prepare_act("Q8_0", xs[i]), acts[i * one:(i + 1) * one]
        for part in parts:
            np.testing.assert_array_equal(mine[part], own[part])
    y = np.zeros((2, 4), np.float32)  # an unsupported type, or rows past a packed matrix: NaN
    lib.kq_matmul_mat(6, ffi.NULL, 4, 64, ffi.NULL, 2, ffi.cast("float *", y.ctypes.data), 4, 0, 4)
    assert np.isnan(y).all()
    y[:] = 0
    lib.kq_matmul_mat(8 | K.PACKED, ffi.NULL, 2, 64, ffi.NULL, 2, ffi.cast("float *", y.ctypes.data), 4, 0, 4)
    assert np.isnan(y).all()


def test_swiglu_gives_the_same_bits_at_every_level():
    """The steps' SwiGLU (the AVX-512 level runs it in registers) against the portable
    loop: every value, tails of every length, the clamps, infinities and NaNs."""
    from kie_engine.cpu._native import ffi, lib
    rng = np.random.default_rng(7)
    gate = np.concatenate([rng.standard_normal(4000).astype(np.float32) * 8,
                           np.float32([0, -0.0, 87, -87, 88.7, -88.7, 90, -90, 1e-40, -1e-40,
                                       np.inf, -np.inf, np.nan, 3e38, -3e38, 15.5])])
    up = rng.standard_normal(gate.size).astype(np.float32)

    def run(n):
        m = np.full(n, 7.0, np.float32)
        lib.kie_cpu_swiglu(ffi.cast("float *", gate.ctypes.data), ffi.cast("float *", up.ctypes.data),
                           ffi.cast("float *", m.ctypes.data), n)
        return m
    got, keep = {}, K.level()
    for lv in LEVELS:
        K.set_level(lv)
        try:
            got[lv] = [run(n) for n in (gate.size, 17, 15, 1)]
        finally:
            K.set_level(keep)
    ref = got["scalar"]
    for lv, ms in got.items():
        for a, b in zip(ms, ref):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=lv)
    z = ref[0][:4000].astype(np.float64)
    g = gate[:4000].astype(np.float64)
    np.testing.assert_allclose(z, g / (1 + np.exp(-g)) * up[:4000], rtol=1e-5, atol=1e-30)
