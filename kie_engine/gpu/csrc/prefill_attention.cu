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
 * Tuned shapes (PfAttnArgs keys, chains, mma; head sizes 64 and 128) are there to
 * be measured against this one: 64-key tiles, the scores as two chains of MMAs,
 * and Hopper's warpgroup MMA for the scores, or for the scores and P V. */
#include <math.h>

#include "kie_kernels.h"

namespace {

template <int HD, int KEYS>
struct PfShape {
  static constexpr int BQ = 64;                    /* queries per block */
  static constexpr int BK = KEYS;                  /* keys per tile: 32, or 64 (prefill_attn_keys) */
  static constexpr int STAGES = KEYS == 32 ? 3 : 2; /* tiles in flight beside the one used */
  static constexpr int LDS = HD + 8;               /* shared-memory row stride (bf16) */
  static constexpr int THREADS = 128;
  static constexpr size_t SMEM = (size_t)(BQ + 2 * STAGES * BK) * LDS * 2; /* Q, then K and V per stage */
};

/* Blocks an SM must hold for the default shape to keep its residency (registers capped to
 * fit); the tuned shapes count on two (a 1,024-token chunk of 16 heads is 256 blocks: two an
 * SM hold them all), which leaves them up to 255 registers. */
template <int HD, int KEYS, int NC, int WG>
constexpr int pf_min_blocks() {
  return KEYS == 32 && NC == 1 && WG == 0 ? (HD <= 64 ? 4 : HD <= 128 ? 3 : 1) : 2;
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

/* Warpgroup MMA (sm_90a) for the scores: S (64 x N, f32) = Q (64 x 16k) K^T, both operands
 * in shared memory in the K-major layout without swizzle: 8 x 8 core matrices of 128
 * contiguous bytes (row i of one at byte 16 i), the K direction's next one 128 bytes on
 * (LBO), the next eight rows CH * 128 on (SBO).  The accumulators' layout is mma.sync's
 * m16n8 one, warp w holding rows 16 w .. 16 w + 15: d[4 n + e] is s[n][e]. */
__device__ __forceinline__ uint64_t wg_desc(const void *p, uint32_t lbo, uint32_t sbo) {
  const uint64_t a = (s_addr(p) & 0x3FFFFu) >> 4;
  return a | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32); /* swizzle bits 62-63: none */
}
/* (r, c): row r, 16-byte chunk c of a core-matrix tile of CH chunks a row, in bf16 elements */
template <int CH>
__device__ __forceinline__ int wg_off(int r, int c) {
  return ((r >> 3) * CH + c) * 64 + (r & 7) * 8;
}
/* sm_90a has them; the PTX for other GPUs does not (the host refuses prefill_attn_mma=2 there) */
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KIE_WGMMA(...) asm volatile(__VA_ARGS__)
#else
#define KIE_WGMMA(...) __trap()
#endif
__device__ __forceinline__ void wg_fence() { KIE_WGMMA("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit_wait() {
  KIE_WGMMA("wgmma.commit_group.sync.aligned;" ::: "memory");
  KIE_WGMMA("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
template <int NT>
__device__ __forceinline__ void wg_keep(float (&d)[NT][4]) { /* no access moves across the MMA */
#pragma unroll
  for (int n = 0; n < NT; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) asm volatile("" : "+f"(d[n][e])::"memory");
}
__device__ __forceinline__ void wg_mma(float (&d)[4][4], uint64_t da, uint64_t db, int acc) {
  KIE_WGMMA(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
      "%16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(da), "l"(db), "r"(acc));
}
__device__ __forceinline__ void wg_mma(float (&d)[8][4], uint64_t da, uint64_t db, int acc) {
  KIE_WGMMA(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(da), "l"(db), "r"(acc));
}

/* O += P V with P (bf16) from registers, as mma.sync's A fragments of a warp's 16 rows, and V in
 * shared memory MN-major (its 8 keys x 8 columns core matrices: LBO the next 8 keys, SBO the next
 * 8 columns; imm-trans-b = 1) */
__device__ __forceinline__ void wg_mma_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db, int acc) {
  KIE_WGMMA(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
      "}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}
__device__ __forceinline__ void wg_mma_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db, int acc) {
  KIE_WGMMA(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
      "}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
        "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}

/* NC: independent accumulator chains of the scores (1, or 2: even and odd 16-element steps of
 * the head, added at the end: half as long a chain of dependent MMAs per tile).  WG: 1 the
 * scores by warpgroup MMA from shared memory (Q and K tiles then in its core-matrix layout,
 * V as before for the mma.sync product with P); 2 both products by warpgroup MMA (V in the
 * core-matrix layout too, read MN-major; P from registers). */
template <int HD, int KEYS, int NC, int WG>
__global__ void __launch_bounds__(128, pf_min_blocks<HD, KEYS, NC, WG>()) k_pf_attention(const PfAttnArgs a) {
  kcclDevPdlWait();
  typedef PfShape<HD, KEYS> SH;
  constexpr int BQ = SH::BQ, BK = SH::BK, LDS = SH::LDS, CH = HD / 8, NT = BK / 8, ND = HD / 8;
  constexpr int ST = SH::STAGES;
  extern __shared__ __align__(16) unsigned char pf_smem[];
  bf16 *Qs = reinterpret_cast<bf16 *>(pf_smem);
  bf16 *Ks = Qs + BQ * LDS; /* [ST][BK][LDS] */
  bf16 *Vs = Ks + ST * BK * LDS;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int nq = (a.T + BQ - 1) / BQ, nb = nq * a.nh, b = (int)blockIdx.x;
  int qt = b % nq, h = b / nq;
  if (a.order == PF_ORDER_ZIGZAG) { /* r: the block's rank by work, heaviest first */
    const int half = (nb + 1) / 2, r = b < half ? b : nb - 1 - (b - half);
    qt = nq - 1 - r / a.nh;
    h = r % a.nh;
  }
  const int q0 = qt * BQ, kvh = h / a.g;
  const int P0 = *a.pos + a.first; /* the position of q's first row */
  const int qend = min(q0 + BQ, a.T);
  const int nkeys = P0 + qend; /* keys 0 .. the block's last query position */
  const bf16 *K = a.kc + (size_t)kvh * a.max_seq * HD, *V = a.vc + (size_t)kvh * a.max_seq * HD;

  /* a 16-byte chunk index i to (row, chunk): for the core-matrix layout, consecutive threads take
   * consecutive rows of one core matrix (128 contiguous bytes), else consecutive chunks of a row */
  auto rc = [&](int i, int &r, int &c) {
    if (WG) {
      c = (i >> 3) % CH;
      r = (i / (8 * CH)) * 8 + (i & 7);
    } else {
      r = i / CH;
      c = i - r * CH;
    }
  };
  for (int i = tid; i < BQ * CH; i += SH::THREADS) {
    int r, c;
    rc(i, r, c);
    const int t = q0 + r;
    cp16(Qs + (WG ? wg_off<CH>(r, c) : r * LDS + c * 8), a.q + (size_t)min(t, a.T - 1) * a.q_ld + (size_t)h * HD + c * 8,
         t < a.T);
  }
  auto load_kv = [&](int tile, int stage) {
    const int k0 = tile * BK;
    for (int i = tid; i < BK * CH; i += SH::THREADS) {
      int r, c;
      rc(i, r, c);
      const int key = k0 + r;
      const bool ok = key < nkeys;
      const size_t off = (size_t)(ok ? key : 0) * HD + c * 8;
      cp16(Ks + stage * BK * LDS + (WG ? wg_off<CH>(r, c) : r * LDS + c * 8), K + off, ok);
      cp16(Vs + stage * BK * LDS + (WG == 2 ? wg_off<CH>(r, c) : r * LDS + c * 8), V + off, ok);
    }
  };
  const int ntiles = (nkeys + BK - 1) / BK;
#pragma unroll
  for (int st = 0; st < ST - 1; st++) { /* the queries ride with the first tile's group */
    if (st < ntiles) load_kv(st, st);
    cp_commit();
  }
  uint32_t qf[HD / 16][4]; /* mma.sync's queries (unused, so not kept, with warpgroup MMA) */

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

  for (int kt = 0; kt < ntiles; kt++) {
    if (kt + ST - 1 < ntiles) load_kv(kt + ST - 1, (kt + ST - 1) % ST);
    cp_commit();
    cp_wait<ST - 1>(); /* this tile (and the queries) landed; the next ones may still be in flight */
    if (WG) asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* cp.async's writes, for the MMA's reads */
    __syncthreads();
    if (!WG && kt == 0)
#pragma unroll
      for (int kk = 0; kk < HD / 16; kk++)
        ldsm4(qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], Qs + (warp * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8);
    const bf16 *Kt = Ks + (kt % ST) * BK * LDS, *Vt = Vs + (kt % ST) * BK * LDS;
    const int kb = kt * BK;

    float sc[NC][NT][4];
    if (WG) { /* the whole warpgroup, whatever its warps' rows */
      wg_keep(sc[0]);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < HD / 16; kk++)
        wg_mma(sc[0], wg_desc(Qs + wg_off<CH>(0, 2 * kk), 128, CH * 128), wg_desc(Kt + wg_off<CH>(0, 2 * kk), 128, CH * 128),
               kk);
      wg_commit_wait();
      wg_keep(sc[0]);
    }
    /* a tile wholly past the warp's last query adds nothing (the diagonal of a 64-row block);
     * with warpgroup MMA for P V every warp takes part (its masked scores add zeros) */
    if (WG != 2 && kb > wlast) {
      __syncthreads();
      continue;
    }
    if (!WG) {
#pragma unroll
      for (int c = 0; c < NC; c++)
#pragma unroll
        for (int n = 0; n < NT; n++) sc[c][n][0] = sc[c][n][1] = sc[c][n][2] = sc[c][n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < HD / 16; kk++) {
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm4(b0, b1, b2, b3, Kt + ((n + (mi >> 1)) * 8 + rr) * LDS + kk * 16 + (mi & 1) * 8);
          mma16816(sc[kk % NC][n], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b0, b1);
          mma16816(sc[kk % NC][n + 1], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b2, b3);
        }
      }
    }
    float (&s)[NT][4] = sc[0];
#pragma unroll
    for (int c = 1; c < NC; c++)
#pragma unroll
      for (int n = 0; n < NT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[n][e] += sc[c][n][e];

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
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
    float alpha[2], muse[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float mnew = fmaxf(mrow[r], mx[r] * a.scale_log2);
      muse[r] = mnew == -INFINITY ? 0.f : mnew;
      alpha[r] = exp2f(mrow[r] - muse[r]);
      mrow[r] = mnew;
    }
    float lsum[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const float p = exp2f(fmaf(s[n][e], a.scale_log2, -muse[e >> 1]));
        s[n][e] = p;
        lsum[e >> 1] += p;
      }
#pragma unroll
    for (int r = 0; r < 2; r++) lrow[r] = lrow[r] * alpha[r] + lsum[r];
#pragma unroll
    for (int n = 0; n < ND; n++) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }

    /* O += P V: P's accumulators are the A fragments of the next product. */
    if constexpr (WG == 2) { /* 16 keys a step, V's core matrices: the next 8 keys CH * 128 bytes on, columns 128 */
      wg_keep(o);
      wg_fence();
#pragma unroll
      for (int k2 = 0; k2 < BK / 16; k2++) {
        const uint32_t pa[4] = {pack_bf16(s[2 * k2][0], s[2 * k2][1]), pack_bf16(s[2 * k2][2], s[2 * k2][3]),
                                pack_bf16(s[2 * k2 + 1][0], s[2 * k2 + 1][1]),
                                pack_bf16(s[2 * k2 + 1][2], s[2 * k2 + 1][3])};
        wg_mma_rs(o, pa, wg_desc(Vt + wg_off<CH>(16 * k2, 0), CH * 128, 128), 1);
      }
      wg_commit_wait();
      wg_keep(o);
    } else {
#pragma unroll
      for (int k2 = 0; k2 < BK / 16; k2++) {
        const uint32_t a0 = pack_bf16(s[2 * k2][0], s[2 * k2][1]), a1 = pack_bf16(s[2 * k2][2], s[2 * k2][3]);
        const uint32_t a2 = pack_bf16(s[2 * k2 + 1][0], s[2 * k2 + 1][1]);
        const uint32_t a3 = pack_bf16(s[2 * k2 + 1][2], s[2 * k2 + 1][3]);
#pragma unroll
        for (int n = 0; n < ND; n += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm4t(b0, b1, b2, b3, Vt + (k2 * 16 + (mi & 1) * 8 + rr) * LDS + (n + (mi >> 1)) * 8);
          mma16816(o[n], a0, a1, a2, a3, b0, b1);
          mma16816(o[n + 1], a0, a1, a2, a3, b2, b3);
        }
      }
    }
    __syncthreads(); /* this stage is refilled ST tiles on */
  }
  cp_wait<0>();

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

template <int HD, int KEYS, int NC, int WG = 0>
cudaError_t launch_shape(const PfAttnArgs &a, cudaStream_t st, int pdl) {
  typedef PfShape<HD, KEYS> SH;
  const dim3 grid((unsigned)((a.T + SH::BQ - 1) / SH::BQ * a.nh));
  return kcclLaunch(k_pf_attention<HD, KEYS, NC, WG>, grid, dim3(SH::THREADS), SH::SMEM, st, pdl, a);
}

/* The tuned shapes (64-key tiles, two score chains, warpgroup MMA) exist for head sizes 64 and
 * 128, the models' own; other sizes take the default. */
constexpr bool pf_tuned(int hd) { return hd == 64 || hd == 128; }

/* The shape a launch asks for at one tile size: warpgroup MMA for both products (mma 3) or the
 * scores (2), else mma.sync with one or two score chains. */
template <int HD, int KEYS>
cudaError_t launch_keys(const PfAttnArgs &a, cudaStream_t st, int pdl) {
  constexpr bool T = pf_tuned(HD);
  if (T && a.mma == 3) return launch_shape<HD, KEYS, 1, T ? 2 : 0>(a, st, pdl);
  if (T && a.mma == 2) return launch_shape<HD, KEYS, 1, T ? 1 : 0>(a, st, pdl);
  if (T && a.chains == 2) return launch_shape<HD, KEYS, T ? 2 : 1>(a, st, pdl);
  return launch_shape<HD, KEYS, 1>(a, st, pdl);
}

template <int HD>
cudaError_t launch_hd(const PfAttnArgs &a, cudaStream_t st, int pdl) {
  constexpr bool T = pf_tuned(HD);
  return T && a.keys == 64 ? launch_keys<HD, T ? 64 : 32>(a, st, pdl) : launch_keys<HD, 32>(a, st, pdl);
}

template <int HD, int KEYS, int NC, int WG = 0>
cudaError_t attr_shape() {
  return cudaFuncSetAttribute(k_pf_attention<HD, KEYS, NC, WG>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              (int)PfShape<HD, KEYS>::SMEM);
}

/* Every shape launch_keys can pick at one tile size */
template <int HD, int KEYS>
cudaError_t attr_keys() {
  constexpr bool T = pf_tuned(HD);
  cudaError_t e = attr_shape<HD, KEYS, 1>();
  if (T && e == cudaSuccess) e = attr_shape<HD, KEYS, T ? 2 : 1>();
  if (T && e == cudaSuccess) e = attr_shape<HD, KEYS, 1, T ? 1 : 0>();
  if (T && e == cudaSuccess) e = attr_shape<HD, KEYS, 1, T ? 2 : 0>();
  return e;
}

template <int HD>
cudaError_t attr_hd() {
  constexpr bool T = pf_tuned(HD);
  cudaError_t e = attr_keys<HD, 32>();
  return T && e == cudaSuccess ? attr_keys<HD, T ? 64 : 32>() : e;
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
