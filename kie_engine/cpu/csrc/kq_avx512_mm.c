/* kq_avx512_mm.c: AVX-512 VNNI kernels for several inputs on the packed layout (kq.h's
 * kq_matmul_mat): a prompt's tokens or a batch's sequences against Q4_0 / Q4_1 / Q8_0.
 *
 * A register holds four rows x four inputs (lane 4k + r: input k, row r).  Per block, a
 * row group's 4-byte pieces j (one 16-byte load, repeated across the register) meet four
 * inputs' pieces j (their records of four, kq_internal.h) in one VNNI product: eight
 * products make the block's exact integer dots for all sixteen pairs, and then one
 * convert, one scale (d_w * d_x: one multiply for the sixteen) and one fused add per
 * block; the minimum / offset / sign-flip term adds up in its own register.  That is,
 * per input and row, what the matvec kernel (kq_avx512.c) computes, in its order: the
 * same bits.
 *
 * Loops: inputs eight at a time (two records of four share each block's unpacked
 * weights), row groups in batches whose partial sums wait on the stack while the
 * blocks go by in passes of KC, so that the inputs' records of a pass stay in L1.  With
 * few inputs (a batch of sequences) the weights stream from memory once: the kernel
 * asks for the group PF ahead while it computes. */
#include "kq_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

#include "kq_x512.h"

#define KC 16 /* blocks per pass when the records of all blocks pass L1_RECS bytes */
#define L1_RECS (24 << 10)
#define RB 32 /* row groups per batch */
#define PF 4  /* row groups ahead that the kernel prefetches (a few kB) */
#define INLINE static inline __attribute__((always_inline))

enum { Q4_0, Q4_1, Q8_0 };

/* The block's eight weight registers (pieces 0-7 of the four rows, each repeated four
 * times), its d_w per lane (row), and e (m_w for Q4_1, d_w otherwise) */
INLINE void weights(int T, const uint8_t *q, const uint8_t *s, int64_t b, __m512i W[8], __m512 *d16, __m512 *e16)
{
    if (T == Q8_0) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int j = 0; j < 8; j++)
            W[j] = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(q + 128 * b + 16 * j))), flip);
    } else {
        const __m512i nib = _mm512_set1_epi8(0x0f);
        for (int j = 0; j < 4; j++) {
            __m512i B = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(q + 64 * b + 16 * j)));
            W[j] = _mm512_and_si512(B, nib);
            W[4 + j] = _mm512_andnot_si512(nib, B); /* 16 times the high nibble: no shift */
        }
    }
    if (T == Q4_1) {
        const __m512i lanes_d = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
        const __m512i lanes_m = _mm512_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7);
        __m512 dm = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16 * b))));
        *d16 = _mm512_permutexvar_ps(lanes_d, dm);
        *e16 = _mm512_permutexvar_ps(lanes_m, dm);
    } else {
        *d16 = *e16 = _mm512_broadcast_f32x4(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(s + 8 * b))));
    }
}

/* Row groups [g0, g1) (multiples of 4) x the NG records of four at x4 (blocks nb each) */
INLINE void tile(int T, int NG, const uint8_t *qs, const uint8_t *ss, int64_t nb, const char *x4, int64_t g0,
                 int64_t g1, int nt, int t0, float *y, size_t ldy, int64_t r0, int64_t r1)
{
    const size_t qb = T == Q8_0 ? 128 : 64, sb = T == Q4_1 ? 16 : 8; /* per group and block */
    __m512 part[RB][2][2];
    const int64_t kc = (size_t)NG * (size_t)nb * KQ_X4_REC <= L1_RECS ? nb : KC;
    for (int64_t b0 = 0; b0 < nb; b0 += kc) {
        const int64_t b1 = b0 + kc < nb ? b0 + kc : nb;
        for (int64_t g = g0; g < g1; g += 4) {
            __m512 (*pg)[2] = part[(g - g0) / 4];
            const uint8_t *q = qs + (size_t)(g / 4) * (size_t)nb * qb, *s = ss + (size_t)(g / 4) * (size_t)nb * sb;
            if (g + 4 * PF < g1) { /* a later group's weights of this pass, on their way from memory */
                const uint8_t *nq = q + (size_t)PF * (size_t)nb * qb, *ns = s + (size_t)PF * (size_t)nb * sb;
                for (size_t o = (size_t)b0 * qb; o < (size_t)b1 * qb; o += 64)
                    _mm_prefetch((const char *)nq + o, _MM_HINT_T1);
                for (size_t o = (size_t)b0 * sb; o < (size_t)b1 * sb; o += 64)
                    _mm_prefetch((const char *)ns + o, _MM_HINT_T1);
            }
            __m512 acc[2], acc2[2];
            for (int i = 0; i < NG; i++) {
                acc[i] = b0 ? pg[i][0] : _mm512_setzero_ps();
                acc2[i] = b0 ? pg[i][1] : _mm512_setzero_ps();
            }
            for (int64_t b = b0; b < b1; b++) {
                __m512i W[8];
                __m512 d16, e16;
                weights(T, q, s, b, W, &d16, &e16);
                for (int i = 0; i < NG; i++) {
                    const char *rec = x4 + ((size_t)i * (size_t)nb + (size_t)b) * KQ_X4_REC;
                    __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
                    for (int j = 0; j < 4; j++) {
                        lo = _mm512_dpbusd_epi32(lo, W[j], _mm512_load_si512(rec + 64 * j));
                        hi = _mm512_dpbusd_epi32(hi, W[4 + j], _mm512_load_si512(rec + 256 + 64 * j));
                    }
                    __m512 dx = _mm512_load_ps((const float *)(rec + 512)), ds = _mm512_load_ps((const float *)(rec + 576));
                    if (T != Q8_0) /* exact: every product of hi is a multiple of 16 */
                        hi = _mm512_srai_epi32(hi, 4);
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), _mm512_mul_ps(d16, dx), acc[i]);
                    acc2[i] = _mm512_fmadd_ps(e16, ds, acc2[i]);
                }
            }
            if (b1 < nb) {
                for (int i = 0; i < NG; i++) {
                    pg[i][0] = acc[i];
                    pg[i][1] = acc2[i];
                }
                continue;
            }
            for (int i = 0; i < NG; i++) {
                __m512 out = T == Q4_1   ? _mm512_add_ps(acc[i], acc2[i])
                             : T == Q4_0 ? _mm512_fmadd_ps(acc2[i], _mm512_set1_ps(-8.0f), acc[i])
                                         : _mm512_fnmadd_ps(acc2[i], _mm512_set1_ps(128.0f), acc[i]);
                float o[16];
                _mm512_storeu_ps(o, out);
                for (int k = 0; k < 4; k++) {
                    int t = t0 + 4 * i + k;
                    if (t < nt)
                        store_group(y + (size_t)t * ldy, g, r0, r1, _mm_loadu_ps(o + 4 * k));
                }
            }
        }
    }
}

INLINE void mm(int T, const void *w, int64_t rows, int64_t cols, const char *x4, int nt, float *y, size_t ldy,
               int64_t r0, int64_t r1)
{
    const int64_t nb = cols / 32, r4 = (rows + 3) / 4 * 4, groups = (nt + 3) / 4;
    const size_t qrow = T == Q8_0 ? 32 : 16; /* quant bytes per row and block */
    const uint8_t *qs = (const uint8_t *)w, *ss = qs + (size_t)r4 * (size_t)nb * qrow;
    for (int64_t G = 0; G < groups; G += 2) {
        const char *rec = x4 + (size_t)G * (size_t)nb * KQ_X4_REC;
        for (int64_t g0 = r0 / 4 * 4; g0 < r1; g0 += 4 * RB) {
            int64_t g1 = g0 + 4 * RB < r1 ? g0 + 4 * RB : r1;
            if (groups - G >= 2)
                tile(T, 2, qs, ss, nb, rec, g0, g1, nt, (int)(4 * G), y, ldy, r0, r1);
            else
                tile(T, 1, qs, ss, nb, rec, g0, g1, nt, (int)(4 * G), y, ldy, r0, r1);
        }
    }
}

static void mm_q4_0x4(const void *w, int64_t rows, int64_t cols, const char *x4, int nt, float *y, size_t ldy,
                      int64_t r0, int64_t r1)
{
    mm(Q4_0, w, rows, cols, x4, nt, y, ldy, r0, r1);
}

static void mm_q4_1x4(const void *w, int64_t rows, int64_t cols, const char *x4, int nt, float *y, size_t ldy,
                      int64_t r0, int64_t r1)
{
    mm(Q4_1, w, rows, cols, x4, nt, y, ldy, r0, r1);
}

static void mm_q8_0x4(const void *w, int64_t rows, int64_t cols, const char *x4, int nt, float *y, size_t ldy,
                      int64_t r0, int64_t r1)
{
    mm(Q8_0, w, rows, cols, x4, nt, y, ldy, r0, r1);
}

const kq_mm_impl kq_mm_avx512 = {mm_q8_0x4, mm_q4_0x4, mm_q4_1x4};

#pragma GCC pop_options

#endif
