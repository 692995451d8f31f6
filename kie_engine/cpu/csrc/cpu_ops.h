/* cpu_ops.h: the per-row arithmetic that the token step (cpu_step.c) and the batch step
 * (cpu_batch.c) share, inline in both: one definition, so a row gets the same bits
 * whichever step runs it. */
#ifndef KIE_CPU_OPS_H
#define KIE_CPU_OPS_H

#include <math.h>

#include "cpu_attn.h"
#include "cpu_internal.h"

static inline void kie_rms_norm(const float *x, const float *w, int n, float eps, float *out) {
  double ss = 0;
  for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
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

static inline float kie_swiglu(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

static inline void kie_add(float *x, const float *y, int n) {
  for (int i = 0; i < n; i++) x[i] += y[i];
}

/* 1 when x holds a NaN or an infinity: x * 0 is NaN exactly for those (one vectorized
 * pass).  Quantizing an input drops a NaN (the block's scale takes it, its codes do not),
 * so the steps look at every product's input and flag the row. */
static inline int kie_nonfinite(const float *x, int n) {
  float z = 0.0f;
  for (int k = 0; k < n; k++) z += x[k] * 0.0f;
  return z != z;
}

/* The value the cache holds for x (f16: rounded to half) */
static inline float kie_cache_round(float x, int kv16) { return kv16 ? kie_half_to_float(kie_float_to_half(x)) : x; }

#endif
