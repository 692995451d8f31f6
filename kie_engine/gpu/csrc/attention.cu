/* attention.cu - decode attention over the bf16 KV cache, grouped-query, split
 * over the context so that a long context still spreads over every SM.
 *
 * Block (kv head group, split, token): the query heads of one KV head (up to
 * ATT_MAXG of them share each key and value load) against positions
 * [c0, c1) of the keys token t may see (0 .. pos + t).  It writes the split's
 * partial result (max score, sum of exponentials, unnormalised weighted sum of
 * values); the last block of a (token, group) to finish folds the splits into
 * the output, so the combine needs no kernel of its own.  The splits are a
 * fixed count (the grid is captured once) of equal shares of the current
 * length, read from the device. */
#include <math.h>

#include "kie_kernels.h"

namespace {

__device__ __forceinline__ uint4 ld_nc(const void *p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void bf8(const uint4 w, float *f) {
  f[0] = __uint_as_float(w.x << 16);
  f[1] = __uint_as_float(w.x & 0xffff0000u);
  f[2] = __uint_as_float(w.y << 16);
  f[3] = __uint_as_float(w.y & 0xffff0000u);
  f[4] = __uint_as_float(w.z << 16);
  f[5] = __uint_as_float(w.z & 0xffff0000u);
  f[6] = __uint_as_float(w.w << 16);
  f[7] = __uint_as_float(w.w & 0xffff0000u);
}

__global__ void __launch_bounds__(ATT_THREADS) k_attention(const AttnArgs a) {
  extern __shared__ float4 smem4[];
  float *qs = reinterpret_cast<float *>(smem4);       /* [ATT_MAXG][hd] */
  float *sc = qs + ATT_MAXG * a.hd;                    /* [ATT_MAXG][chunk_max] scores, then weights */
  float *red = sc + ATT_MAXG * a.chunk_max;            /* [ATT_THREADS][ATT_MAXG * 8] partial sums */
  float *stat = red + ATT_THREADS * ATT_MAXG * 8;      /* [ATT_MAXG][2]: max, sum */
  __shared__ int last;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, hd = a.hd;
  const int kvh = blockIdx.x / a.hgroups, hg = blockIdx.x - kvh * a.hgroups;
  const int h0 = kvh * a.g + hg * a.gper;
  const int G = min(a.gper, a.g - hg * a.gper);
  const int split = blockIdx.y, t = blockIdx.z;

  kie_pdl_wait();
  kie_pdl_trigger();

  const int S = *a.pos + t + 1; /* keys 0 .. pos + t */
  const int len = (S + a.nsplit - 1) / a.nsplit;
  const int c0 = min(S, split * len), c1 = min(S, c0 + len), n = c1 - c0;
  const bf16 *K = a.kc + (size_t)kvh * a.max_seq * hd, *V = a.vc + (size_t)kvh * a.max_seq * hd;

  for (int i = tid; i < G * hd; i += ATT_THREADS) qs[i] = a.q[(size_t)t * a.q_ld + (size_t)h0 * hd + i];
  __syncthreads();

  /* Scores: hd / 8 lanes per key, each with one 16-byte load. */
  const int lpk = hd >> 3, kpw = 32 / lpk, sub = lane / lpk, sl = lane - sub * lpk;
  for (int base = c0 + warp * kpw; base < c1; base += (ATT_THREADS / 32) * kpw) {
    const int p = base + sub;
    float kf[8];
    if (p < c1) bf8(ld_nc(K + (size_t)p * hd + sl * 8), kf);
    else
      for (int i = 0; i < 8; i++) kf[i] = 0.f;
    float d[ATT_MAXG];
#pragma unroll
    for (int j = 0; j < ATT_MAXG; j++) {
      d[j] = 0.f;
      if (j < G) {
        const float4 qa = *reinterpret_cast<const float4 *>(qs + j * hd + sl * 8);
        const float4 qb = *reinterpret_cast<const float4 *>(qs + j * hd + sl * 8 + 4);
        d[j] = kf[0] * qa.x + kf[1] * qa.y + kf[2] * qa.z + kf[3] * qa.w + kf[4] * qb.x + kf[5] * qb.y +
               kf[6] * qb.z + kf[7] * qb.w;
      }
    }
    for (int off = lpk >> 1; off; off >>= 1)
#pragma unroll
      for (int j = 0; j < ATT_MAXG; j++) d[j] += __shfl_xor_sync(0xffffffffu, d[j], off);
    if (sl == 0 && p < c1)
#pragma unroll
      for (int j = 0; j < ATT_MAXG; j++)
        if (j < G) sc[j * a.chunk_max + (p - c0)] = d[j] * a.scale;
  }
  __syncthreads();

  /* Softmax pieces per head: a warp per head. */
  for (int j = warp; j < G; j += ATT_THREADS / 32) {
    float m = -INFINITY;
    for (int i = lane; i < n; i += 32) m = fmaxf(m, sc[j * a.chunk_max + i]);
    for (int off = 16; off; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float l = 0.f;
    for (int i = lane; i < n; i += 32) {
      const float e = expf(sc[j * a.chunk_max + i] - m);
      sc[j * a.chunk_max + i] = e;
      l += e;
    }
    for (int off = 16; off; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
    if (lane == 0) {
      stat[2 * j] = m;
      stat[2 * j + 1] = l;
    }
  }
  __syncthreads();

  /* Weighted values: thread (position group pg, 8 dims d8). */
  const int d8n = hd >> 3, d8 = tid % d8n, pg = tid / d8n, npg = ATT_THREADS / d8n;
  float acc[ATT_MAXG][8];
#pragma unroll
  for (int j = 0; j < ATT_MAXG; j++)
#pragma unroll
    for (int i = 0; i < 8; i++) acc[j][i] = 0.f;
  for (int p = c0 + pg; p < c1; p += npg) {
    float vf[8];
    bf8(ld_nc(V + (size_t)p * hd + d8 * 8), vf);
#pragma unroll
    for (int j = 0; j < ATT_MAXG; j++) {
      if (j < G) {
        const float e = sc[j * a.chunk_max + (p - c0)];
#pragma unroll
        for (int i = 0; i < 8; i++) acc[j][i] = fmaf(e, vf[i], acc[j][i]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < ATT_MAXG; j++)
    if (j < G)
#pragma unroll
      for (int i = 0; i < 8; i++) red[((size_t)pg * ATT_MAXG + j) * hd + d8 * 8 + i] = acc[j][i];
  __syncthreads();
  const size_t pstride = (size_t)hd + 2;
  for (int i = tid; i < G * hd; i += ATT_THREADS) {
    const int j = i / hd, dd = i - j * hd;
    float s = 0.f;
    for (int q = 0; q < npg; q++) s += red[((size_t)q * ATT_MAXG + j) * hd + dd];
    a.part[(((size_t)t * a.nh + h0 + j) * a.nsplit + split) * pstride + dd] = s;
  }
  if (tid < G) {
    float *pp = a.part + (((size_t)t * a.nh + h0 + tid) * a.nsplit + split) * pstride;
    pp[hd] = n > 0 ? stat[2 * tid] : -INFINITY;
    pp[hd + 1] = n > 0 ? stat[2 * tid + 1] : 0.f;
  }

  /* The last split block of this (token, group) combines. */
  __threadfence();
  __syncthreads();
  if (tid == 0) last = atomicAdd(&a.cnt[(size_t)t * gridDim.x + blockIdx.x], 1u) == (unsigned)a.nsplit - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  /* Split weights w[j][s] = exp(m_s - M_j), in the (now free) score area. */
  float *wgt = red; /* [ATT_MAXG][nsplit] */
  float *msum = stat; /* [ATT_MAXG][2]: M, L */
  for (int j = warp; j < G; j += ATT_THREADS / 32) {
    const float *pp = a.part + (((size_t)t * a.nh + h0 + j) * a.nsplit) * pstride;
    float M = -INFINITY;
    for (int s = lane; s < a.nsplit; s += 32) M = fmaxf(M, __ldcg(pp + s * pstride + hd));
    for (int off = 16; off; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    float L = 0.f;
    for (int s = lane; s < a.nsplit; s += 32) {
      const float l = __ldcg(pp + s * pstride + hd + 1);
      const float w = l > 0.f ? expf(__ldcg(pp + s * pstride + hd) - M) : 0.f;
      wgt[j * a.nsplit + s] = w;
      L += l * w;
    }
    for (int off = 16; off; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
    if (lane == 0) msum[2 * j + 1] = L;
  }
  __syncthreads();
  for (int i = tid; i < G * hd; i += ATT_THREADS) {
    const int j = i / hd, dd = i - j * hd;
    const float *pp = a.part + (((size_t)t * a.nh + h0 + j) * a.nsplit) * pstride + dd;
    const float *w = wgt + j * a.nsplit;
    float o = 0.f;
#pragma unroll 4
    for (int s = 0; s < a.nsplit; s++) o = fmaf(__ldcg(pp + s * pstride), w[s], o);
    a.out[(size_t)t * a.out_ld + (size_t)(h0 + j) * hd + dd] = o / msum[2 * j + 1];
  }
  if (tid == 0) a.cnt[(size_t)t * gridDim.x + blockIdx.x] = 0;
}

}  // namespace

size_t kie_attention_smem(int hd, int chunk_max) {
  return sizeof(float) * ((size_t)ATT_MAXG * hd + (size_t)ATT_MAXG * chunk_max + (size_t)ATT_THREADS * ATT_MAXG * 8 +
                          2 * ATT_MAXG);
}

cudaError_t kie_attention_attributes(size_t max_smem) {
  return cudaFuncSetAttribute(k_attention, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)max_smem);
}

cudaError_t kie_launch_attention(const AttnArgs &a, int T, size_t smem, cudaStream_t st, int pdl) {
  const dim3 grid((unsigned)(a.nh / a.g * a.hgroups), (unsigned)a.nsplit, (unsigned)T);
  return kie_launch(k_attention, grid, dim3(ATT_THREADS), smem, st, pdl, a);
}
