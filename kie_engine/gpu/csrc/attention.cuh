/* attention.cuh - decode attention over the bf16 KV cache, grouped-query, split
 * over the context so that a long context still spreads over the SMs.
 *
 * Item (KV head group, split, token): the query heads of one KV head (up to
 * ATT_MAXG of them share each key and value load) against positions [c0, c1)
 * of the keys token t may see (0 .. pos + t).  The context is cut into as many
 * splits as give each at least `min_chunk` keys (at most `nsplit`, the grid's
 * count, fixed when the graph is captured; the rest of the items end at
 * once).  An item (ATT_THREADS threads) walks its keys in tiles of ATT_TILE with an online softmax,
 * every thread issuing all its loads of a tile before using them.  One split
 * writes the output itself; otherwise each writes a partial result (max
 * score, sum of exponentials, weighted sum of values) and the last one of a
 * (token, group) to finish folds them together. */
#ifndef KIE_ATTENTION_CUH_
#define KIE_ATTENTION_CUH_
#include <math.h>

#include "gemv_common.cuh"

namespace kie {


#define ATT_TILE 64 /* keys per tile */

/* One (head group, split) item's shared memory. */
template <int HD>
struct __align__(16) AttSmem { /* 16: the queries are read as float4, and items sit side by side */
  float qs[ATT_MAXG * HD];
  float sc[ATT_MAXG * ATT_TILE];
  float red[ATT_THREADS * ATT_MAXG * 8 > ATT_MAXG * 1024 ? ATT_THREADS * ATT_MAXG * 8 : ATT_MAXG * 1024];
  float m_run[ATT_MAXG], l_run[ATT_MAXG], fac[ATT_MAXG];
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

template <int HD, bool CG, typename Sync>
__device__ void attend(const AttnArgs &a, int grp, int split, int t, int tid, AttSmem<HD> &sm, Sync sync,
                       unsigned *signal) {
  constexpr int LPK = HD / 8;                        /* lanes per key (one 16-byte load each) */
  constexpr int KPW = 32 / LPK;                      /* keys per warp per pass */
  constexpr int KPP = (ATT_THREADS / 32) * KPW;      /* keys per pass */
  constexpr int PASSES = ATT_TILE / KPP;             /* passes per tile */
  constexpr int NPG = ATT_THREADS / LPK;             /* position groups of the value pass */
  constexpr int VPT = ATT_TILE / NPG;                /* values per thread per tile */
  static_assert(ATT_TILE % KPP == 0 && ATT_TILE % NPG == 0, "tile shape");
  float *qs = sm.qs, *sc = sm.sc, *red = sm.red, *m_run = sm.m_run, *l_run = sm.l_run, *fac = sm.fac;
  const int warp = tid >> 5, lane = tid & 31;
  const int kvh = grp / a.hgroups, hg = grp - kvh * a.hgroups, groups = a.nh / a.g * a.hgroups;
  const int h0 = kvh * a.g + hg * a.gper;
  const int G = min(a.gper, a.g - hg * a.gper);

  const int S = *a.pos + t + 1; /* keys 0 .. pos + t */
  const int ns = min(a.nsplit, (S + a.min_chunk - 1) / a.min_chunk);
  if (split >= ns) return;
  const int len = (S + ns - 1) / ns;
  const int c0 = min(S, split * len), c1 = min(S, c0 + len);
  const bf16 *K = a.kc + (size_t)kvh * a.max_seq * HD, *V = a.vc + (size_t)kvh * a.max_seq * HD;

  const int sub = lane / LPK, sl = lane - sub * LPK;
  const int d8 = tid % LPK, pg = tid / LPK;
  /* A tile's key and value loads, all issued before any is used; the first
   * tile's go out before the queries are staged, so the two overlap. */
  uint4 kv[PASSES], vv[VPT];
  auto load_tile = [&](int tile, int tend) {
#pragma unroll
    for (int pp = 0; pp < PASSES; pp++) {
      const int p = tile + pp * KPP + warp * KPW + sub;
      kv[pp] = p < tend ? ld_kv<CG>(K + (size_t)p * HD + sl * 8) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < VPT; k++) {
      const int p = tile + pg + k * NPG;
      vv[k] = p < tend ? ld_kv<CG>(V + (size_t)p * HD + d8 * 8) : make_uint4(0, 0, 0, 0);
    }
  };
  if (c0 < c1) load_tile(c0, min(c1, c0 + ATT_TILE));

  for (int i = tid; i < G * HD; i += ATT_THREADS) qs[i] = __ldcg(a.q + (size_t)t * a.q_ld + (size_t)h0 * HD + i);
  if (tid < ATT_MAXG) {
    m_run[tid] = -INFINITY;
    l_run[tid] = 0.f;
  }
  sync();

  float acc[ATT_MAXG][8];
#pragma unroll
  for (int j = 0; j < ATT_MAXG; j++)
#pragma unroll
    for (int i = 0; i < 8; i++) acc[j][i] = 0.f;

  for (int tile = c0; tile < c1; tile += ATT_TILE) {
    const int tend = min(c1, tile + ATT_TILE);
    if (tile != c0) load_tile(tile, tend);
    /* Scores. */
#pragma unroll
    for (int pp = 0; pp < PASSES; pp++) {
      const int p = tile + pp * KPP + warp * KPW + sub;
      float kf[8];
      bf8(kv[pp], kf);
      float d[ATT_MAXG];
#pragma unroll
      for (int j = 0; j < ATT_MAXG; j++) {
        d[j] = 0.f;
        if (j < G) {
          const float4 qa = *reinterpret_cast<const float4 *>(qs + j * HD + sl * 8);
          const float4 qb = *reinterpret_cast<const float4 *>(qs + j * HD + sl * 8 + 4);
          d[j] = kf[0] * qa.x + kf[1] * qa.y + kf[2] * qa.z + kf[3] * qa.w + kf[4] * qb.x + kf[5] * qb.y +
                 kf[6] * qb.z + kf[7] * qb.w;
        }
      }
#pragma unroll
      for (int off = LPK / 2; off; off >>= 1)
#pragma unroll
        for (int j = 0; j < ATT_MAXG; j++) d[j] += __shfl_xor_sync(0xffffffffu, d[j], off);
      if (sl == 0 && p < tend)
#pragma unroll
        for (int j = 0; j < ATT_MAXG; j++)
          if (j < G) sc[j * ATT_TILE + (p - tile)] = d[j] * a.scale;
    }
    sync();
    /* Online softmax: a warp per head rescales its running max and sum. */
    const int nt = tend - tile;
    for (int j = warp; j < G; j += ATT_THREADS / 32) {
      float m = -INFINITY;
      for (int i = lane; i < nt; i += 32) m = fmaxf(m, sc[j * ATT_TILE + i]);
      for (int off = 16; off; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
      const float m_new = fmaxf(m_run[j], m);
      float l = 0.f;
      for (int i = lane; i < nt; i += 32) {
        const float e = expf(sc[j * ATT_TILE + i] - m_new);
        sc[j * ATT_TILE + i] = e;
        l += e;
      }
      for (int off = 16; off; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
      if (lane == 0) {
        const float f = m_run[j] == -INFINITY ? 0.f : expf(m_run[j] - m_new);
        fac[j] = f;
        l_run[j] = l_run[j] * f + l;
        m_run[j] = m_new;
      }
    }
    sync();
#pragma unroll
    for (int j = 0; j < ATT_MAXG; j++) {
      if (j < G) {
        const float f = fac[j];
#pragma unroll
        for (int i = 0; i < 8; i++) acc[j][i] *= f;
      }
    }
#pragma unroll
    for (int k = 0; k < VPT; k++) {
      const int p = tile + pg + k * NPG;
      if (p < tend) {
        float vf[8];
        bf8(vv[k], vf);
#pragma unroll
        for (int j = 0; j < ATT_MAXG; j++) {
          if (j < G) {
            const float e = sc[j * ATT_TILE + (p - tile)];
#pragma unroll
            for (int i = 0; i < 8; i++) acc[j][i] = fmaf(e, vf[i], acc[j][i]);
          }
        }
      }
    }
    sync(); /* sc is rewritten by the next tile */
  }

  /* The position groups' sums, in group order. */
#pragma unroll
  for (int j = 0; j < ATT_MAXG; j++)
    if (j < G)
#pragma unroll
      for (int i = 0; i < 8; i++) red[((size_t)pg * ATT_MAXG + j) * HD + d8 * 8 + i] = acc[j][i];
  sync();
  const size_t pstride = (size_t)HD + 2;
  if (ns == 1) { /* the whole context in this block: the output directly */
    for (int i = tid; i < G * HD; i += ATT_THREADS) {
      const int j = i / HD, dd = i - j * HD;
      float s = 0.f;
      for (int q = 0; q < NPG; q++) s += red[((size_t)q * ATT_MAXG + j) * HD + dd];
      a.out[(size_t)t * a.out_ld + (size_t)(h0 + j) * HD + dd] = s / l_run[j];
    }
    att_signal(signal, tid, sync);
    return;
  }
  for (int i = tid; i < G * HD; i += ATT_THREADS) {
    const int j = i / HD, dd = i - j * HD;
    float s = 0.f;
    for (int q = 0; q < NPG; q++) s += red[((size_t)q * ATT_MAXG + j) * HD + dd];
    a.part[(((size_t)t * a.nh + h0 + j) * a.nsplit + split) * pstride + dd] = s;
  }
  if (tid < G) {
    float *pp = a.part + (((size_t)t * a.nh + h0 + tid) * a.nsplit + split) * pstride;
    pp[HD] = m_run[tid];
    pp[HD + 1] = l_run[tid];
  }

  /* The last split block of this (token, group) combines. */
  __threadfence();
  sync();
  if (tid == 0) sm.last = atomicAdd(&a.cnt[(size_t)t * groups + grp], 1u) == (unsigned)ns - 1;
  sync();
  if (!sm.last) return;
  __threadfence();
  float *wgt = red; /* [ATT_MAXG][ns]: exp(m_s - M) / L */
  for (int j = warp; j < G; j += ATT_THREADS / 32) {
    const float *pp = a.part + (((size_t)t * a.nh + h0 + j) * a.nsplit) * pstride;
    float M = -INFINITY;
    for (int s = lane; s < ns; s += 32) M = fmaxf(M, __ldcg(pp + s * pstride + HD));
    for (int off = 16; off; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    float L = 0.f;
    for (int s = lane; s < ns; s += 32) {
      const float l = __ldcg(pp + s * pstride + HD + 1);
      const float w = l > 0.f ? expf(__ldcg(pp + s * pstride + HD) - M) : 0.f;
      wgt[j * ns + s] = w;
      L += l * w;
    }
    for (int off = 16; off; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
    __syncwarp();
    for (int s = lane; s < ns; s += 32) wgt[j * ns + s] /= L;
  }
  sync();
  for (int i = tid; i < G * HD; i += ATT_THREADS) {
    const int j = i / HD, dd = i - j * HD;
    const float *pp = a.part + (((size_t)t * a.nh + h0 + j) * a.nsplit) * pstride + dd;
    const float *w = wgt + j * ns;
    float o = 0.f;
    for (int s0 = 0; s0 < ns; s0 += 8) { /* eight independent loads in flight */
      float v[8];
#pragma unroll
      for (int k = 0; k < 8; k++) v[k] = s0 + k < ns ? __ldcg(pp + (size_t)(s0 + k) * pstride) : 0.f;
#pragma unroll
      for (int k = 0; k < 8; k++)
        if (s0 + k < ns) o = fmaf(v[k], w[s0 + k], o);
    }
    a.out[(size_t)t * a.out_ld + (size_t)(h0 + j) * HD + dd] = o;
  }
  if (tid == 0) a.cnt[(size_t)t * groups + grp] = 0;
  att_signal(signal, tid, sync);
}

}  // namespace kie
#endif
