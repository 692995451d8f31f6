/* cpu_attn_x86.c: cpu_attn_core.h compiled for AVX2 + FMA and for AVX-512 (F16C widening
 * the cache's halves), picked by cpu_attn.c from the kernels' level. */
#include "cpu_attn.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include "kie_half.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define ATTN_FN kie_attn_avx2
#define ATTN_FMA(a, b, c) __builtin_fmaf((a), (b), (c))
#include "cpu_attn_core.h"
#undef ATTN_FN
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>
#define ATTN_FN kie_attn_avx512
#define ATTN_F16C 1
#include "cpu_attn_core.h"
#undef ATTN_FN
#undef ATTN_F16C
#undef ATTN_FMA
#pragma GCC pop_options
#endif
