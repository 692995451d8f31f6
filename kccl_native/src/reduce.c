/* reduce.c - element-wise reductions in a fixed order (input 0, then 1, ...),
 * so every rank computes bitwise-identical results.  float16 and bfloat16
 * accumulate in float32 tiles; integer sum/prod wrap like numpy's.
 *
 * The loops are plain C written to auto-vectorize; on x86-64 each kernel is
 * compiled for AVX-512, AVX2(+F16C) and baseline, picked at load time. */
#include <string.h>

#include "internal.h"

#if defined(__x86_64__) && !defined(KCCL_NO_CLONES)
#define KCCL_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KCCL_CLONES
#endif

#define TILE 512

/* Bit casts through a union (not memcpy): GCC vectorizes these loops. */
typedef union { uint32_t u; float f; } f32_bits;
static inline float bf16_to_f32(uint16_t h) {
  f32_bits v = {.u = (uint32_t)h << 16};
  return v.f;
}
static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN stays NaN */
  f32_bits v = {.f = f};
  uint32_t rounded = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
  uint32_t nan = (v.u >> 16) | 0x40u;
  return (uint16_t)(((v.u & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
}

#define OP_SUM(a, b) ((a) + (b))
#define OP_PROD(a, b) ((a) * (b))
#define OP_MAX(a, b) ((a) > (b) ? (a) : (b))
#define OP_MIN(a, b) ((a) < (b) ? (a) : (b))
/* Wrapping integer arithmetic without signed-overflow UB. */
#define IOP_SUM(T, U, a, b) ((T)((U)(a) + (U)(b)))
#define IOP_PROD(T, U, a, b) ((T)((U)(a) * (U)(b)))

/* Same storage and accumulation type: out tile stays in L1 across inputs. */
#define DEF_DIRECT(NAME, T, COMBINE)                                                          \
  KCCL_CLONES static void NAME(void *restrict outv, const void *const *in, int nin, size_t n, \
                               int navg) {                                                    \
    T *restrict o = (T *)outv;                                                                \
    (void)navg;                                                                               \
    for (size_t b = 0; b < n; b += TILE) {                                                    \
      size_t m = n - b < TILE ? n - b : TILE;                                                 \
      const T *restrict x0 = (const T *)in[0] + b;                                            \
      T *restrict ot = o + b;                                                                 \
      if (nin == 1) {                                                                         \
        memcpy(ot, x0, m * sizeof(T));                                                        \
        continue;                                                                             \
      }                                                                                       \
      const T *restrict x1 = (const T *)in[1] + b;                                            \
      for (size_t i = 0; i < m; i++) { T a = x0[i], c = x1[i]; ot[i] = COMBINE; }             \
      for (int r = 2; r < nin; r++) {                                                         \
        const T *restrict xr = (const T *)in[r] + b;                                          \
        for (size_t i = 0; i < m; i++) { T a = ot[i], c = xr[i]; ot[i] = COMBINE; }           \
      }                                                                                       \
    }                                                                                         \
  }

/* Average = sum, then divide by the number of ranks (truncating for integers). */
#define DEF_AVG(NAME, SUMNAME, T)                                                         \
  static void NAME(void *outv, const void *const *in, int nin, size_t n, int navg) {      \
    SUMNAME(outv, in, nin, n, navg);                                                      \
    T *o = (T *)outv;                                                                     \
    T d = (T)navg;                                                                        \
    for (size_t i = 0; i < n; i++) o[i] = (T)(o[i] / d);                                  \
  }

#define DEF_INT(TN, T, U)                                        \
  DEF_DIRECT(red_sum_##TN, T, IOP_SUM(T, U, a, c))               \
  DEF_DIRECT(red_prod_##TN, T, IOP_PROD(T, U, a, c))             \
  DEF_DIRECT(red_max_##TN, T, OP_MAX(a, c))                      \
  DEF_DIRECT(red_min_##TN, T, OP_MIN(a, c))                      \
  DEF_AVG(red_avg_##TN, red_sum_##TN, T)

#define DEF_FLOAT(TN, T)                                         \
  DEF_DIRECT(red_sum_##TN, T, OP_SUM(a, c))                      \
  DEF_DIRECT(red_prod_##TN, T, OP_PROD(a, c))                    \
  DEF_DIRECT(red_max_##TN, T, OP_MAX(a, c))                      \
  DEF_DIRECT(red_min_##TN, T, OP_MIN(a, c))                      \
  DEF_AVG(red_avg_##TN, red_sum_##TN, T)

DEF_INT(i8, int8_t, uint8_t)
DEF_INT(u8, uint8_t, uint8_t)
DEF_INT(i32, int32_t, uint32_t)
DEF_INT(u32, uint32_t, uint32_t)
DEF_INT(i64, int64_t, uint64_t)
DEF_INT(u64, uint64_t, uint64_t)
DEF_FLOAT(f32, float)
DEF_FLOAT(f64, double)

/* Half types: convert a tile to float32, combine there, round once at the end. */
#define DEF_HALF(NAME, S, LOADT, STORET, COMBINE, AVG)                                         \
  KCCL_CLONES static void NAME(void *restrict outv, const void *const *in, int nin, size_t n,  \
                               int navg) {                                                     \
    S *restrict o = (S *)outv;                                                                 \
    float acc[TILE], x[TILE];                                                                  \
    const float d = (float)navg;                                                               \
    (void)d;                                                                                   \
    for (size_t b = 0; b < n; b += TILE) {                                                     \
      size_t m = n - b < TILE ? n - b : TILE;                                                  \
      LOADT(acc, (const S *)in[0] + b, m);                                                     \
      for (int r = 1; r < nin; r++) {                                                          \
        LOADT(x, (const S *)in[r] + b, m);                                                     \
        for (size_t i = 0; i < m; i++) { float a = acc[i], c = x[i]; acc[i] = COMBINE; }       \
      }                                                                                        \
      if (AVG)                                                                                 \
        for (size_t i = 0; i < m; i++) acc[i] = acc[i] / d;                                    \
      STORET(o + b, acc, m);                                                                   \
    }                                                                                          \
  }

KCCL_CLONES static void bf16_load_tile(float *restrict dst, const uint16_t *restrict src, size_t m) {
  for (size_t i = 0; i < m; i++) dst[i] = bf16_to_f32(src[i]);
}
KCCL_CLONES static void bf16_store_tile(uint16_t *restrict dst, const float *restrict src, size_t m) {
  for (size_t i = 0; i < m; i++) dst[i] = f32_to_bf16(src[i]);
}

/* float16: GCC 12 does not vectorize _Float16 conversions, so with F16C the
 * tiles go through vcvtph2ps / vcvtps2ph (round to nearest even, exact as the
 * scalar casts); without it, scalar casts. */
#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx2,f16c"))) static void f16_load_f16c(float *dst, const _Float16 *src, size_t m) {
  size_t i = 0;
  for (; i + 8 <= m; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
  for (; i < m; i++) dst[i] = (float)src[i];
}
__attribute__((target("avx2,f16c"))) static void f16_store_f16c(_Float16 *dst, const float *src, size_t m) {
  size_t i = 0;
  for (; i + 8 <= m; i += 8)
    _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < m; i++) dst[i] = (_Float16)src[i];
}
static int have_f16c(void) {
  static int v = -1;
  if (v < 0) v = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");
  return v;
}
#else
static int have_f16c(void) { return 0; }
#define f16_load_f16c(d, s, m) ((void)0)
#define f16_store_f16c(d, s, m) ((void)0)
#endif
static void f16_load_tile(float *restrict dst, const _Float16 *restrict src, size_t m) {
  if (have_f16c()) { f16_load_f16c(dst, src, m); return; }
  for (size_t i = 0; i < m; i++) dst[i] = (float)src[i];
}
static void f16_store_tile(_Float16 *restrict dst, const float *restrict src, size_t m) {
  if (have_f16c()) { f16_store_f16c(dst, src, m); return; }
  for (size_t i = 0; i < m; i++) dst[i] = (_Float16)src[i];
}

#define DEF_HALF_ALL(TN, S, LOADT, STORET)                                 \
  DEF_HALF(red_sum_##TN, S, LOADT, STORET, OP_SUM(a, c), 0)                \
  DEF_HALF(red_prod_##TN, S, LOADT, STORET, OP_PROD(a, c), 0)              \
  DEF_HALF(red_max_##TN, S, LOADT, STORET, OP_MAX(a, c), 0)                \
  DEF_HALF(red_min_##TN, S, LOADT, STORET, OP_MIN(a, c), 0)                \
  DEF_HALF(red_avg_##TN, S, LOADT, STORET, OP_SUM(a, c), 1)

DEF_HALF_ALL(f16, _Float16, f16_load_tile, f16_store_tile)
DEF_HALF_ALL(bf16, uint16_t, bf16_load_tile, bf16_store_tile)

typedef void (*red_fn)(void *, const void *const *, int, size_t, int);

#define ROW(TN) {red_sum_##TN, red_prod_##TN, red_max_##TN, red_min_##TN, red_avg_##TN}
static const red_fn table[kcclNumTypes][kcclNumOps] = {
    [kcclInt8] = ROW(i8),     [kcclUint8] = ROW(u8),     [kcclInt32] = ROW(i32),
    [kcclUint32] = ROW(u32),  [kcclInt64] = ROW(i64),    [kcclUint64] = ROW(u64),
    [kcclFloat16] = ROW(f16), [kcclFloat32] = ROW(f32),  [kcclFloat64] = ROW(f64),
    [kcclBfloat16] = ROW(bf16),
};

void kccl_reduce(void *out, const void *const *in, int nin, size_t count, kcclDataType_t t,
                 kcclRedOp_t op, int nranks_for_avg) {
  if (count == 0) return;
  table[t][op](out, in, nin, count, nranks_for_avg);
}
