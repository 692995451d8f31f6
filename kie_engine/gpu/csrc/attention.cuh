/* attention.cuh - decode attention over the bf16 KV cache, grouped-query, split
 * over the context so that a long context still spreads over the SMs.
 *
 * Item (KV head group, split, token): the query heads of one KV head (up to
 * ATT_MAXG of them) against positions [c0, c1) of the keys token t may see
 * (0 .. pos + t).  The context is cut into as many splits as give each at least
 * `min_chunk` keys (at most `nsplit`, the grid's count, fixed when the graph is
 * captured; the rest of the items end at once).  An item (ATT_THREADS threads)
 * walks its keys in tiles of ATT_TILE with an online softmax.  One split writes
 * the output itself; otherwise each writes a partial result (max score, sum of
 * exponentials, weighted sum of values) and the last one of a (token, group) to
 * finish folds them together.
 *
 * The work is laid out so that an item is a short chain of memory round trips
 * and each thread holds little: a score is one thread's whole dot product of a
 * query head with a key row (the query from shared memory, broadcast; no
 * shuffles; the key row from L2 or L1, once per query head of the group), and a
 * value chunk (DV dims of one head) is one thread's sum over a share of the
 * tile's keys, read from shared memory, where the tile's values are copied
 * (cp.async) while its scores are computed. */
#ifndef KIE_ATTENTION_CUH_
#define KIE_ATTENTION_CUH_
#include <math.h>

#include "gemv_common.cuh"

namespace kie {


#define ATT_TILE 64 /* keys per tile */
#define ATT_DV 4     /* dims of a value chunk: one 8-byte load of bf16 */

/* Value chunks a thread sums at most (all ATT_MAXG heads of a group). */
template <int HD>
struct AttShape {
  static constexpr int KV8 = HD / 8;                                              /* 16-byte loads per key row */
  static constexpr int KB = KV8 < 16 ? KV8 : 16;                                  /* of them in flight at once */
  static constexpr int PPT = (ATT_MAXG * ATT_TILE + ATT_THREADS - 1) / ATT_THREADS; /* scores per thread */
  static constexpr int CPT = (ATT_MAXG * HD / ATT_DV + ATT_THREADS - 1) / ATT_THREADS; /* value chunks per thread */
  static constexpr int VB = 8;                                                     /* value loads in flight */
};

/* One (head group, split) item's shared memory. */
template <int HD>
struct __align__(16) AttSmem { /* 16: the queries are read as float4, and items sit side by side */
  float qs[ATT_MAXG * HD];
  float sc[ATT_MAXG * ATT_TILE];
  float red[ATT_THREADS * ATT_DV]; /* the key phases' value sums (when a chunk has several threads) */
  bf16 vs[ATT_TILE * HD];          /* the tile's value rows, copied in while the scores are computed */
  float m_run[ATT_MAXG], l_run[ATT_MAXG], fac[ATT_MAXG], big_m[ATT_MAXG], big_l[ATT_MAXG];
  int last;
};

/* A group's output is complete: count it (the monokernel's stage counter). */
template <typename Sync>
__device__ __forceinline__ void att_signal(unsigned *signal, int tid, Sync sync) {
  if (!signal) return;
  sync();
  if (tid == 0) {
    __threadfence();
    atomicAdd(signal, 1u);
  }
}

/* A key or value load: through the non-coherent path when the cache was written
 * by an earlier kernel, through L2 (CG) when by another block of this grid. */
template <bool CG>
__device__ __forceinline__ uint4 ld_kv(const void *p) {
  uint4 v;
  if (CG)
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void att_cp16(void *dst, const void *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
}

__device__ __forceinline__ void att_clock(unsigned long long *at) { *at = kie_gtime(); }

/* f(ci, j, dd) for each value chunk ci of thread tid (chunk c = tid + ci * NTHREADS, below
 * nch): head j of the group, dims dd .. dd + ATT_DV - 1. */
template <int HD, int CPT, int NTHREADS, typename F>
__device__ __forceinline__ void att_each_chunk(int tid, int nch, F f) {
#pragma unroll
  for (int ci = 0; ci < CPT; ci++) {
    const int c = tid + ci * NTHREADS;
    if (c >= nch) continue;
    const int j = c / (HD / ATT_DV), dd = (c - j * (HD / ATT_DV)) * ATT_DV;
    f(ci, j, dd);
  }
}

/* The key phases of a chunk (R > 1: R threads a chunk, thread r the keys r, r + R, ...) meet
 * in phase order: phase 0's threads hold the sums.  vthread: this thread has a phase. */
template <typename Sync>
__device__ __forceinline__ void att_phase_sum(float (&acc)[ATT_DV], float *red, int tid, int r, int R, int nch,
                                              bool vthread, Sync sync) {
  if (vthread)
#pragma unroll
    for (int i = 0; i < ATT_DV; i++) red[tid * ATT_DV + i] = acc[i];
  sync();
  if (r == 0)
    for (int q = 1; q < R; q++)
#pragma unroll
      for (int i = 0; i < ATT_DV; i++) acc[i] += red[(tid + q * nch) * ATT_DV + i];
}

/* A split's partial result in a.part: HD sums, its maximum m and sum l, and two floats of
 * padding that keep every split's row 16 bytes aligned (the host sizes a.part by it). */
template <int HD>
__host__ __device__ constexpr int att_part_stride() {
  return HD + 4;
}

/* A split's partial result into a.part (the owners of the chunks: phase 0): each chunk's sums
 * unscaled, and per head its maximum m and sum l. */
template <int HD, int CPT, int NTHREADS>
__device__ __forceinline__ void att_store_part(const AttnArgs &a, int t, int h0, int G, int split, int tid, int nch,
                                               bool owner, const float (&acc)[CPT][ATT_DV], const float *m,
                                               const float *l) {
  const size_t pstride = att_part_stride<HD>();
  if (owner)
    att_each_chunk<HD, CPT, NTHREADS>(tid, nch, [&](int ci, int j, int dd) {
      float *pp = a.part + (((size_t)t * a.nh + h0 + j) * a.nsplit + split) * pstride + dd; /* 8-byte aligned */
#pragma unroll
      for (int i = 0; i < ATT_DV; i++) pp[i] = acc[ci][i];
    });
  if (tid < G) {
    float *pp = a.part + (((size_t)t * a.nh + h0 + tid) * a.nsplit + split) * pstride;
    pp[HD] = m[tid];
    pp[HD + 1] = l[tid];
  }
}

/* Adds 1 to a count with acquire-release semantics at GPU scope (att_combine says why). */
__device__ __forceinline__ unsigned att_count_acq_rel(unsigned *p) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
  return old;
}

/* N splits' sums at dims dd, maxima and sums from s0 on (pp: a head's first split row), through
 * L2 (other blocks wrote them); past ns, a split that adds nothing (l = 0). */
template <int N, int HD>
__device__ __forceinline__ void att_load_splits(const float *pp, size_t pstride, int s0, int ns, int dd, float (&v)[N],
                                                float (&m)[N], float (&l)[N]) {
#pragma unroll
  for (int k = 0; k < N; k++) {
    const bool in = s0 + k < ns;
    v[k] = in ? __ldcg(pp + (size_t)(s0 + k) * pstride + dd) : 0.f;
    m[k] = in ? __ldcg(pp + (size_t)(s0 + k) * pstride + HD) : -INFINITY;
    l[k] = in ? __ldcg(pp + (size_t)(s0 + k) * pstride + HD + 1) : 0.f;
  }
}

/* Where an attention output goes: a.out at element i (both kernels).  The monokernel's LL mode
 * passes its own (mono.cu's AttOutLL), which also writes the output's LL words. */
struct AttOutPlain {
  __device__ __forceinline__ void operator()(const AttnArgs &a, size_t i, float v) const { a.out[i] = v; }
  __device__ __forceinline__ void operator()(const AttnArgs &a, size_t i, float4 v) const {
    *reinterpret_cast<float4 *>(a.out + i) = v;
  }
};

/* The last split's fold with a.combine ATT_COMBINE_ONE_PASS: each output reads its splits' sums,
 * maxima and sums in one round trip to L2 (16 splits a round trip) and folds them in with a
 * running maximum: (sum over splits of v e^(m - M)) / (sum of l e^(m - M)), in split order.
 * Under the weight stream each round trip to L2 costs about a microsecond, and the chain of
 * them is the combine's time. */
template <int HD, int NTHREADS, typename Out>
__device__ void att_fold_one_pass(const AttnArgs &a, int t, int h0, int G, int ns, int tid, const float *src,
                                  size_t hstride, Out out) {
  constexpr int B = 16; /* splits a round trip */
  const size_t pstride = att_part_stride<HD>();
  for (int i = tid; i < G * HD; i += NTHREADS) {
    const int j = i / HD, dd = i - j * HD;
    const float *pp = src + (size_t)j * hstride;
    float M = -INFINITY, L = 0.f, o = 0.f;
    for (int s0 = 0; s0 < ns; s0 += B) {
      float v[B], m[B], l[B];
      att_load_splits<B, HD>(pp, pstride, s0, ns, dd, v, m, l);
      float Mn = M;
#pragma unroll
      for (int k = 0; k < B; k++)
        if (l[k] > 0.f) Mn = fmaxf(Mn, m[k]);
      if (s0 > 0 && Mn != M) { /* rescale what the earlier round trips folded in */
        const float f = expf(M - Mn);
        o *= f;
        L *= f;
      }
      M = Mn;
#pragma unroll
      for (int k = 0; k < B; k++)
        if (l[k] > 0.f) {
          const float e = expf(m[k] - M);
          o = fmaf(v[k], e, o);
          L = fmaf(l[k], e, L);
        }
    }
    out(a, (size_t)t * a.out_ld + (size_t)(h0 + j) * HD + dd, o / L);
  }
}

/* The last split's fold with a.combine ATT_COMBINE_CHAIN: per head the splits' maxima and sums
 * (M, L), then each output from the splits' sums scaled to them, eight splits' loads in flight. */
template <int HD, int NTHREADS, typename Sync, typename Out>
__device__ void att_fold_chain(const AttnArgs &a, int t, int h0, int G, int ns, int tid, const float *src,
                               size_t hstride, float *big_m, float *big_l, Sync sync, Out out) {
  const int warp = tid >> 5, lane = tid & 31;
  const size_t pstride = att_part_stride<HD>();
  for (int j = warp; j < G; j += NTHREADS / 32) {
    const float *pp = src + (size_t)j * hstride;
    float M = -INFINITY;
    for (int s = lane; s < ns; s += 32) M = fmaxf(M, __ldcg(pp + s * pstride + HD));
    for (int off = 16; off; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    float L = 0.f;
    for (int s = lane; s < ns; s += 32) {
      const float l = __ldcg(pp + s * pstride + HD + 1);
      L += l > 0.f ? l * expf(__ldcg(pp + s * pstride + HD) - M) : 0.f;
    }
    for (int off = 16; off; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
    if (lane == 0) {
      big_m[j] = M;
      big_l[j] = L;
    }
  }
  sync();
  for (int i = tid; i < G * HD; i += NTHREADS) {
    const int j = i / HD, dd = i - j * HD;
    const float *pp = src + (size_t)j * hstride;
    const float M = big_m[j], invL = 1.f / big_l[j];
    float o = 0.f;
    for (int s0 = 0; s0 < ns; s0 += 8) {
      float v[8], m[8], l[8];
      att_load_splits<8, HD>(pp, pstride, s0, ns, dd, v, m, l);
#pragma unroll
      for (int k = 0; k < 8; k++)
        if (l[k] > 0.f) o = fmaf(v[k], expf(m[k] - M) * invL, o);
    }
    out(a, (size_t)t * a.out_ld + (size_t)(h0 + j) * HD + dd, o);
  }
}

/* A split item's partial result is in a.part: the last split of (token t, group grp) to get
 * here folds them together into the output and returns true; the others return false.  The
 * sums' order is the splits' whatever the thread count, so every kernel that uses it agrees.
 * How the last split learns it is last (a.combine): ATT_COMBINE_ONE_PASS, thread 0's
 * acquire-release count after the block's barrier (release: the block's partial rows, ordered
 * before it by the barrier; acquire: every other split's); ATT_COMBINE_CHAIN, every thread's
 * fence, a relaxed count, and a fence after it.  out: where the outputs go (AttOutPlain). */
template <int HD, int NTHREADS, typename Sync, typename Out = AttOutPlain>
__device__ bool att_combine(const AttnArgs &a, int t, int grp, int h0, int G, int ns, int tid, float *big_m,
                            float *big_l, int *last, Sync sync, Out out = Out()) {
  const bool one_pass = a.combine == ATT_COMBINE_ONE_PASS;
  unsigned *cnt = &a.cnt[(size_t)t * (a.nh / a.g * a.hgroups) + grp];
  if (!one_pass) __threadfence();
  sync();
  if (tid == 0) *last = (one_pass ? att_count_acq_rel(cnt) : atomicAdd(cnt, 1u)) == (unsigned)ns - 1;
  sync();
  if (!*last) return false;
  const size_t pstride = att_part_stride<HD>();
  const float *src = a.part + ((size_t)t * a.nh + h0) * a.nsplit * pstride;
  const size_t hstride = (size_t)a.nsplit * pstride; /* between heads */
  if (one_pass) {
    att_fold_one_pass<HD, NTHREADS>(a, t, h0, G, ns, tid, src, hstride, out);
  } else {
    __threadfence();
    att_fold_chain<HD, NTHREADS>(a, t, h0, G, ns, tid, src, hstride, big_m, big_l, sync, out);
  }
  if (tid == 0) *cnt = 0;
  return true;
}

/* clk (profiling, or NULL): thread 0 writes the time its scores and softmax were done
 * to clk[0] and its values to clk[1], for the first tile. */
template <int HD, bool CG, typename Sync>
__device__ void attend(const AttnArgs &a, int grp, int split, int t, int tid, AttSmem<HD> &sm, Sync sync,
                       unsigned *signal, unsigned long long *const *clk = nullptr) {
  typedef AttShape<HD> AS;
  const int warp = tid >> 5, lane = tid & 31;
  const int kvh = grp / a.hgroups, hg = grp - kvh * a.hgroups;
  const int h0 = kvh * a.g + hg * a.gper;
  const int G = min(a.gper, a.g - hg * a.gper);

  const int S = *a.pos + t + 1; /* keys 0 .. pos + t */
  const int ns = min(a.nsplit, (S + a.min_chunk - 1) / a.min_chunk);
  if (split >= ns) return;
  const int len = (S + ns - 1) / ns;
  const int c0 = min(S, split * len), c1 = min(S, c0 + len);
  const bf16 *K = a.kc + (size_t)kvh * a.max_seq * HD, *V = a.vc + (size_t)kvh * a.max_seq * HD;

  /* The queries (G heads) into shared memory, every load issued before any store. */
  {
    constexpr int QB = (ATT_MAXG * HD / 4 + ATT_THREADS - 1) / ATT_THREADS;
    const float4 *q4 = reinterpret_cast<const float4 *>(a.q + (size_t)t * a.q_ld + (size_t)h0 * HD);
    float4 *qs4 = reinterpret_cast<float4 *>(sm.qs);
    const int n4 = G * HD / 4;
    float4 v[QB];
#pragma unroll
    for (int k = 0; k < QB; k++) {
      const int i = tid + k * ATT_THREADS;
      v[k] = i < n4 ? __ldcg(q4 + i) : f4_zero();
    }
#pragma unroll
    for (int k = 0; k < QB; k++) {
      const int i = tid + k * ATT_THREADS;
      if (i < n4) qs4[i] = v[k];
    }
  }
  if (tid < ATT_MAXG) {
    sm.m_run[tid] = -INFINITY;
    sm.l_run[tid] = 0.f;
  }

  /* Value chunks: c = (head j, dims d .. d + ATT_DV) over nch chunks; with fewer
   * chunks than threads, R threads share a chunk, each the keys r, r + R, ... */
  const int nch = G * HD / ATT_DV;
  const int R = nch >= ATT_THREADS ? 1 : ATT_THREADS / nch;
  const int r = tid / min(nch, ATT_THREADS);
  const bool vthread = r < R;
  float acc[AS::CPT][ATT_DV];
#pragma unroll
  for (int ci = 0; ci < AS::CPT; ci++)
#pragma unroll
    for (int i = 0; i < ATT_DV; i++) acc[ci][i] = 0.f;
  sync();

  for (int tile = c0; tile < c1; tile += ATT_TILE) {
    const int nt = min(ATT_TILE, c1 - tile);
    /* The tile's values into shared memory (through L2: another block of a monokernel may
     * have written the last row), their round trip overlapping the keys'. */
    for (int i = tid; i < nt * (HD / 8); i += ATT_THREADS) att_cp16(sm.vs + (size_t)i * 8, V + (size_t)tile * HD + (size_t)i * 8);
    asm volatile("cp.async.commit_group;" ::: "memory");
    /* Scores: pair p = (head p / ATT_TILE, key p % ATT_TILE), one thread's dot product each. */
#pragma unroll
    for (int pi = 0; pi < AS::PPT; pi++) {
      const int p = tid + pi * ATT_THREADS, j = p / ATT_TILE, key = p - j * ATT_TILE;
      if (j >= G || key >= nt) continue;
      const uint4 *krow = reinterpret_cast<const uint4 *>(K + (size_t)(tile + key) * HD);
      const float *qj = sm.qs + j * HD;
      float d = 0.f;
#pragma unroll
      for (int cb = 0; cb < AS::KV8; cb += AS::KB) {
        uint4 kk[AS::KB];
#pragma unroll
        for (int c = 0; c < AS::KB; c++) kk[c] = ld_kv<CG>(krow + cb + c);
#pragma unroll
        for (int c = 0; c < AS::KB; c++) {
          const float4 qa = *reinterpret_cast<const float4 *>(qj + (cb + c) * 8);
          const float4 qb = *reinterpret_cast<const float4 *>(qj + (cb + c) * 8 + 4);
          d = dot8(kk[c], qa, qb, d);
        }
      }
      sm.sc[j * ATT_TILE + key] = d * a.scale;
    }
    sync();
    /* Online softmax: a warp per head rescales its running max and sum. */
    for (int j = warp; j < G; j += ATT_THREADS / 32) {
      float m = -INFINITY;
      for (int i = lane; i < nt; i += 32) m = fmaxf(m, sm.sc[j * ATT_TILE + i]);
      for (int off = 16; off; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
      const float m_new = fmaxf(sm.m_run[j], m);
      float l = 0.f;
      for (int i = lane; i < nt; i += 32) {
        const float e = expf(sm.sc[j * ATT_TILE + i] - m_new);
        sm.sc[j * ATT_TILE + i] = e;
        l += e;
      }
      for (int off = 16; off; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
      if (lane == 0) {
        const float f = sm.m_run[j] == -INFINITY ? 0.f : expf(sm.m_run[j] - m_new);
        sm.fac[j] = f;
        sm.l_run[j] = sm.l_run[j] * f + l;
        sm.m_run[j] = m_new;
      }
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    sync();
    if (clk && tid == 0 && tile == c0) att_clock(clk[0]);
    /* Values: each chunk's running sum rescaled, then its keys added, AS::VB loads in flight. */
    if (vthread) {
#pragma unroll
      for (int ci = 0; ci < AS::CPT; ci++) {
        const int c = (R > 1 ? tid - r * nch : tid) + ci * ATT_THREADS;
        if (c >= nch) continue;
        const int j = c / (HD / ATT_DV), dd = (c - j * (HD / ATT_DV)) * ATT_DV;
        const float f = sm.fac[j];
#pragma unroll
        for (int i = 0; i < ATT_DV; i++) acc[ci][i] *= f;
        const bf16 *vcol = sm.vs + dd;
        const float *e = sm.sc + j * ATT_TILE;
        for (int k0 = r; k0 < nt; k0 += R * AS::VB) {
          uint2 vv[AS::VB];
#pragma unroll
          for (int k = 0; k < AS::VB; k++) {
            const int key = k0 + k * R;
            vv[k] = key < nt ? *reinterpret_cast<const uint2 *>(vcol + (size_t)key * HD) : make_uint2(0, 0);
          }
#pragma unroll
          for (int k = 0; k < AS::VB; k++) {
            const int key = k0 + k * R;
            if (key >= nt) break;
            const float w = e[key];
            acc[ci][0] = fmaf(w, bf_lo(vv[k].x), acc[ci][0]);
            acc[ci][1] = fmaf(w, bf_hi(vv[k].x), acc[ci][1]);
            acc[ci][2] = fmaf(w, bf_lo(vv[k].y), acc[ci][2]);
            acc[ci][3] = fmaf(w, bf_hi(vv[k].y), acc[ci][3]);
          }
        }
      }
    }
    sync(); /* sc and fac are rewritten by the next tile */
    if (clk && tid == 0 && tile == c0) att_clock(clk[1]);
  }

  if (R > 1) att_phase_sum(acc[0], sm.red, tid, r, R, nch, vthread, sync);
  const bool owner = R > 1 ? r == 0 : true;
  if (ns == 1) { /* the whole context in this item: the output directly */
    if (owner)
      att_each_chunk<HD, AS::CPT, ATT_THREADS>(tid, nch, [&](int ci, int j, int dd) {
        const float l = sm.l_run[j];
        float4 o = make_float4(acc[ci][0] / l, acc[ci][1] / l, acc[ci][2] / l, acc[ci][3] / l);
        *reinterpret_cast<float4 *>(a.out + (size_t)t * a.out_ld + (size_t)(h0 + j) * HD + dd) = o;
      });
    att_signal(signal, tid, sync);
    return;
  }
  att_store_part<HD, AS::CPT, ATT_THREADS>(a, t, h0, G, split, tid, nch, owner, acc, sm.m_run, sm.l_run);

  if (!att_combine<HD, ATT_THREADS>(a, t, grp, h0, G, ns, tid, sm.big_m, sm.big_l, &sm.last, sync)) return;
  att_signal(signal, tid, sync);
}

}  // namespace kie
#endif
