/* cpu_attn.c: see cpu_attn.h. */
#include "cpu_attn.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KIE_X86 1
#include <immintrin.h>
#endif

float kie_half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else { /* subnormal: normalise */
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) {
        man <<= 1;
        exp--;
      }
      bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

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

/* -- portable ----------------------------------------------------------------------------- */

static float dot_f32(const float *a, const float *b, int n) {
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; i++) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

static float dot_f16(const float *a, const uint16_t *b, int n) {
  float s = 0;
  for (int i = 0; i < n; i++) s += a[i] * kie_half_to_float(b[i]);
  return s;
}

static void axpy_f32(float *y, float p, const float *x, int n) {
  for (int i = 0; i < n; i++) y[i] += p * x[i];
}

static void axpy_f16(float *y, float p, const uint16_t *x, int n) {
  for (int i = 0; i < n; i++) y[i] += p * kie_half_to_float(x[i]);
}

static void scores_portable(const float *q, const void *kc, int kv_f16, int n, int hd, float *s) {
  for (int t = 0; t < n; t++)
    s[t] = kv_f16 ? dot_f16(q, (const uint16_t *)kc + (size_t)t * hd, hd) : dot_f32(q, (const float *)kc + (size_t)t * hd, hd);
}

static void mix_portable(const float *p, const void *vc, int kv_f16, int n, int hd, float *out) {
  for (int t = 0; t < n; t++) {
    if (kv_f16)
      axpy_f16(out, p[t], (const uint16_t *)vc + (size_t)t * hd, hd);
    else
      axpy_f32(out, p[t], (const float *)vc + (size_t)t * hd, hd);
  }
}

/* -- AVX2 + FMA + F16C ------------------------------------------------------------------- */
#ifdef KIE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static inline float hsum256(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

AVX2 static inline __m256 load8(const void *base, int f16, size_t i) {
  if (f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
  return _mm256_loadu_ps((const float *)base + i);
}

AVX2 static float elem(const void *base, int f16, size_t i) {
  return f16 ? kie_half_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

AVX2 static void scores_avx2(const float *q, const void *kc, int kv_f16, int n, int hd, float *s) {
  int v8 = hd & ~7;
  for (int t = 0; t < n; t++) {
    size_t row = (size_t)t * hd;
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < v8; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(kc, kv_f16, row + i), acc);
    float r = hsum256(acc);
    for (int i = v8; i < hd; i++) r += q[i] * elem(kc, kv_f16, row + i);
    s[t] = r;
  }
}

AVX2 static void mix_avx2(const float *p, const void *vc, int kv_f16, int n, int hd, float *out) {
  int v8 = hd & ~7;
  for (int i = 0; i < v8; i += 8) { /* one 8-wide slice of the output over every position */
    __m256 acc = _mm256_loadu_ps(out + i);
    for (int t = 0; t < n; t++) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), load8(vc, kv_f16, (size_t)t * hd + i), acc);
    _mm256_storeu_ps(out + i, acc);
  }
  for (int i = v8; i < hd; i++)
    for (int t = 0; t < n; t++) out[i] += p[t] * elem(vc, kv_f16, (size_t)t * hd + i);
}
#endif

static int simd_level = -1;

int kie_attn_simd(void) {
  if (simd_level < 0) {
#ifdef KIE_X86
    __builtin_cpu_init();
    simd_level = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    simd_level = 0;
#endif
  }
  return simd_level;
}

void kie_attend(const float *q, const void *kc, const void *vc, int kv_f16, const float *kcur, const float *vcur,
                int n, int hd, float scale, float *scores, float *out) {
  int past = n - 1;
  int simd = kie_attn_simd();
#ifdef KIE_X86
  if (simd)
    scores_avx2(q, kc, kv_f16, past, hd, scores);
  else
#endif
    scores_portable(q, kc, kv_f16, past, hd, scores);
  scores[past] = dot_f32(q, kcur, hd);
  float m = -INFINITY;
  for (int t = 0; t < n; t++) {
    scores[t] *= scale;
    if (scores[t] > m) m = scores[t];
  }
  float sum = 0;
  for (int t = 0; t < n; t++) {
    scores[t] = expf(scores[t] - m);
    sum += scores[t];
  }
  float inv = 1.0f / sum;
  for (int t = 0; t < n; t++) scores[t] *= inv;
  memset(out, 0, sizeof(float) * hd);
#ifdef KIE_X86
  if (simd)
    mix_avx2(scores, vc, kv_f16, past, hd, out);
  else
#endif
    mix_portable(scores, vc, kv_f16, past, hd, out);
  axpy_f32(out, scores[past], vcur, hd);
}
