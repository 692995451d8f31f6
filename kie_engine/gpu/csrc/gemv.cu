/* gemv.cu - y = W x for bf16 W (row-major (out, in)) and f32 x, f32 accumulation,
 * with the input and output work of a decode step fused in.
 *
 * Batch-1 decode is bound by streaming the weights, so the kernel is built
 * around that: each warp takes a unit of two rows and loads both with 16-byte
 * non-allocating loads, several per lane in flight before the first use, and
 * keeps x in shared memory (or, for a prefill pass too large for it, in L1).
 * Two rows per unit are also what the epilogues need: a RoPE pair (j, j + hd/2),
 * a gate row with its up row.
 *
 *   EPI_STORE   out[t][row] = y                  (o and down projections: the sublayer's partial sum)
 *   EPI_QKV     q rotated to q_out; k rotated and v to the bf16 cache at pos + t
 *   EPI_SWIGLU  out[t][j] = silu(gate_j) * up_j
 *   EPI_HEAD    logits to out; the argmax of the real rows (ties: lowest id) to cand
 *   EPI_RESID   out[t][row] = r_in[t][row] + y   (o and down at one lane, delay 0: the new residual)
 *
 * With x == NULL the input is the residual stream: the kernel adds the sums due
 * (the DTP schedule decides which), writes the updated residual (block 0) and
 * applies the RMSNorm before the product, so the norm costs no kernel of its own. */
#include <math.h>

#include "bulk_copy.cuh"
#include "gemv_common.cuh"

using namespace kie;

namespace {

/* A weight load: not kept in L1, with L2 cache policy `pol` (bulk_copy.cuh's l2_stream_policy). */
__device__ __forceinline__ uint4 ld_stream(const uint4 *p, uint64_t pol) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(pol));
  return v;
}

/* Asks L2 to fetch [p, p + bytes) (16-byte aligned, a multiple of 16). */
__device__ __forceinline__ void prefetch_l2(const void *p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

/* One batch: this lane's U vectors of rows r0, r1 from v0 (stride 32), if below ve. */
template <int U>
__device__ __forceinline__ void load_batch(const GemvArgs &a, int r0, int r1, int v0, int ve, uint4 *wa, uint4 *wb,
                                           uint64_t pol) {
  const uint4 *w0 = reinterpret_cast<const uint4 *>(a.w + (size_t)r0 * a.ld);
  const uint4 *w1 = reinterpret_cast<const uint4 *>(a.w + (size_t)(r1 >= 0 ? r1 : r0) * a.ld);
#pragma unroll
  for (int k = 0; k < U; k++) {
    const int v = v0 + k * 32;
    if (v < ve) {
      wa[k] = ld_stream(w0 + v, pol);
      wb[k] = ld_stream(w1 + v, pol);
    }
  }
}

template <int NT, int XS, int U>
__device__ __forceinline__ void use_batch(const GemvArgs &a, const float *xsrc, int xld, int v0, int ve,
                                          const uint4 *wa, const uint4 *wb, float *acc0, float *acc1) {
#pragma unroll
  for (int k = 0; k < U; k++) {
    const int v = v0 + k * 32;
    if (v < ve) {
#pragma unroll
      for (int t = 0; t < NT; t++) {
        if (NT > 1 && t >= a.T) break;
        const float4 *xp = reinterpret_cast<const float4 *>(xsrc + (size_t)t * xld + (size_t)v * 8);
        const float4 xa = XS ? xp[0] : __ldg(xp), xb = XS ? xp[1] : __ldg(xp + 1);
        acc0[t] = dot8(wa[k], xa, xb, acc0[t]);
        acc1[t] = dot8(wb[k], xa, xb, acc1[t]);
      }
    }
  }
}

/* Work: units (two rows) x segs segments of the input (a power of two <= 8
 * warps per unit, chosen by the host so that a warp's share of a unit is about
 * one batch of loads).  The block walks its units in lockstep, GEMV_WARPS / segs
 * units per round; the segments' partial sums meet in shared memory in a fixed
 * order, so results do not depend on timing.  PIPE (when every share is one
 * batch): the next round's batch is loaded before this round's is used, so a
 * warp always has loads in flight.  CLK (the step clock, a.clk): thread 0 marks the
 * block's times as it passes them; a kernel of its own, so that the hot kernels carry
 * none of it (they sit at their register cap, where any state kept live through the loop
 * costs loads in flight). */
template <int NT, int XS, int EPI, int U, int PIPE, bool CLK>
__global__ void __launch_bounds__(GEMV_THREADS) k_gemv(const GemvArgs a) {
  extern __shared__ float4 smem4[];
  __shared__ float part[GEMV_WARPS][2 * GEMV_MAX_T];
  float *xs = reinterpret_cast<float *>(smem4);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int units = gemv_units<EPI>(a), segs = a.segs, upb = GEMV_WARPS / segs, stride = gridDim.x * upb;
  const int seg = warp & (segs - 1), slot = warp / segs;
  const int nvec = a.ld >> 3, seg_vecs = (nvec + segs - 1) / segs;
  const int vb = min(nvec, seg * seg_vecs), ve = min(nvec, vb + seg_vecs);

  if (CLK) kie_clock_mark(a.clk, KIE_CLK_START);
  /* The weights do not depend on the previous kernel: start on them while it
   * still runs (an L2 prefetch of this warp's first segment, or its first batch
   * of loads into registers), so HBM stays busy across the kernel boundary. */
  uint4 wa[U], wb[U], na[U], nb[U];
  const uint64_t pol = l2_stream_policy(a.l2_first);
  int ub = blockIdx.x * upb;
  bool preloaded = false;
  /* RES (EPI_RESID in the pipelined loop): the residual rows that this warp's
   * lane 0 adds to its unit's sums, loaded with the round's weights.  The residual is two
   * kernels old or more, complete before this kernel starts, so the first round's rows
   * load before the wait as well. */
  const bool RES = PIPE && NT == 1 && EPI == EPI_RESID && lane == 0 && seg == 0;
  float res0 = 0.f, res1 = 0.f, nres0 = 0.f, nres1 = 0.f;
  if (ub + slot < units && (a.prefetch || PIPE)) {
    int r0, r1;
    unit_rows<EPI>(a, ub + slot, r0, r1);
    if (RES) {
      res0 = __ldcg(a.r_in + r0);
      if (r1 >= 0) res1 = __ldcg(a.r_in + r1);
    }
    if (a.prefetch == 1 && !PIPE) {
      if (lane < 2 && (lane == 0 || r1 >= 0) && ve > vb)
        prefetch_l2(a.w + (size_t)(lane == 0 ? r0 : r1) * a.ld + (size_t)vb * 8, (uint32_t)(ve - vb) * 16u);
    } else {
      load_batch<U>(a, r0, r1, vb + lane, ve, wa, wb, pol);
      preloaded = true;
    }
  }
  /* What else does not depend on the previous kernel (a.early): the norm's gamma, copied
   * asynchronously after x, and QKV's RoPE row. */
  __shared__ float rope[EPI == EPI_QKV && NT == 1 ? 2 * ROPE_MAX_HALF : 1];
  float *gs = XS && a.x == nullptr && (a.early & EARLY_GAMMA) ? xs + (size_t)a.T * a.ld : nullptr;
  if (gs) stage_gamma_async(a, gs, threadIdx.x, GEMV_THREADS);
  if (EPI == EPI_QKV && NT == 1 && XS && (a.early & EARLY_ROPE)) stage_rope(a, rope, threadIdx.x, GEMV_THREADS);
  /* trigger_early (the o GEMV, kie_shape.o_trigger_early): the next kernel may launch while
   * this one still waits, so that its blocks start their loads where SMs have room. */
  if (a.trigger_early) kcclDevPdlTrigger();
  kcclDevPdlWait();
  if (!a.trigger_early) kcclDevPdlTrigger();
  if (CLK) kie_clock_mark(a.clk, KIE_CLK_WAITED);

  if (XS) {
    __shared__ float red[GEMV_WARPS];
    if (EPI == EPI_QKV && NT == 1 && !(a.early & EARLY_ROPE)) stage_rope(a, rope, threadIdx.x, GEMV_THREADS);
    if (a.x) stage_plain(a, xs, threadIdx.x);
    else stage_norm<CLK>(a, xs, threadIdx.x, blockIdx.x == 0, SyncBlock(), red, gs);
    __syncthreads();
  }
  if (CLK) kie_clock_mark(a.clk, KIE_CLK_STAGED);
  const float *cs = EPI == EPI_QKV && NT == 1 && XS ? rope : nullptr;
  const float *xsrc = XS ? xs : a.x;
  const int xld = XS ? a.ld : a.x_ld;
  unsigned long long best = 0; /* EPI_HEAD: this lane's best key */

  if (PIPE) {
    for (; ub < units; ub += stride) {
      const int u = ub + slot;
      const bool active = u < units;
      int r0 = 0, r1 = -1;
      if (active) unit_rows<EPI>(a, u, r0, r1);
      if (ub + stride + slot < units) { /* the next round's batch, in flight during this one */
        int n0, n1;
        unit_rows<EPI>(a, ub + stride + slot, n0, n1);
        load_batch<U>(a, n0, n1, vb + lane, ve, na, nb, pol);
        if (RES) {
          nres0 = __ldcg(a.r_in + n0);
          if (n1 >= 0) nres1 = __ldcg(a.r_in + n1);
        }
      }
      float acc0[NT], acc1[NT];
#pragma unroll
      for (int t = 0; t < NT; t++) acc0[t] = acc1[t] = 0.f;
      if (active) use_batch<NT, XS, U>(a, xsrc, xld, vb + lane, ve, wa, wb, acc0, acc1);
      finish_unit<NT, EPI, PIPE != 0>(a, u, r0, r1, active, acc0, acc1, best, part, threadIdx.x, SyncBlock(), cs, res0,
                                      res1);
      res0 = nres0;
      res1 = nres1;
#pragma unroll
      for (int k = 0; k < U; k++) {
        wa[k] = na[k];
        wb[k] = nb[k];
      }
    }
  } else {
    for (; ub < units; ub += stride) {
      const int u = ub + slot;
      const bool active = u < units;
      int r0 = 0, r1 = -1;
      float acc0[NT], acc1[NT];
#pragma unroll
      for (int t = 0; t < NT; t++) acc0[t] = acc1[t] = 0.f;
      if (active) {
        unit_rows<EPI>(a, u, r0, r1);
        for (int v0 = vb + lane; v0 < ve; v0 += 32 * U) {
          if (!preloaded) load_batch<U>(a, r0, r1, v0, ve, wa, wb, pol);
          preloaded = false;
          use_batch<NT, XS, U>(a, xsrc, xld, v0, ve, wa, wb, acc0, acc1);
        }
      }
      preloaded = false;
      finish_unit<NT, EPI>(a, u, r0, r1, active, acc0, acc1, best, part, threadIdx.x, SyncBlock(), cs);
    }
  }

  if (EPI == EPI_HEAD) {
    /* Block best, then the grid's through one atomic; the last block to finish
     * writes this lane's candidate (value, id) and clears the slots for the next
     * step.  cand has a pair per lane, zero but this lane's, so that a sum over
     * the lanes hands every lane all of them. */
    __shared__ unsigned long long sbest[GEMV_WARPS];
    __shared__ int last;
    if (lane == 0) sbest[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long b = 0;
      for (int w = 0; w < GEMV_WARPS; w++) b = sbest[w] > b ? sbest[w] : b;
      if (b) atomicMax(a.amax, b);
      __threadfence();
      last = atomicAdd(a.cnt, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last && threadIdx.x == 0) {
      __threadfence();
      head_candidate(a, atomicExch(a.amax, 0ull));
      *a.cnt = 0;
    }
  }
  if (CLK) kie_clock_mark(a.clk, KIE_CLK_END);
}

template <int NT, int XS, int U, int PIPE, bool CLK>
cudaError_t launch_epi(const GemvArgs &a, int epi, int grid, size_t smem, cudaStream_t st, int pdl) {
  const dim3 g(grid), b(GEMV_THREADS);
  switch (epi) {
    case EPI_STORE: return kcclLaunch(k_gemv<NT, XS, EPI_STORE, U, PIPE, CLK>, g, b, smem, st, pdl, a);
    case EPI_RESID: return kcclLaunch(k_gemv<NT, XS, EPI_RESID, U, PIPE, CLK>, g, b, smem, st, pdl, a);
    case EPI_QKV: return kcclLaunch(k_gemv<NT, XS, EPI_QKV, U, PIPE, CLK>, g, b, smem, st, pdl, a);
    case EPI_SWIGLU: return kcclLaunch(k_gemv<NT, XS, EPI_SWIGLU, U, PIPE, CLK>, g, b, smem, st, pdl, a);
    case EPI_HEAD: return kcclLaunch(k_gemv<1, XS, EPI_HEAD, U, PIPE, CLK>, g, b, smem, st, pdl, a);
  }
  return cudaErrorInvalidValue;
}

/* One token's launch: with or without the step clock. */
template <int XS, int U, int PIPE>
cudaError_t launch_one(const GemvArgs &a, int epi, int grid, size_t smem, cudaStream_t st, int pdl) {
  return a.clk ? launch_epi<1, XS, U, PIPE, true>(a, epi, grid, smem, st, pdl)
               : launch_epi<1, XS, U, PIPE, false>(a, epi, grid, smem, st, pdl);
}

template <int NT, int XS, int U, int PIPE, bool CLK>
cudaError_t set_attr(size_t max_smem, int carveout) {
  cudaError_t e = cudaSuccess;
  const int v = (int)max_smem, c = carveout > 0 ? carveout : (int)cudaSharedmemCarveoutDefault;
  auto set = [&](auto k) {
    if (e == cudaSuccess) e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, v);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, c);
  };
  set(k_gemv<NT, XS, EPI_STORE, U, PIPE, CLK>);
  set(k_gemv<NT, XS, EPI_RESID, U, PIPE, CLK>);
  set(k_gemv<NT, XS, EPI_QKV, U, PIPE, CLK>);
  set(k_gemv<NT, XS, EPI_SWIGLU, U, PIPE, CLK>);
  set(k_gemv<1, XS, EPI_HEAD, U, PIPE, CLK>);
  return e;
}

__global__ void k_fill_random(bf16 *p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 0x2c1b3c6du;
    h ^= h >> 12;
    h *= 0x297a2d39u;
    h ^= h >> 15;
    p[i] = __float2bfloat16_rn(((float)(h >> 8) * (1.0f / 16777216.0f) - 0.5f) * scale);
  }
}

}  // namespace

cudaError_t kie_launch_gemv(const GemvArgs &a, int epi, int xs, int grid, size_t smem, cudaStream_t st, int pdl) {
  if (a.T > 1) return xs ? launch_epi<GEMV_MAX_T, 1, 2, 0, false>(a, epi, grid, smem, st, pdl)
                         : launch_epi<GEMV_MAX_T, 0, 2, 0, false>(a, epi, grid, smem, st, pdl);
  if (a.pipe) return xs ? launch_one<1, 4, 1>(a, epi, grid, smem, st, pdl) : launch_one<0, 4, 1>(a, epi, grid, smem, st, pdl);
  if (a.u == 4) return xs ? launch_one<1, 4, 0>(a, epi, grid, smem, st, pdl) : launch_one<0, 4, 0>(a, epi, grid, smem, st, pdl);
  return xs ? launch_one<1, 8, 0>(a, epi, grid, smem, st, pdl) : launch_one<0, 8, 0>(a, epi, grid, smem, st, pdl);
}

cudaError_t kie_gemv_attributes(size_t max_smem, int carveout) {
  cudaError_t e = cudaSuccess;
  if (e == cudaSuccess) e = set_attr<1, 1, 8, 0, false>(max_smem, carveout);
  if (e == cudaSuccess) e = set_attr<1, 1, 4, 0, false>(max_smem, carveout);
  if (e == cudaSuccess) e = set_attr<1, 1, 4, 1, false>(max_smem, carveout);
  if (e == cudaSuccess) e = set_attr<1, 1, 8, 0, true>(max_smem, carveout);
  if (e == cudaSuccess) e = set_attr<1, 1, 4, 0, true>(max_smem, carveout);
  if (e == cudaSuccess) e = set_attr<1, 1, 4, 1, true>(max_smem, carveout);
  if (e == cudaSuccess) e = set_attr<GEMV_MAX_T, 1, 2, 0, false>(max_smem, carveout);
  return e;
}

cudaError_t kie_launch_fill_random(bf16 *p, size_t n, uint32_t seed, float scale, cudaStream_t st) {
  k_fill_random<<<1024, 256, 0, st>>>(p, n, seed, scale);
  return cudaGetLastError();
}
