/* kq_avx512.c: AVX-512 kernels (F, BW, VL, DQ and VNNI; F16C for the half scales).
 *
 * The integer products are vpdpbusd: unsigned weight bytes times the signed 8-bit input,
 * four products summed per 32-bit lane.  Nibble types feed their 0..15 values as they
 * are; Q8_0 flips each weight's sign bit (q + 128, unsigned) and takes 128 times the
 * input's 4-sums (s4) back out of each lane; Q6_K (0..63) takes out 32 times s4.
 * The 32-byte types run four rows per pass, so each input load and scale broadcast
 * serves four rows, and each block's four half-precision scales convert in one
 * instruction.  The packed layout's kernels are kq_avx512_mm.c's.  Compiled for these
 * instructions through the pragma below whatever the build's flags; kq_dispatch.c calls
 * in only when CPUID shows them. */
#include "kq_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

#include "kq_x512.h"

#define ROW(w, rb, r) ((const char *)(w) + (size_t)(r) * (rb))

/* Software prefetch, on top of the hardware's: a pass over four rows reads four streams
 * (row_bytes apart), and asking for the next pass's rows at the same offset keeps more
 * lines in flight (the A/B is in bench/RESULTS.md).  Single-row kernels ask for the
 * lines PF_AHEAD bytes past their position. */
#define PF_AHEAD 1024

static inline void pf4(const char *const p[4], size_t ahead)
{
    for (int k = 0; k < 4; k++)
        _mm_prefetch(p[k] + ahead, _MM_HINT_T0);
}

static inline void pf_span(const void *p, size_t bytes)
{
    for (size_t o = 0; o < bytes; o += 64)
        _mm_prefetch((const char *)p + PF_AHEAD + o, _MM_HINT_T0);
}

static inline int32_t ld32(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline int ld16(const void *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* The four rows' results of a Q4_0 / Q4_1 pass: the integer-dot sums (acc0 + acc1, one
 * 4-lane group per row), plus the m * sum(x) terms (Q4_1: accm's odd lanes) or -8 * d * sum(x)
 * (Q4_0: acc4). */
static inline __m128 q4_total4(__m512 acc0, __m512 acc1, __m256 accm, __m128 acc4, int has_min)
{
    __m128 out = sum_groups4(_mm512_add_ps(acc0, acc1));
    if (has_min)
        return _mm_add_ps(out, _mm256_castps256_ps128(_mm256_permutevar8x32_ps(accm, _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7))));
    return _mm_fmadd_ps(acc4, _mm_set1_ps(-8.0f), out);
}

/* Rows r..r+3 of [r, r1): past r1 the last row repeats (its result is dropped) */
static inline void rows4(const void *w, size_t rb, int64_t r, int64_t r1, const char *p[4])
{
    for (int k = 0; k < 4; k++)
        p[k] = ROW(w, rb, r + k < r1 ? r + k : r1 - 1);
}

static inline void store4(float *y, int64_t r, int64_t r1, __m128 v)
{
    if (r + 4 <= r1) {
        _mm_storeu_ps(y + r, v);
    } else {
        float t[4];
        _mm_storeu_ps(t, v);
        for (int k = 0; r + k < r1; k++)
            y[r + k] = t[k];
    }
}

/* The 16-bit values at p[k] + off, k = 0..3, in the low four halves */
static inline __m128i halves4_bits(const char *const p[4], size_t off)
{
    __m128i h = _mm_cvtsi32_si128(ld16(p[0] + off));
    h = _mm_insert_epi16(h, ld16(p[1] + off), 1);
    h = _mm_insert_epi16(h, ld16(p[2] + off), 2);
    return _mm_insert_epi16(h, ld16(p[3] + off), 3);
}

/* The same as 4 floats (half precision scales) */
static inline __m128 halves4(const char *const p[4], size_t off)
{
    return _mm_cvtph_ps(halves4_bits(p, off));
}

/* -- the prepared input ----------------------------------------------------------------------- */

static void quantize_act(const float *x, int64_t cols, void *act)
{
    char *p = (char *)act;
    int8_t *q = (int8_t *)p;
    int32_t *s4 = (int32_t *)(p + kq_up64((size_t)cols));
    float *dds = (float *)(p + 2 * kq_up64((size_t)cols));
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    const __m256i ones = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < cols / 32; b++) {
        __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(x0, absmask), _mm512_and_ps(x1, absmask)));
        float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        /* x - x is NaN exactly where x is NaN or infinite: then q = 0 and d = NaN, as scalar */
        if (_mm512_cmp_ps_mask(_mm512_sub_ps(x0, x0), _mm512_sub_ps(x1, x1), _CMP_UNORD_Q))
            db = __builtin_nanf(""), id = 0.0f;
        __m512 vid = _mm512_set1_ps(id);
        /* cvtps rounds to nearest even (the default MXCSR mode), as the scalar path does */
        __m128i q0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, vid)));
        __m128i q1 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, vid)));
        __m256i qq = _mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1);
        _mm256_storeu_si256((__m256i *)(q + 32 * b), qq);
        __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, qq);
        _mm256_storeu_si256((__m256i *)(s4 + 8 * b), sums);
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
        dds[2 * b] = db;
        dds[2 * b + 1] = db * (float)_mm_cvtsi128_si32(s);
    }
}

/* -- float weights: four rows per pass, 16 columns per step, the tail masked ------------------- */

#define FLOAT_KERNEL(NAME, LOAD, ESIZE)                                                                        \
    static void NAME(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0,       \
                     int64_t r1)                                                                          \
    {                                                                                                     \
        const float *x = (const float *)act;                                                              \
        int64_t full = cols & ~(int64_t)15;                                                               \
        __mmask16 tail = (__mmask16)((1u << (cols & 15)) - 1);                                            \
        for (int64_t r = r0; r < r1; r += 4) {                                                            \
            const char *p[4];                                                                             \
            rows4(w, rb, r, r1, p);                                                                       \
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),               \
                             _mm512_setzero_ps()};                                                        \
            for (int64_t i = 0; i < full; i += 16) {                                                      \
                if ((i * ESIZE) % 64 == 0)                                                                \
                    pf4(p, (size_t)(i * ESIZE) + 4 * rb);                                                 \
                __m512 xv = _mm512_loadu_ps(x + i);                                                       \
                for (int k = 0; k < 4; k++)                                                               \
                    acc[k] = _mm512_fmadd_ps(LOAD(p[k], i, 0xffff), xv, acc[k]);                          \
            }                                                                                             \
            if (tail) {                                                                                   \
                __m512 xv = _mm512_maskz_loadu_ps(tail, x + full);                                        \
                for (int k = 0; k < 4; k++)                                                               \
                    acc[k] = _mm512_fmadd_ps(LOAD(p[k], full, tail), xv, acc[k]);                         \
            }                                                                                             \
            float t[4];                                                                                   \
            for (int k = 0; k < 4; k++)                                                                   \
                t[k] = _mm512_reduce_add_ps(acc[k]);                                                      \
            store4(y, r, r1, _mm_loadu_ps(t));                                                            \
        }                                                                                                 \
    }

#define LOAD_F32(p, i, m) _mm512_maskz_loadu_ps((__mmask16)(m), (const float *)(p) + (i))
#define LOAD_F16(p, i, m) _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)(m), (const uint16_t *)(p) + (i)))
#define LOAD_BF16(p, i, m)                                                                                \
    _mm512_castsi512_ps(_mm512_slli_epi32(                                                                \
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16((__mmask16)(m), (const uint16_t *)(p) + (i))), 16))

FLOAT_KERNEL(mv_f32, LOAD_F32, 4)
FLOAT_KERNEL(mv_f16, LOAD_F16, 2)
FLOAT_KERNEL(mv_bf16, LOAD_BF16, 2)

/* -- Q4_0 and Q4_1: four rows' 16 nibble bytes fill one register, one per 128-bit lane -------- */

/* One block of four Q4 rows: qw holds row k's 16 nibble bytes in 128-bit
 * lane k, sc their fp16 scales: (d, m) x 4 for Q4_1, d x 4 (low half) for Q4_0.  The dot
 * of row k with the input's q lands in lanes 4k..4k+3, scaled by d_w d_x, in acc0 or acc1
 * (alternate blocks: two dependency chains); m_w (sum of x) goes to accm for Q4_1, d_w (sum
 * of x) to acc4 for Q4_0, which q4_total4 adds in (the latter times -8). */
static inline void q4_block4(__m512i qw, __m128i sc, const kq_act8 *a, int64_t b, int has_min, __m512 *acc0,
                             __m512 *acc1, __m256 *accm, __m128 *acc4)
{
    const __m512i nib = _mm512_set1_epi8(0x0f);
    const __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i lanes_dm = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
    __m512i lo = _mm512_and_si512(qw, nib), hi = _mm512_and_si512(_mm512_srli_epi16(qw, 4), nib);
    __m512i alo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(a->q + 32 * b)));
    __m512i ahi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(a->q + 32 * b + 16)));
    __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, alo), hi, ahi);
    __m512 scale;
    if (has_min) { /* (d, m) of row k in lanes 2k, 2k+1, times (d_x, sum x) */
        double pair;
        memcpy(&pair, a->dds + 2 * b, 8);
        __m256 prod = _mm256_mul_ps(_mm256_cvtph_ps(sc), _mm256_castpd_ps(_mm256_set1_pd(pair)));
        *accm = _mm256_add_ps(*accm, prod);
        scale = _mm512_permutexvar_ps(lanes_dm, _mm512_castps256_ps512(prod));
    } else {
        __m128 dw = _mm_cvtph_ps(sc);
        *acc4 = _mm_fmadd_ps(dw, _mm_set1_ps(a->dds[2 * b + 1]), *acc4);
        scale = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_mul_ps(dw, _mm_set1_ps(a->dds[2 * b]))));
    }
    if (b & 1)
        *acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, *acc1);
    else
        *acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, *acc0);
}

/* Q4_0 / Q4_1 in the GGUF rows: per block, four rows' nibbles gathered into one register
 * and their scales into another (q4_block4). */
static inline void q4_rows(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0,
                           int64_t r1, int has_min)
{
    kq_act8 a = kq_act8_view(act, cols);
    const size_t bs = has_min ? sizeof(kq_block_q4_1) : sizeof(kq_block_q4_0), qoff = has_min ? 4 : 2;
    const int64_t nb = cols / 32;
    for (int64_t r = r0; r < r1; r += 4) {
        const char *p[4];
        rows4(w, rb, r, r1, p);
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        __m256 accm = _mm256_setzero_ps();
        __m128 acc4 = _mm_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const size_t o = (size_t)b * bs;
            if (b % 3 == 0)
                pf4(p, o + 4 * rb);
            __m512i qw = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p[0] + o + qoff)));
            qw = _mm512_inserti32x4(qw, _mm_loadu_si128((const __m128i *)(p[1] + o + qoff)), 1);
            qw = _mm512_inserti32x4(qw, _mm_loadu_si128((const __m128i *)(p[2] + o + qoff)), 2);
            qw = _mm512_inserti32x4(qw, _mm_loadu_si128((const __m128i *)(p[3] + o + qoff)), 3);
            __m128i sc;
            if (has_min) { /* (d, m) of row k -> halves 2k, 2k+1 */
                sc = _mm_cvtsi32_si128(ld32(p[0] + o));
                sc = _mm_insert_epi32(sc, ld32(p[1] + o), 1);
                sc = _mm_insert_epi32(sc, ld32(p[2] + o), 2);
                sc = _mm_insert_epi32(sc, ld32(p[3] + o), 3);
            } else {
                sc = halves4_bits(p, o);
            }
            q4_block4(qw, sc, &a, b, has_min, &acc0, &acc1, &accm, &acc4);
        }
        __m128 out = q4_total4(acc0, acc1, accm, acc4, has_min);
        store4(y, r, r1, out);
    }
}

static void mv_q4_0(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    q4_rows(w, rb, cols, act, y, r0, r1, 0);
}

static void mv_q4_1(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    q4_rows(w, rb, cols, act, y, r0, r1, 1);
}

/* -- Q8_0: two rows' 32 bytes per register, four rows per pass --------------------------------- */

static void mv_q8_0(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    kq_act8 a = kq_act8_view(act, cols);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i lanes01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i lanes23 = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const int64_t nb = cols / 32;
    for (int64_t r = r0; r < r1; r += 4) {
        const char *p[4];
        rows4(w, rb, r, r1, p);
        __m512 acc01 = _mm512_setzero_ps(), acc23 = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const size_t o = (size_t)b * sizeof(kq_block_q8_0);
            pf4(p, o + 4 * rb);
            __m512i ax = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(a.q + 32 * b)));
            /* 128 * (4-sums of the input): what the sign flip added to each lane */
            __m512i bias = _mm512_slli_epi32(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(a.s4 + 8 * b))), 7);
            __m512i w01 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p[0] + o + 2))),
                                             _mm256_loadu_si256((const __m256i *)(p[1] + o + 2)), 1);
            __m512i w23 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p[2] + o + 2))),
                                             _mm256_loadu_si256((const __m256i *)(p[3] + o + 2)), 1);
            __m512i d01 = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(w01, flip), ax), bias);
            __m512i d23 = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(w23, flip), ax), bias);
            __m512 s = _mm512_castps128_ps512(_mm_mul_ps(halves4(p, o), _mm_set1_ps(a.dds[2 * b])));
            acc01 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d01), _mm512_permutexvar_ps(lanes01, s), acc01);
            acc23 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d23), _mm512_permutexvar_ps(lanes23, s), acc23);
        }
        /* acc01: row 0 in lanes 0..7, row 1 in 8..15 (acc23: rows 2, 3); pair up the
         * 128-bit quarters so that each quarter of t holds one row */
        __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(acc01, acc23, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(acc01, acc23, _MM_SHUFFLE(3, 1, 3, 1)));
        /* t lanes: [row0 4 | row1 4 | row2 4 | row3 4] */
        store4(y, r, r1, sum_groups4(t));
    }
}

/* kq_q4k_scales (kq_internal.h) on 32-bit lanes: [sc0..7, m0..7] from the 12 bytes
 * (16 loaded: the 4 after them are the block's first quants, ignored) */
static inline __m128i q4k_scales(const uint8_t *s)
{
    __m128i v = _mm_loadu_si128((const __m128i *)s);
    __m128i a = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)); /* u0 u2 u1 u2 */
    __m128i b = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)); /* u0 u0 u1 u1 */
    __m128i lo = _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)),
                               _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    __m128i hi = _mm_and_si128(_mm_srli_epi32(b, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(lo, hi);
}

/* -- Q4_K: one row at a time, 64 values (two sub-blocks) per register ------------------------- */

static void mv_q4_k(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    kq_act8 a = kq_act8_view(act, cols);
    const __m512i nib = _mm512_set1_epi8(0x0f);
    /* the upper 32 bytes are the high nibbles: shifted by 4 before the mask */
    const __m512i shifts = _mm512_setr_epi64(0, 0, 0, 0, 0x0004000400040004LL, 0x0004000400040004LL,
                                             0x0004000400040004LL, 0x0004000400040004LL);
    __m512i pick[4];
    for (int c = 0; c < 4; c++) /* chunk c: sub-blocks 2c, 2c+1 (their scales: lanes 4c, 4c+2) */
        pick[c] = _mm512_setr_epi32(4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c + 2, 4 * c + 2,
                                    4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2);
    const int64_t nb = cols / 256;
    for (int64_t r = r0; r < r1; r++) {
        const kq_block_q4_k *bl = (const kq_block_q4_k *)ROW(w, rb, r);
        /* one accumulator per chunk: four independent FMA chains, not one */
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        __m512 accm = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            pf_span(&bl[b], sizeof bl[b]);
            __m128i smv = q4k_scales(bl[b].scales);
            /* [sc0, m0, sc1, m1, ...] times [d d_x0, -dmin sum0, d d_x1, ...] */
            __m512 scm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(smv, _mm_srli_si128(smv, 8))));
            __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(ld32(&bl[b].d)));   /* d, dmin */
            dd = _mm_mul_ps(dd, _mm_setr_ps(1.0f, -1.0f, 0.0f, 0.0f));
            __m512 ddv = _mm512_castpd_ps(_mm512_broadcastsd_pd(_mm_castps_pd(dd)));
            __m512 prod = _mm512_mul_ps(_mm512_mul_ps(scm, ddv), _mm512_loadu_ps(a.dds + 16 * b));
            accm = _mm512_add_ps(accm, prod);
            const int8_t *aq = a.q + 256 * b;
            for (int c = 0; c < 4; c++) {
                __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(bl[b].qs + 32 * c)));
                q = _mm512_and_si512(_mm512_srlv_epi16(q, shifts), nib);
                __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, _mm512_loadu_si512(aq + 64 * c));
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick[c], prod), acc[c]);
            }
        }
        /* the minimum terms are accm's odd lanes */
        __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        y[r] = _mm512_reduce_add_ps(sum) + _mm512_mask_reduce_add_ps(0xAAAA, accm);
    }
}

/* -- Q6_K: one row at a time, 64 values per register ------------------------------------------ */

static void mv_q6_k(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    kq_act8 a = kq_act8_view(act, cols);
    const __m512i nib = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30);
    /* qh bits of k = 0, 1 (lower, upper 32 bytes) move up to bits 4-5: << 4, << 2;
     * those of k = 2, 3 sit at 4-5 and 6-7: >> 0, >> 2 */
    const __m512i shl01 = _mm512_setr_epi64(0x0004000400040004LL, 0x0004000400040004LL, 0x0004000400040004LL,
                                            0x0004000400040004LL, 0x0002000200020002LL, 0x0002000200020002LL,
                                            0x0002000200020002LL, 0x0002000200020002LL);
    const __m512i shr23 = _mm512_setr_epi64(0, 0, 0, 0, 0x0002000200020002LL, 0x0002000200020002LL,
                                            0x0002000200020002LL, 0x0002000200020002LL);
    const __m512i da_of_group = _mm512_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14);
    __m512i pick[4];
    for (int j = 0; j < 4; j++) /* register j: groups 4j..4j+3, four lanes each */
        pick[j] = _mm512_setr_epi32(4 * j, 4 * j, 4 * j, 4 * j, 4 * j + 1, 4 * j + 1, 4 * j + 1, 4 * j + 1,
                                    4 * j + 2, 4 * j + 2, 4 * j + 2, 4 * j + 2, 4 * j + 3, 4 * j + 3, 4 * j + 3, 4 * j + 3);
    const int64_t nb = cols / 256;
    for (int64_t r = r0; r < r1; r++) {
        const kq_block_q6_k *bl = (const kq_block_q6_k *)ROW(w, rb, r);
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t b = 0; b < nb; b++) {
            pf_span(&bl[b], sizeof bl[b]);
            __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)bl[b].scales)));
            __m512 da = _mm512_permutexvar_ps(da_of_group, _mm512_loadu_ps(a.dds + 16 * b));
            __m512 s16 = _mm512_mul_ps(_mm512_mul_ps(sc, da), _mm512_set1_ps(_cvtsh_ss((unsigned short)bl[b].d)));
            const int8_t *aq = a.q + 256 * b;
            const int32_t *s4 = a.s4 + 64 * b;
            for (int n = 0; n < 2; n++) {
                __m512i L = _mm512_loadu_si512(bl[b].ql + 64 * n);
                __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(bl[b].qh + 32 * n)));
                __m512i q0 = _mm512_or_si512(_mm512_and_si512(L, nib), _mm512_and_si512(_mm512_sllv_epi16(H, shl01), top2));
                __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), nib),
                                             _mm512_and_si512(_mm512_srlv_epi16(H, shr23), top2));
                __m512i b0 = _mm512_slli_epi32(_mm512_loadu_si512(s4 + 32 * n), 5);
                __m512i b1 = _mm512_slli_epi32(_mm512_loadu_si512(s4 + 32 * n + 16), 5);
                __m512i d0 = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q0, _mm512_loadu_si512(aq + 128 * n)), b0);
                __m512i d1 = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q1, _mm512_loadu_si512(aq + 128 * n + 64)), b1);
                acc[2 * n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_permutexvar_ps(pick[2 * n], s16), acc[2 * n]);
                acc[2 * n + 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_permutexvar_ps(pick[2 * n + 1], s16),
                                                 acc[2 * n + 1]);
            }
        }
        y[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    }
}

static const kq_impl kq_avx512 = {
    "avx512", quantize_act, mv_f32, mv_f16, mv_bf16, mv_q8_0, mv_q4_0, mv_q4_1, mv_q4_k, mv_q6_k,
    kq_avx512_packed_q8_0, kq_avx512_packed_q4_0, kq_avx512_packed_q4_1, &kq_mm_avx512,
};
const kq_impl *const kq_impl_avx512 = &kq_avx512;

#pragma GCC pop_options

#else
const kq_impl *const kq_impl_avx512 = NULL;
#endif
