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

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN stays NaN */
  uint32_t u;
  memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
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

/* Half types: load to a float32 tile, combine there, round once at the end. */
#define DEF_HALF(NAME, S, LOAD, STORE, COMBINE, AVG)                                           \
  KCCL_CLONES static void NAME(void *restrict outv, const void *const *in, int nin, size_t n,  \
                               int navg) {                                                     \
    S *restrict o = (S *)outv;                                                                 \
    float acc[TILE];                                                                           \
    const float d = (float)navg;                                                               \
    (void)d;                                                                                   \
    for (size_t b = 0; b < n; b += TILE) {                                                     \
      size_t m = n - b < TILE ? n - b : TILE;                                                  \
      const S *restrict x0 = (const S *)in[0] + b;                                             \
      for (size_t i = 0; i < m; i++) acc[i] = LOAD(x0[i]);                                     \
      for (int r = 1; r < nin; r++) {                                                          \
        const S *restrict xr = (const S *)in[r] + b;                                           \
        for (size_t i = 0; i < m; i++) { float a = acc[i], c = LOAD(xr[i]); acc[i] = COMBINE; } \
      }                                                                                        \
      if (AVG)                                                                                 \
        for (size_t i = 0; i < m; i++) acc[i] = acc[i] / d;                                    \
      for (size_t i = 0; i < m; i++) o[b + i] = STORE(acc[i]);                                 \
    }                                                                                          \
  }

#define F16_LOAD(x) ((float)(x))
#define F16_STORE(x) ((_Float16)(x))
#define BF16_LOAD(x) bf16_to_f32(x)
#define BF16_STORE(x) f32_to_bf16(x)

#define DEF_HALF_ALL(TN, S, LOAD, STORE)                                   \
  DEF_HALF(red_sum_##TN, S, LOAD, STORE, OP_SUM(a, c), 0)                  \
  DEF_HALF(red_prod_##TN, S, LOAD, STORE, OP_PROD(a, c), 0)                \
  DEF_HALF(red_max_##TN, S, LOAD, STORE, OP_MAX(a, c), 0)                  \
  DEF_HALF(red_min_##TN, S, LOAD, STORE, OP_MIN(a, c), 0)                  \
  DEF_HALF(red_avg_##TN, S, LOAD, STORE, OP_SUM(a, c), 1)

DEF_HALF_ALL(f16, _Float16, F16_LOAD, F16_STORE)
DEF_HALF_ALL(bf16, uint16_t, BF16_LOAD, BF16_STORE)

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
