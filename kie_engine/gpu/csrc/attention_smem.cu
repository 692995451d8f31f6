/* attention_smem.cu - the graph path's decode attention: a block per (KV head group,
 * split, token) holds its keys' rows of K and V in shared memory.
 *
 * A decode step's attention reads little (1 MB a layer at a context of 1,024 on the
 * 2b shape) but sits between two kernels on the step's critical path, so it is built
 * for latency:
 *   - Every key before the step's position was written by an earlier step, so a block
 *     copies those rows (cp.async) before it waits for the QKV kernel: their round trip
 *     to DRAM overlaps that kernel's tail.  Only the pass's own rows (positions pos ..)
 *     and the queries are read after the wait, from L2.
 *   - A context of up to `kcap` keys (AttnArgs.kcap, at most ATT_SMEM_KEYS(hd): 192 for
 *     head size 128) is one block a group, whose output is final: no partial results,
 *     no combine.  A longer one is cut into ceil(S / ksplit) equal splits (at most the
 *     grid's, AttnArgs.nsplit: a split past kcap keys walks them in chunks of kcap with an
 *     online softmax), and the last split of a (token, group) to finish combines them
 *     (attention.cuh's att_combine);
 *     ksplit = 96 by default, the fastest of 96 / 128 / 192 at a context of 1,024 on the
 *     2b shape (more blocks fetch at once, each computes less after its wait).
 *   - While the context fits one block, a block takes one query head (AttnArgs.heads1):
 *     twice the blocks on the 2b shape, each with half the work after the wait, the keys
 *     read once for each from L2 or DRAM.
 *   - From shared memory: a score is one thread's dot product of a query head with a key
 *     row (four partial sums; rows padded by 16 bytes so that a warp's rows fall in
 *     different banks), the softmax a warp a head, a value chunk (4 dims of one head) one
 *     thread's sum over a share of the keys, the shares meeting in phase order.
 * The arithmetic differs from the monokernel's attention items (attention.cuh) in its
 * summation order; KIE_GPU_DECODE_ATTN=1 gives the graph path those items instead. */
#include "attention.cuh"

using namespace kie;

namespace {

constexpr int AS_THREADS = 256;

template <int HD>
struct SmemShape {
  static constexpr int KCAP = ATT_SMEM_KEYS(HD);
  static constexpr int LD = HD + 8; /* a row's stride (bf16): 16 bytes of padding */
  static constexpr int CH = HD / 8; /* 16-byte chunks a row */
  static constexpr int NCH = ATT_MAXG * HD / ATT_DV;
  static constexpr int CPT = (NCH + AS_THREADS - 1) / AS_THREADS; /* value chunks a thread at most */
  static constexpr size_t BYTES =
      (size_t)2 * KCAP * LD * 2 + (size_t)ATT_MAXG * HD * 4 + (size_t)ATT_MAXG * KCAP * 4 + (size_t)AS_THREADS * ATT_DV * 4;
};

template <int HD>
__global__ void __launch_bounds__(AS_THREADS, 1) k_attention_smem(const AttnArgs a) {
  typedef SmemShape<HD> SS;
  constexpr int LD = SS::LD, CH = SS::CH, KCAP = SS::KCAP;
  extern __shared__ __align__(16) unsigned char as_smem[];
  bf16 *Ks = reinterpret_cast<bf16 *>(as_smem);
  bf16 *Vs = Ks + KCAP * LD;
  float *qs = reinterpret_cast<float *>(Vs + KCAP * LD);
  float *sc = qs + ATT_MAXG * HD;
  float *red = sc + ATT_MAXG * KCAP;
  __shared__ float m_s[ATT_MAXG], l_s[ATT_MAXG], fac[ATT_MAXG], big_m[ATT_MAXG], big_l[ATT_MAXG];
  __shared__ int last;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int split = blockIdx.y, t = blockIdx.z;
  /* The position is final here: the kernel that advanced it ran before the QKV kernel,
   * which waited for it before this grid could launch. */
  const int pos = *a.pos, S = pos + t + 1; /* keys 0 .. pos + t */
  /* one block up to kcap keys, else splits of ksplit keys, as many as the grid has at most (a
   * longer split walks its keys in chunks of kcap) */
  const int ns = S <= a.kcap ? 1 : min(a.nsplit, (S + a.ksplit - 1) / a.ksplit);
  if (split >= ns) return;
  /* The block's query heads h0 .. h0 + G - 1 (of KV head kvh; grp: the group's index).  With
   * heads1 the grid has a block a query head: each takes its own while the context fits one
   * block (twice the blocks to share the work after the wait), and past it the first block of
   * each group takes the group's heads, whose keys it then reads once. */
  int grp = blockIdx.x, kvh, hg, h0, G;
  if (a.heads1) {
    kvh = grp / a.g;
    const int r = grp - kvh * a.g;
    if (ns == 1) {
      h0 = grp, G = 1;
    } else {
      if (r % a.gper) return;
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
    for (int i = r0 * CH + tid; i < r1 * CH; i += AS_THREADS) {
      const int r = i / CH, c = i - r * CH;
      att_cp16(Ks + (r - cb) * LD + c * 8, K + (size_t)r * HD + c * 8);
      att_cp16(Vs + (r - cb) * LD + c * 8, V + (size_t)r * HD + c * 8);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  const int n0 = min(n, a.kcap);             /* the first chunk */
  const int old = min(n0, max(0, pos - c0)); /* its rows 0 .. old - 1: written by earlier steps */
  copy_rows(0, 0, old);
  kcclDevPdlWait();
  kcclDevPdlTrigger();
  copy_rows(0, old, n0);
  {
    const float4 *q4 = reinterpret_cast<const float4 *>(a.q + (size_t)t * a.q_ld + (size_t)h0 * HD);
    for (int i = tid; i < G * HD / 4; i += AS_THREADS) reinterpret_cast<float4 *>(qs)[i] = __ldcg(q4 + i);
  }
  if (tid < G) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.f;
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  __syncthreads();

  /* Value chunks: c = (head j, dims dd .. dd + 3); with fewer chunks than threads, R threads
   * share one, thread r of them the keys r, r + R, ... of each chunk of keys */
  const int nch = G * HD / ATT_DV;
  const int R = nch >= AS_THREADS ? 1 : AS_THREADS / nch;
  const int r = tid / min(nch, AS_THREADS);
  float acc[SS::CPT][ATT_DV];
#pragma unroll
  for (int ci = 0; ci < SS::CPT; ci++)
#pragma unroll
    for (int i = 0; i < ATT_DV; i++) acc[ci][i] = 0.f;

  for (int cb = 0; cb < n; cb += a.kcap) { /* a chunk of keys (kcap at most) in shared memory at a time */
    const int nt = min(a.kcap, n - cb);
    if (cb > 0) { /* the keys past the first chunk: read after the wait (the last rows are this step's) */
      copy_rows(cb, cb, cb + nt);
      asm volatile("cp.async.wait_group 0;" ::: "memory");
      __syncthreads();
    }

    /* Scores: pair p = (head p / nt, key p % nt). */
    for (int p = tid; p < G * nt; p += AS_THREADS) {
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
      sc[j * KCAP + k] = ((d[0] + d[1]) + (d[2] + d[3])) * a.scale;
    }
    __syncthreads();
    /* Softmax: a warp a head, online across chunks (a context within one chunk: the maximum and
     * sum of its keys alone); the probabilities replace the scores. */
    for (int j = warp; j < G; j += AS_THREADS / 32) {
      float *s = sc + j * KCAP;
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
    __syncthreads();

    if (r < R) {
#pragma unroll
      for (int ci = 0; ci < SS::CPT; ci++) {
        const int c = (R > 1 ? tid - r * nch : tid) + ci * AS_THREADS;
        if (c >= nch) continue;
        const int j = c / (HD / ATT_DV), dd = (c - j * (HD / ATT_DV)) * ATT_DV;
        const float f = fac[j];
#pragma unroll
        for (int i = 0; i < ATT_DV; i++) acc[ci][i] *= f;
        const bf16 *vcol = Vs + dd;
        const float *e = sc + j * KCAP;
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
    if (cb + a.kcap < n) __syncthreads(); /* the next chunk rewrites the rows, scores and factors */
  }
  if (R > 1) att_phase_sum(acc[0], red, tid, r, R, nch, r < R, SyncBlock());
  const bool owner = R > 1 ? r == 0 : true;
  if (ns == 1) { /* the whole context in this block: the output directly */
    if (owner)
      att_each_chunk<HD, SS::CPT, AS_THREADS>(tid, nch, [&](int ci, int j, int dd) {
        const float inv = 1.f / l_s[j];
        *reinterpret_cast<float4 *>(a.out + (size_t)t * a.out_ld + (size_t)(h0 + j) * HD + dd) =
            make_float4(acc[ci][0] * inv, acc[ci][1] * inv, acc[ci][2] * inv, acc[ci][3] * inv);
      });
    return;
  }
  att_store_part<HD, SS::CPT, AS_THREADS>(a, t, h0, G, split, tid, nch, owner, acc, m_s, l_s);
  att_combine<HD, AS_THREADS>(a, t, grp, h0, G, ns, tid, big_m, big_l, &last, SyncBlock());
}

template <int HD>
cudaError_t launch_hd(const AttnArgs &a, int T, cudaStream_t st, int pdl) {
  const dim3 grid((unsigned)(a.heads1 ? a.nh : a.nh / a.g * a.hgroups), (unsigned)a.nsplit, (unsigned)T);
  return kcclLaunch(k_attention_smem<HD>, grid, dim3(AS_THREADS), SmemShape<HD>::BYTES, st, pdl, a);
}

}  // namespace

cudaError_t kie_launch_attention_smem(const AttnArgs &a, int T, cudaStream_t st, int pdl) {
  if (a.kcap < 1 || a.kcap > ATT_SMEM_KEYS(a.hd) || a.ksplit < 1 || a.ksplit > a.kcap) return cudaErrorInvalidValue;
  return kie_with_hd(a.hd, cudaErrorInvalidValue, [&](auto h) { return launch_hd<decltype(h)::value>(a, T, st, pdl); });
}

cudaError_t kie_attention_smem_attributes(void) {
  const cudaFuncAttribute at = cudaFuncAttributeMaxDynamicSharedMemorySize;
  cudaError_t e = cudaFuncSetAttribute(k_attention_smem<16>, at, (int)SmemShape<16>::BYTES);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(k_attention_smem<32>, at, (int)SmemShape<32>::BYTES);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(k_attention_smem<64>, at, (int)SmemShape<64>::BYTES);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(k_attention_smem<128>, at, (int)SmemShape<128>::BYTES);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(k_attention_smem<256>, at, (int)SmemShape<256>::BYTES);
  return e;
}
