/* kq_avx2.c: AVX2 + FMA + F16C kernels, for x86-64 CPUs without AVX-512 VNNI.
 *
 * The integer products are vpmaddubsw (unsigned bytes times signed bytes, pairs summed
 * to 16 bits) then vpmaddwd by ones (pairs summed again to 32 bits), so each 32-bit lane
 * holds 4 products, as in the AVX-512 kernels.  The 16-bit step saturates past 32767:
 * nibbles (<= 15) and Q6_K's 6-bit values (<= 63) times |x| <= 127 stay far below, and
 * Q8_0 multiplies |w| by x with w's sign moved onto it (vpsignb), <= 128 * 127 * 2.
 * Four rows per pass for the 32-value blocks (each input load and scale conversion
 * serves four rows), one for the K types.  Compiled for these instructions through the pragma whatever the
 * build's flags; kq_dispatch.c calls in only when CPUID shows them. */
#include "kq_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#define ROW(w, rb, r) ((const char *)(w) + (size_t)(r) * (rb))

static inline __m256i dot4(__m256i u, __m256i s)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

static inline float hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

static void quantize_act(const float *x, int64_t cols, void *act)
{
    char *p = (char *)act;
    int8_t *q = (int8_t *)p;
    int32_t *s4 = (int32_t *)(p + kq_up64((size_t)cols));
    float *dds = (float *)(p + 2 * kq_up64((size_t)cols));
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < cols / 32; b++) {
        __m256 v[4];
        __m256 m = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(x + 32 * b + 8 * k);
            m = _mm256_max_ps(m, _mm256_and_ps(v[k], absmask));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float db = _mm_cvtss_f32(m4) / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        __m256 bad = _mm256_setzero_ps(); /* x - x is NaN exactly where x is NaN or infinite */
        for (int k = 0; k < 4; k++)
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(v[k], v[k]), _mm256_setzero_ps(), _CMP_UNORD_Q));
        if (_mm256_movemask_ps(bad))
            db = __builtin_nanf(""), id = 0.0f;
        __m256i i[4];
        for (int k = 0; k < 4; k++) /* nearest even, as the scalar path */
            i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(id)));
        /* 4-sums: add the lanes pairwise twice (hadd order: within 128-bit halves) */
        __m256i h01 = _mm256_hadd_epi32(i[0], i[1]), h23 = _mm256_hadd_epi32(i[2], i[3]);
        __m256i s = _mm256_hadd_epi32(h01, h23); /* [g0 g2 g4 g6 | g1 g3 g5 g7] */
        s = _mm256_permutevar8x32_epi32(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(s4 + 8 * b), s);
        __m256i w16 = _mm256_packs_epi32(i[0], i[1]), w16b = _mm256_packs_epi32(i[2], i[3]);
        __m256i b8 = _mm256_packs_epi16(w16, w16b); /* the same order, in 4-byte units */
        b8 = _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + 32 * b), b8);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
        dds[2 * b] = db;
        dds[2 * b + 1] = db * (float)_mm_cvtsi128_si32(t);
    }
}

#define FLOAT_KERNEL(NAME, LOAD8, ONE)                                                                   \
    static void NAME(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0,      \
                     int64_t r1)                                                                         \
    {                                                                                                    \
        const float *x = (const float *)act;                                                             \
        int64_t full = cols & ~(int64_t)15;                                                              \
        for (int64_t r = r0; r < r1; r++) {                                                              \
            const uint8_t *p = (const uint8_t *)ROW(w, rb, r);                                           \
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                                   \
            for (int64_t i = 0; i < full; i += 16) {                                                     \
                a0 = _mm256_fmadd_ps(LOAD8(p, i), _mm256_loadu_ps(x + i), a0);                           \
                a1 = _mm256_fmadd_ps(LOAD8(p, i + 8), _mm256_loadu_ps(x + i + 8), a1);                   \
            }                                                                                            \
            float s = hsum(_mm256_add_ps(a0, a1));                                                       \
            for (int64_t i = full; i < cols; i++)                                                        \
                s += ONE(p, i) * x[i];                                                                   \
            y[r] = s;                                                                                    \
        }                                                                                                \
    }

#define LOAD_F32(p, i) _mm256_loadu_ps((const float *)(p) + (i))
#define ONE_F32(p, i) (((const float *)(p))[i])
#define LOAD_F16(p, i) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)(p) + (i))))
#define ONE_F16(p, i) h2f(((const uint16_t *)(p))[i])
#define LOAD_BF16(p, i)                                                                                  \
    _mm256_castsi256_ps(                                                                                 \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)(p) + (i)))), 16))
#define ONE_BF16(p, i) kq_bf2f(((const uint16_t *)(p))[i])

FLOAT_KERNEL(mv_f32, LOAD_F32, ONE_F32)
FLOAT_KERNEL(mv_f16, LOAD_F16, ONE_F16)
FLOAT_KERNEL(mv_bf16, LOAD_BF16, ONE_BF16)

/* 16 nibble bytes -> 32 values: low nibbles (values 0..15) then high (16..31) */
static inline __m256i nibbles(const uint8_t *qs)
{
    __m128i v = _mm_loadu_si128((const __m128i *)qs);
    __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

/* Rows r..r+3 of [r, r1): past r1 the last row repeats (its result is dropped) */
static inline void rows4(const void *w, size_t rb, int64_t r, int64_t r1, const char *p[4])
{
    for (int k = 0; k < 4; k++)
        p[k] = ROW(w, rb, r + k < r1 ? r + k : r1 - 1);
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

/* The sums of acc[0..3], one row each, stored to y[r..] within r1 */
/* What a Q4_0 / Q4_1 pass adds to its four rows' dot sums: accm's odd lanes, which hold
 * m * sum(x) (Q4_1) or d * sum(x) (Q4_0, whose nibbles are offset by 8). */
static inline __m128 q4_extra4(__m256 accm, int has_min)
{
    __m128 m4 = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(accm, _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7)));
    return has_min ? m4 : _mm_mul_ps(m4, _mm_set1_ps(-8.0f));
}

static inline void store4(float *y, int64_t r, int64_t r1, const __m256 acc[4], __m128 extra)
{
    __m256 a01 = _mm256_hadd_ps(acc[0], acc[1]), a23 = _mm256_hadd_ps(acc[2], acc[3]);
    __m256 s = _mm256_hadd_ps(a01, a23); /* [r0 r1 r2 r3 | r0 r1 r2 r3] partial sums */
    __m128 v = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)), extra);
    float t[4];
    _mm_storeu_ps(t, v);
    for (int k = 0; k < 4 && r + k < r1; k++)
        y[r + k] = t[k];
}

/* One block of four Q4 rows, for both layouts: q[k] row k's 16 nibble bytes, dm their fp16
 * (d, m) pairs (Q4_0: (d, d)).  Per row: the dot of the nibbles with the input's q times
 * d_w d_x into acc[k], plus m_w (sum of x) for Q4_1 or d_w (sum of x) for Q4_0 in the odd
 * lanes of accm (q4_extra4 takes them, the latter times -8). */
static inline void q4_block4(const uint8_t *const q[4], __m128i dm, const kq_act8 *a, int64_t b, __m256 acc[4],
                             __m256 *accm)
{
    double pair;
    memcpy(&pair, a->dds + 2 * b, 8);
    __m256 prod = _mm256_mul_ps(_mm256_cvtph_ps(dm), _mm256_castpd_ps(_mm256_set1_pd(pair)));
    *accm = _mm256_add_ps(*accm, prod);
    __m256i xq = _mm256_loadu_si256((const __m256i *)(a->q + 32 * b));
    for (int k = 0; k < 4; k++) {
        __m256i dot = dot4(nibbles(q[k]), xq);
        __m256 sc = _mm256_permutevar8x32_ps(prod, _mm256_set1_epi32(2 * k));
        acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sc, acc[k]);
    }
}

/* Q4_0 / Q4_1 in the GGUF rows, four rows per pass: the input's 32 values load once for
 * the four rows, and the rows' four (d, m) pairs convert in one instruction (q4_block4). */
static inline void q4_rows(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0,
                           int64_t r1, int has_min)
{
    kq_act8 a = kq_act8_view(act, cols);
    const size_t bs = has_min ? sizeof(kq_block_q4_1) : sizeof(kq_block_q4_0), qoff = has_min ? 4 : 2;
    for (int64_t r = r0; r < r1; r += 4) {
        const char *p[4];
        rows4(w, rb, r, r1, p);
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        __m256 accm = _mm256_setzero_ps();
        for (int64_t b = 0; b < cols / 32; b++) {
            const size_t o = (size_t)b * bs;
            __m128i dm;
            if (has_min) { /* (d, m) of row k -> halves 2k, 2k+1 */
                dm = _mm_cvtsi32_si128(ld32(p[0] + o));
                dm = _mm_insert_epi32(dm, ld32(p[1] + o), 1);
                dm = _mm_insert_epi32(dm, ld32(p[2] + o), 2);
                dm = _mm_insert_epi32(dm, ld32(p[3] + o), 3);
            } else { /* (d, d) */
                dm = _mm_cvtsi32_si128(ld16(p[0] + o));
                dm = _mm_insert_epi16(dm, ld16(p[1] + o), 1);
                dm = _mm_insert_epi16(dm, ld16(p[2] + o), 2);
                dm = _mm_insert_epi16(dm, ld16(p[3] + o), 3);
                dm = _mm_unpacklo_epi16(dm, dm);
            }
            const uint8_t *q[4];
            for (int k = 0; k < 4; k++)
                q[k] = (const uint8_t *)p[k] + o + qoff;
            q4_block4(q, dm, &a, b, acc, &accm);
        }
        store4(y, r, r1, acc, q4_extra4(accm, has_min));
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

static void mv_q8_0(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    kq_act8 a = kq_act8_view(act, cols);
    for (int64_t r = r0; r < r1; r += 4) {
        const char *p[4];
        rows4(w, rb, r, r1, p);
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < cols / 32; b++) {
            const size_t o = (size_t)b * sizeof(kq_block_q8_0);
            __m128i dh = _mm_cvtsi32_si128(ld16(p[0] + o));
            dh = _mm_insert_epi16(dh, ld16(p[1] + o), 1);
            dh = _mm_insert_epi16(dh, ld16(p[2] + o), 2);
            dh = _mm_insert_epi16(dh, ld16(p[3] + o), 3);
            __m256 sc4 = _mm256_castps128_ps256(_mm_mul_ps(_mm_cvtph_ps(dh), _mm_set1_ps(a.dds[2 * b])));
            __m256i xq = _mm256_loadu_si256((const __m256i *)(a.q + 32 * b));
            for (int k = 0; k < 4; k++) {
                __m256i wq = _mm256_loadu_si256((const __m256i *)(p[k] + o + 2));
                __m256i dot = dot4(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
                __m256 sc = _mm256_permutevar8x32_ps(sc4, _mm256_set1_epi32(k));
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sc, acc[k]);
            }
        }
        store4(y, r, r1, acc, _mm_setzero_ps());
    }
}

static void mv_q4_k(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    kq_act8 a = kq_act8_view(act, cols);
    const __m256i nib = _mm256_set1_epi8(0x0f);
    for (int64_t r = r0; r < r1; r++) {
        const kq_block_q4_k *bl = (const kq_block_q4_k *)ROW(w, rb, r);
        __m256 acc = _mm256_setzero_ps();
        float mins = 0.0f;
        for (int64_t b = 0; b < cols / 256; b++) {
            uint8_t sm[16];
            kq_q4k_scales(bl[b].scales, sm);
            float d = h2f(bl[b].d), dmin = h2f(bl[b].dmin);
            const float *dds = a.dds + 16 * b;
            const int8_t *aq = a.q + 256 * b;
            for (int c = 0; c < 4; c++) {
                __m256i q = _mm256_loadu_si256((const __m256i *)(bl[b].qs + 32 * c));
                __m256i lo = _mm256_and_si256(q, nib), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nib);
                __m256i d0 = dot4(lo, _mm256_loadu_si256((const __m256i *)(aq + 64 * c)));
                __m256i d1 = dot4(hi, _mm256_loadu_si256((const __m256i *)(aq + 64 * c + 32)));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(d * sm[2 * c] * dds[4 * c]), acc);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_set1_ps(d * sm[2 * c + 1] * dds[4 * c + 2]), acc);
            }
            for (int j = 0; j < 8; j++)
                mins += dmin * sm[8 + j] * dds[2 * j + 1];
        }
        y[r] = hsum(acc) - mins;
    }
}

static void mv_q6_k(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    kq_act8 a = kq_act8_view(act, cols);
    const __m256i nib = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x30);
    for (int64_t r = r0; r < r1; r++) {
        const kq_block_q6_k *bl = (const kq_block_q6_k *)ROW(w, rb, r);
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < cols / 256; b++) {
            float d = h2f(bl[b].d);
            for (int n = 0; n < 2; n++) {
                __m256i L0 = _mm256_loadu_si256((const __m256i *)(bl[b].ql + 64 * n));
                __m256i L1 = _mm256_loadu_si256((const __m256i *)(bl[b].ql + 64 * n + 32));
                __m256i H = _mm256_loadu_si256((const __m256i *)(bl[b].qh + 32 * n));
                __m256i q[4] = {
                    _mm256_or_si256(_mm256_and_si256(L0, nib), _mm256_and_si256(_mm256_slli_epi16(H, 4), top2)),
                    _mm256_or_si256(_mm256_and_si256(L1, nib), _mm256_and_si256(_mm256_slli_epi16(H, 2), top2)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), nib), _mm256_and_si256(H, top2)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), nib),
                                    _mm256_and_si256(_mm256_srli_epi16(H, 2), top2)),
                };
                for (int k = 0; k < 4; k++) {
                    int e = 128 * n + 32 * k, g = e / 16;
                    __m256i dot = dot4(q[k], _mm256_loadu_si256((const __m256i *)(a.q + 256 * b + e)));
                    __m256i bias = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(a.s4 + 64 * b + e / 4)), 5);
                    float da = a.dds[2 * (8 * b + e / 32)];
                    __m256 sc = _mm256_setr_m128(_mm_set1_ps(d * bl[b].scales[g] * da), _mm_set1_ps(d * bl[b].scales[g + 1] * da));
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot, bias)), sc, acc);
                }
            }
        }
        y[r] = hsum(acc);
    }
}

/* -- the packed layout (kq.h): the row kernels' arithmetic in the same order (so the same
 * results, bit for bit), reading four rows' blocks side by side ------------------------------ */

/* The sums of acc[0..3] (rows g..g+3, plus extra) into y, only rows in [r0, r1) */
static inline void store_group(float *y, int64_t g, int64_t r0, int64_t r1, const __m256 acc[4], __m128 extra)
{
    __m256 a01 = _mm256_hadd_ps(acc[0], acc[1]), a23 = _mm256_hadd_ps(acc[2], acc[3]);
    __m256 s = _mm256_hadd_ps(a01, a23);
    __m128 v = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)), extra);
    float t[4];
    _mm_storeu_ps(t, v);
    for (int k = 0; k < 4; k++)
        if (g + k >= r0 && g + k < r1)
            y[g + k] = t[k];
}

/* Four rows of a group of the packed layout (kq.h): their 16-byte chunks of pieces
 * (chunk j: piece j of the four rows, KQ_GROUP * 4 bytes after chunk j - 1) back into the
 * four rows' 16 bytes (a 4 x 4 transpose of 32-bit pieces), into rows[64] */
#define CHUNK (4 * KQ_GROUP)
static inline void rows_of_pieces(const uint8_t *p, uint8_t rows[64])
{
    __m128i c0 = _mm_loadu_si128((const __m128i *)p), c1 = _mm_loadu_si128((const __m128i *)(p + CHUNK));
    __m128i c2 = _mm_loadu_si128((const __m128i *)(p + 2 * CHUNK)), c3 = _mm_loadu_si128((const __m128i *)(p + 3 * CHUNK));
    __m128i t0 = _mm_unpacklo_epi32(c0, c1), t1 = _mm_unpackhi_epi32(c0, c1);
    __m128i t2 = _mm_unpacklo_epi32(c2, c3), t3 = _mm_unpackhi_epi32(c2, c3);
    _mm_storeu_si128((__m128i *)rows, _mm_unpacklo_epi64(t0, t2));
    _mm_storeu_si128((__m128i *)(rows + 16), _mm_unpackhi_epi64(t0, t2));
    _mm_storeu_si128((__m128i *)(rows + 32), _mm_unpacklo_epi64(t1, t3));
    _mm_storeu_si128((__m128i *)(rows + 48), _mm_unpackhi_epi64(t1, t3));
}

/* Four rows at a time (k0: the first of them within its group of the packed layout) */
static inline void q4x4(const void *w, int64_t rows, int64_t cols, const void *act, float *y, int64_t r0,
                        int64_t r1, int has_min)
{
    kq_act8 a = kq_act8_view(act, cols);
    const int64_t nb = cols / 32, r16 = (rows + KQ_GROUP - 1) / KQ_GROUP * KQ_GROUP;
    const size_t sb = has_min ? 4 : 2;
    const uint8_t *qs = (const uint8_t *)w, *ss = qs + (size_t)r16 * (size_t)nb * 16;
    for (int64_t g = r0 / 4 * 4; g < r1; g += 4) {
        const int64_t k0 = g % KQ_GROUP, grp = g / KQ_GROUP;
        const uint8_t *q = qs + (size_t)grp * (size_t)nb * 16 * KQ_GROUP + 4 * k0;
        const uint8_t *sc = ss + (size_t)grp * (size_t)nb * sb * KQ_GROUP + 2 * k0;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        __m256 accm = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *sbk = sc + (size_t)b * sb * KQ_GROUP;
            __m128i d4 = _mm_loadl_epi64((const __m128i *)sbk);
            /* (d, m) of row k -> halves 2k, 2k+1 (Q4_0: d twice) */
            __m128i dm = _mm_unpacklo_epi16(d4, has_min ? _mm_loadl_epi64((const __m128i *)(sbk + 2 * KQ_GROUP)) : d4);
            uint8_t r[64];
            rows_of_pieces(q + (size_t)b * 16 * KQ_GROUP, r);
            const uint8_t *qk[4] = {r, r + 16, r + 32, r + 48};
            q4_block4(qk, dm, &a, b, acc, &accm);
        }
        store_group(y, g, r0, r1, acc, q4_extra4(accm, has_min));
    }
}

static void mv_q4_0x4(const void *w, int64_t rows, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    q4x4(w, rows, cols, act, y, r0, r1, 0);
}

static void mv_q4_1x4(const void *w, int64_t rows, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    q4x4(w, rows, cols, act, y, r0, r1, 1);
}

static void mv_q8_0x4(const void *w, int64_t rows, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    kq_act8 a = kq_act8_view(act, cols);
    const int64_t nb = cols / 32, r16 = (rows + KQ_GROUP - 1) / KQ_GROUP * KQ_GROUP;
    const uint8_t *qs = (const uint8_t *)w, *ds = qs + (size_t)r16 * (size_t)cols;
    for (int64_t g = r0 / 4 * 4; g < r1; g += 4) {
        const int64_t k0 = g % KQ_GROUP, grp = g / KQ_GROUP;
        const uint8_t *q = qs + (size_t)grp * (size_t)nb * 32 * KQ_GROUP + 4 * k0;
        const uint8_t *d = ds + (size_t)grp * (size_t)nb * 2 * KQ_GROUP + 2 * k0;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < nb; b++) {
            __m128i dh = _mm_loadl_epi64((const __m128i *)(d + (size_t)b * 2 * KQ_GROUP));
            __m256 sc4 = _mm256_castps128_ps256(_mm_mul_ps(_mm_cvtph_ps(dh), _mm_set1_ps(a.dds[2 * b])));
            __m256i xq = _mm256_loadu_si256((const __m256i *)(a.q + 32 * b));
            uint8_t lo[64], hi[64]; /* bytes 0-15 and 16-31 of the four rows */
            rows_of_pieces(q + (size_t)b * 32 * KQ_GROUP, lo);
            rows_of_pieces(q + (size_t)b * 32 * KQ_GROUP + 4 * CHUNK, hi);
            for (int k = 0; k < 4; k++) {
                __m256i wq = _mm256_setr_m128i(_mm_loadu_si128((const __m128i *)(lo + 16 * k)),
                                               _mm_loadu_si128((const __m128i *)(hi + 16 * k)));
                __m256i dot = dot4(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
                __m256 sc = _mm256_permutevar8x32_ps(sc4, _mm256_set1_epi32(k));
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sc, acc[k]);
            }
        }
        store_group(y, g, r0, r1, acc, _mm_setzero_ps());
    }
}

static const kq_impl kq_avx2 = {
    "avx2", quantize_act, mv_f32, mv_f16, mv_bf16, mv_q8_0, mv_q4_0, mv_q4_1, mv_q4_k, mv_q6_k,
    mv_q8_0x4, mv_q4_0x4, mv_q4_1x4,
};
const kq_impl *const kq_impl_avx2 = &kq_avx2;

#pragma GCC pop_options

#else
const kq_impl *const kq_impl_avx2 = NULL;
#endif
