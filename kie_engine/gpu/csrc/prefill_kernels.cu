/* prefill_kernels.cu - the row-wise kernels of a batched prefill pass (prefill.cu):
 * the matrix products are cuBLAS GEMMs on bf16 activations (blas.cu), and these
 * kernels prepare their inputs and take their outputs, one row per token:
 *
 *   k_pf_norm    the residual plus the sums due -> residual; its RMSNorm * gamma -> bf16
 *                (a block a row)
 *   k_pf_rope    the QKV product (f32): q rotated -> bf16 queries; k rotated and v -> the
 *                bf16 KV cache at pos + t (decode reads the same cache); a pair a thread
 *   k_pf_swiglu  silu(gate) * up of the gate/up product -> bf16
 *
 * Each computes what the decode step's fused epilogues compute, with the same
 * formulas, on a whole chunk of tokens at once. */
#include <math.h>

#include "gemv_common.cuh"

using namespace kie;

namespace {

#define PF_THREADS 256

__device__ __forceinline__ float block_sum_pf(float v, float *red) {
  for (int off = 16; off; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float s = 0.f;
  for (int w = 0; w < PF_THREADS / 32; w++) s += red[w];
  return s;
}

/* A block a row, each thread a float4 at a time, B of them in flight. */
__global__ void __launch_bounds__(PF_THREADS) k_pf_norm(const PfNormArgs a) {
  constexpr int TPR = PF_THREADS, B = 4;
  kcclDevPdlWait();
  __shared__ float red[PF_THREADS / 32];
  const int lt = threadIdx.x, t = blockIdx.x, n4 = a.ld >> 2;
  const size_t row = (size_t)t * a.ld;
  const bf16 *erow = a.r_in ? nullptr : a.embed + (size_t)a.tokens[t] * a.ld;
  /* the residual is written back only when it changes (the embedding, or sums added) */
  const bool write = a.r_out && (a.r_out != a.r_in || a.nadd > 0 || a.add16);
  float ss = 0.f;
  /* the row is read twice (sum of squares, then scaling) only past B * TPR float4s */
  float4 keep[B];
  for (int i0 = lt, pass = 0; i0 < n4; i0 += B * TPR, pass++) {
    float4 v[B];
#pragma unroll
    for (int k = 0; k < B; k++) {
      const int i = i0 + k * TPR;
      v[k] = f4_zero();
      if (i < n4 && 4 * i < a.hidden) {
        if (a.r_in) {
          v[k] = reinterpret_cast<const float4 *>(a.r_in + row)[i];
        } else {
          const uint2 e = *reinterpret_cast<const uint2 *>(erow + 4 * (size_t)i);
          v[k] = make_float4(bf_lo(e.x), bf_hi(e.x), bf_lo(e.y), bf_hi(e.y));
        }
      }
    }
    for (int j = 0; j < a.nadd; j++) {
#pragma unroll
      for (int k = 0; k < B; k++) {
        const int i = i0 + k * TPR;
        if (i < n4 && 4 * i < a.hidden) f4_add(v[k], reinterpret_cast<const float4 *>(a.adds[j] + row)[i]);
      }
    }
    if (a.add16)
#pragma unroll
      for (int k = 0; k < B; k++) {
        const int i = i0 + k * TPR;
        if (i < n4 && 4 * i < a.hidden) {
          const uint2 s = *reinterpret_cast<const uint2 *>(a.add16 + row + 4 * (size_t)i);
          f4_add(v[k], make_float4(bf_lo(s.x), bf_hi(s.x), bf_lo(s.y), bf_hi(s.y)));
        }
      }
#pragma unroll
    for (int k = 0; k < B; k++) {
      const int i = i0 + k * TPR;
      if (i >= n4) continue;
      const float4 c = f4_clip(v[k], i, a.hidden);
      if (write && 4 * i < a.hidden) reinterpret_cast<float4 *>(a.r_out + row)[i] = c;
      if (pass == 0) keep[k] = c;
      ss = fmaf(c.x, c.x, ss);
      ss = fmaf(c.y, c.y, ss);
      ss = fmaf(c.z, c.z, ss);
      ss = fmaf(c.w, c.w, ss);
    }
  }
  ss = block_sum_pf(ss, red);
  const float root = sqrtf(ss / (float)a.hidden + a.eps);
  const float4 *g4 = reinterpret_cast<const float4 *>(a.gamma);
  for (int i0 = lt, pass = 0; i0 < n4; i0 += B * TPR, pass++) {
#pragma unroll
    for (int k = 0; k < B; k++) {
      const int i = i0 + k * TPR;
      if (i >= n4) continue;
      float4 c = keep[k];
      if (pass > 0) { /* a row longer than the registers hold: read back what this thread wrote */
        c = f4_zero();
        if (4 * i < a.hidden) c = f4_clip(reinterpret_cast<const float4 *>((write ? a.r_out : a.r_in) + row)[i], i, a.hidden);
      }
      const float4 g = 4 * i < a.hidden ? g4[i] : f4_zero();
      const float4 x = f4_norm(c, root, g);
      __nv_bfloat162 *dst = reinterpret_cast<__nv_bfloat162 *>(a.x + (size_t)t * a.x_ld + 4 * (size_t)i);
      dst[0] = __floats2bfloat162_rn(x.x, x.y);
      dst[1] = __floats2bfloat162_rn(x.z, x.w);
    }
  }
}

/* Row t's position, or -1 (and the error raised) past the cache */
__device__ __forceinline__ int rope_position(const PfRopeArgs &a, int t) {
  const int p = *a.pos + t;
  if (p < a.max_seq) return p;
  if (threadIdx.x == 0) kie_set_error(a.ring, KIE_DERR_POS, p);
  return -1;
}

/* One block per token row: RoPE pairs (j, j + hd/2) of q and k, and v pairs. */
__global__ void __launch_bounds__(PF_THREADS) k_pf_rope(const PfRopeArgs a) {
  kcclDevPdlWait();
  const int t = blockIdx.x, half = a.hd >> 1, nq = a.nh * half, nk = a.nkv * half;
  const int units = nq + nk + a.nkv * half;
  const int p = rope_position(a, t);
  if (p < 0) return;
  const float *y = a.y + (size_t)t * a.y_ld;
  for (int u = threadIdx.x; u < units; u += PF_THREADS) {
    if (u < nq + nk) {
      const int h = u / half, j = u - h * half;
      const float v0 = y[h * a.hd + j], v1 = y[h * a.hd + j + half];
      const float c = a.cosv[(size_t)p * half + j], s = a.sinv[(size_t)p * half + j];
      const float o0 = v0 * c - v1 * s, o1 = v1 * c + v0 * s;
      if (u < nq) {
        bf16 *q = a.q + (size_t)t * a.q_ld + (size_t)h * a.hd;
        q[j] = __float2bfloat16_rn(o0);
        q[j + half] = __float2bfloat16_rn(o1);
      } else {
        bf16 *k = a.kc + ((size_t)(h - a.nh) * a.max_seq + p) * a.hd;
        k[j] = __float2bfloat16_rn(o0);
        k[j + half] = __float2bfloat16_rn(o1);
      }
    } else {
      const int vr = 2 * (u - nq - nk), h = vr / a.hd, j = vr - h * a.hd;
      const float *yv = y + (a.nh + a.nkv) * a.hd + vr;
      bf16 *v = a.vc + ((size_t)h * a.max_seq + p) * a.hd;
      *reinterpret_cast<__nv_bfloat162 *>(v + j) = __floats2bfloat162_rn(yv[0], yv[1]);
    }
  }
}

__device__ __forceinline__ uint32_t swiglu2(uint32_t g, uint32_t u) {
  const float2 gg = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&g));
  const float2 uu = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u));
  const __nv_bfloat162 r = __floats2bfloat162_rn(silu(gg.x) * uu.x, silu(gg.y) * uu.y);
  return *reinterpret_cast<const uint32_t *>(&r);
}

/* act[t][c] = silu(gate) * up, gate and up the bf16 columns c and cols + c of gu: eight
 * columns a thread (16-byte loads and stores), where the rows' alignment allows it. */
__global__ void __launch_bounds__(PF_THREADS) k_pf_swiglu8(const PfSwigluArgs a) {
  kcclDevPdlWait();
  const int t = blockIdx.y;
  const uint4 *g = reinterpret_cast<const uint4 *>(a.gu + (size_t)t * a.gu_ld);
  const uint4 *u = reinterpret_cast<const uint4 *>(a.gu + (size_t)t * a.gu_ld + a.cols);
  uint4 *o = reinterpret_cast<uint4 *>(a.act + (size_t)t * a.act_ld);
  for (int c = blockIdx.x * PF_THREADS + threadIdx.x; c < a.cols / 8; c += PF_THREADS * gridDim.x) {
    const uint4 gg = g[c], uu = u[c];
    o[c] = make_uint4(swiglu2(gg.x, uu.x), swiglu2(gg.y, uu.y), swiglu2(gg.z, uu.z), swiglu2(gg.w, uu.w));
  }
}

/* act[t][c] = silu(gate) * up, gate and up the bf16 columns c and cols + c of gu. */
__global__ void __launch_bounds__(PF_THREADS) k_pf_swiglu(const PfSwigluArgs a) {
  kcclDevPdlWait();
  const int t = blockIdx.y;
  const bf16 *g = a.gu + (size_t)t * a.gu_ld;
  const bool pairs = (a.cols & 1) == 0; /* the up columns start 4-byte aligned */
  for (int c = 2 * (blockIdx.x * PF_THREADS + threadIdx.x); c < a.cols; c += 2 * PF_THREADS * gridDim.x) {
    if (pairs) {
      const float2 gg = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(g + c));
      const float2 uu = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(g + a.cols + c));
      *reinterpret_cast<__nv_bfloat162 *>(a.act + (size_t)t * a.act_ld + c) =
          __floats2bfloat162_rn(silu(gg.x) * uu.x, silu(gg.y) * uu.y);
    } else {
      for (int k = c; k < c + 2 && k < a.cols; k++)
        a.act[(size_t)t * a.act_ld + k] =
            __float2bfloat16_rn(silu(__bfloat162float(g[k])) * __bfloat162float(g[a.cols + k]));
    }
  }
}

}  // namespace

cudaError_t kie_launch_pf_norm(const PfNormArgs &a, cudaStream_t st, int pdl) {
  return kcclLaunch(k_pf_norm, dim3((unsigned)a.T), dim3(PF_THREADS), 0, st, pdl, a);
}

cudaError_t kie_launch_pf_rope(const PfRopeArgs &a, cudaStream_t st, int pdl) {
  return kcclLaunch(k_pf_rope, dim3((unsigned)a.T), dim3(PF_THREADS), 0, st, pdl, a);
}

cudaError_t kie_launch_pf_swiglu(const PfSwigluArgs &a, cudaStream_t st, int pdl) {
  if (a.cols % 8 == 0 && a.gu_ld % 8 == 0 && a.act_ld % 8 == 0) { /* 16-byte aligned rows */
    const int per_row = (a.cols / 8 + PF_THREADS - 1) / PF_THREADS;
    return kcclLaunch(k_pf_swiglu8, dim3((unsigned)per_row, (unsigned)a.T), dim3(PF_THREADS), 0, st, pdl, a);
  }
  const int per_row = (a.cols + 2 * PF_THREADS - 1) / (2 * PF_THREADS);
  return kcclLaunch(k_pf_swiglu, dim3((unsigned)per_row, (unsigned)a.T), dim3(PF_THREADS), 0, st, pdl, a);
}
