/* cpu_attn_x86.c: cpu_attn_core.h compiled for AVX2 + FMA (the AVX-512 level has its own
 * kernel: cpu_attn_avx512.c), picked by cpu_attn.c from the kernels' level. */
#include "cpu_attn.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include "kie_half.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define ATTN_FN kie_attn_avx2
#define ATTN_FMA(a, b, c) __builtin_fmaf((a), (b), (c))
#include "cpu_attn_core.h"
#undef ATTN_FN

#include <immintrin.h>

/* kie_halves's first n / 8 * 8 values (returns how many): the conversion rounds to nearest
 * even as kie_float_to_half does; a NaN, whose payload the instruction keeps, goes through
 * kie_float_to_half (one quiet NaN of its sign) */
int kie_halves_f16c(const float *x, uint16_t *out, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        int nan = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        for (int k = 0; nan && k < 8; k++)
            if (nan >> k & 1)
                out[i + k] = kie_float_to_half(x[i + k]);
    }
    return i;
}
#pragma GCC pop_options

#undef ATTN_FMA
#endif
