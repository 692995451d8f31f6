/* cpu_attn.h: attention over the KV cache for one query head, and the half-precision
 * conversions of the cache.  An AVX2/FMA/F16C path is picked at run time when the CPU
 * has it; the portable path gives the same cache contents (both round to nearest even). */
#ifndef KIE_CPU_ATTN_H
#define KIE_CPU_ATTN_H

#include <stdint.h>

float kie_half_to_float(uint16_t h);
uint16_t kie_float_to_half(float f);

/* 1 when the SIMD path is in use (decided once). */
int kie_attn_simd(void);

/* out[hd] = softmax_s(scale * q . k_s) weighted sum of v_s over s < n, where keys and
 * values s < n - 1 are the cache rows (stride hd, f32 or f16 per kv_f16) and s = n - 1
 * is kcur / vcur (floats, already rounded as the cache holds them); scores: n floats
 * of scratch. */
void kie_attend(const float *q, const void *kc, const void *vc, int kv_f16, const float *kcur, const float *vcur,
                int n, int hd, float scale, float *scores, float *out);

#endif
