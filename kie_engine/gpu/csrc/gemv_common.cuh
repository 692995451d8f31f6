/* gemv_common.cuh - the GEMV's arithmetic and row mapping, shared by the
 * per-sublayer kernels (gemv.cu) and the monokernel (mono.cu) so that both
 * compute every output with the same operations in the same order. */
#ifndef KIE_GEMV_COMMON_CUH_
#define KIE_GEMV_COMMON_CUH_
#include <math.h>

#include "kie_kernels.h"

namespace kie {

__device__ __forceinline__ float bf_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ float dot8(const uint4 w, const float4 xa, const float4 xb, float acc) {
  acc = fmaf(bf_lo(w.x), xa.x, acc);
  acc = fmaf(bf_hi(w.x), xa.y, acc);
  acc = fmaf(bf_lo(w.y), xa.z, acc);
  acc = fmaf(bf_hi(w.y), xa.w, acc);
  acc = fmaf(bf_lo(w.z), xb.x, acc);
  acc = fmaf(bf_hi(w.z), xb.y, acc);
  acc = fmaf(bf_lo(w.w), xb.z, acc);
  acc = fmaf(bf_hi(w.w), xb.w, acc);
  return acc;
}

__device__ __forceinline__ float silu(float a) { return a * (0.5f + 0.5f * tanhf(0.5f * a)); }

/* Orders floats as unsigned ints; with the id in the low word (inverted), the
 * largest key is the largest value at the lowest id. */
__device__ __forceinline__ unsigned long long argmax_key(float v, int id) {
  unsigned u = __float_as_uint(v);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ((unsigned long long)u << 32) | (unsigned long long)(0xffffffffu - (unsigned)id);
}
__device__ __forceinline__ float argmax_value(unsigned long long key) {
  const unsigned u = (unsigned)(key >> 32);
  return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}

template <int EPI>
__device__ __forceinline__ int gemv_units(const GemvArgs &a) {
  if (EPI == EPI_SWIGLU) return a.cols;
  return (a.rows + 1) / 2; /* QKV: (nh + 2 nkv) * hd / 2, hd even */
}

/* The rows of unit u (r1 = -1: none). */
template <int EPI>
__device__ __forceinline__ void unit_rows(const GemvArgs &a, int u, int &r0, int &r1) {
  if (EPI == EPI_SWIGLU) {
    r0 = u;
    r1 = a.cols + u;
  } else if (EPI == EPI_QKV) {
    const int half = a.hd >> 1, nq = a.nh * half, nk = a.nkv * half;
    if (u < nq + nk) { /* q heads, then k heads: the pair (j, j + hd/2) of one head */
      const int h = u / half, j = u - h * half;
      r0 = h * a.hd + j;
      r1 = r0 + half;
    } else {           /* v: two neighbouring rows */
      r0 = (a.nh + a.nkv) * a.hd + 2 * (u - nq - nk);
      r1 = r0 + 1;
    }
  } else {
    r0 = 2 * u;
    r1 = 2 * u + 1 < a.rows ? 2 * u + 1 : -1;
  }
}

#define ROPE_MAX_HALF 128 /* head_dim / 2 at most (derive admits up to 256) */

/* The step's RoPE row (cos, then sin, of its one position) into shared memory, staged
 * with the input by the block's `nthreads` threads, so that the QKV epilogue of each
 * unit reads it there instead of making a round trip to memory per unit. */
__device__ __forceinline__ void stage_rope(const GemvArgs &a, float *cs, int tid, int nthreads) {
  const int half = a.hd >> 1, p = *a.pos;
  if (p >= a.max_seq) return; /* the epilogue reports it */
  for (int i = tid; i < half; i += nthreads) {
    cs[i] = a.cosv[(size_t)p * half + i];
    cs[half + i] = a.sinv[(size_t)p * half + i];
  }
}

/* LL words (the monokernel's kie_shape.mono_ll): an output element as one 8-byte word, its
 * float's bits below the step's tag, written in one access, so that a reader that sees the
 * tag sees the value, with no fence before a count and no count to poll. */
__device__ __forceinline__ unsigned long long ll_word(float v, unsigned tag) {
  return (unsigned long long)tag << 32 | __float_as_uint(v);
}
__device__ __forceinline__ void ll_put(unsigned long long *p, float v, unsigned tag) {
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(ll_word(v, tag)) : "memory");
}
/* Two neighbouring words in one 16-byte store (p 16-byte aligned); each word is written whole. */
__device__ __forceinline__ void ll_put2(unsigned long long *p, float x, float y, unsigned tag) {
  asm volatile("st.relaxed.gpu.global.v2.b64 [%0], {%1, %2};" ::"l"(p), "l"(ll_word(x, tag)), "l"(ll_word(y, tag))
               : "memory");
}

/* cs: stage_rope's row (one token), or NULL: the tables in memory.  LL (the monokernel, one
 * token): each output also as the LL word of its row at ll (when not NULL), tagged; a k or v
 * row's word carries the bf16 value the cache holds. */
template <int NT, bool LL = false>
__device__ __forceinline__ void epilogue_qkv(const GemvArgs &a, int u, int r0, const float *acc0,
                                             const float *acc1, int lane, const float *cs,
                                             unsigned long long *ll = nullptr, unsigned tag = 0) {
  const int half = a.hd >> 1, nq = a.nh * half, nk = a.nkv * half;
  const int pos = *a.pos;
#pragma unroll
  for (int t = 0; t < NT; t++) {
    if (lane != t || t >= a.T) continue;
    const int p = pos + t;
    if (p >= a.max_seq) {
      kie_set_error(a.ring, KIE_DERR_POS, p);
      continue;
    }
    const float v0 = acc0[t], v1 = acc1[t];
    if (u < nq + nk) {
      const int h = u / half, j = u - h * half;
      const float c = cs ? cs[j] : a.cosv[(size_t)p * half + j], s = cs ? cs[half + j] : a.sinv[(size_t)p * half + j];
      const float o0 = v0 * c - v1 * s, o1 = v1 * c + v0 * s;
      if (u < nq) {
        float *q = a.q_out + (size_t)t * a.q_ld + (size_t)h * a.hd;
        q[j] = o0;
        q[j + half] = o1;
        if (LL && ll) {
          ll_put(ll + r0, o0, tag);
          ll_put(ll + r0 + half, o1, tag);
        }
      } else {
        bf16 *k = a.kc + ((size_t)(h - a.nh) * a.max_seq + p) * a.hd;
        const bf16 k0 = __float2bfloat16_rn(o0), k1 = __float2bfloat16_rn(o1);
        k[j] = k0;
        k[j + half] = k1;
        if (LL && ll) {
          ll_put(ll + r0, __bfloat162float(k0), tag);
          ll_put(ll + r0 + half, __bfloat162float(k1), tag);
        }
      }
    } else {
      const int vr = r0 - (a.nh + a.nkv) * a.hd, h = vr / a.hd, j = vr - h * a.hd;
      bf16 *v = a.vc + ((size_t)h * a.max_seq + p) * a.hd;
      const bf16 w0 = __float2bfloat16_rn(v0), w1 = __float2bfloat16_rn(v1);
      v[j] = w0;
      v[j + 1] = w1;
      if (LL && ll) ll_put2(ll + r0, __bfloat162float(w0), __bfloat162float(w1), tag);
    }
  }
}

/* Barriers for the staging below: the whole block, or the named barrier of the
 * threads that take part (the monokernel's consumer warps). */
struct SyncBlock {
  __device__ void operator()() const { __syncthreads(); }
};
struct SyncNamed {
  int id, threads;
  __device__ void operator()() const { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory"); }
};

/* Staging loads float4s, STAGE_BATCH of them per thread in flight before any is
 * used: x comes from L2 and one load after another would cost a round trip each. */
#define STAGE_BATCH 8

__device__ __forceinline__ float4 f4_zero() { return make_float4(0.f, 0.f, 0.f, 0.f); }
__device__ __forceinline__ void f4_add(float4 &v, const float4 w) {
  v.x += w.x;
  v.y += w.y;
  v.z += w.z;
  v.w += w.w;
}
/* Elements 4 i .. 4 i + 3 at or past n become zero. */
__device__ __forceinline__ float4 f4_clip(float4 v, int i, int n) {
  if (4 * i + 0 >= n) v.x = 0.f;
  if (4 * i + 1 >= n) v.y = 0.f;
  if (4 * i + 2 >= n) v.z = 0.f;
  if (4 * i + 3 >= n) v.w = 0.f;
  return v;
}

/* x in shared memory: [T][ld], zero past `in`, staged by GEMV_THREADS threads.
 * Loads go through L2 (ld.cg): in the monokernel the producer of x is another
 * block of the same grid, whose writes this SM's L1 may not have seen.  x rows
 * (x_ld) and ld are multiples of 4 floats. */
__device__ __forceinline__ void stage_plain(const GemvArgs &a, float *xs, int tid) {
  const int n4 = a.ld >> 2;
  for (int t = 0; t < a.T; t++) {
    const float4 *src = reinterpret_cast<const float4 *>(a.x + (size_t)t * a.x_ld);
    float4 *dst = reinterpret_cast<float4 *>(xs + (size_t)t * a.ld);
    for (int i0 = tid; i0 < n4; i0 += GEMV_THREADS * STAGE_BATCH) {
      float4 v[STAGE_BATCH];
#pragma unroll
      for (int k = 0; k < STAGE_BATCH; k++) {
        const int i = i0 + k * GEMV_THREADS;
        v[k] = i < n4 && 4 * i < a.in ? __ldcg(src + i) : f4_zero();
      }
#pragma unroll
      for (int k = 0; k < STAGE_BATCH; k++) {
        const int i = i0 + k * GEMV_THREADS;
        if (i < n4) dst[i] = f4_clip(v[k], i, a.in);
      }
    }
  }
}

/* The norm's gamma into shared memory gs (ld floats) by cp.async, before the GEMV waits for
 * the previous kernel (gamma does not depend on it), so that no L2 round trip for it follows
 * the wait.  A thread copies the float4s that it reads in stage_norm, whose
 * cp.async.wait_all is then all it needs before reading them.  Past `in`: gamma's padding,
 * as stage_norm's loads from memory read it. */
__device__ __forceinline__ void stage_gamma_async(const GemvArgs &a, float *gs, int tid, int nthreads) {
  const int n4 = a.ld >> 2;
  for (int i = tid; i < n4; i += nthreads) {
    if (4 * i < a.in)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(gs + 4 * i)),
                   "l"(a.gamma + 4 * i)
                   : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

template <typename Sync>
__device__ __forceinline__ float block_sum(float v, float *red, int tid, Sync sync) {
  for (int off = 16; off; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = tid >> 5, lane = tid & 31;
  sync(); /* red may still be read by the previous call */
  if (lane == 0) red[warp] = v;
  sync();
  float s = 0.f;
  for (int w = 0; w < GEMV_WARPS; w++) s += red[w];
  return s;
}

/* x / root * gamma for the float4s of x at i (the same operations, element by element,
 * whichever path computes them). */
__device__ __forceinline__ float4 f4_norm(const float4 x, float root, const float4 g) {
  return make_float4(x.x / root * g.x, x.y / root * g.y, x.z / root * g.z, x.w / root * g.w);
}

/* The residual update and the RMSNorm, token by token; `writer`: this block
 * stores the updated residual (one block of the grid does).  Each thread sums
 * the squares of its float4s in order, then the block's sums meet in warp order.
 * Every global load is issued in batches before its values are used: a row of
 * up to GEMV_THREADS * STAGE_BATCH float4s stays in registers between the sum of
 * squares and the scaling, so the scaling costs one batch of gamma loads, not a
 * round trip per element.  CLK (the graph path's step clock): thread 0 marks its loads
 * landed and the block's sum done (KIE_CLK_LOADED, KIE_CLK_SUMMED). */
template <bool CLK = false, typename Sync>
__device__ void stage_norm(const GemvArgs &a, float *xs, int tid, bool writer, Sync sync, float *red,
                           const float *gs = nullptr) {
  const int hidden = a.in, n4 = a.ld >> 2;
  const bool in_regs = n4 <= GEMV_THREADS * STAGE_BATCH;
  /* gamma from memory, or from stage_gamma_async's copy (gs) */
  const float4 *g4 = reinterpret_cast<const float4 *>(gs ? gs : a.gamma);
  auto gamma4 = [&](int i) { return gs ? g4[i] : __ldg(g4 + i); };
  for (int t = 0; t < a.T; t++) {
    float ss = 0.f;
    const bf16 *erow = a.r_in ? nullptr : a.embed + (size_t)__ldcg(a.tokens + t) * a.ld;
    const size_t row = (size_t)t * a.r_ld;
    float4 *x4 = reinterpret_cast<float4 *>(xs + (size_t)t * a.ld);
    float4 v[STAGE_BATCH];
    for (int i0 = tid; i0 < n4; i0 += GEMV_THREADS * STAGE_BATCH) {
#pragma unroll
      for (int k = 0; k < STAGE_BATCH; k++) {
        const int i = i0 + k * GEMV_THREADS;
        v[k] = f4_zero();
        if (i < n4 && 4 * i < hidden) {
          if (a.r_in) {
            v[k] = __ldcg(reinterpret_cast<const float4 *>(a.r_in + row) + i);
          } else {
            const uint2 e = *reinterpret_cast<const uint2 *>(erow + 4 * (size_t)i);
            v[k] = make_float4(bf_lo(e.x), bf_hi(e.x), bf_lo(e.y), bf_hi(e.y));
          }
        }
      }
      for (int j = 0; j < a.nadd; j++) {
        float4 w[STAGE_BATCH];
#pragma unroll
        for (int k = 0; k < STAGE_BATCH; k++) {
          const int i = i0 + k * GEMV_THREADS;
          w[k] = i < n4 && 4 * i < hidden ? __ldcg(reinterpret_cast<const float4 *>(a.adds[j] + row) + i) : f4_zero();
        }
#pragma unroll
        for (int k = 0; k < STAGE_BATCH; k++) f4_add(v[k], w[k]);
      }
#pragma unroll
      for (int k = 0; k < STAGE_BATCH; k++) {
        const int i = i0 + k * GEMV_THREADS;
        if (i >= n4) continue;
        const float4 c = f4_clip(v[k], i, hidden);
        v[k] = c;
        if (a.r_out && writer && 4 * i < hidden) reinterpret_cast<float4 *>(a.r_out + row)[i] = c;
        if (!in_regs) x4[i] = c;
        ss = fmaf(c.x, c.x, ss);
        ss = fmaf(c.y, c.y, ss);
        ss = fmaf(c.z, c.z, ss);
        ss = fmaf(c.w, c.w, ss);
      }
    }
    if (CLK && t == 0) kie_clock_mark(a.clk, KIE_CLK_LOADED); /* thread 0's loads have landed */
    /* gamma's first batch is on its way while the block sums (it does not depend on the sum) */
    if (gs && t == 0) asm volatile("cp.async.wait_all;" ::: "memory");
    float4 g[STAGE_BATCH];
#pragma unroll
    for (int k = 0; k < STAGE_BATCH; k++) {
      const int i = tid + k * GEMV_THREADS;
      g[k] = i < n4 && 4 * i < hidden ? gamma4(i) : f4_zero();
    }
    const float ms = block_sum(ss, red, tid, sync) / (float)hidden;
    if (CLK && t == 0) kie_clock_mark(a.clk, KIE_CLK_SUMMED);
    const float root = sqrtf(ms + a.eps);
    if (in_regs) {
#pragma unroll
      for (int k = 0; k < STAGE_BATCH; k++) {
        const int i = tid + k * GEMV_THREADS;
        if (i < n4) x4[i] = f4_norm(v[k], root, g[k]);
      }
      continue;
    }
    for (int i0 = tid; i0 < n4; i0 += GEMV_THREADS * STAGE_BATCH) {
      if (i0 != tid)
#pragma unroll
        for (int k = 0; k < STAGE_BATCH; k++) {
          const int i = i0 + k * GEMV_THREADS;
          g[k] = i < n4 && 4 * i < hidden ? gamma4(i) : f4_zero();
        }
#pragma unroll
      for (int k = 0; k < STAGE_BATCH; k++) {
        const int i = i0 + k * GEMV_THREADS;
        if (i < n4) x4[i] = f4_norm(x4[i], root, g[k]);
      }
    }
  }
}

/* A unit's sums are done: its segments meet (fixed order), then the epilogue.
 * Called by every warp of the block (every consumer warp) the same number of
 * times; `part` is free for it (no warp still reads a previous call's).  EPI_RESID:
 * EPI_STORE with the residual's rows (a.r_in) added, r + y as stage_norm adds them; PRE:
 * token 0's (res0, res1) already loaded by the caller.  LL (the monokernel, one token): the
 * outputs also as LL words at ll (when not NULL), tagged (the LM head's: none). */
template <int NT, int EPI, bool PRE = false, bool LL = false, typename Sync>
__device__ __forceinline__ void finish_unit(const GemvArgs &a, int u, int r0, int r1, bool active, float *acc0,
                                            float *acc1, unsigned long long &best, float (*part)[2 * GEMV_MAX_T],
                                            int tid, Sync sync, const float *rope = nullptr, float res0 = 0.f,
                                            float res1 = 0.f, unsigned long long *ll = nullptr, unsigned tag = 0) {
  const int warp = tid >> 5, lane = tid & 31, segs = a.segs, seg = warp & (segs - 1);
#pragma unroll
  for (int t = 0; t < NT; t++) {
    for (int off = 16; off; off >>= 1) {
      acc0[t] += __shfl_xor_sync(0xffffffffu, acc0[t], off);
      acc1[t] += __shfl_xor_sync(0xffffffffu, acc1[t], off);
    }
  }
  if (segs > 1) {
    if (lane == 0)
#pragma unroll
      for (int t = 0; t < NT; t++) {
        part[warp][2 * t] = acc0[t];
        part[warp][2 * t + 1] = acc1[t];
      }
    sync();
    if (seg == 0) {
#pragma unroll
      for (int t = 0; t < NT; t++) {
        float s0 = part[warp][2 * t], s1 = part[warp][2 * t + 1];
        for (int q = 1; q < segs; q++) {
          s0 += part[warp + q][2 * t];
          s1 += part[warp + q][2 * t + 1];
        }
        acc0[t] = s0;
        acc1[t] = s1;
      }
    }
    sync();
  }
  if (!active || seg != 0) return;
  if (EPI == EPI_STORE || EPI == EPI_RESID) {
#pragma unroll
    for (int t = 0; t < NT; t++) {
      if (lane != t || t >= a.T) continue;
      float y0 = acc0[t], y1 = acc1[t];
      if (EPI == EPI_RESID) {
        const float *rr = a.r_in + (size_t)t * a.r_ld;
        y0 = (PRE && t == 0 ? res0 : __ldcg(rr + r0)) + y0;
        if (r1 >= 0) y1 = (PRE && t == 0 ? res1 : __ldcg(rr + r1)) + y1;
      }
      a.out[(size_t)t * a.out_ld + r0] = y0;
      if (r1 >= 0) a.out[(size_t)t * a.out_ld + r1] = y1;
      if (LL && ll) {
        ll_put(ll + r0, y0, tag);
        if (r1 >= 0) ll_put(ll + r1, y1, tag);
      }
    }
  } else if (EPI == EPI_SWIGLU) {
#pragma unroll
    for (int t = 0; t < NT; t++) {
      if (lane != t || t >= a.T) continue;
      const float y = silu(acc0[t]) * acc1[t];
      a.out[(size_t)t * a.out_ld + u] = y;
      if (LL && ll) ll_put(ll + u, y, tag);
    }
  } else if (EPI == EPI_QKV) {
    epilogue_qkv<NT, LL>(a, u, r0, acc0, acc1, lane, NT == 1 ? rope : nullptr, ll, tag);
  } else { /* EPI_HEAD: one token */
    if (lane == 0) {
      a.out[r0] = acc0[0];
      if (r1 >= 0) a.out[r1] = acc1[0];
      if (r0 < a.valid_rows) {
        const unsigned long long k0 = argmax_key(acc0[0], a.row_off + r0);
        if (k0 > best) best = k0;
      }
      if (r1 >= 0 && r1 < a.valid_rows) {
        const unsigned long long k1 = argmax_key(acc1[0], a.row_off + r1);
        if (k1 > best) best = k1;
      }
    }
  }
}

/* The LM head's candidate once `best` holds the grid's largest key: this lane's
 * (value, id) pair in cand, zero elsewhere, so that a sum over the lanes hands
 * every lane all of them. */
__device__ __forceinline__ void head_candidate(const GemvArgs &a, unsigned long long b) {
  for (int i = 0; i < 2 * a.tp; i++) a.cand[i] = 0.f;
  a.cand[a.rank] = b ? argmax_value(b) : -INFINITY;
  a.cand[a.tp + a.rank] = b ? (float)(0xffffffffu - (unsigned)(b & 0xffffffffu)) : 0.f;
}

}  // namespace kie
#endif
