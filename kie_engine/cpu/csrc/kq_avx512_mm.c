/* kq_avx512_mm.c: AVX-512 VNNI kernels for several inputs on the packed layout (kq.h's
 * kq_matmul_mat): a prompt's tokens or a batch's sequences against Q4_0 / Q4_1 / Q8_0.
 *
 * Per group of four rows, four inputs at a time: each block's weights are loaded,
 * unpacked and their scales converted once, then applied to the four inputs, whose
 * per-block terms (the minimum of Q4_1, the offset of Q4_0, the sign flip of Q8_0) go
 * four inputs x four rows into one register from the transposed block sums.  Every
 * input's result is computed with the operations of its matvec kernel (kq_avx512.c), in
 * the same order (even and odd blocks in two accumulators, the per-block scale as the
 * product d_w * d_x, the minimum terms summed block after block): the same bits. */
#include "kq_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

#include "kq_x512.h"

/* Inputs t0..t0+3 (past nt the last one repeats; its results are dropped): their 8-bit
 * values and their (d, d * sum q) pairs */
static inline void inputs4(const char *acts, size_t stride, int64_t cols, int nt, int t0, const int8_t *q[4],
                           const float *dds[4])
{
    for (int k = 0; k < 4; k++) {
        int t = t0 + k < nt ? t0 + k : nt - 1;
        kq_act8 a = kq_act8_view(acts + (size_t)t * stride, cols);
        q[k] = a.q;
        dds[k] = a.dds;
    }
}

/* [s0 s0 s0 s0 s1 s1 s1 s1 ...]: the four inputs' block sums, one per four lanes, so
 * that lane 4k + r pairs input k with row r of [v0 v1 v2 v3 v0 ...] */
static inline __m512 spread4(const float *s)
{
    const __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_loadu_ps(s)));
}

static inline void q4x4_mm(const void *w, int64_t rows, int64_t cols, const char *acts, size_t stride,
                           const float *sums, int nt, int nt4, float *y, size_t ldy, int64_t r0, int64_t r1,
                           int has_min)
{
    const int64_t nb = cols / 32, r4 = (rows + 3) / 4 * 4;
    const size_t sb = has_min ? 4 : 2;
    const uint8_t *qs = (const uint8_t *)w, *ss = qs + (size_t)r4 * (size_t)nb * 16;
    const __m512i nib = _mm512_set1_epi8(0x0f);
    const __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i lanes_d = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
    const __m512i lanes_m = _mm512_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7);
    for (int64_t g = r0 / 4 * 4; g < r1; g += 4) {
        const uint8_t *q = qs + (size_t)g * (size_t)nb * 16, *s = ss + (size_t)g * (size_t)nb * sb;
        for (int t0 = 0; t0 < nt; t0 += 4) {
            const int8_t *aq[4];
            const float *dx[4];
            inputs4(acts, stride, cols, nt, t0, aq, dx);
            __m512 acc0[4], acc1[4], accm = _mm512_setzero_ps();
            for (int k = 0; k < 4; k++)
                acc0[k] = acc1[k] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                __m512i qw = _mm512_loadu_si512(q + 64 * b);
                __m512i lo = _mm512_and_si512(qw, nib), hi = _mm512_and_si512(_mm512_srli_epi16(qw, 4), nib);
                __m512 d16, s16 = spread4(sums + b * nt4 + t0);
                if (has_min) { /* (d, m) x 4 rows: d_r for the scales, m_r x block sum for the minimum */
                    __m512 dm = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16 * b))));
                    d16 = _mm512_permutexvar_ps(lanes_d, dm);
                    accm = _mm512_add_ps(accm, _mm512_mul_ps(_mm512_permutexvar_ps(lanes_m, dm), s16));
                } else { /* d x 4 rows: d_r x block sum for the offset of 8 */
                    __m128 dw = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(s + 8 * b)));
                    d16 = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(dw));
                    accm = _mm512_fmadd_ps(_mm512_broadcast_f32x4(dw), s16, accm);
                }
                for (int k = 0; k < 4; k++) {
                    __m512i alo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(aq[k] + 32 * b)));
                    __m512i ahi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(aq[k] + 32 * b + 16)));
                    __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, alo), hi, ahi);
                    __m512 sc = _mm512_mul_ps(d16, _mm512_set1_ps(dx[k][2 * b]));
                    if (b & 1)
                        acc1[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc1[k]);
                    else
                        acc0[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc0[k]);
                }
            }
            float extra[16];
            _mm512_storeu_ps(extra, accm);
            for (int k = 0; k < 4 && t0 + k < nt; k++) {
                __m128 out = sum_groups4(_mm512_add_ps(acc0[k], acc1[k])), ex = _mm_loadu_ps(extra + 4 * k);
                out = has_min ? _mm_add_ps(out, ex) : _mm_fmadd_ps(ex, _mm_set1_ps(-8.0f), out);
                store_group(y + (size_t)(t0 + k) * ldy, g, r0, r1, out);
            }
        }
    }
}

static void mm_q4_0x4(const void *w, int64_t rows, int64_t cols, const char *acts, size_t stride, const float *sums,
                      int nt, int nt4, float *y, size_t ldy, int64_t r0, int64_t r1)
{
    q4x4_mm(w, rows, cols, acts, stride, sums, nt, nt4, y, ldy, r0, r1, 0);
}

static void mm_q4_1x4(const void *w, int64_t rows, int64_t cols, const char *acts, size_t stride, const float *sums,
                      int nt, int nt4, float *y, size_t ldy, int64_t r0, int64_t r1)
{
    q4x4_mm(w, rows, cols, acts, stride, sums, nt, nt4, y, ldy, r0, r1, 1);
}

/* Q8_0: rows 0-1 and 2-3 of a block in two registers, sign-flipped once for the four
 * inputs; 128 x (d_w x block sum) taken out per row at the end, as mv_q8_0x4 does. */
static void mm_q8_0x4(const void *w, int64_t rows, int64_t cols, const char *acts, size_t stride, const float *sums,
                      int nt, int nt4, float *y, size_t ldy, int64_t r0, int64_t r1)
{
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i lanes01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i lanes23 = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const int64_t nb = cols / 32, r4 = (rows + 3) / 4 * 4;
    const int8_t *qs = (const int8_t *)w;
    const uint16_t *ds = (const uint16_t *)(qs + (size_t)r4 * (size_t)cols);
    for (int64_t g = r0 / 4 * 4; g < r1; g += 4) {
        const int8_t *q = qs + (size_t)g * (size_t)cols;
        const uint16_t *d = ds + (size_t)g * (size_t)nb;
        for (int t0 = 0; t0 < nt; t0 += 4) {
            const int8_t *aq[4];
            const float *dx[4];
            inputs4(acts, stride, cols, nt, t0, aq, dx);
            __m512 acc01[4], acc23[4], bias = _mm512_setzero_ps();
            for (int k = 0; k < 4; k++)
                acc01[k] = acc23[k] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                __m512i w01 = _mm512_xor_si512(_mm512_loadu_si512(q + 128 * b), flip);
                __m512i w23 = _mm512_xor_si512(_mm512_loadu_si512(q + 128 * b + 64), flip);
                __m128 dw = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(d + 4 * b)));
                __m512 d01 = _mm512_permutexvar_ps(lanes01, _mm512_castps128_ps512(dw));
                __m512 d23 = _mm512_permutexvar_ps(lanes23, _mm512_castps128_ps512(dw));
                bias = _mm512_fmadd_ps(_mm512_broadcast_f32x4(dw), spread4(sums + b * nt4 + t0), bias);
                for (int k = 0; k < 4; k++) {
                    __m512i ax = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(aq[k] + 32 * b)));
                    __m512i p01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w01, ax);
                    __m512i p23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w23, ax);
                    __m512 dxk = _mm512_set1_ps(dx[k][2 * b]);
                    acc01[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p01), _mm512_mul_ps(d01, dxk), acc01[k]);
                    acc23[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p23), _mm512_mul_ps(d23, dxk), acc23[k]);
                }
            }
            float extra[16];
            _mm512_storeu_ps(extra, bias);
            for (int k = 0; k < 4 && t0 + k < nt; k++) {
                __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(acc01[k], acc23[k], _MM_SHUFFLE(2, 0, 2, 0)),
                                         _mm512_shuffle_f32x4(acc01[k], acc23[k], _MM_SHUFFLE(3, 1, 3, 1)));
                __m128 out = _mm_fnmadd_ps(_mm_loadu_ps(extra + 4 * k), _mm_set1_ps(128.0f), sum_groups4(t));
                store_group(y + (size_t)(t0 + k) * ldy, g, r0, r1, out);
            }
        }
    }
}

const kq_mm_impl kq_mm_avx512 = {mm_q8_0x4, mm_q4_0x4, mm_q4_1x4};

#pragma GCC pop_options

#endif
