/* kq_internal.h: what the kq_*.c files share and nothing outside them sees: the block
 * layouts, the prepared-input layout, half/bfloat conversions and the per-level table
 * of kernels that kq_dispatch.c picks from. */
#ifndef KQ_INTERNAL_H
#define KQ_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "kie_half.h"
#include "kq.h"

/* GGUF block layouts (the format fixes them; the sizes are checked below) */
typedef struct { uint16_t d; int8_t qs[32]; } kq_block_q8_0;                      /* x = d*q */
typedef struct { uint16_t d; uint8_t qs[16]; } kq_block_q4_0;                    /* x = d*(q-8) */
typedef struct { uint16_t d, m; uint8_t qs[16]; } kq_block_q4_1;                 /* x = d*q + m */
/* x = d*sc_j*q - dmin*m_j over 8 sub-blocks of 32; scales: 6-bit sc and m, packed */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } kq_block_q4_k;
/* x = d*sc_g*(q-32) over 16 groups of 16; q = 4 low bits from ql, 2 high from qh */
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } kq_block_q6_k;

_Static_assert(sizeof(kq_block_q8_0) == 34, "Q8_0 block");
_Static_assert(sizeof(kq_block_q4_0) == 18, "Q4_0 block");
_Static_assert(sizeof(kq_block_q4_1) == 20, "Q4_1 block");
_Static_assert(sizeof(kq_block_q4_k) == 144, "Q4_K block");
_Static_assert(sizeof(kq_block_q6_k) == 210, "Q6_K block");

/* The prepared input of every quantized type is one layout (so any level's kernel reads
 * any level's preparation, and a file mixing types prepares once per width):
 *   int8  q[cols]        x quantized per block of 32: q = round(x / d), d = max|x| / 127
 *   int32 s4[cols / 4]   sums of each 4 consecutive q: the integer dot products take
 *                        unsigned weights (q + bias), and s4 is what removes the bias
 *                        lane by lane (a SIMD lane sums 4 products)
 *   float dds[cols / 16] per block the pair (d, ds): d the block's scale, ds = d * (sum
 *                        of its q), the block's sum of x for the minimum terms; paired
 *                        so one 8-byte load serves both
 *   int8  x1[cols / 32][2][64]  per block, q's 4-byte pieces 0-3 then 4-7, each repeated
 *                        four times ([p0 p0 p0 p0 p1 ...]): in 32-bit lane 4j + r, piece j
 *                        meets row r's piece j of the packed layout (kq.h)
 * each part starting on a 64-byte boundary.  The float types take x itself. */
typedef struct {
    const int8_t *q;
    const int32_t *s4;
    const float *dds;
    const int8_t *x1;
} kq_act8;

static inline size_t kq_up64(size_t n) { return (n + 63) & ~(size_t)63; }

static inline size_t kq_act8_bytes(int64_t cols)
{
    return kq_up64((size_t)cols) + kq_up64((size_t)cols) /* s4: 4 bytes per 4 q */
         + kq_up64((size_t)(cols / 16) * sizeof(float)) + (size_t)(cols / 32) * 128;
}

static inline kq_act8 kq_act8_view(const void *act, int64_t cols)
{
    const char *p = (const char *)act;
    kq_act8 a;
    a.q = (const int8_t *)p;
    p += kq_up64((size_t)cols);
    a.s4 = (const int32_t *)p;
    p += kq_up64((size_t)cols);
    a.dds = (const float *)p;
    p += kq_up64((size_t)(cols / 16) * sizeof(float));
    a.x1 = (const int8_t *)p;
    return a;
}

/* The inputs of a multi-input product, four at a time (kq.h's kq_matmul_mat), after the
 * nt single inputs: per group of four inputs (the last padded with zeros) and per block
 * of 32, a record of
 *   int8  x[8][64]   piece j (4 bytes) of input k in 32-bit lane 4k + r, for r = 0..3
 *   float d[16]      input k's block scale d in lanes 4k..4k+3
 *   float ds[16]     input k's d * (sum of q), likewise
 * so that one product of a block's row piece j (the packed layout, its four rows
 * broadcast) with x[j] gives rows x inputs in one register. */
#define KQ_X4_REC 640

static inline size_t kq_x4_bytes(int64_t cols, int nt) { return (size_t)((nt + 3) / 4) * (size_t)(cols / 32) * KQ_X4_REC; }

static inline float kq_bf2f(uint16_t b)
{
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K's 12 scale bytes -> sc[0..7] (bytes 0..7) and m[0..7] (bytes 8..15) */
static inline void kq_q4k_scales(const uint8_t s[12], uint8_t out[16])
{
    uint32_t u0, u1, u2, w[4];
    memcpy(&u0, s, 4);
    memcpy(&u1, s + 4, 4);
    memcpy(&u2, s + 8, 4);
    w[0] = u0 & 0x3f3f3f3fu;
    w[1] = (u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4);
    w[2] = u1 & 0x3f3f3f3fu;
    w[3] = ((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4);
    memcpy(out, w, 16);
}

/* One matvec kernel: y[r] for r in [r0, r1), rows `rb` bytes apart. */
typedef void (*kq_matvec_fn)(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0,
                             int64_t r1);

/* One kernel on the packed layout (kq.h): rows [r0, r1) of a matrix of `rows` rows. */
typedef void (*kq_packed_fn)(const void *w, int64_t rows, int64_t cols, const void *act, float *y, int64_t r0,
                             int64_t r1);

/* One kernel on the packed layout for nt inputs (kq.h's kq_matmul_mat): x4 their records
 * of four (above). */
typedef void (*kq_packed_mm_fn)(const void *w, int64_t rows, int64_t cols, const char *x4, int nt, float *y,
                                size_t ldy, int64_t r0, int64_t r1);

/* A level's kernels for several inputs; NULL: kq_matmul.c runs the matvec kernel on a
 * few rows at a time for each input, those rows' weights staying in L1 meanwhile. */
typedef struct {
    kq_packed_mm_fn q8_0x4, q4_0x4, q4_1x4;
} kq_mm_impl;

typedef struct {
    const char *name;
    void (*quantize_act)(const float *x, int64_t cols, void *act); /* the layout above */
    kq_matvec_fn f32, f16, bf16, q8_0, q4_0, q4_1, q4_k, q6_k;
    /* packed kernels; NULL: kq_dispatch.c unpacks four rows at a time for the row kernel */
    kq_packed_fn q8_0x4, q4_0x4, q4_1x4;
    const kq_mm_impl *mm; /* NULL: every type through the matvec kernels */
} kq_impl;

/* The packed layout's parts for a base type: quant and scale bytes per row and block */
static inline int kq_packed_parts(int base, size_t *qb, size_t *sb)
{
    switch (base) {
    case KQ_Q8_0: *qb = 32, *sb = 2; return 1;
    case KQ_Q4_0: *qb = 16, *sb = 2; return 1;
    case KQ_Q4_1: *qb = 16, *sb = 4; return 1;
    default: return 0;
    }
}

extern const kq_impl kq_impl_scalar;
/* NULL when the build's compiler cannot make that level (other architectures) */
extern const kq_impl *const kq_impl_avx2;
extern const kq_impl *const kq_impl_avx512;
extern const kq_mm_impl kq_mm_avx512; /* (x86-64 builds) kq_avx512_mm.c */

void kq_scalar_dequant_row(int type, const void *row, int64_t cols, float *out);
/* the level kq_dispatch.c picked (or kq_set_level set) */
const kq_impl *kq_current(void);

/* act's x1 part from its q (every level prepares the same bytes: kq_dispatch.c) */
void kq_expand_x1(void *act, int64_t cols);

#endif
