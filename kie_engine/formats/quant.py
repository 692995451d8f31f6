"""GGUF block formats in numpy: quantize float rows into a type's blocks, and back.

The layouts are the GGUF spec's (see csrc/kq_internal.h for the same in C).  Q8_0, Q4_0
and Q4_1 quantize with gguf-py's reference quantizer (what llama.cpp's own tools write);
Q4_K and Q6_K, which gguf-py only reads, with the quantizers below (plain min / max
scales per sub-block: simpler than llama.cpp's error-minimizing search, so somewhat
less accurate, but the same format).  The tests check
every type against gguf-py's dequantizer."""
import numpy as np

from .gguf_types import BF16, BLOCKS, CODES, F16, F32, NAMES, Q4_0, Q4_1, Q4_K, Q6_K, Q8_0  # noqa: F401


def row_bytes(t, cols):
    n_el, n_bytes = BLOCKS[t]
    if cols % n_el:
        raise ValueError(f"{NAMES[t]} rows hold a multiple of {n_el} values, not {cols}")
    return cols // n_el * n_bytes


def _f16(a):
    return np.ascontiguousarray(a).view(np.float16).astype(np.float32)


def check_finite(values, source, tensor, outcome="nothing was written"):
    """Raises NonFiniteWeightsError naming `source` (the file) and `tensor` when `values`
    (a float array) holds a NaN or an infinity; `outcome` says what was not done."""
    if not np.isfinite(np.add.reduce(values, axis=None, dtype=np.float64)):  # finite iff every value is
        from ..errors import NonFiniteWeightsError
        bad = int(np.count_nonzero(~np.isfinite(values)))
        raise NonFiniteWeightsError(f"{source}: tensor {tensor} holds {bad} NaN or infinite weight"
                                    f"{'s' if bad != 1 else ''} of {values.size}: the file is corrupt; {outcome}")


# -- dequantization ------------------------------------------------------------------------------

def dequantize(raw, t, cols):
    """float32 (rows, cols) from stored rows `raw` ((rows, row bytes) uint8).  A corrupt
    block's scale may be a NaN or an infinity: the values then are too, without numpy's
    warning, and the caller refuses them (check_finite)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return _dequantize(raw, t, cols)


def _dequantize(raw, t, cols):
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows = raw.shape[0]
    if t == F32:
        return raw.view(np.float32).reshape(rows, cols).copy()
    if t == F16:
        return raw.view(np.float16).reshape(rows, cols).astype(np.float32)
    if t == BF16:  # bfloat16 is the top half of a float32
        return (raw.view(np.uint16).reshape(rows, cols).astype(np.uint32) << 16).view(np.float32)
    n_el, n_bytes = BLOCKS[t]
    b = raw.reshape(rows, cols // n_el, n_bytes)
    if t == Q8_0:  # f16 d, int8 q[32]: x = d q
        return (_f16(b[..., 0:2]) * b[..., 2:].view(np.int8)).reshape(rows, cols)
    if t in (Q4_0, Q4_1):  # f16 d, (f16 m,) 16 bytes: low nibbles values 0..15, high 16..31
        off = 2 if t == Q4_0 else 4
        qs = b[..., off:]
        q = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1).astype(np.float32)
        if t == Q4_0:
            return (_f16(b[..., 0:2]) * (q - 8)).reshape(rows, cols)
        return (_f16(b[..., 0:2]) * q + _f16(b[..., 2:4])).reshape(rows, cols)
    if t == Q4_K:
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])           # (rows, nb, 1)
        sc, m = q4k_unpack_scales(b[..., 4:16])                  # (rows, nb, 8)
        qs = b[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
        q = (qs & np.uint8(15)).reshape(rows, -1, 8, 32).astype(np.float32)
        x = (d * sc)[..., None] * q - (dmin * m)[..., None]
        return x.reshape(rows, cols)
    if t == Q6_K:
        q = q6k_unpack(b[..., :192])                             # (rows, nb, 256) 0..63
        sc = b[..., 192:208].view(np.int8).astype(np.float32)    # (rows, nb, 16)
        d = _f16(b[..., 208:210])
        x = (d * sc)[..., None] * (q.reshape(rows, -1, 16, 16).astype(np.float32) - 32)
        return x.reshape(rows, cols)
    raise ValueError(f"no dequantizer for type {t}")


def q4k_unpack_scales(s):
    """(..., 12) packed bytes -> 6-bit scales and minimums, each (..., 8) float32.
    Sub-blocks 0..3 keep theirs in the low 6 bits of bytes 0..3 (scales) and 4..7
    (minimums); 4..7 put their low 4 bits in bytes 8..11 and their top 2 bits in the
    top bits of bytes 0..3 (scales) and 4..7 (minimums)."""
    s = s.astype(np.uint8)
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    m = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), m.astype(np.float32)


def q4k_pack_scales(sc, m):
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    a = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    b = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    c = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return np.concatenate([a, b, c], axis=-1)


def q6k_unpack(b):
    """(..., 192) = ql[128] qh[64] -> (..., 256) values 0..63.  Element 128n + 32k + l
    has low bits in nibble k//2 of ql[64n + 32(k%2) + l], high bits 2k.. of qh[32n + l]."""
    ql = b[..., :128].reshape(*b.shape[:-1], 2, 2, 32)           # (n, k%2, l)
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)        # (n, -, l)
    lo = np.stack([ql[..., 0, :] & 15, ql[..., 1, :] & 15, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], axis=-2)
    hi = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3
    return (lo | (hi << 4)).reshape(*b.shape[:-1], 256)


def q6k_pack(q):
    """Inverse of q6k_unpack: (..., 256) values 0..63 -> (..., 192) bytes."""
    q = q.astype(np.uint8).reshape(*q.shape[:-1], 2, 4, 32)
    lo, hi = q & 15, q >> 4
    ql = np.stack([lo[..., 0, :] | (lo[..., 2, :] << 4), lo[..., 1, :] | (lo[..., 3, :] << 4)], axis=-2)
    qh = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)
    return np.concatenate([ql.reshape(*q.shape[:-3], 128), qh.reshape(*q.shape[:-3], 64)], axis=-1)


# -- quantization --------------------------------------------------------------------------------

def quantize(x, t):
    """Stored rows (rows, row bytes) uint8 of float rows x (rows, cols)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x.reshape(1, -1)
    rows, cols = x.shape
    row_bytes(t, cols)
    if t == F32:
        return x.view(np.uint8).reshape(rows, -1).copy()
    if t == F16:
        return x.astype(np.float16).view(np.uint8).reshape(rows, -1)
    if t == BF16:  # round to nearest even, as torch and llama.cpp do
        from .safetensors_io import float32_to_bf16_bits
        return float32_to_bf16_bits(x).view(np.uint8).reshape(rows, -1)
    if t in (Q8_0, Q4_0, Q4_1):
        import gguf
        return np.ascontiguousarray(gguf.quants.quantize(x, gguf.GGMLQuantizationType(t))).reshape(rows, -1)
    if t == Q4_K:
        return _quantize_q4_k(x.reshape(-1, 8, 32)).reshape(rows, -1)
    if t == Q6_K:
        return _quantize_q6_k(x.reshape(-1, 16, 16)).reshape(rows, -1)
    raise ValueError(f"no quantizer for type {t}")


def _as_f16(v):
    return v.astype(np.float16).astype(np.float32)


def _quantize_q4_k(x):
    """x (n, 8, 32) -> (n, 144) Q4_K blocks: x ~ d sc_j q - dmin m_j, q in 0..15, with
    6-bit sc_j, m_j per sub-block of 32.  The minimums (the sub-block's lowest value,
    clipped to <= 0: the format subtracts them) are quantized first, rounding up so that
    x + m_j >= 0; then the step that reaches the sub-block's top from there, rounding up
    too, so no value falls outside 0..15.  (d, dmin are nudged up by 1/1000 so that
    their f16 rounding cannot push a 6-bit value past 63.)"""
    n = x.shape[0]
    mins = -np.minimum(x.min(axis=-1), 0.0)                        # (n, 8), >= 0
    hi = x.max(axis=-1)
    dmin = _as_f16(mins.max(axis=-1) / 63 * 1.001)                 # (n,)
    m = np.clip(np.ceil(mins / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63)
    m_eff = dmin[:, None] * m
    need = (hi + m_eff) / 15                                       # the step per sub-block
    d = _as_f16(need.max(axis=-1) / 63 * 1.001)
    sc = np.clip(np.ceil(need / np.where(d > 0, d, 1)[:, None]), 0, 63)
    s_eff = d[:, None] * sc
    q = np.clip(np.rint((x + m_eff[..., None]) / np.where(s_eff > 0, s_eff, 1)[..., None]), 0, 15)
    q = np.where(s_eff[..., None] > 0, q, 0).astype(np.uint8)      # (n, 8, 32)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(n, 128)    # byte i of chunk c: sub 2c low, 2c+1 high
    head = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(n, 2),
                           dmin.astype(np.float16).view(np.uint8).reshape(n, 2)], axis=-1)
    return np.concatenate([head, q4k_pack_scales(sc, m), qs], axis=-1)


def _quantize_q6_k(x):
    """x (n, 16, 16) -> (n, 210) Q6_K blocks: x ~ d sc_g (q - 32), q in 0..63.  Each
    group's scale maps its largest-magnitude value to -32 (the wider end); the group
    scales are quantized to int8 against the block's f16 d."""
    n = x.shape[0]
    idx = np.abs(x).argmax(axis=-1)
    vmax = np.take_along_axis(x, idx[..., None], axis=-1)[..., 0]  # (n, 16), signed
    s = -vmax / 32
    d = _as_f16(np.abs(s).max(axis=-1) / 127)                     # (n,)
    sc = np.clip(np.rint(s / np.where(d > 0, d, 1)[:, None]), -128, 127)
    s_eff = d[:, None] * sc
    q = np.rint(x / np.where(s_eff != 0, s_eff, 1)[..., None])
    q = np.where(s_eff[..., None] != 0, np.clip(q, -32, 31), 0) + 32
    q = q.astype(np.uint8).reshape(n, 256)
    return np.concatenate([q6k_pack(q), sc.astype(np.int8).view(np.uint8),
                           d.astype(np.float16).view(np.uint8).reshape(n, 2)], axis=-1)
