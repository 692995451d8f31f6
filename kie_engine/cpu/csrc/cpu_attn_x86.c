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
#pragma GCC pop_options

#undef ATTN_FMA
#endif
