/* cpu_swiglu.c: cpu_ops.h's SwiGLU, 16 values per register, for the AVX-512 level.
 * Every value goes through kie_exp16's operations in its order (separate multiplies and
 * adds, the same constants, the same clamps; a NaN input is its own result), so a value
 * gets the portable loop's bits: the compiler leaves that loop scalar (its selects are
 * branches to it), at ~4 ns a value, which a batch of rows paid in every layer. */
#include "cpu_ops.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq")
#include <immintrin.h>

int kie_swiglu_avx512(const float *gate, const float *up, float *m, int r0, int r1) {
  const __m512 lo = _mm512_set1_ps(-87.0f), hi = _mm512_set1_ps(88.7f), big = _mm512_set1_ps(12582912.0f);
  const __m512 one = _mm512_set1_ps(1.0f);
  int i = r0;
  for (; i + 16 <= r1; i += 16) {
    __m512 g = _mm512_loadu_ps(gate + i);
    __m512 x = _mm512_xor_ps(g, _mm512_set1_ps(-0.0f)); /* -gate */
    /* x < -87 ? -87 : x, then xc > 88.7 ? 88.7 : xc (a NaN's value does not matter) */
    __m512 xc = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), x, lo);
    xc = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(xc, hi, _CMP_GT_OQ), xc, hi);
    __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504f)), big), big);
    __m512 r = _mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(1.428606765330187e-6f)));
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 120));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 24));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 6));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0.5f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), one);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), one);
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 t = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), t, x);
    _mm512_storeu_ps(m + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, t)), _mm512_loadu_ps(up + i)));
  }
  return i;
}

#pragma GCC pop_options
#endif

void kie_cpu_swiglu(const float *gate, const float *up, float *m, int n) { kie_swiglu(gate, up, m, 0, n); }
