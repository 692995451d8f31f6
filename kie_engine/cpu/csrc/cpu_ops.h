/* cpu_ops.h: the per-row arithmetic that the token step (cpu_step.c) and the batch step
 * (cpu_batch.c) share, inline in both: one definition, so a row gets the same bits
 * whichever step runs it. */
#ifndef KIE_CPU_OPS_H
#define KIE_CPU_OPS_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "cpu_attn.h"
#include "cpu_internal.h"
#include "kq.h"

/* The sum of squares in double, as eight partial sums (element i into sum i % 8) added
 * pairwise at the end: a fixed order, so the same bits on every path, and eight chains of
 * adds instead of one (the compiler keeps them in vector registers). */
static inline void kie_rms_norm(const float *x, const float *w, int n, float eps, float *out) {
  double p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; k++) p[k] += (double)x[i + k] * x[i + k];
  for (int k = 0; i < n; i++, k++) p[k] += (double)x[i] * x[i];
  double ss = ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
  float r = (float)(1.0 / sqrt(ss / n + (double)eps));
  for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* cos then sin of position pos for each of the hd / 2 frequencies, into cs[hd] */
static inline void kie_rope_angles(const kie_cpu *e, int pos, float *cs) {
  int hd = e->s.head_dim;
  for (int i = 0; i < hd / 2; i++) {
    double a = (double)pos * e->inv_freq[i];
    cs[i] = (float)cos(a);
    cs[hd / 2 + i] = (float)sin(a);
  }
}

static inline void kie_rope(const float *x, float *out, int hd, int mode, const float *cs) {
  int half = hd / 2;
  const float *c = cs, *s = cs + half;
  if (mode == KIE_CPU_ROPE_PAIRS) {
    for (int i = 0; i < half; i++) {
      float a = x[2 * i], b = x[2 * i + 1];
      out[2 * i] = a * c[i] - b * s[i];
      out[2 * i + 1] = b * c[i] + a * s[i];
    }
  } else {
    for (int i = 0; i < half; i++) {
      float a = x[i], b = x[i + half];
      out[i] = a * c[i] - b * s[i];
      out[i + half] = b * c[i] + a * s[i];
    }
  }
}

/* exp(x) of 16 values, elementwise and branch-free so that it vectorizes (libm's expf is
 * a call per element: it was a fifth of a prompt's time): 2^n times a degree-6
 * polynomial of the remainder (relative error ~2e-7), x clamped to [-87, 88.7] (inf
 * above; NaN kept).  The same C in both steps gives the same bits whatever the compiler
 * vectorizes (no fused multiply-adds: the build turns contraction off). */
static inline void kie_exp16(float v[16]) {
  for (int c = 0; c < 16; c++) {
    float x = v[c];
    float xc = x < -87.0f ? -87.0f : x;
    xc = xc > 88.7f ? 88.7f : xc;
    float n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f; /* nearest integer */
    float r = xc - n * 0.693145751953125f;
    r = r - n * 1.428606765330187e-6f;
    float p = 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    v[c] = x != x ? x : p * scale;
  }
}

int kie_swiglu_avx512(const float *gate, const float *up, float *m, int r0, int r1); /* cpu_swiglu.c */

/* m[i] = silu(gate[i]) * up[i] for i in [r0, r1), 16 at a time (the tail's padding unused);
 * at the AVX-512 level the whole sixteens in registers, with the same bits */
static inline void kie_swiglu(const float *gate, const float *up, float *m, int r0, int r1) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (!strcmp(kq_level(), "avx512")) r0 = kie_swiglu_avx512(gate, up, m, r0, r1);
#endif
  for (int i = r0; i < r1; i += 16) {
    int n = r1 - i < 16 ? r1 - i : 16;
    float t[16];
    for (int c = 0; c < 16; c++) t[c] = c < n ? -gate[i + c] : 0.0f;
    kie_exp16(t);
    if (n == 16) /* the same operations as the tail's, vectorized */
      for (int c = 0; c < 16; c++) m[i + c] = gate[i + c] / (1.0f + t[c]) * up[i + c];
    else
      for (int c = 0; c < n; c++) m[i + c] = gate[i + c] / (1.0f + t[c]) * up[i + c];
  }
}

static inline void kie_add(float *x, const float *y, int n) {
  for (int i = 0; i < n; i++) x[i] += y[i];
}

/* 1 when x holds a NaN or an infinity: x * 0 is NaN exactly for those (one vectorized
 * pass).  Quantizing an input drops a NaN (the block's scale takes it, its codes do not),
 * so the steps look at every product's input and flag the row. */
static inline int kie_nonfinite(const float *x, int n) {
  float z[16] = {0}, t = 0.0f; /* sixteen sums, so that it vectorizes: NaN in any order */
  int k = 0;
  for (; k + 16 <= n; k += 16)
    for (int c = 0; c < 16; c++) z[c] += x[k + c] * 0.0f;
  for (; k < n; k++) t += x[k] * 0.0f;
  for (int c = 0; c < 16; c++) t += z[c];
  return t != t;
}

/* The value the cache holds for x (f16: rounded to half) */
static inline float kie_cache_round(float x, int kv16) { return kv16 ? kie_half_to_float(kie_float_to_half(x)) : x; }

static inline double kie_now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The profile (kie_cpu_profile): the time since the last stamp goes to stage i, on
 * thread 0 while profiling (locals prof and t_prev, engine e) */
#define STAMP(i)                     \
  do {                               \
    if (prof) {                      \
      double t_ = kie_now_s();       \
      e->prof[i] += t_ - t_prev;     \
      t_prev = t_;                   \
    }                                \
  } while (0)

#endif
