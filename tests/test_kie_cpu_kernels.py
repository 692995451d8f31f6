"""The CPU engine's block-format kernels (kie_engine/cpu/csrc/kq_*.c) against numpy:
every weight type x every SIMD level this CPU runs (forced through kq_set_level, the
portable scalar path always among them) x shapes from hypothesis (odd row counts, row
ranges, one to several blocks, zero blocks), plus the dequantizers (C and numpy) against
gguf-py's, and the prepared input against its definition."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

gguf = pytest.importorskip("gguf")  # the kie extra (CI installs it)

from kie_engine.formats import quant as Q  # noqa: E402
from kie_engine.cpu import kernels as K  # noqa: E402

try:
    LEVELS = K.levels()
except ImportError as e:  # the extension was not built
    pytest.skip(f"native CPU kernels not built: {e}", allow_module_level=True)

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]
FLOATS = {"F32", "F16", "BF16"}


@pytest.fixture(params=LEVELS)
def level(request):
    keep = K.level()
    assert K.set_level(request.param), request.param
    yield request.param
    K.set_level(keep)


def quantize_input(x):
    """The prepared input's definition (kq_internal.h): per 32 values, d = max|x| / 127,
    q = x / d rounded to nearest even, in float32 as the kernels compute it."""
    xb = x.astype(np.float32).reshape(-1, 32)
    d = (np.abs(xb).max(axis=1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[:, None]).astype(np.int32)
    return q, d


def reference(t, w_raw, x, cols):
    """float64 product of the dequantized weights with the input the kernel really sees
    (x itself for float weights, its 8-bit blocks otherwise), and a bound on float32
    rounding in any summation order: |W| @ |x| times a few units in the last place."""
    wf = Q.dequantize(w_raw, Q.CODES[t], cols).astype(np.float64)
    if t in FLOATS:
        xs = x.astype(np.float64)
    else:
        q, d = quantize_input(x)
        xs = (q * d[:, None].astype(np.float64)).reshape(-1)
    return wf @ xs, np.abs(wf) @ np.abs(xs) * 3e-6 * np.sqrt(cols) + 1e-30


def make_rows(rng, t, rows, cols, zero_rows=()):
    scale = rng.uniform(1e-3, 10, (rows, 1))
    w = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    if t in ("Q4_1", "Q4_K"):  # rows whose values are mostly positive: the minimum matters
        w[::3] += np.float32(2 * scale[::3])
    for r in zero_rows:
        if r < rows:
            w[r] = 0
    return w, Q.quantize(w, Q.CODES[t])


@st.composite
def problems(draw):
    t = draw(st.sampled_from(TYPES))
    blk = {"Q4_K": 256, "Q6_K": 256}.get(t, 32)
    if t in FLOATS:
        cols = draw(st.integers(1, 200))
    else:
        cols = blk * draw(st.integers(1, 5 if blk == 256 else 24))
    rows = draw(st.integers(1, 13))
    r0 = draw(st.integers(0, rows))
    r1 = draw(st.integers(r0, rows))
    return t, rows, cols, r0, r1, draw(st.integers(0, 2**32 - 1)), draw(st.sampled_from(["normal", "zero", "tiny", "big"]))


@pytest.mark.parametrize("lv", LEVELS)
@settings(max_examples=150)
@given(p=problems())
def test_matvec_matches_numpy(lv, p):
    t, rows, cols, r0, r1, seed, kind = p
    keep = K.level()
    K.set_level(lv)
    try:
        check_matvec(t, rows, cols, r0, r1, seed, kind, lv)
    finally:
        K.set_level(keep)


def check_matvec(t, rows, cols, r0, r1, seed, kind, level):
    rng = np.random.default_rng(seed)
    _, raw = make_rows(rng, t, rows, cols, zero_rows=(1,))
    x = rng.standard_normal(cols).astype(np.float32)
    if kind == "zero":
        x[: min(cols, 40)] = 0  # whole zero input blocks: scale 0
    elif kind == "tiny":
        x *= np.float32(1e-6)
    elif kind == "big":
        x *= np.float32(1e4)
    sentinel = np.float32(-7.5)
    out = np.full(rows, sentinel, np.float32)
    y = K.matvec(t, raw, x, r0, r1, out=out)
    want, tol = reference(t, raw, x, cols)
    err = np.abs(y[r0:r1] - want[r0:r1])
    assert (err <= tol[r0:r1]).all(), (t, level, err.max(), tol[r0:r1].min())
    # rows outside the range are left alone
    assert (y[:r0] == sentinel).all() and (y[r1:] == sentinel).all()


@pytest.mark.parametrize("t", TYPES)
def test_smollm2_shapes(level, t):
    """The widths and row counts of SmolLM2-135M (576 hidden, 1536 MLP), rows split
    unevenly as threads split them."""
    rng = np.random.default_rng(5)
    for rows, cols in ((576, 576), (67, 1536), (1536, 576)):
        if cols % Q.BLOCKS[Q.CODES[t]][0]:
            continue
        _, raw = make_rows(rng, t, rows, cols)
        x = rng.standard_normal(cols).astype(np.float32)
        act = K.prepare_act(t, x)
        y = np.zeros(rows, np.float32)
        h = rows // 2
        for a, b in ((0, 1), (1, h), (h, h + 1), (h + 1, rows)):
            K.matvec(t, raw, x, a, b, act=act, out=y)
        want, tol = reference(t, raw, x, cols)
        assert (np.abs(y - want) <= tol).all(), (t, level)


@pytest.mark.parametrize("t", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_every_level_agrees_with_scalar(t):
    """The SIMD levels compute what the portable path computes, up to summation order."""
    rng = np.random.default_rng(11)
    cols = 512
    _, raw = make_rows(rng, t, 9, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    keep = K.level()
    try:
        got = {}
        for lv in LEVELS:
            K.set_level(lv)
            got[lv] = K.matvec(t, raw, x)
    finally:
        K.set_level(keep)
    _, tol = reference(t, raw, x, cols)
    for lv in LEVELS:
        assert (np.abs(got[lv] - got["scalar"]) <= tol).all(), lv


def test_prepared_input_is_its_definition(level):
    """q, the 4-sums and (d, d * sum q) per block, exactly, on every level."""
    rng = np.random.default_rng(3)
    cols = 160
    x = rng.standard_normal(cols).astype(np.float32) * 3
    x[32:64] = 0
    x[64] = 1e-30
    act = K.prepare_act("Q8_0", x)
    up = lambda n: (n + 63) // 64 * 64  # noqa: E731
    q = act[:cols].view(np.int8).astype(np.int32)
    s4 = act[up(cols):up(cols) + cols].view(np.int32)
    dds = act[2 * up(cols):2 * up(cols) + cols // 16 * 4].view(np.float32).reshape(-1, 2)
    wq, wd = quantize_input(x)
    np.testing.assert_array_equal(q, wq.reshape(-1))
    np.testing.assert_array_equal(s4, wq.reshape(-1, 4).sum(axis=1))
    np.testing.assert_array_equal(dds[:, 0], wd)
    np.testing.assert_array_equal(dds[:, 1], wd * wq.sum(axis=1).astype(np.float32))


@pytest.mark.parametrize("t", TYPES)
def test_dequant_matches_gguf_py(t):
    """C's kq_dequant_row and numpy's quant.dequantize, both against gguf-py's dequantizer,
    on rows from our quantizers (gguf-py's own for Q8_0 / Q4_0 / Q4_1)."""
    rng = np.random.default_rng(Q.CODES[t])
    cols = 512
    w, raw = make_rows(rng, t, 6, cols, zero_rows=(2,))
    if t == "BF16":  # gguf-py reads BF16 as raw 16-bit words
        want = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(6, cols)
    else:
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(Q.CODES[t])).reshape(6, cols)
    np.testing.assert_array_equal(Q.dequantize(raw, Q.CODES[t], cols), want)
    np.testing.assert_array_equal(K.dequant(t, raw, cols), want)
    # the quantizer is the format's, not noise: relative error per type
    tol = {"F32": 0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 8e-3, "Q6_K": 3e-2, "Q4_0": 0.1, "Q4_1": 0.1, "Q4_K": 0.12}[t]
    assert np.abs(want - w).max() <= tol * np.abs(w).max()


def test_q4_k_and_q6_k_by_hand():
    """One block of each K type built byte by byte, against the format's definition."""
    b = np.zeros(144, np.uint8)
    b[0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    b[2:4] = np.frombuffer(np.float16(0.25).tobytes(), np.uint8)
    sc, m = np.arange(8) * 7 + 1, 63 - np.arange(8) * 5   # 6-bit values, high bits used
    b[4:16] = Q.q4k_pack_scales(sc, m)
    q = (np.arange(256) * 7) % 16
    qs = q.reshape(4, 2, 32)
    b[16:] = (qs[:, 0] | (qs[:, 1] << 4)).reshape(-1)
    want = 0.5 * np.repeat(sc, 32) * q - 0.25 * np.repeat(m, 32)
    for got in (Q.dequantize(b[None], Q.Q4_K, 256)[0], K.dequant("Q4_K", b[None], 256)[0],
                gguf.quants.dequantize(b[None], gguf.GGMLQuantizationType.Q4_K)[0]):
        np.testing.assert_array_equal(got, want.astype(np.float32))
    b6 = np.zeros(210, np.uint8)
    q6 = (np.arange(256) * 11) % 64
    b6[:192] = Q.q6k_pack(q6)
    sc6 = (np.arange(16) * 17 - 128).astype(np.int8)
    b6[192:208] = sc6.view(np.uint8)
    b6[208:210] = np.frombuffer(np.float16(0.125).tobytes(), np.uint8)
    want6 = 0.125 * np.repeat(sc6.astype(np.float64), 16) * (q6 - 32)
    for got in (Q.dequantize(b6[None], Q.Q6_K, 256)[0], K.dequant("Q6_K", b6[None], 256)[0],
                gguf.quants.dequantize(b6[None], gguf.GGMLQuantizationType.Q6_K)[0]):
        np.testing.assert_array_equal(got, want6.astype(np.float32))


def test_scalar_level_is_always_there_and_bad_names_refused():
    keep = K.level()
    try:
        assert K.set_level("scalar") and K.level() == "scalar"
        assert not K.set_level("sse9")
        assert K.level() == "scalar"
    finally:
        K.set_level(keep)
    assert keep in LEVELS and "scalar" in LEVELS


PACKABLE = ["Q8_0", "Q4_0", "Q4_1"]


@pytest.mark.parametrize("lv", LEVELS)
@settings(max_examples=100)
@given(t=st.sampled_from(PACKABLE), rows=st.integers(1, 40), nb=st.integers(1, 20), cut=st.tuples(
    st.integers(0, 40), st.integers(0, 40)), seed=st.integers(0, 2**32 - 1))
def test_packed_layout_matches_the_rows(lv, t, rows, nb, cut, seed):
    """The sixteen-row packed layout (kq_pack, kq_matvec_mat) computes what the GGUF rows do:
    bit for bit on levels that go through the row kernels, up to summation order on
    those with packed kernels; any row range (not only multiples of 4), rows outside it
    left alone, padding rows never written."""
    cols = 32 * nb
    r0, r1 = sorted(min(c, rows) for c in cut)
    rng = np.random.default_rng(seed)
    _, raw = make_rows(rng, t, rows, cols, zero_rows=(2,))
    x = rng.standard_normal(cols).astype(np.float32)
    keep = K.level()
    K.set_level(lv)
    try:
        want = K.matvec(t, raw, x)
        code, p = K.pack(t, raw, cols)
        assert code == K.TYPES[t] | K.PACKED and p.nbytes == -(-rows // 16) * 16 * K.row_bytes(t, cols)
        sentinel = np.float32(-7.5)
        y = K.matvec_packed(code, p, rows, x, r0, r1, out=np.full(rows, sentinel, np.float32))
    finally:
        K.set_level(keep)
    _, tol = reference(t, raw, x, cols)
    assert (np.abs(y[r0:r1] - want[r0:r1]) <= tol[r0:r1]).all(), (t, lv)
    if lv != "avx512":
        assert (y[r0:r1] == want[r0:r1]).all(), (t, lv)
    assert (y[:r0] == sentinel).all() and (y[r1:] == sentinel).all()


def test_packed_forms_exist_only_where_they_should():
    ffi, lib = __import__("kie_engine.cpu._native", fromlist=["native"]).native()
    for t in ("F32", "F16", "BF16", "Q4_K", "Q6_K"):
        assert lib.kq_packed_bytes(K.TYPES[t], 8, 256) == 0 and K.pack(t, np.zeros((8, K.row_bytes(t, 256)), np.uint8), 256) is None
    assert lib.kq_packed_bytes(8, 5, 64) == 16 * 68
    assert lib.kq_packed_bytes(8 | K.PACKED, 8, 64) == 0  # packing twice is refused
    assert lib.kq_packed_bytes(8, 4, 32 * 1000) == 0  # rows past 16 kB stay GGUF rows
    assert lib.kq_pack(12, ffi.NULL, 4, 256, ffi.NULL) == -1
    assert ffi.string(lib.kq_type_name(8 | K.PACKED)) == b"Q8_0x16" and lib.kq_supported(3 | K.PACKED)
    assert not lib.kq_supported(12 | K.PACKED)
    out = np.zeros(64, np.float32)  # a packed row is not a row: dequantizing one says so
    lib.kq_dequant_row(8 | K.PACKED, ffi.NULL, 64, ffi.cast("float *", out.ctypes.data))
    assert np.isnan(out).all()
    y = np.zeros(4, np.float32)  # a row range past the matrix: NaN, never a read past it
    lib.kq_matvec_mat(8 | K.PACKED, ffi.NULL, 2, 64, ffi.NULL, ffi.cast("float *", y.ctypes.data), 0, 4)
    assert np.isnan(y).all()


def test_unsupported_type_and_width():
    ffi, lib = __import__("kie_engine.cpu._native", fromlist=["native"]).native()
    assert lib.kq_supported(8) == 1 and lib.kq_supported(6) == 0  # Q8_0 yes, Q5_0 no
    assert ffi.string(lib.kq_type_name(6)) == b"?"
    assert lib.kq_row_bytes(8, 33) == 0 and lib.kq_row_bytes(12, 512) == 288
    assert lib.kq_act_bytes(6, 64) == 0
    with pytest.raises(ValueError):
        K.matvec("Q8_0", np.zeros((2, 34), np.uint8), np.zeros(33, np.float32))
    y = np.zeros(2, np.float32)  # an unsupported type: the kernel marks its output, never garbage
    lib.kq_matvec(6, ffi.NULL, 64, ffi.NULL, ffi.cast("float *", y.ctypes.data), 0, 2)
    assert np.isnan(y).all()


def _run_child(env_extra):
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_extra)
    code = "from kie_engine.cpu import kernels as K; print(K.level()); print(K.levels())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("hide", ["avx2", " AVX512 , avx2,"])
def test_hidden_avx2_gets_scalar_and_one_notice_saying_it_was_hidden(hide):
    """KIE_CPU_HIDE masks features from the dispatcher: without AVX2 (and so without the
    AVX-512 level, which needs it) the portable path runs, and stderr says once that the
    setting hid them (not that the CPU lacks them); KIE's settings table knows the name."""
    r = _run_child({"KIE_CPU_HIDE": hide})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["scalar", "['scalar']"]
    notice = [line for line in r.stderr.splitlines() if "AVX2" in line]
    assert len(notice) == 1 and "scalar" in notice[0], r.stderr
    if "avx2" in LEVELS:
        assert f"KIE_CPU_HIDE={hide} hides AVX2" in notice[0] and "has no" not in notice[0], notice
        assert ("AVX-512" in notice[0]) == ("avx512" in LEVELS), notice
    assert "not a KIE setting" not in r.stderr, r.stderr
    if "avx512" in LEVELS:  # hiding only AVX-512 leaves AVX2, without a word
        r = _run_child({"KIE_CPU_HIDE": "avx512"})
        assert r.stdout.splitlines()[0] == "avx2" and "AVX2" not in r.stderr


def test_a_bad_hide_value_is_refused_before_any_kernel_runs():
    r = _run_child({"KIE_CPU_HIDE": "avx3"})
    assert r.returncode != 0 and "SettingError: KIE_CPU_HIDE='avx3': expected some of avx512, avx2" in r.stderr, \
        r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("t", TYPES)
def test_non_finite_input_reaches_every_output(level, t):
    """A NaN or infinity in the input gives NaN rows (the int8 blocks must not turn a
    diverged activation into plausible numbers), on every level."""
    rng = np.random.default_rng(2)
    cols = 512
    _, raw = make_rows(rng, t, 6, cols, zero_rows=(3,))
    for bad in (np.nan, np.inf, -np.inf):
        x = rng.standard_normal(cols).astype(np.float32)
        x[300] = bad
        y = K.matvec(t, raw, x)
        if t in FLOATS and bad != bad:
            assert np.isnan(y).all()
        elif t in FLOATS:  # inf times finite weights: inf or nan, never finite
            assert not np.isfinite(y[[0, 1, 2, 4, 5]]).any()
        else:
            assert np.isnan(y).all(), (t, bad, y)


def test_every_half_converts_exactly():
    """The portable half -> float conversion (scales of every block type, F16 weights) on
    all 65536 halves, against numpy's, bit for bit (NaN payloads included)."""
    keep = K.level()
    try:
        K.set_level("scalar")
        h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
        got = K.dequant("F16", h.view(np.uint8).reshape(1, -1), 65536)[0]
    finally:
        K.set_level(keep)
    np.testing.assert_array_equal(got.view(np.uint32), h.view(np.float16).astype(np.float32).view(np.uint32))


# -- the GGUF type table: C's copy is Python's (kie_engine/formats/gguf_types.py) --------------------

def test_the_kernels_type_table_is_gguf_types():
    """kq.h's codes, kq_types.c's names and blocks, as the built library reports them, are
    gguf_types.TYPES, and every type there is one the kernels take."""
    from kie_engine.formats import gguf_types
    ffi, lib = K.native()
    for code, (name, elems, nbytes) in gguf_types.TYPES.items():
        assert getattr(lib, f"KQ_{name}") == code, name
        assert lib.kq_supported(code), name
        assert ffi.string(lib.kq_type_name(code)).decode() == name
        assert (lib.kq_block_elems(code), lib.kq_row_bytes(code, elems)) == (elems, nbytes), name
    assert sorted(gguf_types.NAMES.values()) == sorted(TYPES)


def test_the_build_refuses_a_type_table_that_disagrees(tmp_path):
    """cpu/_build.py's check sees a block size, a code or a type that differs."""
    import os
    import runpy
    import shutil
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    build = runpy.run_path(os.path.join(root, "kie_engine", "cpu", "_build.py"))
    table = open(os.path.join(root, "kie_engine", "formats", "gguf_types.py")).read()
    build["check_types"]()  # the tree's own agree
    for old, new in (('("Q6_K", 256, 210)', '("Q6_K", 256, 211)'), ("Q4_K, Q6_K, BF16 = 0, 1, 2, 3, 8, 12, 14, 30",
                                                                    "Q4_K, Q6_K, BF16 = 0, 1, 2, 3, 8, 13, 14, 30"),
                     (', BF16: ("BF16", 1, 2)}', ', BF16: ("BF16", 1, 2), 31: ("X", 1, 1)}')):
        assert old in table
        bad = tmp_path / "gguf_types.py"
        bad.write_text(table.replace(old, new))
        with pytest.raises(SystemExit, match="are not kie_engine/formats/gguf_types.py's"):
            build["check_types"](str(bad))
    csrc = tmp_path / "csrc"
    shutil.copytree(os.path.join(root, "kie_engine", "cpu", "csrc"), csrc)
    (csrc / "kq.h").write_text((csrc / "kq.h").read_text().replace("#define KQ_BF16 30", "#define KQ_BF16 29"))
    with pytest.raises(SystemExit):
        build["check_types"](csrc=str(csrc))
