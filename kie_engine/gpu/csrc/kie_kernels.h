/* kie_kernels.h - the engine's kernel arguments and launchers, shared by the
 * host code (engine_internal.h and its files) and the kernel files (gemv.cu,
 * attention.cu, pick.cu, mono.cu). */
#ifndef KIE_KERNELS_H_
#define KIE_KERNELS_H_
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "kccl_device.cuh" /* kcclDevComm: the monokernel's lanes sum through KCCL's device API */
#include "kccl_launch.cuh" /* kcclLaunch and the PDL waits: kernels launched as KCCL launches its own */
#include "kie_gpu.h"

typedef __nv_bfloat16 bf16;

/* Device-side error codes (HostRing.err). */
#define KIE_DERR_POS 1     /* a position past the KV cache */
#define KIE_DERR_NAN 2     /* non-finite logits */
#define KIE_DERR_TOKEN 3   /* a token id outside the vocabulary */
#define KIE_DERR_STALL 4   /* a monokernel wait ran past its bound (argument: the stage) */
#define KIE_DERR_COMM 5    /* the monokernel's all-reduce of the lanes' sums failed (argument: the kcclResult_t) */
#define KIE_DERR_PEER 6    /* a monokernel wait for the lanes' sum ran past its bound (argument: the stage that
                              wrote the partial sum) */

/* Written by the device, read by the host without synchronizing (host-mapped). */
struct HostRing {
  int32_t token[KIE_RING];
  uint32_t seq[KIE_RING]; /* step + 1 once token[step % KIE_RING] is there */
  int32_t err, err_arg;
};

/* The position and step counters live on the device, so a captured step can be
 * replayed without the host touching anything. */
struct DevState {
  int pos;  /* first position of the tokens the next forward pass reads */
  int step; /* tokens picked so far (ring index) */
};

struct SampParams {
  float inv_temp, top_p;
  int top_k, pad;
  unsigned long long seed;
};

/* Where a step that picks a token puts it. */
struct Commit {
  DevState *st;
  HostRing *ring; /* device address of the host-mapped ring */
  int *tokbuf;    /* the next step's input token */
  int T;          /* tokens this pass consumed: the position moves by T */
};

enum { EPI_STORE = 0, EPI_QKV = 1, EPI_SWIGLU = 2, EPI_HEAD = 3, EPI_RESID = 4 };

#define GEMV_THREADS 256
#define GEMV_WARPS (GEMV_THREADS / 32)
#define GEMV_MAX_T 8 /* tokens of one prefill pass */

#define EARLY_GAMMA 1 /* the norm's gamma copied to shared memory (cp.async) */
#define EARLY_ROPE 2  /* the RoPE row of the step's position staged */

struct GemvArgs {
  const bf16 *w;
  int rows, ld;        /* ld: row length in elements, a multiple of 8 (zero padded) */
  int in;              /* logical input length (<= ld) */
  int T;               /* tokens (rows of x) */
  int prefetch;        /* before waiting for the previous kernel: 0 nothing, 1 L2 prefetch, 2 first loads */
  int segs;            /* warps sharing a unit, each a segment of the input: 1, 2, 4 or 8 */
  int u;               /* decode: 16-byte loads per row per lane in a batch, 4 or 8 */
  int pipe;            /* decode: the next round's batch loads while this one is used (u = 4) */
  int blocks_per_sm;   /* the graph path's launch: its grid at most this many blocks an SM (0: the engine's) */
  int l2_first;        /* 1: the weights' loads carry L2's evict_first policy (kie_shape.l2_evict_first) */
  int trigger_early;   /* 1: lets the next kernel launch before this one's wait (kie_shape.o_trigger_early) */
  int early;           /* what a normed GEMV stages before its wait (kie_shape.gemv_early): EARLY_GAMMA,
                          EARLY_ROPE (QKV; the position is final before the wait past a pass's first kernel) */
  /* Plain input: x [T][x_ld] (x_ld >= ld, zero past `in`). */
  const float *x;
  int x_ld;
  /* Norm-fused input (x == NULL): v = r_in (or the embedding rows of tokens) +
   * adds[0] + ... ; r_out = v (when not NULL); x = v / sqrt(mean(v^2) + eps) * gamma. */
  const float *r_in;
  const bf16 *embed;
  const int *tokens;
  const float *adds[KIE_MAX_ADDS];
  int nadd;
  float *r_out;
  int r_ld;
  const float *gamma;
  float eps;
  /* Epilogues. */
  float *out;
  int out_ld;
  /* EPI_QKV */
  int nh, nkv, hd, max_seq;
  const int *pos;
  const float *cosv, *sinv; /* [max_seq][hd / 2] */
  bf16 *kc, *vc;            /* this layer's cache, [nkv][max_seq][hd] */
  float *q_out;
  int q_ld;
  /* EPI_SWIGLU: rows = 2 * cols */
  int cols;
  /* EPI_HEAD: logits to out, argmax of the real rows to cand */
  int valid_rows, row_off, tp, rank;
  unsigned long long *amax;
  unsigned *cnt;
  float *cand;
  HostRing *ring;
  unsigned long long *clk; /* the graph path's step clock (kie_shape.step_clock), or NULL: KIE_CLK_* */
};

/* The graph path's step clock: each launch of a step has [KIE_CLK_MARKS][KIE_CLK_BLOCKS]
 * slots, each block's %globaltimer (ns) at its start, when its wait for the previous
 * kernel passed, when its input was staged and at its end (block index flattened; blocks
 * past KIE_CLK_BLOCKS and blocks without work do not mark), read by bench/kie_native's
 * kb_graph_marks: where the time of a step in the graph goes, PDL's overlap included.
 * A normed GEMV's staging also marks when thread 0's residual and sums had landed
 * (LOADED) and when the block's sum of squares was done (SUMMED); the attention marks its
 * first chunk's rows and queries in shared memory (LOADED) and its values done (SUMMED);
 * the plain GEMVs leave those two at 0. */
enum {
  KIE_CLK_START = 0,
  KIE_CLK_WAITED = 1,
  KIE_CLK_STAGED = 2,
  KIE_CLK_END = 3,
  KIE_CLK_LOADED = 4,
  KIE_CLK_SUMMED = 5,
  KIE_CLK_MARKS = 6
};
#define KIE_CLK_BLOCKS 1024

__device__ __forceinline__ unsigned long long kie_gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* This block's slot of a launch's marks (its index flattened). */
__device__ __forceinline__ unsigned kie_clock_block() {
  return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}

/* Thread 0 of a block writes mark k now (the GEMVs, whose every block marks). */
__device__ __forceinline__ void kie_clock_mark(unsigned long long *clk, int k) {
  const unsigned b = kie_clock_block();
  if (threadIdx.x == 0 && b < KIE_CLK_BLOCKS) clk[(size_t)k * KIE_CLK_BLOCKS + b] = kie_gtime();
}

/* Thread 0 of a block writes its marks (t[KIE_CLK_MARKS]) at once (the attention:
 * a block without work marks nothing). */
__device__ __forceinline__ void kie_clock_marks(unsigned long long *clk, const unsigned long long *t) {
  const unsigned b = kie_clock_block();
  if (threadIdx.x != 0 || b >= KIE_CLK_BLOCKS) return;
  for (int k = 0; k < KIE_CLK_MARKS; k++) clk[(size_t)k * KIE_CLK_BLOCKS + b] = t[k];
}

#define ATT_THREADS 128
/* Keys the graph path's shared-memory attention block holds at most (its K and V rows, padded:
 * 104 KB for head size 128). */
#define ATT_SMEM_KEYS(hd) ((hd) >= 256 ? 96 : (hd) >= 128 ? 192 : 256)
#define ATT_MAXG 8 /* query heads of one KV head a block handles */

/* AttnArgs.combine: how the last split of a (token, group) learns it is last and reads the others'
 * partial rows (attention.cuh's att_combine; kie_shape.att_combine). */
enum { ATT_COMBINE_ONE_PASS = 1, ATT_COMBINE_CHAIN = 2 };

struct AttnArgs {
  const float *q;
  int q_ld;
  const bf16 *kc, *vc; /* this layer's cache */
  int max_seq, hd, nh, g, hgroups, gper;
  int nsplit;    /* blocks per (group, token): the most splits */
  int min_chunk; /* keys per split at least */
  int kcap;      /* the shared-memory kernel (attention_smem.cu): keys a block holds at most, */
  int ksplit;    /* and of a split, when the context passes kcap; */
  int heads1;    /* and 1: a block a query head while the context fits one block (the grid: a block a head) */
  int warm;      /* the graph path's kernel: 1 runs an item's arithmetic once before its wait (attention_smem.cuh) */
  int blocks;    /* and 0: a block an item slot of its grid (heads x nsplit x T); N > 0: N x T blocks, each
                    taking the step's items i, i + N, ... */
  const int *pos;
  float scale;
  float *part;   /* [T][nh][nsplit][hd + 4] (attention.cuh's att_part_stride) */
  unsigned *cnt; /* [T][nkv * hgroups] */
  float *out;
  int out_ld;
  unsigned long long *clk; /* the graph path's step clock, or NULL (KIE_CLK_*) */
  int combine;             /* the split combine (attention.cuh): ATT_COMBINE_ONE_PASS or ATT_COMBINE_CHAIN */
};

struct FinalArgs {
  const float *cand;
  int tp;
  Commit c;
};

struct SampleArgs {
  const float *logits;
  int V;
  const SampParams *p;
  Commit c;
};

/* The monokernel (mono.cu): one decode step (T = 1) as one persistent kernel,
 * its work the same GEMVs and attention items as the per-sublayer kernels, in
 * the order of this table (built by the host once, from the same arguments). */
enum { MONO_GEMV = 0, MONO_ATTN = 1, MONO_ATTN_SMEM = 2 }; /* ATTN: the split items (attention.cuh);
                                                             ATTN_SMEM: attention_smem.cuh's items */

struct MonoStage {
  int kind;
  int epi, segs, upt; /* GEMV: epilogue, warps per unit, units per ring tile */
  /* One lane, kie_shape.mono_ll: ll_out, where this GEMV also writes its output as LL words
   * (ll_put); ll_in, the words of the stage before that this GEMV stages its input from (its
   * x, or the residual its norm reads) instead of waiting for that stage's count.  signal:
   * the stage's count is published (some stage waits for it); always with lanes. */
  unsigned long long *ll_out;
  const unsigned long long *ll_in;
  int signal;
  GemvArgs g;
  AttnArgs at;
};

/* Counters that order the stages across the grid.  They only grow: stage k of
 * step n is complete when cnt[k] reaches (n + 1) times its share count, n
 * being `epoch` (compared modulo 2^32).  Zeroed when the engine is reset. */
struct MonoSync {
  unsigned epoch, done, abort, pad;
  unsigned long long amax; /* the LM head's best key (argmax_key) */
};

/* TP > 1: what the lanes add up around stage k (one per stage, beside the table). */
struct MonoLink {
  float *sum;                /* not NULL: stage k wrote this lane's partial sum here; the reducers
                                replace it with the lanes' sum once the stage is complete */
  int nneed;                 /* the lanes' sums stage k adds (its normed input's adds) */
  int need[KIE_MAX_ADDS];    /* ... given as the stages that wrote them */
};

#define KIE_MONO_MAX_LANES 8 /* the monokernel's KCCL calls handle this many lanes */

struct MonoArgs {
  const MonoStage *stages;
  int nstages;
  MonoSync *sync;
  unsigned *cnt;      /* [nstages] */
  int pick;           /* 1: the last stage is the LM head and its argmax is the token (greedy) */
  const float *cand;  /* the head's candidate pair (tp = 1) */
  Commit c;
  HostRing *ring;
  int slot_bytes, nslots, subs; /* ring of weight tiles; attention items per block at once */
  int prefetch;                 /* tiles past the ring's the producer asks L2 for */
  int l2_first;                 /* 1: the weight tiles' copies carry L2's evict_first policy */
  int ring_off, x_off;          /* dynamic shared memory: mbarriers at 0, then these */
  int att_cap;                  /* MONO_ATTN_SMEM: keys the attention's shared memory (at x_off) holds */
  long long timeout_ns;         /* a wait longer than this ends the step with KIE_DERR_STALL */
  int sync_release;             /* 1: stage counts by release reductions, polled relaxed (kie_shape.mono_sync 0 or 2) */
  int stage_ahead;              /* 1: each stage's table entry loaded while the stage before runs (kie_shape.mono_ahead 0
                                   or 1; one lane) */
  unsigned long long *marks;    /* [nstages][4][grid]: each block's clock at each stage's start, x staged,
                                   end, and its producer's first copy (mono.cu's MARK_*) */
  /* Lanes (tp > 1 runs the kernel's TP copy, which alone reads what follows). */
  int tp;
  const MonoLink *links;        /* [nstages] */
  unsigned *rcnt;               /* [nstages]: reducers done with stage k's sum, growing as cnt does */
  int nred, red_per, sum_count; /* reducer blocks (the grid's last; KCCL slots 0..nred-1), floats each
                                   (the last: the rest), floats of a sum */
  kcclDevComm dc;               /* channel 1 of the lanes' communicator */
};

#define MONO_CONSUMERS GEMV_THREADS /* the GEMV's threads: the same reduction order */
#define MONO_LL_NORM_VEC4 (MONO_CONSUMERS * 8) /* mono_ll: a normed stage's input at most this many float4s */
#define MONO_RESID_ROWS 128         /* EPI_RESID stage: residual rows a block holds in shared memory */
#define MONO_THREADS (MONO_CONSUMERS + 32) /* and a producer warp streaming the weights */
#define MONO_SUBS_MAX (MONO_CONSUMERS / ATT_THREADS)

/* A batched prefill pass (prefill.cu): the row-wise kernels around its GEMMs
 * (prefill_kernels.cu) and its causal attention (prefill_attention.cu). */
struct PfNormArgs {
  const float *r_in;   /* [T][ld] residual, or NULL: the embedding rows of tokens */
  const bf16 *embed;
  const int *tokens;
  const float *adds[KIE_MAX_ADDS]; /* [T][ld] sums due */
  int nadd;
  const bf16 *add16;   /* [T][ld] a sum due in bf16 (the last sublayer's product), or NULL */
  float *r_out;        /* [T][ld] updated residual (may be r_in) */
  int ld, hidden, T;
  const float *gamma;
  float eps;
  bf16 *x;             /* [T][x_ld] normed */
  int x_ld;
};

struct PfRopeArgs {
  const float *y;      /* [T][y_ld]: q rows, k rows, v rows of this lane */
  int y_ld, T, nh, nkv, hd, max_seq;
  const int *pos;
  const float *cosv, *sinv;
  bf16 *q;             /* [T][q_ld] */
  int q_ld;
  bf16 *kc, *vc;
  HostRing *ring;
};

struct PfSwigluArgs {
  const bf16 *gu;      /* [T][gu_ld]: cols gate columns, then cols up columns */
  int gu_ld, cols, T;
  bf16 *act;           /* [T][act_ld] */
  int act_ld;
};

struct PfAttnArgs {
  const bf16 *q;       /* [T][q_ld], head h at h * hd: the chunk's rows first .. first + T - 1 */
  int q_ld;
  const bf16 *kc, *vc; /* this layer's cache; the chunk's keys already written at pos .. */
  int max_seq, hd, nh, g, T;
  const int *pos;
  int first;           /* q's row r is the chunk's row first + r, at position pos + first + r */
  float scale_log2;    /* 1 / sqrt(hd) * log2(e) */
  bf16 *out;           /* [T][out_ld] */
  int out_ld;
  int order;           /* PF_ORDER_*: which block takes which (query tile, head) */
  int keys;            /* keys per tile: 32, or 64 (head sizes 64 and 128) */
  float *part;         /* PF_ORDER_SPLIT: each split tile's two shares, [head][tile][2][PF_PART_FLOATS] */
  unsigned *cnt;       /* and its count of shares done, [head][tile], zero between launches */
};
/* Queries per block of the prefill attention, and the floats of one split block's share (its
 * 128 threads' output accumulators, row maxima and sums) */
#define PF_BQ 64
#define PF_PART_FLOATS(hd) ((size_t)128 * ((hd) / 2 + 4))
/* Query tiles of a chunk of `chunk` tokens over `heads` heads: the split blocks' shares and
 * counts are sized by it */
#define PF_QUERY_TILES(heads, chunk) ((size_t)(heads) * (((chunk) + PF_BQ - 1) / PF_BQ))
/* Causality makes a query tile's work grow with its index.  Launch order gives block b
 * head b / tiles, tile b % tiles; zigzag gives the first half of the blocks the longest
 * tiles, longest first, and the second half the shortest first, so that the blocks the
 * scheduler puts together on an SM (b and about b + SMs) add up to similar work. */
#define PF_ORDER_LAUNCH 1
#define PF_ORDER_ZIGZAG 2
/* Split: the longer half of a head's query tiles (index nq / 2 on) each take two blocks, keys
 * before and from a tile boundary at most half way and no later than the tile's first query;
 * the second block to finish merges the first's share (PfAttnArgs.part) into its own and
 * writes the rows.  Blocks go heaviest first (a split block's keys are about half its tile's). */
#define PF_ORDER_SPLIT 3

/* The prefill's row and attention kernels wait for their predecessor with
 * griddepcontrol.wait (pdl: launched with programmatic stream serialization, so that
 * a launch overlaps the end of the cuBLAS product before it); none triggers early. */
cudaError_t kie_launch_pf_norm(const PfNormArgs &a, cudaStream_t st, int pdl);
cudaError_t kie_launch_pf_rope(const PfRopeArgs &a, cudaStream_t st, int pdl);
cudaError_t kie_launch_pf_swiglu(const PfSwigluArgs &a, cudaStream_t st, int pdl);
cudaError_t kie_launch_pf_attention(const PfAttnArgs &a, cudaStream_t st, int pdl);
cudaError_t kie_pf_attention_attributes(void);

/* Launchers: grid and dynamic shared memory chosen by the caller; pdl launches
 * with programmatic stream serialization (the kernel waits for its predecessor
 * with griddepcontrol.wait). */
cudaError_t kie_launch_gemv(const GemvArgs &a, int epi, int xs, int grid, size_t smem, cudaStream_t st, int pdl);
/* carveout: cudaFuncAttributePreferredSharedMemoryCarveout (percent), 0: the driver's choice */
cudaError_t kie_gemv_attributes(size_t max_smem, int carveout);
cudaError_t kie_launch_attention(const AttnArgs &a, int T, cudaStream_t st, int pdl);
cudaError_t kie_launch_attention_smem(const AttnArgs &a, int T, cudaStream_t st, int pdl);
cudaError_t kie_attention_smem_attributes(void);
cudaError_t kie_launch_finalize(const FinalArgs &a, cudaStream_t st, int pdl);
cudaError_t kie_launch_advance(const Commit &c, cudaStream_t st, int pdl);
cudaError_t kie_launch_sample(const SampleArgs &a, cudaStream_t st, int pdl);
/* mono.cu: the dynamic shared memory a block of head size hd needs for
 * attention (cap 0: the split items, MONO_SUBS_MAX at once; else an item
 * holding cap keys in shared memory); the static shared memory of the
 * kernel for tp lanes (its TP copy when tp > 1); the kernel set up for `smem`
 * bytes of dynamic shared memory (*per_sm: blocks that fit an SM); the
 * launch, cooperative (m.tp picks the copy). */
size_t kie_mono_attention_smem(int hd, int cap);
cudaError_t kie_mono_static_smem(int hd, int tp, size_t *bytes);
cudaError_t kie_mono_prepare(int hd, int tp, size_t smem, int *per_sm);
cudaError_t kie_launch_mono(const MonoArgs &m, int hd, int grid, size_t smem, cudaStream_t st);
cudaError_t kie_launch_fill_random(bf16 *p, size_t n, uint32_t seed, float scale, cudaStream_t st);

/* The head sizes the attention is compiled for (derive() admits exactly these):
 * f(std::integral_constant<int, HD>{}) for hd, `other` for any other size. */
template <typename R, typename F>
static inline R kie_with_hd(int hd, R other, F f) {
  switch (hd) {
    case 16: return f(std::integral_constant<int, 16>{});
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 256: return f(std::integral_constant<int, 256>{});
  }
  return other;
}

#ifdef __CUDACC__
/* Every kernel waits for its predecessor before reading what it wrote
 * (kcclDevPdlWait, kccl_launch.cuh), then lets its own successor start
 * launching (kcclDevPdlTrigger): triggering only after the wait keeps at most two
 * kernels of the stream resident, so a chain of early-launched kernels never
 * holds the SMs that the running one needs.  The one exception is a switch
 * (GemvArgs.trigger_early, on the o GEMV only): three kernels, the attention's
 * blocks all resident before the o GEMV launched.  Launches: kcclLaunch. */
__device__ __forceinline__ void kie_set_error(HostRing *ring, int code, int arg) {
  if (atomicCAS(&ring->err, 0, code) == 0) ring->err_arg = arg;
  __threadfence_system();
}

/* The token is the next step's input, and goes to the host ring (the token
 * first, then its sequence number, each made visible to the host in order). */
__device__ __forceinline__ void kie_commit(const Commit &c, int token) {
  const int step = c.st->step;
  c.tokbuf[0] = token;
  c.ring->token[step % KIE_RING] = token;
  __threadfence_system();
  *(volatile uint32_t *)&c.ring->seq[step % KIE_RING] = (uint32_t)step + 1u;
  __threadfence_system();
  c.st->step = step + 1;
  c.st->pos += c.T;
}

/* Greedy: the best of the lanes' (value, id) candidates, the first lane on ties;
 * non-finite logits are an error (the token then is 0). */
__device__ __forceinline__ void kie_finalize_pick(const float *cand, int tp, const Commit &c) {
  int best = 0;
  bool bad = false;
  for (int r = 0; r < tp; r++) {
    const float v = cand[r];
    if (isnan(v)) bad = true;
    if (v > cand[best]) best = r;
  }
  const float v = cand[best];
  if (bad || isinf(v)) kie_set_error(c.ring, KIE_DERR_NAN, c.st->step);
  kie_commit(c, bad || isinf(v) ? 0 : (int)cand[tp + best]);
}
#endif
#endif
