/* kq_avx512_mm.c: AVX-512 VNNI kernels on the packed layout (kq.h): Q4_0 / Q4_1 / Q8_0
 * against one input (the token step) or several (a prompt's tokens, a batch's sequences).
 *
 * A register holds piece j (4 bytes) of each of a group's sixteen rows, lane r for row r:
 * the 64 bytes the layout keeps together, unpacked once per block (the nibbles' low and
 * high halves; Q8_0's sign flip) and then taken by one VNNI product per input against
 * that input's piece j broadcast.  Every lane is one row all along, so per block and
 * input the exact integer dot of all sixteen rows needs no sum across lanes, and one
 * convert, one scale (d_w * d_x: one multiply) and one fused add finish the block; the
 * minimum / offset / sign-flip term adds up in its own register.  Per row and input that
 * is the order of the matvec kernels on GGUF rows (kq_avx512.c): acc += dot * (d_w * d_x),
 * acc2 += e_w * (d_x * sum q_x), block after block, then acc + acc2 (Q4_1), acc - 8 acc2
 * (Q4_0), acc - 128 acc2 (Q8_0).
 *
 * Inputs go four at a time through a group's blocks, the group's weights (at most a few
 * kB a block row for the widths of a small model) staying in L1 for the next four; the
 * weights stream from memory once.  With several inputs, the first four prefetch Q4_0 /
 * Q4_1 weights AHEAD bytes on into L2: their arithmetic slows a core's stream below what
 * memory gives, and the hardware's prefetcher alone left a 4-row batch step's products
 * well below their rate from L2 (with the step's prefetching while it waits, cpu_batch.c's
 * meet: 4-row step 0.95x the time, one row unchanged).  One input streams at memory's rate
 * and prefetches nothing here; nor does Q8_0 (a 4-row step's LM head: no faster with it). */
#include "kq_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

#define G KQ_GROUP
#define AHEAD 8192 /* bytes of a group's Q4 quants that the first pass of several inputs prefetches ahead */
#define INLINE static inline __attribute__((always_inline))

enum { Q4_0, Q4_1, Q8_0 };

static inline __m512i bcast32(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* One group's sixteen rows (quants q, scales s, blocks nb) against the NI inputs x[]:
 * out[k] the sixteen results of input k; PF: prefetch the weights AHEAD bytes on */
INLINE void group(int T, int NI, int PF, const uint8_t *q, const uint8_t *s, int64_t nb, const kq_act8 *x,
                  __m512 *out)
{
    const size_t qg = T == Q8_0 ? 32 * G : 16 * G, sg = T == Q4_1 ? 4 * G : 2 * G; /* bytes per block */
    const size_t ahead = AHEAD / qg;
    const __m512i nib = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[4], acc2[4];
    for (int k = 0; k < NI; k++)
        acc[k] = acc2[k] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *qb = q + (size_t)b * qg, *sb = s + (size_t)b * sg;
        if (PF) { /* the weights AHEAD bytes on, into L2 (see the header) */
            for (size_t o = 0; o < qg; o += 64)
                _mm_prefetch((const char *)qb + ahead * qg + o, _MM_HINT_T1);
            _mm_prefetch((const char *)sb + ahead * sg, _MM_HINT_T1);
        }
        __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
        __m512 e16 = T == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 2 * G))) : d16;
        __m512i W[8]; /* pieces 0-3 (elements 0-15) and 4-7 (16-31) of the sixteen rows */
        if (T == Q8_0) {
            for (int j = 0; j < 8; j++)
                W[j] = _mm512_xor_si512(_mm512_loadu_si512(qb + 64 * j), flip);
        } else {
            for (int j = 0; j < 4; j++) {
                __m512i B = _mm512_loadu_si512(qb + 64 * j);
                W[j] = _mm512_and_si512(B, nib);
                W[4 + j] = _mm512_andnot_si512(nib, B); /* 16 times the high nibble: no shift */
            }
        }
        for (int k = 0; k < NI; k++) {
            const int8_t *xq = x[k].q + 32 * b;
            __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {
                lo = _mm512_dpbusd_epi32(lo, W[j], bcast32(xq + 4 * j));
                hi = _mm512_dpbusd_epi32(hi, W[4 + j], bcast32(xq + 16 + 4 * j));
            }
            if (T != Q8_0) /* exact: every product of hi is a multiple of 16 */
                hi = _mm512_srai_epi32(hi, 4);
            acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)),
                                     _mm512_mul_ps(d16, _mm512_set1_ps(x[k].dds[2 * b])), acc[k]);
            acc2[k] = _mm512_fmadd_ps(e16, _mm512_set1_ps(x[k].dds[2 * b + 1]), acc2[k]);
        }
    }
    for (int k = 0; k < NI; k++)
        out[k] = T == Q4_1   ? _mm512_add_ps(acc[k], acc2[k])
                 : T == Q4_0 ? _mm512_fmadd_ps(acc2[k], _mm512_set1_ps(-8.0f), acc[k])
                             : _mm512_fnmadd_ps(acc2[k], _mm512_set1_ps(128.0f), acc[k]);
}

/* y[t * ldy + r] for the nt inputs at acts (one apart), rows [r0, r1) */
INLINE void mm(int T, const void *w, int64_t rows, int64_t cols, const char *acts, size_t one, int nt, float *y,
               size_t ldy, int64_t r0, int64_t r1)
{
    const int64_t nb = cols / 32, r16 = (rows + G - 1) / G * G;
    const size_t qg = T == Q8_0 ? 32 * G : 16 * G, sg = T == Q4_1 ? 4 * G : 2 * G;
    const uint8_t *qs = (const uint8_t *)w, *ss = qs + (size_t)(r16 / G) * (size_t)nb * qg;
    for (int64_t g = r0 / G * G; g < r1; g += G) {
        const uint8_t *q = qs + (size_t)(g / G) * (size_t)nb * qg, *s = ss + (size_t)(g / G) * (size_t)nb * sg;
        const int64_t a = g > r0 ? g : r0, e = g + G < r1 ? g + G : r1;
        const __mmask16 keep = (__mmask16)((((uint32_t)1 << (e - g)) - 1) & ~(((uint32_t)1 << (a - g)) - 1));
        for (int t = 0; t < nt; t += 4) {
            kq_act8 x[4];
            __m512 out[4];
            const int n = nt - t < 4 ? nt - t : 4;
            for (int k = 0; k < n; k++)
                x[k] = kq_act8_view(acts + (size_t)(t + k) * one, cols);
            /* the count a constant in each copy: the loops unroll, the sums stay in registers */
            if (nt == 1)
                group(T, 1, 0, q, s, nb, x, out);
            else if (t > 0 || T == Q8_0) /* the group's weights came in with the first inputs; Q8_0: see the header */
                switch (n) {
                case 1: group(T, 1, 0, q, s, nb, x, out); break;
                case 2: group(T, 2, 0, q, s, nb, x, out); break;
                case 3: group(T, 3, 0, q, s, nb, x, out); break;
                default: group(T, 4, 0, q, s, nb, x, out); break;
                }
            else
                switch (n) {
                case 2: group(T, 2, 1, q, s, nb, x, out); break;
                case 3: group(T, 3, 1, q, s, nb, x, out); break;
                default: group(T, 4, 1, q, s, nb, x, out); break;
                }
            for (int k = 0; k < n; k++)
                _mm512_mask_storeu_ps(y + (size_t)(t + k) * ldy + g, keep, out[k]);
        }
    }
}

#define KERNELS(name, T)                                                                                            \
    static void mm_##name(const void *w, int64_t rows, int64_t cols, const char *acts, size_t one, int nt, float *y, \
                          size_t ldy, int64_t r0, int64_t r1)                                                       \
    {                                                                                                               \
        mm(T, w, rows, cols, acts, one, nt, y, ldy, r0, r1);                                                        \
    }                                                                                                               \
    void kq_avx512_packed_##name(const void *w, int64_t rows, int64_t cols, const void *act, float *y, int64_t r0, \
                                 int64_t r1)                                                                        \
    {                                                                                                               \
        mm(T, w, rows, cols, (const char *)act, 0, 1, y, 0, r0, r1);                                                \
    }

KERNELS(q4_0, Q4_0)
KERNELS(q4_1, Q4_1)
KERNELS(q8_0, Q8_0)

const kq_mm_impl kq_mm_avx512 = {mm_q8_0, mm_q4_0, mm_q4_1};

#pragma GCC pop_options

#endif
