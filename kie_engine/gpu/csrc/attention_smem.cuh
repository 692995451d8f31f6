/* attention_smem.cuh - decode attention with a block's keys in shared memory: one item
 * (query heads, split, token) run by NT threads, used by the graph path's kernel
 * (attention_smem.cu, a block an item) and by the monokernel's attention stage in its
 * shared-memory mode (mono.cu, a block's consumer threads an item at a time).
 *
 * A decode step's attention reads little (1 MB a layer at a context of 1,024 on the
 * 2b shape) but sits on the step's critical path, between the QKV GEMV and the o
 * projection, so it is built for latency:
 *   - Every key before the step's position was written by an earlier step, so an item
 *     copies those rows (cp.async) before it waits for the QKV work (`wait`): their
 *     round trip to DRAM overlaps that work's tail.  Only the pass's own rows
 *     (positions pos ..) and the queries are read after the wait, from L2.
 *   - A context of up to `kcap` keys (AttnArgs.kcap, at most the `cap` the shared memory
 *     holds) is one item a group, whose output is final: no partial results, no
 *     combine.  A longer one is cut into att_smem_splits() equal splits (at most
 *     AttnArgs.nsplit: a split past kcap keys walks them in chunks of kcap with an
 *     online softmax), and the last split of a (token, group) to finish combines them
 *     (attention.cuh's att_combine).
 *   - While the context fits one item, an item takes one query head (AttnArgs.heads1):
 *     twice the items on the 2b shape, each with half the work after the wait.
 *   - From shared memory: a score is one thread's dot product of a query head with a key
 *     row (four partial sums; rows padded by 16 bytes so that a warp's rows fall in
 *     different banks), the softmax a warp a head, a value chunk (4 dims of one head) one
 *     thread's sum over a share of the keys, the shares meeting in phase order.
 * The arithmetic depends on NT, kcap, ksplit, nsplit and heads1 alone, so the graph
 * kernel and the monokernel agree to the bit when those agree. */
#ifndef KIE_ATTENTION_SMEM_CUH_
#define KIE_ATTENTION_SMEM_CUH_
#include "attention.cuh"

namespace kie {

/* An item's shared memory for up to `cap` keys: K and V rows (padded), the queries, the
 * scores, the key phases' value sums. */
template <int HD, int NT>
struct SmemShape {
  static constexpr int LD = HD + 8; /* a row's stride (bf16): 16 bytes of padding */
  static constexpr int CH = HD / 8; /* 16-byte chunks a row */
  static constexpr int NCH = ATT_MAXG * HD / ATT_DV;
  static constexpr int CPT = (NCH + NT - 1) / NT; /* value chunks a thread at most */
  __host__ __device__ static constexpr size_t bytes(int cap) {
    return (size_t)2 * cap * LD * 2 + (size_t)ATT_MAXG * HD * 4 + (size_t)ATT_MAXG * cap * 4 + (size_t)NT * ATT_DV * 4;
  }
};

/* The per-head running values of an item (static shared memory of its caller). */
struct AttSmemHeads {
  float m[ATT_MAXG], l[ATT_MAXG], fac[ATT_MAXG], big_m[ATT_MAXG], big_l[ATT_MAXG];
  int last;
};

/* Splits of a context of S keys (one while it fits an item). */
__device__ __forceinline__ int att_smem_splits(const AttnArgs &a, int S) {
  return S <= a.kcap ? 1 : min(a.nsplit, (S + a.ksplit - 1) / a.ksplit);
}

/* Where an item's queries and this step's key and value rows come from after its wait: the
 * QKV kernel's outputs in memory (q, the cache), which the wait orders.  The monokernel's
 * AttInLL (In::LL, where its on() says so) takes them from the QKV stage's LL words instead,
 * and its wait does not wait. */
struct AttInPlain {
  static constexpr bool LL = false;
  __device__ bool on() const { return false; }
  __device__ bool operator()(const AttnArgs &, int, int, int, bf16 *, bf16 *, float *, int) const { return true; }
};

/* Item (bx, split, token t): bx a query head (a.heads1) or a head group, as the graph
 * kernel's grid lays them out.  smem: SmemShape<HD, NT>::bytes(cap) bytes, cap >= a.kcap.
 * wait() is called once, after the rows of earlier steps are on their way and before
 * anything this pass wrote is read; false from it: the item leaves (its copies landed)
 * and returns false.  Returns true otherwise, also for an item with nothing to do (which
 * returns before calling wait).  clk (profiling, or NULL): thread 0 writes the time its
 * first chunk's scores and softmax were done to clk[0], its values to clk[1], and where
 * clk[2] is not NULL the time its first chunk's rows and queries were in shared memory.  out:
 * where the outputs go (attention.cuh's AttOutPlain, a.out). */
template <int HD, int NT, bool WARM = false, typename Sync, typename Wait, typename Out = AttOutPlain,
          typename In = AttInPlain>
__device__ bool att_smem_item(const AttnArgs &a, int bx, int split, int t, int tid, unsigned char *smem, int cap,
                              AttSmemHeads &hs, Sync sync, Wait wait, unsigned long long *const *clk = nullptr,
                              Out out = Out(), In in = In()) {
  typedef SmemShape<HD, NT> SS;
  constexpr int LD = SS::LD, CH = SS::CH;
  bf16 *Ks = reinterpret_cast<bf16 *>(smem);
  bf16 *Vs = Ks + cap * LD;
  float *qs = reinterpret_cast<float *>(Vs + cap * LD);
  float *sc = qs + ATT_MAXG * HD;
  float *red = sc + ATT_MAXG * cap;
  float *m_s = hs.m, *l_s = hs.l, *fac = hs.fac;
  const int warp = tid >> 5, lane = tid & 31;
  /* The position is final here (the pass that advances it comes after this one's work). */
  const int pos = *a.pos, S = pos + t + 1; /* keys 0 .. pos + t */
  const int ns = att_smem_splits(a, S);
  if (split >= ns) return true;
  /* The item's query heads h0 .. h0 + G - 1 (of KV head kvh; grp: the group's index).  With
   * heads1 there is an item a query head: each takes its own while the context fits one
   * item, and past it the first item of each group takes the group's heads, whose keys it
   * then reads once. */
  int grp = bx, kvh, hg, h0, G;
  if (a.heads1) {
    kvh = grp / a.g;
    const int r = grp - kvh * a.g;
    if (ns == 1) {
      h0 = grp, G = 1;
    } else {
      if (r % a.gper) return true;
      hg = r / a.gper;
      grp = kvh * a.hgroups + hg;
      h0 = kvh * a.g + hg * a.gper;
      G = min(a.gper, a.g - hg * a.gper);
    }
  } else {
    kvh = grp / a.hgroups, hg = grp - kvh * a.hgroups;
    h0 = kvh * a.g + hg * a.gper;
    G = min(a.gper, a.g - hg * a.gper);
  }
  const int len = (S + ns - 1) / ns;
  const int c0 = split * len, n = min(S, c0 + len) - c0;
  const bf16 *K = a.kc + ((size_t)kvh * a.max_seq + c0) * HD, *V = a.vc + ((size_t)kvh * a.max_seq + c0) * HD;
  /* the split's rows r0 .. r1 - 1 into shared memory rows from 0, for the chunk starting at cb */
  auto copy_rows = [&](int cb, int r0, int r1) {
    for (int i = r0 * CH + tid; i < r1 * CH; i += NT) {
      const int r = i / CH, c = i - r * CH;
      att_cp16(Ks + (r - cb) * LD + c * 8, K + (size_t)r * HD + c * 8);
      att_cp16(Vs + (r - cb) * LD + c * 8, V + (size_t)r * HD + c * 8);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  const int n0 = min(n, a.kcap);             /* the first chunk */
  const int old = min(n0, max(0, pos - c0)); /* its rows 0 .. old - 1: written by earlier steps */
  copy_rows(0, 0, old);

  /* Value chunks: c = (head j, dims dd .. dd + 3); with fewer chunks than threads, R threads
   * share one, thread r of them the keys r, r + R, ... of each chunk of keys */
  const int nch = G * HD / ATT_DV;
  const int R = nch >= NT ? 1 : NT / nch;
  const int r = tid / min(nch, NT);
  float acc[SS::CPT][ATT_DV];

  /* Pass 0 (WARM, the graph kernel for a.warm; before the wait): the first chunk's arithmetic
   * once over the rows of earlier steps with zero queries, its results dropped, so that the
   * instructions the item runs after the wait are in this SM's instruction cache rather than each
   * a fetch from L2 under the weight stream's load.  Pass 1: the item.  A loop, not two copies of
   * the code: the point is that both passes run the same instructions; a kernel of its own, since
   * the loop costs registers.  false from a pass: the item left at its wait. */
  auto run_pass = [&](int pass) -> bool {
    const int np = pass ? n : old; /* keys of this pass */
    if (pass) {
      if (!wait()) {
        asm volatile("cp.async.wait_all;" ::: "memory"); /* nothing lands in shared memory after the caller left */
        return false;
      }
      if (In::LL && in.on()) { /* the queries and this step's key and value row from the QKV stage's words */
        if (!in(a, h0, G, kvh, n0 > old ? Ks + old * LD : nullptr, n0 > old ? Vs + old * LD : nullptr, qs, tid)) {
          asm volatile("cp.async.wait_all;" ::: "memory");
          return false;
        }
      } else {
        copy_rows(0, old, n0);
        const float4 *q4 = reinterpret_cast<const float4 *>(a.q + (size_t)t * a.q_ld + (size_t)h0 * HD);
        for (int i = tid; i < G * HD / 4; i += NT) reinterpret_cast<float4 *>(qs)[i] = __ldcg(q4 + i);
      }
    } else {
      for (int i = tid; i < G * HD / 4; i += NT) reinterpret_cast<float4 *>(qs)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (tid < G) {
      m_s[tid] = -INFINITY;
      l_s[tid] = 0.f;
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    sync();
    if (pass && clk && clk[2] && tid == 0) att_clock(clk[2]);
#pragma unroll
    for (int ci = 0; ci < SS::CPT; ci++)
#pragma unroll
      for (int i = 0; i < ATT_DV; i++) acc[ci][i] = 0.f;

    for (int cb = 0; cb < np; cb += a.kcap) { /* a chunk of keys (kcap at most) in shared memory at a time */
      const int nt = min(a.kcap, np - cb);
      if (cb > 0) { /* the keys past the first chunk: read after the wait (the last rows are this step's) */
        copy_rows(cb, cb, cb + nt);
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        sync();
      }
      /* Scores: pair p = (head p / nt, key p % nt). */
      for (int p = tid; p < G * nt; p += NT) {
        const int j = p / nt, k = p - j * nt;
        const uint4 *kr = reinterpret_cast<const uint4 *>(Ks + k * LD);
        const float4 *q4 = reinterpret_cast<const float4 *>(qs + j * HD);
        float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int c = 0; c < CH; c++) {
          const uint4 kk = kr[c];
          const float4 qa = q4[2 * c], qb = q4[2 * c + 1];
          d[0] = fmaf(bf_lo(kk.x), qa.x, d[0]);
          d[1] = fmaf(bf_hi(kk.x), qa.y, d[1]);
          d[2] = fmaf(bf_lo(kk.y), qa.z, d[2]);
          d[3] = fmaf(bf_hi(kk.y), qa.w, d[3]);
          d[0] = fmaf(bf_lo(kk.z), qb.x, d[0]);
          d[1] = fmaf(bf_hi(kk.z), qb.y, d[1]);
          d[2] = fmaf(bf_lo(kk.w), qb.z, d[2]);
          d[3] = fmaf(bf_hi(kk.w), qb.w, d[3]);
        }
        sc[j * cap + k] = ((d[0] + d[1]) + (d[2] + d[3])) * a.scale;
      }
      sync();
      /* Softmax: a warp a head, online across chunks (a context within one chunk: the maximum and
       * sum of its keys alone); the probabilities replace the scores. */
      for (int j = warp; j < G; j += NT / 32) {
        float *s = sc + j * cap;
        float m = -INFINITY;
        for (int i = lane; i < nt; i += 32) m = fmaxf(m, s[i]);
        for (int off = 16; off; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
        m = fmaxf(m_s[j], m);
        float l = 0.f;
        for (int i = lane; i < nt; i += 32) {
          const float e = expf(s[i] - m);
          s[i] = e;
          l += e;
        }
        for (int off = 16; off; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
        if (lane == 0) {
          const float f = m_s[j] == -INFINITY ? 0.f : expf(m_s[j] - m);
          fac[j] = f;
          l_s[j] = l_s[j] * f + l;
          m_s[j] = m;
        }
      }
      sync();
      if (pass && clk && tid == 0 && cb == 0) att_clock(clk[0]);

      if (r < R) {
#pragma unroll
        for (int ci = 0; ci < SS::CPT; ci++) {
          const int c = (R > 1 ? tid - r * nch : tid) + ci * NT;
          if (c >= nch) continue;
          const int j = c / (HD / ATT_DV), dd = (c - j * (HD / ATT_DV)) * ATT_DV;
          const float f = fac[j];
#pragma unroll
          for (int i = 0; i < ATT_DV; i++) acc[ci][i] *= f;
          const bf16 *vcol = Vs + dd;
          const float *e = sc + j * cap;
          for (int k0 = r; k0 < nt; k0 += 4 * R) {
            uint2 vv[4];
            float w[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
              const int key = k0 + u * R;
              vv[u] = key < nt ? *reinterpret_cast<const uint2 *>(vcol + key * LD) : make_uint2(0, 0);
              w[u] = key < nt ? e[key] : 0.f;
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
              acc[ci][0] = fmaf(w[u], bf_lo(vv[u].x), acc[ci][0]);
              acc[ci][1] = fmaf(w[u], bf_hi(vv[u].x), acc[ci][1]);
              acc[ci][2] = fmaf(w[u], bf_lo(vv[u].y), acc[ci][2]);
              acc[ci][3] = fmaf(w[u], bf_hi(vv[u].y), acc[ci][3]);
            }
          }
        }
      }
      if (pass && clk && tid == 0 && cb == 0) att_clock(clk[1]);
      if (cb + a.kcap < np) sync(); /* the next chunk rewrites the rows, scores and factors */
    }
    if (R > 1) att_phase_sum(acc[0], red, tid, r, R, nch, r < R, sync);
    if (!pass) sync(); /* pass 0's reads of the shared memory are done before pass 1 writes it */
    return true;
  };
  if (WARM) {
#pragma unroll 1
    for (int pass = old > 0 ? 0 : 1; pass < 2; pass++)
      if (!run_pass(pass)) return false;
  } else if (!run_pass(1)) {
    return false;
  }
  const bool owner = R > 1 ? r == 0 : true;
  if (ns == 1) { /* the whole context in this item: the output directly */
    if (owner)
      att_each_chunk<HD, SS::CPT, NT>(tid, nch, [&](int ci, int j, int dd) {
        const float inv = 1.f / l_s[j];
        out(a, (size_t)t * a.out_ld + (size_t)(h0 + j) * HD + dd,
            make_float4(acc[ci][0] * inv, acc[ci][1] * inv, acc[ci][2] * inv, acc[ci][3] * inv));
      });
    return true;
  }
  att_store_part<HD, SS::CPT, NT>(a, t, h0, G, split, tid, nch, owner, acc, m_s, l_s);
  /* The partial rows are read from L2: a copy of them into the rows' shared memory first was
   * no faster in the graph path and slower in the monokernel (bench/RESULTS.md). */
  att_combine<HD, NT>(a, t, grp, h0, G, ns, tid, hs.big_m, hs.big_l, &hs.last, sync, out);
  return true;
}

}  // namespace kie
#endif
