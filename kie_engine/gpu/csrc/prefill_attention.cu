/* prefill_attention.cu - causal attention of a prefill chunk on the tensor cores.
 *
 * The chunk's queries (tokens pos .. pos + T - 1, bf16; or of them only rows
 * first .. : the last layer needs only the last row's) attend to the KV cache up
 * to their own position (the chunk's keys were written there first, so a later
 * chunk sees every earlier one).  A block takes 64 queries of one head
 * (which block takes which: PfAttnArgs.order), four warps of 16 rows each, and
 * walks the keys in tiles of 32 with an online softmax: scores S = Q K^T and the
 * sum P V are bf16 mma.sync m16n8k16 products with f32 accumulation, the
 * probabilities P rounded to bf16 as the product's input, the queries' fragments
 * held in registers.  Tiles of K and V are copied into shared memory (cp.async,
 * three stages: two tiles land while one is used; small tiles keep the shared
 * memory at 70 KB for head size 128, so that three blocks share an SM and hide
 * each other's waits) and read with ldmatrix, V transposed by it.  Rows are
 * padded by 16 bytes so that ldmatrix's eight rows fall in different banks.  Keys
 * past the chunk's end are zero-filled, never read, so a stale cache cannot bring
 * a NaN into the sum.  Only the tiles a warp's rows can see past are masked, and
 * a warp skips the tiles wholly past its last row.
 *
 * A chunk has few blocks for the GPU (1,024 tokens of 16 heads: 256 query tiles),
 * and the causal mask makes the last tiles' keys 16 times the first's; so the
 * longer half of a head's tiles take two blocks each (PF_ORDER_SPLIT, the default:
 * keys before a tile boundary and from it, the second to finish merging the
 * first's maxima, sums and accumulators from global memory, see the end of the
 * kernel), which halves the longest block and brings 384 blocks, heaviest first.
 * Within a block the loop is built around the latencies of a few warps an SM: one
 * barrier a tile, the next fragments' ldmatrix issued before the products that use
 * the current ones, V's first fragments before the softmax, reductions as trees,
 * and the output's rescale skipped when no row's maximum moved.  64-key tiles
 * (KIE_GPU_PREFILL_ATTN_KEYS=64, head sizes 64 and 128) are there to be measured
 * against 32. */
#include <math.h>

#include "kie_kernels.h"

namespace {

template <int HD, int KEYS>
struct PfShape {
  static constexpr int BQ = PF_BQ;                 /* queries per block */
  static constexpr int BK = KEYS;                  /* keys per tile: 32, or 64 (prefill_attn_keys) */
  static constexpr int STAGES = KEYS == 32 ? 3 : 2; /* tiles in flight beside the one used */
  static constexpr int LDS = HD + 8;               /* shared-memory row stride (bf16) */
  static constexpr int THREADS = 128;
  static constexpr size_t SMEM = (size_t)(BQ + 2 * STAGES * BK) * LDS * 2; /* Q, then K and V per stage */
};

/* Blocks an SM must hold for the default shape to keep its residency (registers capped to
 * fit); 64-key tiles count on two (a 1,024-token chunk of 16 heads is 256 blocks: two an SM
 * hold them all), which leaves them up to 255 registers. */
template <int HD, int KEYS>
constexpr int pf_min_blocks() {
  return KEYS == 32 ? (HD <= 64 ? 4 : HD <= 128 ? 3 : 1) : 2;
}

__device__ __forceinline__ uint32_t s_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* 16 bytes from global to shared memory, zero-filled when !valid (src is not read then). */
__device__ __forceinline__ void cp16(void *dst, const void *src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s_addr(dst)), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ void ldsm4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(s_addr(p)));
}
__device__ __forceinline__ void ldsm4t(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(s_addr(p)));
}

/* d += A (16 x 16, row) * B (16 x 8, col), bf16 in, f32 out. */
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t *>(&v);
}

/* 2^x for x <= 0 (the softmax's), one MUFU instruction: results below 2^-126 flush to zero, which
 * a probability that small is beside its row's largest (1) */
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/* op (max or sum) over row r's (0: g, 1: g + 8) scores in this thread's fragments, as a tree */
template <int NT, typename Op>
__device__ __forceinline__ float row_tree(const float (&s)[NT][4], int r, Op op) {
  float v[NT];
#pragma unroll
  for (int n = 0; n < NT; n++) v[n] = op(s[n][2 * r], s[n][2 * r + 1]);
#pragma unroll
  for (int w = 1; w < NT; w *= 2)
#pragma unroll
    for (int n = 0; n + w < NT; n += 2 * w) v[n] = op(v[n], v[n + w]);
  return v[0];
}
struct MaxOp {
  __device__ float operator()(float x, float y) const { return fmaxf(x, y); }
};
struct AddOp {
  __device__ float operator()(float x, float y) const { return x + y; }
};

/* PF_ORDER_SPLIT: block b's query tile, head and share (-1: the whole tile).  The two lists,
 * split tiles (nq - 1 down to nq / 2, 2 nh blocks each, about qt + 1 tiles of keys) and whole
 * ones (nq / 2 - 1 down to 0, nh blocks each, about 2 (qt + 1)), merged heaviest first. */
__device__ __forceinline__ void pf_split_unit(int b, int nq, int nh, int &qt, int &h, int &share) {
  int us = nq - 1, uw = nq / 2 - 1, start = 0;
  for (;;) {
    const bool split = us >= nq / 2 && (uw < 0 || us + 1 >= 2 * (uw + 1));
    const int n = split ? 2 * nh : nh;
    if (b < start + n || (us < nq / 2 && uw < 0)) {
      const int u = b - start;
      qt = split ? us : uw;
      h = u % nh;
      share = split ? u / nh : -1;
      return;
    }
    start += n;
    if (split) us--;
    else uw--;
  }
}

template <int HD, int KEYS>
__global__ void __launch_bounds__(128, pf_min_blocks<HD, KEYS>()) k_pf_attention(const PfAttnArgs a) {
  kcclDevPdlWait();
  typedef PfShape<HD, KEYS> SH;
  constexpr int BQ = SH::BQ, BK = SH::BK, LDS = SH::LDS, CH = HD / 8, NT = BK / 8, ND = HD / 8, KS = HD / 16;
  constexpr int ST = SH::STAGES;
  constexpr int NV = (BK / 16) * (ND / 2); /* V's fragment groups a tile (ldmatrix x4 each) */
  extern __shared__ __align__(16) unsigned char pf_smem[];
  bf16 *Qs = reinterpret_cast<bf16 *>(pf_smem);
  bf16 *Ks = Qs + BQ * LDS; /* [ST][BK][LDS] */
  bf16 *Vs = Ks + ST * BK * LDS;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int nq = (a.T + BQ - 1) / BQ, nb = nq * a.nh, b = (int)blockIdx.x;
  int qt = b % nq, h = b / nq, share = -1;
  if (a.order == PF_ORDER_SPLIT) {
    pf_split_unit(b, nq, a.nh, qt, h, share);
  } else if (a.order == PF_ORDER_ZIGZAG) { /* r: the block's rank by work, heaviest first */
    const int half = (nb + 1) / 2, r = b < half ? b : nb - 1 - (b - half);
    qt = nq - 1 - r / a.nh;
    h = r % a.nh;
  }
  const int q0 = qt * BQ, kvh = h / a.g;
  const int P0 = *a.pos + a.first; /* the position of q's first row */
  const int qend = min(q0 + BQ, a.T);
  const int nkeys = P0 + qend; /* keys 0 .. the block's last query position */
  const bf16 *K = a.kc + (size_t)kvh * a.max_seq * HD, *V = a.vc + (size_t)kvh * a.max_seq * HD;

  for (int i = tid; i < BQ * CH; i += SH::THREADS) {
    const int r = i / CH, c = i - r * CH, t = q0 + r;
    cp16(Qs + r * LDS + c * 8, a.q + (size_t)min(t, a.T - 1) * a.q_ld + (size_t)h * HD + c * 8, t < a.T);
  }
  auto load_kv = [&](int tile, int stage) {
    const int k0 = tile * BK;
    for (int i = tid; i < BK * CH; i += SH::THREADS) {
      const int r = i / CH, c = i - r * CH, key = k0 + r;
      const bool ok = key < nkeys;
      const size_t off = (size_t)(ok ? key : 0) * HD + c * 8;
      cp16(Ks + stage * BK * LDS + r * LDS + c * 8, K + off, ok);
      cp16(Vs + stage * BK * LDS + r * LDS + c * 8, V + off, ok);
    }
  };
  /* this block's key tiles t0 .. t1 - 1: a split tile's first share ends at a tile boundary at
   * most half way and no later than the tile's first query (the second holds every diagonal) */
  int t0 = 0, t1 = (nkeys + BK - 1) / BK;
  if (share >= 0) {
    const int mid = min(t1 / 2, (P0 + q0) / BK);
    if (share == 0) t1 = mid;
    else t0 = mid;
  }
#pragma unroll
  for (int st = 0; st < ST - 1; st++) { /* the queries ride with the first tile's group */
    if (t0 + st < t1) load_kv(t0 + st, st);
    cp_commit();
  }
  uint32_t qf[KS][4];
  float o[ND][4];
#pragma unroll
  for (int n = 0; n < ND; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};
  const int g = lane >> 2, tq = lane & 3;
  const int row0 = q0 + warp * 16 + g;           /* this thread's rows: row0 and row0 + 8 */
  const int qpos[2] = {P0 + row0, P0 + row0 + 8};
  /* the positions of the warp's first and last rows (rows past the chunk's end see no more keys) */
  const int wfirst = P0 + q0 + warp * 16, wlast = P0 + min(q0 + warp * 16 + 15, a.T - 1);
  const int mi = lane >> 3, rr = lane & 7;        /* ldmatrix: the matrix and row this lane addresses */

  for (int kt = t0; kt < t1; kt++) {
    const int stage = (kt - t0) % ST;
    cp_wait<ST - 2>(); /* this thread's copies of this tile (and the queries) landed */
    __syncthreads();   /* everyone's; and every warp is done with the last tile, whose stage is refilled now */
    if (kt + ST - 1 < t1) load_kv(kt + ST - 1, (stage + ST - 1) % ST);
    cp_commit();
    if (kt == t0)
#pragma unroll
      for (int kk = 0; kk < KS; kk++)
        ldsm4(qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], Qs + (warp * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8);
    const bf16 *Kt = Ks + stage * BK * LDS, *Vt = Vs + stage * BK * LDS;
    const int kb = kt * BK;
    if (kb > wlast) continue; /* wholly past the warp's last query (the diagonal of a 64-row block) */

    /* S = Q K^T, the next 16 columns' K fragments loaded while this step's products run */
    float s[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    uint32_t kf[2][NT / 2][4];
    auto load_k = [&](int kk, uint32_t (&f)[NT / 2][4]) {
#pragma unroll
      for (int n = 0; n < NT / 2; n++)
        ldsm4(f[n][0], f[n][1], f[n][2], f[n][3], Kt + ((2 * n + (mi >> 1)) * 8 + rr) * LDS + kk * 16 + (mi & 1) * 8);
    };
    load_k(0, kf[0]);
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
      if (kk + 1 < KS) load_k(kk + 1, kf[(kk + 1) & 1]);
#pragma unroll
      for (int n = 0; n < NT / 2; n++) {
        const uint32_t(&f)[4] = kf[kk & 1][n];
        mma16816(s[2 * n], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], f[0], f[1]);
        mma16816(s[2 * n + 1], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], f[2], f[3]);
      }
    }
    /* V's first fragments, in flight during the softmax; group j: keys 16 (j / (ND / 2)) on,
     * columns 16 (j % (ND / 2)) on */
    uint32_t vf[2][4];
    auto load_v = [&](int j, uint32_t (&f)[4]) {
      const int k2 = j / (ND / 2), n = 2 * (j % (ND / 2));
      ldsm4t(f[0], f[1], f[2], f[3], Vt + (k2 * 16 + (mi & 1) * 8 + rr) * LDS + (n + (mi >> 1)) * 8);
    };
    load_v(0, vf[0]);

    /* Causal mask (only where a key can lie past a row: the diagonal, the chunk's end) and the
     * online softmax in base 2, on raw scores (the scale goes into one FMA with the max); a
     * row's four threads (tq) meet by shuffles. */
    if (kb + BK - 1 > wfirst) {
#pragma unroll
      for (int n = 0; n < NT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int key = kb + n * 8 + 2 * tq + (e & 1);
          if (key > qpos[e >> 1] || key >= nkeys) s[n][e] = -INFINITY;
        }
    }
    float alpha[2], muse[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
      float mx = row_tree(s, r, MaxOp());
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mnew = fmaxf(mrow[r], mx * a.scale_log2);
      muse[r] = mnew == -INFINITY ? 0.f : mnew;
      alpha[r] = ex2(mrow[r] - muse[r]);
      mrow[r] = mnew;
    }
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) s[n][e] = ex2(fmaf(s[n][e], a.scale_log2, -muse[e >> 1]));
#pragma unroll
    for (int r = 0; r < 2; r++) lrow[r] = fmaf(lrow[r], alpha[r], row_tree(s, r, AddOp()));
    /* most tiles past the first few move no row's maximum: the output keeps its scale */
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int n = 0; n < ND; n++) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
      }
    }

    /* O += P V: P's accumulators are the A fragments of the next product; V's fragments a group
     * ahead of the products */
    uint32_t pa[BK / 16][4];
#pragma unroll
    for (int k2 = 0; k2 < BK / 16; k2++) {
      pa[k2][0] = pack_bf16(s[2 * k2][0], s[2 * k2][1]);
      pa[k2][1] = pack_bf16(s[2 * k2][2], s[2 * k2][3]);
      pa[k2][2] = pack_bf16(s[2 * k2 + 1][0], s[2 * k2 + 1][1]);
      pa[k2][3] = pack_bf16(s[2 * k2 + 1][2], s[2 * k2 + 1][3]);
    }
#pragma unroll
    for (int j = 0; j < NV; j++) {
      if (j + 1 < NV) load_v(j + 1, vf[(j + 1) & 1]);
      const int k2 = j / (ND / 2), n = 2 * (j % (ND / 2));
      const uint32_t(&f)[4] = vf[j & 1];
      mma16816(o[n], pa[k2][0], pa[k2][1], pa[k2][2], pa[k2][3], f[0], f[1]);
      mma16816(o[n + 1], pa[k2][0], pa[k2][1], pa[k2][2], pa[k2][3], f[2], f[3]);
    }
  }
  cp_wait<0>();

  if (share >= 0) { /* a split tile: this share goes out, and the second to finish merges both */
    constexpr int NF = ND * 4, NT_ = SH::THREADS;
    __shared__ int last;
    const size_t unit = (size_t)h * nq + qt;
    float *mine = a.part + (unit * 2 + share) * PF_PART_FLOATS(HD);
#pragma unroll
    for (int n = 0; n < ND; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) mine[(n * 4 + e) * NT_ + tid] = o[n][e];
#pragma unroll
    for (int r = 0; r < 2; r++) {
      mine[(NF + r) * NT_ + tid] = mrow[r];
      mine[(NF + 2 + r) * NT_ + tid] = lrow[r];
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(&a.cnt[unit], 1u) == 1u;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float *other = a.part + (unit * 2 + (1 - share)) * PF_PART_FLOATS(HD);
    float as[2], ao[2];
#pragma unroll
    for (int r = 0; r < 2; r++) { /* both maxima are a row's (its four threads hold the same) */
      const float mo = __ldcg(other + (NF + r) * NT_ + tid), lo = __ldcg(other + (NF + 2 + r) * NT_ + tid);
      const float m = fmaxf(mrow[r], mo), mu = m == -INFINITY ? 0.f : m;
      as[r] = ex2(mrow[r] - mu);
      ao[r] = ex2(mo - mu);
      lrow[r] = lrow[r] * as[r] + lo * ao[r];
    }
#pragma unroll
    for (int n = 0; n < ND; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) o[n][e] = o[n][e] * as[e >> 1] + __ldcg(other + (n * 4 + e) * NT_ + tid) * ao[e >> 1];
    if (tid == 0) a.cnt[unit] = 0; /* for the next launch (stream order keeps it after this one) */
  }

#pragma unroll
  for (int r = 0; r < 2; r++) {
    lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 1);
    lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int t = row0 + 8 * r;
    if (t >= a.T) continue;
    const float inv = 1.f / lrow[r];
    bf16 *dst = a.out + (size_t)t * a.out_ld + (size_t)h * HD + 2 * tq;
#pragma unroll
    for (int n = 0; n < ND; n++)
      *reinterpret_cast<__nv_bfloat162 *>(dst + n * 8) = __floats2bfloat162_rn(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
  }
}

template <int HD, int KEYS>
cudaError_t launch_shape(const PfAttnArgs &a, cudaStream_t st, int pdl) {
  typedef PfShape<HD, KEYS> SH;
  const int nq = (a.T + SH::BQ - 1) / SH::BQ;
  const dim3 grid((unsigned)((a.order == PF_ORDER_SPLIT ? nq + (nq - nq / 2) : nq) * a.nh));
  return kcclLaunch(k_pf_attention<HD, KEYS>, grid, dim3(SH::THREADS), SH::SMEM, st, pdl, a);
}

/* 64-key tiles exist for head sizes 64 and 128, the models' own; other sizes take 32. */
constexpr bool pf_tuned(int hd) { return hd == 64 || hd == 128; }

template <int HD>
cudaError_t launch_hd(const PfAttnArgs &a, cudaStream_t st, int pdl) {
  constexpr bool T = pf_tuned(HD);
  return T && a.keys == 64 ? launch_shape<HD, T ? 64 : 32>(a, st, pdl) : launch_shape<HD, 32>(a, st, pdl);
}

template <int HD, int KEYS>
cudaError_t attr_shape() {
  return cudaFuncSetAttribute(k_pf_attention<HD, KEYS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              (int)PfShape<HD, KEYS>::SMEM);
}

template <int HD>
cudaError_t attr_hd() {
  constexpr bool T = pf_tuned(HD);
  cudaError_t e = attr_shape<HD, 32>();
  return T && e == cudaSuccess ? attr_shape<HD, T ? 64 : 32>() : e;
}

}  // namespace

cudaError_t kie_launch_pf_attention(const PfAttnArgs &a, cudaStream_t st, int pdl) {
  return kie_with_hd(a.hd, cudaErrorInvalidValue, [&](auto h) { return launch_hd<decltype(h)::value>(a, st, pdl); });
}

cudaError_t kie_pf_attention_attributes(void) {
  cudaError_t e = attr_hd<16>();
  if (e == cudaSuccess) e = attr_hd<32>();
  if (e == cudaSuccess) e = attr_hd<64>();
  if (e == cudaSuccess) e = attr_hd<128>();
  if (e == cudaSuccess) e = attr_hd<256>();
  return e;
}
