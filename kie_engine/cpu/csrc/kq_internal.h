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
 * each part starting on a 64-byte boundary.  The float types take x itself. */
typedef struct {
    const int8_t *q;
    const int32_t *s4;
    const float *dds;
} kq_act8;

static inline size_t kq_up64(size_t n) { return (n + 63) & ~(size_t)63; }

static inline size_t kq_act8_bytes(int64_t cols)
{
    return kq_up64((size_t)cols) + kq_up64((size_t)cols) /* s4: 4 bytes per 4 q */
         + kq_up64((size_t)(cols / 16) * sizeof(float));
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
    return a;
}

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

/* One kernel on the packed layout for nt inputs (kq.h's kq_matmul_mat): input t's
 * prepared form (the layout above) at acts + t * one. */
typedef void (*kq_packed_mm_fn)(const void *w, int64_t rows, int64_t cols, const char *acts, size_t one, int nt,
                                float *y, size_t ldy, int64_t r0, int64_t r1);

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

/* The packed layout's parts for a base type: quant and scale bytes per row and block
 * (kq.h: a group's block is KQ_GROUP * qb quant bytes, KQ_GROUP * sb scale bytes) */
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
/* (x86-64 builds) kq_avx512_mm.c: the packed kernels, one input and several */
extern const kq_mm_impl kq_mm_avx512;
void kq_avx512_packed_q8_0(const void *w, int64_t rows, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1);
void kq_avx512_packed_q4_0(const void *w, int64_t rows, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1);
void kq_avx512_packed_q4_1(const void *w, int64_t rows, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1);

void kq_scalar_dequant_row(int type, const void *row, int64_t cols, float *out);
/* the level kq_dispatch.c picked (or kq_set_level set) */
const kq_impl *kq_current(void);


#endif
