/* prefill_attention_wide.cu - causal attention of a prefill chunk on the tensor
 * cores, 32 rows a warp and the long rows' keys cut across blocks.
 *
 * A block takes PF_WIDE_ROWS (128) rows: 128 queries of one head, or 64 queries of
 * each of the two heads that share a KV head (hb = 2), so that one copy of a K and
 * V tile in shared memory serves both heads.  Each of its four warps owns 32 rows
 * (two 16-row tiles of the m16n8k16 product), so a fragment of K or V read from
 * shared memory feeds two products: at 16 rows a warp, ldmatrix traffic matches
 * the tensor cores' rate and bounds the kernel.  The queries stay in shared memory
 * and are read per product (32 rows of fragments would not fit the registers
 * beside the output's 128 floats a thread).  Keys walk in tiles of BK (64 or 32)
 * with an online softmax in base 2, the probabilities rounded to bf16 as the
 * second product's input; K and V tiles land by cp.async, ST stages deep.
 *
 * Causality makes the last query blocks the longest: their keys are cut into
 * splits of at most split_keys (up to nsplit), one block each, so that no block
 * walks more than a few tiles; the grid puts the longest query blocks first.  A
 * split writes its rows' unnormalized sums, max and exponential sum, and the
 * last split of a block's rows to finish folds them into the output.  Only tiles
 * that cross a warp's diagonal or the split's end are masked; a warp skips tiles
 * after all of its rows.  Keys past the split are zero-filled, never read. */
#include <math.h>

#include "kie_kernels.h"
#include "mma_sm80.cuh"

using namespace kie_mma;

namespace {

template <int HD, int BK>
struct PfWide {
  static constexpr int R = PF_WIDE_ROWS;
  static constexpr int MT = 2;                       /* 16-row tiles a warp */
  static constexpr int THREADS = 128;
  static constexpr int ST = BK >= 64 ? 2 : 3;        /* K/V tiles in flight */
  static constexpr int LDS = HD + 8;                 /* row stride (bf16): ldmatrix's 8 rows in distinct banks */
  static constexpr size_t SMEM = (size_t)(R + 2 * ST * BK) * LDS * 2; /* Q, then K and V per stage */
};

template <int HD, int BK>
__global__ void __launch_bounds__(128, 2) k_pf_wide(const PfAttnArgs a) {
  kcclDevPdlWait();
  typedef PfWide<HD, BK> SH;
  constexpr int R = SH::R, MT = SH::MT, ST = SH::ST, LDS = SH::LDS;
  constexpr int CH = HD / 8, NT = BK / 8, ND = HD / 8, KK = HD / 16;
  extern __shared__ __align__(16) unsigned char pf_smem[];
  bf16 *Qs = reinterpret_cast<bf16 *>(pf_smem);
  bf16 *Ks = Qs + R * LDS; /* [ST][BK][LDS] */
  bf16 *Vs = Ks + ST * BK * LDS;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int hb = a.hb, QB = R / hb;                  /* queries of each head in the block */
  const int nq = (a.T + QB - 1) / QB, nhb = a.nh / hb;
  const int qb = nq - 1 - (int)blockIdx.z, split = (int)blockIdx.y, hblk = (int)blockIdx.x;
  const int h0 = hblk * hb, kvh = h0 / a.g;
  const int q0 = qb * QB, P0 = *a.pos;
  const int nkeys = P0 + min(q0 + QB, a.T);          /* keys 0 .. the block's last query position */
  const int ns = min(a.nsplit, (nkeys + a.split_keys - 1) / a.split_keys);
  if (split >= ns) return;
  const int len = ((nkeys + ns - 1) / ns + BK - 1) / BK * BK;
  const int c0 = min(nkeys, split * len), c1 = min(nkeys, c0 + len); /* this split's keys */
  const bf16 *K = a.kc + (size_t)kvh * a.max_seq * HD, *V = a.vc + (size_t)kvh * a.max_seq * HD;

  /* Row r of the block: head h0 + r / QB, query q0 + r % QB. */
  for (int i = tid; i < R * CH; i += SH::THREADS) {
    const int r = i / CH, c = i - r * CH, hj = r / QB, t = q0 + (r - hj * QB);
    cp16(Qs + r * LDS + c * 8, a.q + (size_t)min(t, a.T - 1) * a.q_ld + (size_t)(h0 + hj) * HD + c * 8, t < a.T);
  }
  auto load_kv = [&](int tile, int stage) {
    const int k0 = c0 + tile * BK;
    for (int i = tid; i < BK * CH; i += SH::THREADS) {
      const int r = i / CH, c = i - r * CH, key = k0 + r;
      const bool ok = key < c1;
      const size_t off = (size_t)(ok ? key : 0) * HD + c * 8;
      cp16(Ks + (stage * BK + r) * LDS + c * 8, K + off, ok);
      cp16(Vs + (stage * BK + r) * LDS + c * 8, V + off, ok);
    }
  };
  const int ntiles = (c1 - c0 + BK - 1) / BK;
#pragma unroll
  for (int st = 0; st < ST - 1; st++) { /* the queries ride with the first tile's group */
    if (st < ntiles) load_kv(st, st);
    cp_commit();
  }

  /* This warp's rows: block rows warp * 32 .. + 31, all of one head, consecutive queries. */
  const int wrow = warp * 32, hj = wrow / QB, wq = q0 + (wrow - hj * QB); /* its first query */
  const int g = lane >> 2, tq = lane & 3;
  const int wfirst = P0 + wq;                      /* the position of the warp's first row */
  const int mi = lane >> 3, rr = lane & 7;         /* ldmatrix: the matrix and row this lane addresses */
  float o[MT][ND][4];
#pragma unroll
  for (int m = 0; m < MT; m++)
#pragma unroll
    for (int n = 0; n < ND; n++) o[m][n][0] = o[m][n][1] = o[m][n][2] = o[m][n][3] = 0.f;
  float mrow[MT][2], lrow[MT][2];
#pragma unroll
  for (int m = 0; m < MT; m++) mrow[m][0] = mrow[m][1] = -INFINITY, lrow[m][0] = lrow[m][1] = 0.f;

  for (int kt = 0; kt < ntiles; kt++) {
    if (kt + ST - 1 < ntiles) load_kv(kt + ST - 1, (kt + ST - 1) % ST);
    cp_commit();
    cp_wait<ST - 1>(); /* this tile (and the queries) landed; the next ones may still be in flight */
    __syncthreads();
    const int kb = c0 + kt * BK;
    if (kb <= wfirst + 31) { /* else every key of the tile is after this warp's rows */
      const bf16 *Kt = Ks + (kt % ST) * BK * LDS, *Vt = Vs + (kt % ST) * BK * LDS;
      float s[MT][NT][4];
#pragma unroll
      for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < NT; n++) s[m][n][0] = s[m][n][1] = s[m][n][2] = s[m][n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KK; kk++) {
        uint32_t qa[MT][4];
#pragma unroll
        for (int m = 0; m < MT; m++)
          ldsm4(qa[m][0], qa[m][1], qa[m][2], qa[m][3],
                Qs + (wrow + m * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm4(b0, b1, b2, b3, Kt + ((n + (mi >> 1)) * 8 + rr) * LDS + kk * 16 + (mi & 1) * 8);
#pragma unroll
          for (int m = 0; m < MT; m++) {
            mma16816(s[m][n], qa[m][0], qa[m][1], qa[m][2], qa[m][3], b0, b1);
            mma16816(s[m][n + 1], qa[m][0], qa[m][1], qa[m][2], qa[m][3], b2, b3);
          }
        }
      }

      /* Mask where the tile crosses the warp's diagonal or the split's end; the online softmax,
       * a row's four threads (tq) meeting by shuffles. */
      const bool whole = kb + BK <= c1 && kb + BK - 1 <= wfirst;
#pragma unroll
      for (int m = 0; m < MT; m++) {
        const int p0 = wfirst + m * 16 + g; /* this thread's rows' positions: p0 and p0 + 8 */
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            const int key = kb + n * 8 + 2 * tq + (e & 1), r = e >> 1;
            const float v = whole || (key <= p0 + 8 * r && key < c1) ? s[m][n][e] * a.scale_log2 : -INFINITY;
            s[m][n][e] = v;
            mx[r] = fmaxf(mx[r], v);
          }
        float alpha[2], muse[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
          const float mnew = fmaxf(mrow[m][r], mx[r]);
          muse[r] = mnew == -INFINITY ? 0.f : mnew;
          alpha[r] = exp2f(mrow[m][r] - muse[r]);
          mrow[m][r] = mnew;
        }
        float lsum[2] = {0.f, 0.f};
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            const float p = exp2f(s[m][n][e] - muse[e >> 1]);
            s[m][n][e] = p;
            lsum[e >> 1] += p;
          }
#pragma unroll
        for (int r = 0; r < 2; r++) lrow[m][r] = lrow[m][r] * alpha[r] + lsum[r];
#pragma unroll
        for (int n = 0; n < ND; n++) {
          o[m][n][0] *= alpha[0];
          o[m][n][1] *= alpha[0];
          o[m][n][2] *= alpha[1];
          o[m][n][3] *= alpha[1];
        }
      }

      /* O += P V: P's accumulators are the A fragments of the second product. */
#pragma unroll
      for (int k2 = 0; k2 < BK / 16; k2++) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int m = 0; m < MT; m++) {
          pa[m][0] = pack_bf16(s[m][2 * k2][0], s[m][2 * k2][1]);
          pa[m][1] = pack_bf16(s[m][2 * k2][2], s[m][2 * k2][3]);
          pa[m][2] = pack_bf16(s[m][2 * k2 + 1][0], s[m][2 * k2 + 1][1]);
          pa[m][3] = pack_bf16(s[m][2 * k2 + 1][2], s[m][2 * k2 + 1][3]);
        }
#pragma unroll
        for (int n = 0; n < ND; n += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm4t(b0, b1, b2, b3, Vt + (k2 * 16 + (mi & 1) * 8 + rr) * LDS + (n + (mi >> 1)) * 8);
#pragma unroll
          for (int m = 0; m < MT; m++) {
            mma16816(o[m][n], pa[m][0], pa[m][1], pa[m][2], pa[m][3], b0, b1);
            mma16816(o[m][n + 1], pa[m][0], pa[m][1], pa[m][2], pa[m][3], b2, b3);
          }
        }
      }
    }
    __syncthreads(); /* this stage is refilled ST tiles on */
  }
  cp_wait<0>();

#pragma unroll
  for (int m = 0; m < MT; m++)
#pragma unroll
    for (int r = 0; r < 2; r++) {
      lrow[m][r] += __shfl_xor_sync(0xffffffffu, lrow[m][r], 1);
      lrow[m][r] += __shfl_xor_sync(0xffffffffu, lrow[m][r], 2);
    }
  const int head = h0 + hj;
  if (ns == 1) {
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int t = wq + m * 16 + g + 8 * r;
        if (t >= a.T) continue;
        const float inv = 1.f / lrow[m][r];
        bf16 *dst = a.out + (size_t)t * a.out_ld + (size_t)head * HD + 2 * tq;
#pragma unroll
        for (int n = 0; n < ND; n++)
          *reinterpret_cast<__nv_bfloat162 *>(dst + n * 8) =
              __floats2bfloat162_rn(o[m][n][2 * r] * inv, o[m][n][2 * r + 1] * inv);
      }
    return;
  }

  /* A split: its rows' unnormalized sums, max and exponential sum, for the last split to fold. */
  constexpr size_t PS = (size_t)R * (HD + 2); /* one split's floats */
  const size_t tile_at = ((size_t)qb * nhb + hblk) * a.nsplit;
  float *pp = a.part + (tile_at + split) * PS;
#pragma unroll
  for (int m = 0; m < MT; m++)
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const int lr = wrow + m * 16 + g + 8 * r;
#pragma unroll
      for (int n = 0; n < ND; n++)
        __stcg(reinterpret_cast<float2 *>(pp + (size_t)lr * HD + n * 8 + 2 * tq),
               make_float2(o[m][n][2 * r], o[m][n][2 * r + 1]));
      if (tq == 0) {
        __stcg(pp + (size_t)R * HD + lr, mrow[m][r]);
        __stcg(pp + (size_t)R * HD + R + lr, lrow[m][r]);
      }
    }
  __shared__ int last;
  __threadfence();
  __syncthreads();
  unsigned *cnt = a.cnt + (size_t)qb * nhb + hblk;
  if (tid == 0) last = atomicAdd(cnt, 1u) == (unsigned)ns - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  /* Per row: M the largest split max, and 1 / L, L the splits' sums scaled to M (in Qs's place). */
  float *rowM = reinterpret_cast<float *>(pf_smem), *rowInvL = rowM + R;
  const float *p0 = a.part + tile_at * PS;
  for (int lr = tid; lr < R; lr += SH::THREADS) {
    float M = -INFINITY;
    for (int sp = 0; sp < ns; sp++) M = fmaxf(M, __ldcg(p0 + sp * PS + R * HD + lr));
    float L = 0.f;
    for (int sp = 0; sp < ns; sp++) {
      const float l = __ldcg(p0 + sp * PS + R * HD + R + lr);
      if (l > 0.f) L += l * exp2f(__ldcg(p0 + sp * PS + R * HD + lr) - M);
    }
    rowM[lr] = M;
    rowInvL[lr] = 1.f / L;
  }
  __syncthreads();
  for (int i = tid; i < R * HD / 2; i += SH::THREADS) {
    const int lr = i / (HD / 2), c = 2 * (i - lr * (HD / 2)), rj = lr / QB, t = q0 + (lr - rj * QB);
    if (t >= a.T) continue;
    float2 acc = make_float2(0.f, 0.f);
    for (int sp = 0; sp < ns; sp++) {
      const float l = __ldcg(p0 + sp * PS + R * HD + R + lr);
      if (!(l > 0.f)) continue; /* a split after every key this row sees */
      const float f = exp2f(__ldcg(p0 + sp * PS + R * HD + lr) - rowM[lr]);
      const float2 v = __ldcg(reinterpret_cast<const float2 *>(p0 + sp * PS + (size_t)lr * HD + c));
      acc.x = fmaf(v.x, f, acc.x);
      acc.y = fmaf(v.y, f, acc.y);
    }
    *reinterpret_cast<__nv_bfloat162 *>(a.out + (size_t)t * a.out_ld + (size_t)(h0 + rj) * HD + c) =
        __floats2bfloat162_rn(acc.x * rowInvL[lr], acc.y * rowInvL[lr]);
  }
  if (tid == 0) *cnt = 0;
}

template <int HD, int BK>
cudaError_t launch(const PfAttnArgs &a, cudaStream_t st, int pdl) {
  typedef PfWide<HD, BK> SH;
  const int QB = SH::R / a.hb;
  const dim3 grid((unsigned)(a.nh / a.hb), (unsigned)a.nsplit, (unsigned)((a.T + QB - 1) / QB));
  return kcclLaunch(k_pf_wide<HD, BK>, grid, dim3(SH::THREADS), SH::SMEM, st, pdl, a);
}

template <int HD>
cudaError_t launch_hd(const PfAttnArgs &a, cudaStream_t st, int pdl) {
  if constexpr (HD > PF_WIDE_HD_MAX) {
    return cudaErrorInvalidValue;
  } else {
    return a.kind == PF_ATT_WIDE32 ? launch<HD, 32>(a, st, pdl) : launch<HD, 64>(a, st, pdl);
  }
}

template <int HD, int BK>
cudaError_t attr() {
  return cudaFuncSetAttribute(k_pf_wide<HD, BK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              (int)PfWide<HD, BK>::SMEM);
}

}  // namespace

cudaError_t kie_launch_pf_attention_wide(const PfAttnArgs &a, cudaStream_t st, int pdl) {
  if (a.hb < 1 || a.hb > 2 || a.g % a.hb || a.nsplit < 1) return cudaErrorInvalidValue;
  return kie_with_hd(a.hd, cudaErrorInvalidValue, [&](auto h) { return launch_hd<decltype(h)::value>(a, st, pdl); });
}

cudaError_t kie_pf_attention_wide_attributes(void) {
  cudaError_t e = cudaSuccess;
  for (cudaError_t x : {attr<16, 64>(), attr<32, 64>(), attr<64, 64>(), attr<128, 64>(), attr<16, 32>(),
                        attr<32, 32>(), attr<64, 32>(), attr<128, 32>()})
    if (e == cudaSuccess) e = x;
  return e;
}
