/* cpu_attn.c: see cpu_attn.h.  The portable kernel, the level dispatch and the cache's
 * half precision. */
#include "cpu_attn.h"

#include <string.h>

#include "kie_half.h"
#include "kq.h"

float kie_half_to_float(uint16_t h) { return kie_h2f(h); }

uint16_t kie_float_to_half(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t ax = x & 0x7fffffff;
  if (ax >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 : 0)); /* inf, nan */
  if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00);                                   /* rounds past 65504 */
  if (ax < 0x38800000) { /* half subnormal or zero: scale into integer units of 2^-24, round to even */
    float a;
    memcpy(&a, &ax, 4);
    float v = a * 16777216.0f; /* exact: a power of two */
    uint32_t q = (uint32_t)v;
    float rem = v - (float)q;
    if (rem > 0.5f || (rem == 0.5f && (q & 1))) q++;
    return (uint16_t)(sign | q);
  }
  /* normal: drop 13 mantissa bits with round to nearest even (a carry into the
   * exponent is the right result) */
  uint32_t r = ax + 0xfff + ((ax >> 13) & 1);
  return (uint16_t)(sign | ((r - 0x38000000) >> 13));
}

/* two tiles of floats, then per query its scaled q and output (hd rounded up to 16 each)
 * and its running max and sum, in 16 floats */
size_t kie_attn_scratch_floats(int hd) {
  size_t hd16 = ((size_t)hd + 15) & ~(size_t)15;
  return (size_t)2 * KIE_ATTN_TILE * hd + (size_t)KIE_ATTN_MAXQ * (2 * hd16 + 16);
}

#define ATTN_FN kie_attn_portable
#define ATTN_FMA(a, b, c) ((a) * (b) + (c))
#include "cpu_attn_core.h"
#undef ATTN_FN
#undef ATTN_FMA

void kie_attn_avx2(const kie_attn_job *a, float *scratch);   /* cpu_attn_x86.c (x86-64 builds) */
int kie_halves_f16c(const float *x, uint16_t *out, int n);
void kie_attn_avx512(const kie_attn_job *a, float *scratch);

int kie_attn_simd(void) { return strcmp(kq_level(), "scalar") != 0; }

void kie_halves(const float *x, uint16_t *out, int n) {
  int i = 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (kie_attn_simd()) i = kie_halves_f16c(x, out, n);
#endif
  for (; i < n; i++) out[i] = kie_float_to_half(x[i]);
}

void kie_attn(const kie_attn_job *job, float *scratch) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  const char *lv = kq_level();
  if (!strcmp(lv, "avx512")) {
    kie_attn_avx512(job, scratch);
    return;
  }
  if (!strcmp(lv, "avx2")) {
    kie_attn_avx2(job, scratch);
    return;
  }
#endif
  kie_attn_portable(job, scratch);
}
