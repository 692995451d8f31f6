/* cpu_attn.h: attention over a sequence's KV cache, and the cache's half precision.
 *
 * A KV head's cache holds K in blocks of 16 positions, element-major within a block
 * ([position / 16][hd][16]: a block's scores are 16-wide products without horizontal
 * sums) and V by position ([position][hd]); capacity a multiple of 16.  kie_attn runs
 * several queries on one KV head at once (a token's query heads of one KV group, a
 * prompt's rows): each tile of keys and values is widened to floats once for all of
 * them, while every query's result stays what it would be alone (cpu_attn_core.h), so a
 * prompt run in chunks gives the bits of the same prompt run token by token.  The
 * instruction set follows the kernels' level (kq_level: AVX-512, AVX2, portable). */
#ifndef KIE_CPU_ATTN_H
#define KIE_CPU_ATTN_H

#include <stddef.h>
#include <stdint.h>

#define KIE_ATTN_TILE 64  /* positions per tile of the online softmax */
#define KIE_ATTN_MAXQ 48  /* queries per kie_attn call */

float kie_half_to_float(uint16_t h);
uint16_t kie_float_to_half(float f);
/* out[i] = kie_float_to_half(x[i]) for i < n (F16C where the kernels' level has it) */
void kie_halves(const float *x, uint16_t *out, int n);

/* 1 when a SIMD path is in use (the kernels' level is not the portable one). */
int kie_attn_simd(void);

/* Memory a caller reads after this call (the next call's keys and values), which the call
 * brings toward the cache while it computes; none: 0 bytes */
typedef struct {
  const void *at[2];
  size_t bytes[2];
} kie_attn_next;

typedef struct {
  const void *k, *v;  /* this KV head's cache (layouts above), f16 or f32 per f16 */
  int f16, hd;
  float scale;
  int nq;             /* 1..KIE_ATTN_MAXQ */
  const float *q[KIE_ATTN_MAXQ];
  int n[KIE_ATTN_MAXQ]; /* query i attends positions [0, n[i]) */
  float *out[KIE_ATTN_MAXQ];
  const float *kcur, *vcur; /* with cur >= 0: position cur's K and V (floats rounded as the */
  int cur;                  /* cache holds them), read instead of the cache; cur = -1: none */
  kie_attn_next pf;         /* what the caller reads next, brought toward the cache meanwhile */
} kie_attn_job;

/* floats of scratch one kie_attn call needs */
size_t kie_attn_scratch_floats(int hd);
void kie_attn(const kie_attn_job *job, float *scratch);

/* Where position p's element d of K / row of V lies in a head's cache (in elements) */
static inline size_t kie_k_index(int p, int d, int hd) { return (size_t)(p / 16) * 16 * hd + (size_t)d * 16 + p % 16; }
static inline size_t kie_v_index(int p, int hd) { return (size_t)p * hd; }

#endif
