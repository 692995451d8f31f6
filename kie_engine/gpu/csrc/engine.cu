/* engine.cu - the host side of KIE's GPU engine: memory, weights, the step as a
 * sequence of launches, its CUDA graphs, and the token ring.
 *
 * One step for T tokens (decode: T = 1, captured; prefill: T <= tmax, eager):
 *
 *   per sublayer i (attention, MLP, attention, ...):
 *     normed GEMV   residual R + the sum due (DTP) -> R', RMSNorm -> QKV (+RoPE, KV write) or gate/up (+SwiGLU)
 *     [attention]   split over the context, last block combines
 *     GEMV          o or down projection -> the partial sum S_i
 *     sum           KCCL all-reduce of S_i over the lanes: in line (delay 0) or split phase (delay d)
 *   normed GEMV     final norm -> LM head slice, argmax candidate
 *   pick            sum of the lanes' candidates + finalize, or gather + sample, or advance
 *
 * DTP delay d: sublayer i reads the residual without the sums of sublayers
 * i-d .. i-1, so S_j is added by the normed GEMV of sublayer j+1+d (and the last
 * d+1 by the final norm); d+1 sum buffers rotate.  With d = 0 it is a plain
 * Llama step.
 *
 * The monokernel (mono.cu) runs the same ops from a stage table built by the
 * same walk; its lanes sum S_i inside the kernel (KCCL's device API) and the
 * stage that adds S_i waits for that sum, so it computes what this path does. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <vector>

#include "kie_kernels.h"

namespace {

thread_local char g_err[1024];

int fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_err, sizeof g_err, fmt, ap);
  va_end(ap);
  return code;
}

#define CU(call)                                                                                         \
  do {                                                                                                   \
    cudaError_t e_ = (call);                                                                             \
    if (e_ != cudaSuccess)                                                                               \
      return fail(KIE_E_CUDA, "%s: %s (%s:%d)", #call, cudaGetErrorString(e_), __FILE__, __LINE__);    \
  } while (0)
#define TRY(call)                  \
  do {                             \
    int rc_ = (call);              \
    if (rc_ != KIE_OK) return rc_; \
  } while (0)

/* KCCL's signatures (kccl.h), called through the addresses the caller passed. */
typedef int (*fn_all_reduce)(const void *, void *, size_t, int, int, void *, void *);
typedef int (*fn_start)(const void *, void *, size_t, int, int, void *, void *, uint64_t *);
typedef int (*fn_wait)(void *, uint64_t, void *);
typedef int (*fn_all_gather)(const void *, void *, size_t, int, void *, void *);
typedef int (*fn_async_error)(void *, int *);
typedef const char *(*fn_last_error)(void *);
typedef int (*fn_dev_comm)(void *, void *, size_t);
const int KCCL_FLOAT32 = 7, KCCL_SUM = 0;

const size_t XS_MAX = 64 * 1024;   /* shared memory for x in a GEMV block: two blocks per SM still fit */

/* The monokernel's lanes: floats a reducer block sums per call (an 8-byte line
 * per consumer thread, KCCL's one-line-per-thread path), and SMs left free of
 * its blocks when lanes share a GPU, for the kernels the other lanes run
 * before theirs (KCCL's rule for waiting kernels, kccl_device.cuh). */
const int MONO_RED_FLOATS = 2 * MONO_CONSUMERS;
const int MONO_FREE_SMS = 4;

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

struct Layer {
  bf16 *wqkv, *wo, *wgu, *wd, *kc, *vc;
  float *n1, *n2;
};

}  // namespace

struct kie_engine {
  kie_shape s;
  kie_comm c;
  int device, sms;
  int hid_pad, qdim, kvdim, qkv_rows, inter_pad, tmax;
  int g, gper, hgroups, nsplit, att_chunk, gemv_grid_max, gemv_u;
  size_t bytes;
  char *arena;
  std::vector<Layer> L;
  bf16 *embed, *head;
  float *normf, *rcos, *rsin;
  float *R[2], *qbuf, *att, *act, *sums, *logits, *logits_all, *cand, *part;
  unsigned *att_cnt, *head_cnt;
  unsigned long long *amax;
  int *tokbuf;
  DevState *st;
  SampParams *samp;
  HostRing *ring_h, *ring_d;
  cudaStream_t stream;
  cudaGraphExec_t graph[3];
  int graph_nodes;
  /* The monokernel: its stage table and counters (in the arena), its launch shape. */
  MonoStage *mono_stages;
  MonoSync *mono_sync;
  unsigned *mono_cnt;             /* [2 mono_n]: the stages' counts, then their lanes' sums' (rcnt) */
  MonoLink *mono_links;
  unsigned long long *mono_marks;
  int mono_n, mono_ready, mono_slot, mono_nslots, mono_xbytes, mono_grid, mono_nred, mono_red_per;
  size_t mono_smem;
  kcclDevComm dc;                 /* tp > 1 and the monokernel: the communicator's device-API handle */
  std::vector<char> have; /* which uploads have arrived */
  std::vector<uint64_t> req;
  int pos_h, step_h;      /* the host's count of what it enqueued */
  int sampling_set;
};

namespace {

/* Sizes that follow from the shape and the device; an error names what does not fit. */
int derive(kie_engine *e, const kie_shape &s, int sms) {
  if (s.hidden < 1 || s.inter < 1 || s.layers < 1 || s.heads < 1 || s.kv_heads < 1 || s.vocab < 1 ||
      s.vocab_part < 1 || s.max_seq < 1)
    return fail(KIE_E_ARG, "every size of the shape must be positive");
  if (s.heads % s.kv_heads)
    return fail(KIE_E_ARG, "heads=%d is not a multiple of kv_heads=%d", s.heads, s.kv_heads);
  if (s.head_dim < 16 || s.head_dim > 256 || (s.head_dim & (s.head_dim - 1)))
    return fail(KIE_E_ARG, "head_dim=%d: the GPU attention takes a power of two from 16 to 256", s.head_dim);
  if (s.vocab_valid < 0 || s.vocab_valid > s.vocab_part || s.vocab_off < 0 || s.vocab_off + s.vocab_valid > s.vocab)
    return fail(KIE_E_ARG, "vocabulary slice [%d, %d + %d) of %d rows does not fit the vocabulary of %d", s.vocab_off,
                s.vocab_off, s.vocab_valid, s.vocab_part, s.vocab);
  if (s.vocab > (1 << 23))
    return fail(KIE_E_ARG, "vocab=%d: the GPU sampler takes at most %d tokens", s.vocab, 1 << 23);
  if (s.dtp_delay < 0 || s.dtp_delay > KIE_MAX_ADDS - 1)
    return fail(KIE_E_ARG, "dtp_delay=%d: 0..%d", s.dtp_delay, KIE_MAX_ADDS - 1);
  if (s.tp_size < 1 || s.tp_rank < 0 || s.tp_rank >= s.tp_size)
    return fail(KIE_E_ARG, "tp_rank=%d of tp_size=%d", s.tp_rank, s.tp_size);
  if (!(s.eps > 0.f)) return fail(KIE_E_ARG, "eps must be positive");
  e->s = s;
  e->sms = sms;
  e->hid_pad = (int)round_up((size_t)s.hidden, 8);
  e->inter_pad = (int)round_up((size_t)s.inter, 8);
  e->qdim = s.heads * s.head_dim;
  e->kvdim = s.kv_heads * s.head_dim;
  e->qkv_rows = e->qdim + 2 * e->kvdim;
  e->tmax = (int)std::min<size_t>(GEMV_MAX_T, XS_MAX / (4 * (size_t)e->hid_pad));
  if (e->tmax < 1)
    return fail(KIE_E_ARG, "hidden=%d: the normed GEMV keeps a token's activations in %zu KB of shared memory",
                s.hidden, XS_MAX / 1024);
  e->g = s.heads / s.kv_heads;
  e->gper = std::min(e->g, ATT_MAXG);
  e->hgroups = (e->g + e->gper - 1) / e->gper;
  const int groups = s.kv_heads * e->hgroups;
  /* Enough blocks to cover the SMs twice at a long context; a short one uses fewer. */
  e->nsplit = std::max(1, std::min(std::min(s.max_seq, 1024), (2 * sms + groups - 1) / groups));
  if (s.att_chunk < 0) return fail(KIE_E_ARG, "att_chunk=%d", s.att_chunk);
  e->att_chunk = s.att_chunk ? s.att_chunk : 32; /* the fastest of 16..256 on the 2b shape (bench/RESULTS.md) */
  const int bps = s.gemv_blocks_per_sm > 0 ? s.gemv_blocks_per_sm : 2;
  e->gemv_grid_max = bps * sms;
  if (s.gemv_u != 0 && s.gemv_u != 4 && s.gemv_u != 8) return fail(KIE_E_ARG, "gemv_u=%d: 4 or 8 (0: auto)", s.gemv_u);
  e->gemv_u = s.gemv_u ? s.gemv_u : 8;
  if (s.prefetch < 0 || s.prefetch > 2) return fail(KIE_E_ARG, "prefetch=%d: 0, 1 or 2", s.prefetch);
  if (s.kernel != KIE_KERNEL_GRAPH && s.kernel != KIE_KERNEL_MONO)
    return fail(KIE_E_ARG, "kernel=%d: KIE_KERNEL_GRAPH (0) or KIE_KERNEL_MONO (1)", s.kernel);
  if (s.kernel == KIE_KERNEL_MONO && s.tp_size > KIE_MONO_MAX_LANES)
    return fail(KIE_E_ARG, "the monokernel sums at most %d lanes; use the graph kernel for tp_size=%d",
                KIE_MONO_MAX_LANES, s.tp_size);
  if (s.kernel == KIE_KERNEL_MONO && s.tp_size > 1 &&
      round_up((size_t)s.hidden, 8) > (size_t)KCCL_DEV_MAX_BLOCKS * (KCCL_LL_MAX_BYTES / 4))
    return fail(KIE_E_ARG, "hidden=%d: the monokernel's lanes sum at most %d floats per sublayer (%d KCCL slots "
                "of %d bytes); use the graph kernel", s.hidden, KCCL_DEV_MAX_BLOCKS * (KCCL_LL_MAX_BYTES / 4),
                KCCL_DEV_MAX_BLOCKS, KCCL_LL_MAX_BYTES);
  if (s.mono_prefetch < -1 || s.mono_prefetch > 64) return fail(KIE_E_ARG, "mono_prefetch=%d: -1..64", s.mono_prefetch);
  if (s.lanes_per_device < 0) return fail(KIE_E_ARG, "lanes_per_device=%d", s.lanes_per_device);
  if (s.mono_blocks < 0) return fail(KIE_E_ARG, "mono_blocks=%d: 0 (auto) or a block count", s.mono_blocks);
  e->mono_n = 5 * s.layers + 1; /* per layer QKV, attention, o, gate/up, down; the head */
  return KIE_OK;
}

/* Carves the arena (base == NULL: only counts).  Returns its size. */
size_t layout(kie_engine *e, char *base) {
  size_t at = 0;
  auto take = [&](size_t bytes) -> char * {
    at = round_up(at, 256);
    char *p = base ? base + at : nullptr;
    at += bytes;
    return p;
  };
  const kie_shape &s = e->s;
  const size_t hp = (size_t)e->hid_pad, T = (size_t)e->tmax, hd = (size_t)s.head_dim;
  e->embed = (bf16 *)take((size_t)s.vocab * hp * 2);
  e->L.assign((size_t)s.layers, Layer{});
  for (int l = 0; l < s.layers; l++) {
    Layer &y = e->L[(size_t)l];
    y.wqkv = (bf16 *)take((size_t)e->qkv_rows * hp * 2);
    y.wo = (bf16 *)take((size_t)s.hidden * e->qdim * 2);
    y.wgu = (bf16 *)take(2 * (size_t)s.inter * hp * 2);
    y.wd = (bf16 *)take((size_t)s.hidden * e->inter_pad * 2);
    y.n1 = (float *)take(hp * 4);
    y.n2 = (float *)take(hp * 4);
    y.kc = (bf16 *)take((size_t)s.kv_heads * s.max_seq * hd * 2);
    y.vc = (bf16 *)take((size_t)s.kv_heads * s.max_seq * hd * 2);
  }
  e->head = (bf16 *)take((size_t)s.vocab_part * hp * 2);
  e->normf = (float *)take(hp * 4);
  e->rcos = (float *)take((size_t)s.max_seq * (hd / 2) * 4);
  e->rsin = (float *)take((size_t)s.max_seq * (hd / 2) * 4);
  e->R[0] = (float *)take(T * hp * 4);
  e->R[1] = (float *)take(T * hp * 4);
  e->qbuf = (float *)take(T * e->qdim * 4);
  e->att = (float *)take(T * e->qdim * 4);
  e->act = (float *)take(T * e->inter_pad * 4);
  e->sums = (float *)take((size_t)(s.dtp_delay + 1) * T * hp * 4);
  e->logits = (float *)take((size_t)s.vocab_part * 4);
  e->logits_all = (float *)take((size_t)s.tp_size * s.vocab_part * 4);
  e->cand = (float *)take(256);
  e->part = (float *)take(T * s.heads * e->nsplit * (hd + 2) * 4);
  e->att_cnt = (unsigned *)take(T * s.kv_heads * e->hgroups * 4);
  e->head_cnt = (unsigned *)take(16);
  e->amax = (unsigned long long *)take(16);
  e->tokbuf = (int *)take(T * 4);
  e->st = (DevState *)take(sizeof(DevState));
  e->samp = (SampParams *)take(sizeof(SampParams));
  e->mono_stages = (MonoStage *)take((size_t)e->mono_n * sizeof(MonoStage));
  e->mono_sync = (MonoSync *)take(sizeof(MonoSync));
  e->mono_cnt = (unsigned *)take((size_t)e->mono_n * 8);
  e->mono_links = (MonoLink *)take((size_t)e->mono_n * sizeof(MonoLink));
  e->mono_marks = (unsigned long long *)take((size_t)e->mono_n * 16);
  return round_up(at, 256);
}

int n_uploads(const kie_shape &s) { return 5 + 6 * s.layers; }
int upload_index(const kie_shape &s, int kind, int layer) {
  switch (kind) {
    case KIE_W_EMBED: return 0;
    case KIE_W_HEAD: return 1;
    case KIE_F_FINAL_NORM: return 2;
    case KIE_F_ROPE_COS: return 3;
    case KIE_F_ROPE_SIN: return 4;
    case KIE_W_QKV: return 5 + 6 * layer;
    case KIE_W_O: return 6 + 6 * layer;
    case KIE_W_GATE_UP: return 7 + 6 * layer;
    case KIE_W_DOWN: return 8 + 6 * layer;
    case KIE_F_ATTN_NORM: return 9 + 6 * layer;
    case KIE_F_MLP_NORM: return 10 + 6 * layer;
  }
  (void)s;
  return -1;
}

int comm_fail(kie_engine *e, int rc, const char *what) {
  const char *why = e->c.last_error ? ((fn_last_error)e->c.last_error)(e->c.comm) : "";
  return fail(KIE_E_COMM, "%s: KCCL error %d: %s", what, rc, why ? why : "");
}

int all_reduce(kie_engine *e, float *p, size_t count) {
  const int rc = ((fn_all_reduce)e->c.all_reduce)(p, p, count, KCCL_FLOAT32, KCCL_SUM, e->c.comm, e->stream);
  return rc ? comm_fail(e, rc, "all-reduce of a sublayer's sum") : KIE_OK;
}

int sum_start(kie_engine *e, float *p, size_t count, uint64_t *req) {
  const int rc = ((fn_start)e->c.start)(p, p, count, KCCL_FLOAT32, KCCL_SUM, e->c.comm, e->stream, req);
  return rc ? comm_fail(e, rc, "split-phase all-reduce start") : KIE_OK;
}

int sum_wait(kie_engine *e, uint64_t req) {
  const int rc = ((fn_wait)e->c.wait)(e->c.comm, req, e->stream);
  return rc ? comm_fail(e, rc, "split-phase all-reduce wait") : KIE_OK;
}

/* Segments per unit: enough warps that each streams about one batch of loads
 * (a batch is 32 lanes x U 16-byte loads per row).  The monokernel takes the
 * same count, so that both sum in the same order. */
int gemv_segs(kie_engine *e, GemvArgs &a) {
  a.u = a.T > 1 ? 2 : e->s.gemv_pipe ? 4 : e->gemv_u;
  const int batch = 32 * a.u, nvec = a.ld / 8;
  int segs = 1;
  while (segs < GEMV_WARPS && (nvec + segs - 1) / segs > batch) segs *= 2;
  return segs;
}

int gemv(kie_engine *e, GemvArgs &a, int epi) {
  const size_t xbytes = (size_t)a.T * a.ld * 4;
  /* x in shared memory (staged by every block), or read through L1 where each
   * warp uses it (plain GEMVs only: the normed ones compute x in shared memory). */
  const int xs = a.x == nullptr || (xbytes <= XS_MAX && !e->s.gemv_x_l1);
  if (a.x == nullptr && xbytes > XS_MAX) return fail(KIE_E_ARG, "normed GEMV input of %zu bytes", xbytes);
  const int units = epi == EPI_SWIGLU ? a.cols : (a.rows + 1) / 2;
  a.segs = gemv_segs(e, a);
  /* The pipelined loop takes one batch per segment. */
  a.pipe = a.T == 1 && e->s.gemv_pipe && (a.ld / 8 + a.segs - 1) / a.segs <= 32 * a.u;
  const int upb = GEMV_WARPS / a.segs;
  const int grid = std::max(1, std::min(e->gemv_grid_max, (units + upb - 1) / upb));
  CU(kie_launch_gemv(a, epi, xs, grid, xs ? xbytes : 0, e->stream, e->s.pdl));
  return KIE_OK;
}

float *sum_buf(kie_engine *e, int j) {
  return e->sums + (size_t)(j % (e->s.dtp_delay + 1)) * e->tmax * e->hid_pad;
}

GemvArgs normed(kie_engine *e, int T, const float *r_in, float *r_out, const float *gamma) {
  GemvArgs a;
  memset(&a, 0, sizeof a);
  a.T = T;
  a.x = nullptr;
  a.in = e->s.hidden;
  a.ld = e->hid_pad;
  a.r_in = r_in;
  a.r_out = r_out;
  a.r_ld = e->hid_pad;
  a.embed = e->embed;
  a.tokens = e->tokbuf;
  a.gamma = gamma;
  a.eps = e->s.eps;
  a.prefetch = e->s.prefetch;
  a.ring = e->ring_d;
  return a;
}

GemvArgs plain(kie_engine *e, int T, const float *x, int in, int x_ld) {
  GemvArgs a;
  memset(&a, 0, sizeof a);
  a.prefetch = e->s.prefetch;
  a.ring = e->ring_d;
  a.T = T;
  a.x = x;
  a.in = in;
  a.ld = x_ld;
  a.x_ld = x_ld;
  return a;
}

/* The arguments of each op of a step (shared by the per-sublayer launches,
 * the layer benchmark and the monokernel's stage table). */
void qkv_args(kie_engine *e, int l, GemvArgs &a) {
  const Layer &y = e->L[(size_t)l];
  a.w = y.wqkv;
  a.rows = e->qkv_rows;
  a.nh = e->s.heads;
  a.nkv = e->s.kv_heads;
  a.hd = e->s.head_dim;
  a.max_seq = e->s.max_seq;
  a.pos = &e->st->pos;
  a.cosv = e->rcos;
  a.sinv = e->rsin;
  a.kc = y.kc;
  a.vc = y.vc;
  a.q_out = e->qbuf;
  a.q_ld = e->qdim;
}

void gate_up_args(kie_engine *e, int l, GemvArgs &a) {
  a.w = e->L[(size_t)l].wgu;
  a.rows = 2 * e->s.inter;
  a.cols = e->s.inter;
  a.out = e->act;
  a.out_ld = e->inter_pad;
}

/* A row-parallel GEMV (o or down projection): this lane's partial sum of the sublayer to S. */
GemvArgs partial_sum_args(kie_engine *e, int T, const float *x, int in, int x_ld, const bf16 *w, float *S) {
  GemvArgs a = plain(e, T, x, in, x_ld);
  a.w = w;
  a.rows = e->s.hidden;
  a.out = S;
  a.out_ld = e->hid_pad;
  return a;
}

AttnArgs attention_args(kie_engine *e, int l) {
  AttnArgs a;
  memset(&a, 0, sizeof a);
  a.q = e->qbuf;
  a.q_ld = e->qdim;
  a.kc = e->L[(size_t)l].kc;
  a.vc = e->L[(size_t)l].vc;
  a.max_seq = e->s.max_seq;
  a.hd = e->s.head_dim;
  a.nh = e->s.heads;
  a.g = e->g;
  a.hgroups = e->hgroups;
  a.gper = e->gper;
  a.nsplit = e->nsplit;
  a.min_chunk = e->att_chunk;
  a.pos = &e->st->pos;
  a.scale = (float)(1.0 / sqrt((double)e->s.head_dim));
  a.part = e->part;
  a.cnt = e->att_cnt;
  a.out = e->att;
  a.out_ld = e->qdim;
  return a;
}

/* The ops of one forward pass of T tokens, in order, handed to the visitor v:
 *   v.gemv(GemvArgs &, epi)    a GEMV and its epilogue
 *   v.attention(AttnArgs &)    attention of one layer
 *   v.sum(S, i)                the lanes' sum of sublayer i (tp > 1)
 *   v.wait(i)                  the split-phase sum of sublayer i joined (tp > 1, delay > 0)
 * and, with `head`, the final norm and the LM head (its argmax candidate). */
template <typename V>
int walk_forward(kie_engine *e, int T, bool head, V &v) {
  const kie_shape &s = e->s;
  const int nsub = 2 * s.layers, d = s.dtp_delay, tp = s.tp_size;
  int cur = 0;
  for (int i = 0; i < nsub; i++) {
    const int l = i / 2, sub = i % 2;
    const Layer &y = e->L[(size_t)l];
    GemvArgs a = normed(e, T, i == 0 ? nullptr : e->R[cur], e->R[cur ^ 1], sub ? y.n2 : y.n1);
    const int j = i - 1 - d;
    if (j >= 0) {
      if (tp > 1 && d > 0) TRY(v.wait(j));
      a.adds[a.nadd++] = sum_buf(e, j);
    }
    cur ^= 1;
    float *S = sum_buf(e, i);
    if (sub == 0) {
      qkv_args(e, l, a);
      TRY(v.gemv(a, EPI_QKV));
      AttnArgs at = attention_args(e, l);
      TRY(v.attention(at));
      GemvArgs o = partial_sum_args(e, T, e->att, e->qdim, e->qdim, y.wo, S);
      TRY(v.gemv(o, EPI_STORE));
    } else {
      gate_up_args(e, l, a);
      TRY(v.gemv(a, EPI_SWIGLU));
      GemvArgs dn = partial_sum_args(e, T, e->act, s.inter, e->inter_pad, y.wd, S);
      TRY(v.gemv(dn, EPI_STORE));
    }
    if (tp > 1) TRY(v.sum(S, i));
  }
  /* The sums still in flight: the final norm adds them (or, without a head,
   * they are only joined, so that nothing is outstanding when the pass ends). */
  if (tp > 1 && d > 0) TRY(v.wait(nsub - 1));
  if (!head) return KIE_OK;
  const size_t last_row = (size_t)(T - 1) * e->hid_pad;
  GemvArgs h = normed(e, 1, e->R[cur] + last_row, nullptr, e->normf);
  for (int j = std::max(0, nsub - 1 - d); j < nsub; j++) h.adds[h.nadd++] = sum_buf(e, j) + last_row;
  h.w = e->head;
  h.rows = s.vocab_part;
  h.out = e->logits;
  h.valid_rows = s.vocab_valid;
  h.row_off = s.vocab_off;
  h.tp = tp;
  h.rank = s.tp_rank;
  h.amax = e->amax;
  h.cnt = e->head_cnt;
  h.cand = e->cand;
  return v.gemv(h, EPI_HEAD);
}

/* The per-sublayer path: each op a kernel (or KCCL call) on the engine's stream. */
struct Launcher {
  kie_engine *e;
  size_t sum_count;
  int T;
  int gemv(GemvArgs &a, int epi) { return ::gemv(e, a, epi); }
  int attention(AttnArgs &a) {
    CU(kie_launch_attention(a, T, e->stream, e->s.pdl));
    return KIE_OK;
  }
  int sum(float *S, int i) {
    if (e->s.dtp_delay == 0) return all_reduce(e, S, sum_count);
    return sum_start(e, S, sum_count, &e->req[(size_t)i]);
  }
  int wait(int j) { return sum_wait(e, e->req[(size_t)j]); }
};

Commit commit_of(kie_engine *e, int T) {
  Commit c;
  c.st = e->st;
  c.ring = e->ring_d;
  c.tokbuf = e->tokbuf;
  c.T = T;
  return c;
}

int enqueue_pick(kie_engine *e, int T, int mode);

/* One forward pass of T tokens (tokbuf, from the device position) ending with `mode`. */
int enqueue_forward(kie_engine *e, int T, int mode) {
  const kie_shape &s = e->s;
  e->req.assign((size_t)(2 * s.layers), 0);
  Launcher v{e, (size_t)T * e->hid_pad, T};
  TRY(walk_forward(e, T, mode != KIE_MODE_ADVANCE, v));
  return enqueue_pick(e, T, mode);
}

/* What follows the LM head: the pick that commits the token, or for a chunk
 * without a pick the position's advance. */
int enqueue_pick(kie_engine *e, int T, int mode) {
  const kie_shape &s = e->s;
  const int tp = s.tp_size;
  if (mode == KIE_MODE_ADVANCE) {
    CU(kie_launch_advance(commit_of(e, T), e->stream, e->s.pdl));
    return KIE_OK;
  }
  if (mode == KIE_MODE_GREEDY) {
    if (tp > 1) TRY(all_reduce(e, e->cand, 2 * (size_t)tp));
    FinalArgs f;
    f.cand = e->cand;
    f.tp = tp;
    f.c = commit_of(e, T);
    CU(kie_launch_finalize(f, e->stream, e->s.pdl));
  } else {
    const float *logits = e->logits;
    if (tp > 1) {
      const int rc = ((fn_all_gather)e->c.all_gather)(e->logits, e->logits_all, (size_t)s.vocab_part, KCCL_FLOAT32,
                                                      e->c.comm, e->stream);
      if (rc) return comm_fail(e, rc, "all-gather of the logits");
      logits = e->logits_all;
    }
    SampleArgs sa;
    sa.logits = logits;
    sa.V = s.vocab;
    sa.p = e->samp;
    sa.c = commit_of(e, T);
    CU(kie_launch_sample(sa, e->stream, e->s.pdl));
  }
  return KIE_OK;
}

/* The monokernel's stage table: the same ops with the same arguments; with
 * lanes, beside it the links: which stage's partial sum the lanes add up, and
 * which of those sums each stage adds (its adds, each the sum last reduced into
 * that buffer: with d + 1 buffers in rotation, S_j's buffer is not written
 * again before S_j's consumer, sublayer j + 1 + d, has run). */
struct MonoBuilder {
  kie_engine *e;
  std::vector<MonoStage> st;
  std::vector<MonoLink> links;
  std::vector<std::pair<const float *, int>> reduced; /* a sum buffer, the stage whose sum it holds */
  int slot = 0, xbytes = 0;
  int gemv(GemvArgs &a, int epi) {
    MonoStage m;
    memset(&m, 0, sizeof m);
    m.kind = MONO_GEMV;
    m.epi = epi;
    m.segs = a.segs = gemv_segs(e, a);
    m.upt = GEMV_WARPS / m.segs;
    m.g = a;
    slot = std::max(slot, m.upt * 4 * a.ld); /* upt units of two bf16 rows */
    xbytes = std::max(xbytes, 4 * a.ld);
    st.push_back(m);
    MonoLink l;
    memset(&l, 0, sizeof l);
    for (int j = 0; e->s.tp_size > 1 && j < a.nadd; j++) {
      int k = -1;
      for (const auto &r : reduced)
        if (r.first == a.adds[j]) k = r.second;
      if (k < 0) return fail(KIE_E_STATE, "monokernel: stage %zu adds a sum no stage wrote", st.size() - 1);
      l.need[l.nneed++] = k;
    }
    links.push_back(l);
    return KIE_OK;
  }
  int attention(AttnArgs &a) {
    MonoStage m;
    memset(&m, 0, sizeof m);
    m.kind = MONO_ATTN;
    m.at = a;
    st.push_back(m);
    MonoLink l;
    memset(&l, 0, sizeof l);
    links.push_back(l);
    return KIE_OK;
  }
  /* The lanes' sum of S, written by the GEMV just added. */
  int sum(float *S, int) {
    const int k = (int)st.size() - 1;
    links[(size_t)k].sum = S;
    for (auto &r : reduced)
      if (r.first == S) {
        r.second = k;
        return KIE_OK;
      }
    reduced.push_back({S, k});
    return KIE_OK;
  }
  /* The graph path's join of a split-phase sum: here the stage that adds the sum waits for it (gemv). */
  int wait(int) { return KIE_OK; }
};

/* Builds and uploads the stage table and sizes the weight ring (once). */
int mono_prepare(kie_engine *e) {
  if (e->mono_ready) return KIE_OK;
  MonoBuilder b{e, {}, {}, {}};
  TRY(walk_forward(e, 1, true, b));
  if ((int)b.st.size() != e->mono_n) return fail(KIE_E_STATE, "monokernel: %zu stages, %d planned", b.st.size(), e->mono_n);
  const int tp = e->s.tp_size;
  int optin = 0;
  CU(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, e->device));
  const size_t att = kie_mono_attention_smem(e->s.head_dim);
  const size_t xu = round_up(std::max((size_t)b.xbytes, att), 128), slot = round_up((size_t)b.slot, 128);
  size_t static_smem = 0;
  CU(kie_mono_static_smem(e->s.head_dim, tp, &static_smem));
  /* The kernel's static shared memory, counted as 4 KB at least (the tp = 1
   * kernel's ring keeps the size it was measured with), and the mbarriers. */
  const size_t reserve = std::max<size_t>(4096, static_smem) + 256;
  const long room = (long)optin - (long)xu - (long)reserve;
  const int nslots = room > 0 ? (int)std::min<long>(8, room / (long)slot) : 0;
  if (nslots < 2)
    return fail(KIE_E_ARG, "the monokernel's weight ring needs two slots of %zu bytes beside %zu bytes of "
                "activations, and a block has %d bytes of shared memory: use the graph kernel for this shape",
                slot, xu, optin);
  e->mono_slot = (int)slot;
  e->mono_nslots = nslots;
  e->mono_xbytes = (int)xu;
  e->mono_smem = 256 + (size_t)nslots * slot + xu;
  int per_sm = 0;
  CU(kie_mono_prepare(e->s.head_dim, tp, e->mono_smem, &per_sm));
  if (per_sm < 1) return fail(KIE_E_CUDA, "the monokernel (%zu bytes of shared memory) does not fit an SM", e->mono_smem);
  /* A block per SM; lanes sharing the GPU (MPS) split its SMs, less a few: a
   * lane's blocks wait for the other lanes' inside the step, so every lane's
   * grid must be resident at once, and the kernels a late lane runs before
   * its step must find an SM. */
  int grid = e->sms;
  /* The caller's count comes from how many GPUs a lane sees; KCCL knows when
   * every lane is on this one (its pull mode), which that count misses when
   * the lanes pick one GPU among several: grids of every SM then could never
   * be resident together, and each lane's step would wait on the other's. */
  int lanes = e->s.lanes_per_device;
  if (tp > 1 && e->dc.pull) lanes = std::max(lanes, tp);
  if (e->s.mono_blocks > 0) grid = std::min(e->s.mono_blocks, e->sms);
  else if (lanes > 1) grid = std::max(1, (e->sms - MONO_FREE_SMS) / lanes);
  /* The lanes' sum of a sublayer (hid_pad floats, T = 1) in slices of at most
   * MONO_RED_FLOATS (more, up to KCCL's 8 KB, only past KCCL_DEV_MAX_BLOCKS
   * slices), a multiple of 4 floats each, one reducer block per slice. */
  int nred = 0, red_per = 0;
  if (tp > 1) {
    const int n = e->hid_pad;
    nred = std::min(KCCL_DEV_MAX_BLOCKS, (n + MONO_RED_FLOATS - 1) / MONO_RED_FLOATS);
    red_per = (int)round_up((size_t)((n + nred - 1) / nred), 4);
    nred = (n + red_per - 1) / red_per;
    if (nred > grid)
      return fail(KIE_E_ARG, "the monokernel's %d blocks are fewer than the %d that sum the lanes' sublayer sums",
                  grid, nred);
    CU(cudaMemcpyAsync(e->mono_links, b.links.data(), b.links.size() * sizeof(MonoLink), cudaMemcpyHostToDevice,
                       e->stream));
  }
  e->mono_grid = grid;
  e->mono_nred = nred;
  e->mono_red_per = red_per;
  CU(cudaMemcpyAsync(e->mono_stages, b.st.data(), b.st.size() * sizeof(MonoStage), cudaMemcpyHostToDevice, e->stream));
  CU(cudaStreamSynchronize(e->stream));
  e->mono_ready = 1;
  return KIE_OK;
}

/* One decode step as the monokernel (the greedy pick inside it), then the
 * sampler or the advance when the mode asks for them. */
int enqueue_mono(kie_engine *e, int mode) {
  TRY(mono_prepare(e));
  MonoArgs m;
  memset(&m, 0, sizeof m);
  m.stages = e->mono_stages;
  m.nstages = mode == KIE_MODE_ADVANCE ? e->mono_n - 1 : e->mono_n;
  m.sync = e->mono_sync;
  m.cnt = e->mono_cnt;
  m.pick = mode == KIE_MODE_GREEDY;
  m.cand = e->cand;
  m.c = commit_of(e, 1);
  m.ring = e->ring_d;
  m.slot_bytes = e->mono_slot;
  m.nslots = e->mono_nslots;
  m.subs = MONO_SUBS_MAX;
  m.prefetch = e->s.mono_prefetch >= 0 ? e->s.mono_prefetch : e->mono_nslots;
  m.ring_off = 256;
  m.x_off = 256 + e->mono_nslots * e->mono_slot;
  m.timeout_ns = 2000000000LL;
  m.marks = e->mono_marks;
  m.tp = e->s.tp_size;
  if (m.tp > 1) {
    /* Any wait of the step may be waiting on a peer (through the reducers'
     * KCCL calls, which the stage after theirs needs): it gives the peer
     * KCCL's own bound first, so that a slow peer is what KCCL says it is
     * (its timeout, its dead or aborted peer), as on the graph path. */
    m.timeout_ns += (long long)e->dc.timeout_ns;
    m.links = e->mono_links;
    m.rcnt = e->mono_cnt + e->mono_n;
    m.nred = e->mono_nred;
    m.red_per = e->mono_red_per;
    m.sum_count = e->hid_pad;
    m.dc = e->dc;
  }
  CU(kie_launch_mono(m, e->s.head_dim, e->mono_grid, e->mono_smem, e->stream));
  return mode == KIE_MODE_GREEDY ? KIE_OK : enqueue_pick(e, 1, mode);
}

/* One decode step, by the engine's kernel. */
int enqueue_step(kie_engine *e, int mode) {
  return e->s.kernel == KIE_KERNEL_MONO ? enqueue_mono(e, mode) : enqueue_forward(e, 1, mode);
}

int ready(kie_engine *e) {
  for (size_t i = 0; i < e->have.size(); i++)
    if (!e->have[i]) return fail(KIE_E_STATE, "weights are missing (upload %zu of %zu not done)", i, e->have.size());
  return KIE_OK;
}

/* What enqueue() puts on the engine's stream, as an instantiated graph (*nodes: its size). */
template <typename F>
int capture_graph(kie_engine *e, F enqueue, cudaGraphExec_t *out, int *nodes) {
  cudaGraph_t g;
  CU(cudaStreamBeginCapture(e->stream, cudaStreamCaptureModeRelaxed));
  const int rc = enqueue();
  const cudaError_t ce = cudaStreamEndCapture(e->stream, &g);
  if (rc != KIE_OK) {
    if (ce == cudaSuccess) cudaGraphDestroy(g);
    return rc;
  }
  CU(ce);
  size_t n = 0;
  cudaGraphGetNodes(g, nullptr, &n);
  if (nodes) *nodes = (int)n;
  cudaGraphExec_t x = nullptr;
  const cudaError_t ie = cudaGraphInstantiate(&x, g, 0);
  cudaGraphDestroy(g);
  CU(ie);
  *out = x;
  return KIE_OK;
}

int capture(kie_engine *e, int mode) {
  if (e->graph[mode]) return KIE_OK;
  if (e->s.kernel == KIE_KERNEL_MONO) TRY(mono_prepare(e)); /* uploads: not inside a capture */
  return capture_graph(e, [&] { return enqueue_step(e, mode); }, &e->graph[mode], &e->graph_nodes);
}

int check_comm(kie_engine *e) {
  if (e->s.tp_size < 2 || !e->c.async_error) return KIE_OK;
  int err = 0;
  ((fn_async_error)e->c.async_error)(e->c.comm, &err);
  return err ? comm_fail(e, err, "the lanes' communicator") : KIE_OK;
}

/* A monokernel failure between the lanes (KIE_E_COMM): what the kernel
 * reported, and what the communicator says (KCCL recorded the call that
 * failed, or a peer its watcher saw go), when it says anything. */
int lanes_fail(kie_engine *e, const char *what) {
  int err = 0;
  if (e->s.tp_size > 1 && e->c.async_error) ((fn_async_error)e->c.async_error)(e->c.comm, &err);
  const char *why = err && e->c.last_error ? ((fn_last_error)e->c.last_error)(e->c.comm) : nullptr;
  return fail(KIE_E_COMM, "%s%s%s", what, why ? ": " : "", why ? why : "");
}

int device_error(kie_engine *e) {
  const int code = *(volatile int32_t *)&e->ring_h->err;
  if (!code) return KIE_OK;
  const int arg = *(volatile int32_t *)&e->ring_h->err_arg;
  switch (code) {
    case KIE_DERR_POS: return fail(KIE_E_DEVICE, "a kernel was asked for position %d, past the KV cache", arg);
    case KIE_DERR_NAN: return fail(KIE_E_DEVICE, "the logits of step %d are not finite", arg);
    case KIE_DERR_STALL:
      return fail(KIE_E_DEVICE, "a monokernel wait at stage %d ran past its bound; the engine must be closed", arg);
    case KIE_DERR_COMM: {
      char what[160];
      snprintf(what, sizeof what, "the monokernel's sum of the lanes failed (KCCL error %d); the engine must be "
               "closed", arg);
      return lanes_fail(e, what);
    }
    case KIE_DERR_PEER: {
      char what[200];
      snprintf(what, sizeof what, "a monokernel wait for the lanes' sum of stage %d ran past its bound (a lane "
               "stopped, or runs other steps); the engine and its communicator must be closed", arg);
      return lanes_fail(e, what);
    }
    default: return fail(KIE_E_DEVICE, "a kernel reported error %d (argument %d)", code, arg);
  }
}

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int time_graph(kie_engine *e, cudaGraphExec_t x, int reps, double *ms_median) {
  cudaEvent_t a, b;
  CU(cudaEventCreate(&a));
  CU(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int r = 0; r < reps; r++) {
    CU(cudaEventRecord(a, e->stream));
    CU(cudaGraphLaunch(x, e->stream));
    CU(cudaEventRecord(b, e->stream));
    CU(cudaEventSynchronize(b));
    float t = 0.f;
    CU(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  *ms_median = ms[ms.size() / 2];
  return KIE_OK;
}

/* Captures `iters` calls of enqueue(i) as one graph and times its replays
 * (two to warm up, then the median of seven); *ms: one replay. */
template <typename F>
int bench_graph(kie_engine *e, int iters, F enqueue, double *ms) {
  cudaGraphExec_t xg;
  TRY(capture_graph(e, [&] {
    int rc = KIE_OK;
    for (int i = 0; i < iters && rc == KIE_OK; i++) rc = enqueue(i);
    return rc;
  }, &xg, nullptr));
  int rc = time_graph(e, xg, 2, ms);
  if (rc == KIE_OK) rc = time_graph(e, xg, 7, ms);
  cudaGraphExecDestroy(xg);
  return rc;
}

}  // namespace

extern "C" {

int kie_built(void) { return 1; }

const char *kie_last_error(void) { return g_err; }

int kie_device_count(int *n) {
  *n = 0;
  if (cudaGetDeviceCount(n) != cudaSuccess) {
    cudaGetLastError();
    *n = 0;
  }
  return KIE_OK;
}

int kie_plan_bytes(const kie_shape *s, int device, size_t *bytes) {
  int n = 0;
  kie_device_count(&n);
  if (device < 0 || device >= n) return fail(KIE_E_NOCUDA, "device %d: this process sees %d CUDA device(s)", device, n);
  int sms = 0;
  CU(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  kie_engine probe;
  TRY(derive(&probe, *s, sms));
  *bytes = layout(&probe, nullptr);
  return KIE_OK;
}

int kie_create(const kie_shape *s, const kie_comm *c, int device, kie_engine **out) {
  *out = nullptr;
  if (s->tp_size > 1 && (!c || !c->comm || !c->all_reduce || !c->start || !c->wait || !c->all_gather))
    return fail(KIE_E_ARG, "tp_size=%d needs a KCCL communicator and its functions", s->tp_size);
  size_t bytes = 0;
  TRY(kie_plan_bytes(s, device, &bytes));
  kcclDevComm dc;
  memset(&dc, 0, sizeof dc);
  if (s->tp_size > 1 && s->kernel == KIE_KERNEL_MONO) { /* the monokernel sums the lanes itself */
    if (!c->dev_comm)
      return fail(KIE_E_ARG, "the monokernel at tp_size=%d needs kcclCommGetDevComm (kie_comm.dev_comm)",
                  s->tp_size);
    const int rc = ((fn_dev_comm)c->dev_comm)(c->comm, &dc, sizeof dc);
    if (rc) {
      const char *why = c->last_error ? ((fn_last_error)c->last_error)(c->comm) : nullptr;
      return fail(KIE_E_COMM, "kcclCommGetDevComm: KCCL error %d: %s", rc, why ? why : "");
    }
  }
  CU(cudaSetDevice(device));
  size_t free_b = 0, total_b = 0;
  CU(cudaMemGetInfo(&free_b, &total_b));
  if (bytes + (256u << 20) > free_b)
    return fail(KIE_E_MEMORY, "the model needs %.2f GiB on device %d (weights, KV cache for %d positions, "
                "buffers) and %.2f GiB of its %.2f GiB are free", bytes / 1073741824.0, device, s->max_seq,
                free_b / 1073741824.0, total_b / 1073741824.0);
  kie_engine *e = new kie_engine();
  e->device = device;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  derive(e, *s, sms);
  if (c) e->c = *c;
  e->dc = dc;
  e->bytes = layout(e, nullptr);
  cudaError_t ce = cudaMalloc((void **)&e->arena, e->bytes);
  if (ce != cudaSuccess) {
    delete e;
    cudaGetLastError();
    return fail(KIE_E_MEMORY, "cudaMalloc of %.2f GiB on device %d: %s", bytes / 1073741824.0, device,
                cudaGetErrorString(ce));
  }
  layout(e, e->arena);
  int rc = KIE_OK;
  /* Every write goes on the engine's stream: it does not wait for the legacy default stream. */
  if ((ce = cudaStreamCreateWithFlags(&e->stream, cudaStreamNonBlocking)) != cudaSuccess ||
      (ce = cudaMemsetAsync(e->arena, 0, e->bytes, e->stream)) != cudaSuccess ||
      (ce = cudaStreamSynchronize(e->stream)) != cudaSuccess ||
      (ce = cudaHostAlloc((void **)&e->ring_h, sizeof(HostRing), cudaHostAllocMapped)) != cudaSuccess ||
      (ce = cudaHostGetDevicePointer((void **)&e->ring_d, e->ring_h, 0)) != cudaSuccess ||
      (ce = kie_gemv_attributes(XS_MAX)) != cudaSuccess)
    rc = fail(KIE_E_CUDA, "device %d setup: %s", device, cudaGetErrorString(ce));
  if (rc != KIE_OK) {
    kie_destroy(e);
    return rc;
  }
  memset(e->ring_h, 0, sizeof(HostRing));
  e->have.assign((size_t)n_uploads(*s), 0);
  *out = e;
  return KIE_OK;
}

void kie_destroy(kie_engine *e) {
  if (!e) return;
  cudaSetDevice(e->device);
  if (e->stream) cudaStreamSynchronize(e->stream);
  for (int m = 0; m < 3; m++)
    if (e->graph[m]) cudaGraphExecDestroy(e->graph[m]);
  if (e->stream) cudaStreamDestroy(e->stream);
  if (e->arena) cudaFree(e->arena);
  if (e->ring_h) cudaFreeHost(e->ring_h);
  cudaGetLastError();
  delete e;
}

int kie_upload(kie_engine *e, int kind, int layer, const void *src, size_t rows, size_t cols, int on_device) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  const kie_shape &s = e->s;
  const int idx = upload_index(s, kind, layer);
  if (idx < 0) return fail(KIE_E_ARG, "unknown weight kind %d", kind);
  const bool per_layer = idx >= 5;
  if (per_layer && (layer < 0 || layer >= s.layers))
    return fail(KIE_E_ARG, "layer %d of %d", layer, s.layers);
  size_t want_r = 0, want_c = 0, ld = 0;
  void *dst = nullptr;
  int f32 = 0;
  const Layer *y = per_layer ? &e->L[(size_t)layer] : nullptr;
  switch (kind) {
    case KIE_W_EMBED: want_r = s.vocab, want_c = s.hidden, ld = e->hid_pad, dst = e->embed; break;
    case KIE_W_HEAD: want_r = s.vocab_part, want_c = s.hidden, ld = e->hid_pad, dst = e->head; break;
    case KIE_W_QKV: want_r = e->qkv_rows, want_c = s.hidden, ld = e->hid_pad, dst = y->wqkv; break;
    case KIE_W_O: want_r = s.hidden, want_c = e->qdim, ld = e->qdim, dst = y->wo; break;
    case KIE_W_GATE_UP: want_r = 2 * (size_t)s.inter, want_c = s.hidden, ld = e->hid_pad, dst = y->wgu; break;
    case KIE_W_DOWN: want_r = s.hidden, want_c = s.inter, ld = e->inter_pad, dst = y->wd; break;
    case KIE_F_ATTN_NORM: want_r = 1, want_c = s.hidden, ld = e->hid_pad, dst = y->n1, f32 = 1; break;
    case KIE_F_MLP_NORM: want_r = 1, want_c = s.hidden, ld = e->hid_pad, dst = y->n2, f32 = 1; break;
    case KIE_F_FINAL_NORM: want_r = 1, want_c = s.hidden, ld = e->hid_pad, dst = e->normf, f32 = 1; break;
    case KIE_F_ROPE_COS: want_r = s.max_seq, want_c = s.head_dim / 2, ld = want_c, dst = e->rcos, f32 = 1; break;
    case KIE_F_ROPE_SIN: want_r = s.max_seq, want_c = s.head_dim / 2, ld = want_c, dst = e->rsin, f32 = 1; break;
  }
  if (rows != want_r || cols != want_c)
    return fail(KIE_E_ARG, "weight kind %d layer %d: got %zu x %zu, the shape needs %zu x %zu", kind, layer, rows,
                cols, want_r, want_c);
  if (!src) return fail(KIE_E_ARG, "weight kind %d: NULL source", kind);
  CU(cudaSetDevice(e->device));
  const size_t es = f32 ? 4 : 2;
  CU(cudaMemcpy2DAsync(dst, ld * es, src, cols * es, cols * es, rows, on_device ? cudaMemcpyDefault
                                                                                 : cudaMemcpyHostToDevice,
                       e->stream));
  CU(cudaStreamSynchronize(e->stream));
  e->have[(size_t)idx] = 1;
  return KIE_OK;
}

int kie_reset(kie_engine *e) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  CU(cudaSetDevice(e->device));
  CU(cudaStreamSynchronize(e->stream));
  TRY(device_error(e));
  /* On the engine's stream (a plain cudaMemset goes on the legacy stream, which
   * this non-blocking stream does not wait for: the next prefill could start
   * from the old position). */
  CU(cudaMemsetAsync(e->st, 0, sizeof(DevState), e->stream));
  CU(cudaMemsetAsync(e->mono_sync, 0, sizeof(MonoSync), e->stream));
  CU(cudaMemsetAsync(e->mono_cnt, 0, (size_t)e->mono_n * 8, e->stream));
  CU(cudaStreamSynchronize(e->stream));
  memset(e->ring_h, 0, sizeof(HostRing));
  e->pos_h = e->step_h = 0;
  return KIE_OK;
}

int kie_set_sampling(kie_engine *e, float temperature, int top_k, float top_p, uint64_t seed) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  if (!(temperature > 0.f)) return fail(KIE_E_ARG, "temperature must be > 0 for sampling (0 is greedy)");
  if (top_k < 0) return fail(KIE_E_ARG, "top_k must be >= 0");
  if (!(top_p > 0.f && top_p <= 1.f)) return fail(KIE_E_ARG, "top_p must be in (0, 1]");
  SampParams p;
  memset(&p, 0, sizeof p);
  p.inv_temp = 1.0f / temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.seed = seed;
  CU(cudaSetDevice(e->device));
  CU(cudaMemcpyAsync(e->samp, &p, sizeof p, cudaMemcpyHostToDevice, e->stream));
  CU(cudaStreamSynchronize(e->stream));
  e->sampling_set = 1;
  return KIE_OK;
}

static int check_mode(kie_engine *e, int mode) {
  if (mode < KIE_MODE_ADVANCE || mode > KIE_MODE_SAMPLE) return fail(KIE_E_ARG, "mode %d", mode);
  if (mode == KIE_MODE_SAMPLE && !e->sampling_set) return fail(KIE_E_STATE, "kie_set_sampling first");
  return KIE_OK;
}

int kie_prefill(kie_engine *e, const int32_t *tokens, int n, int mode) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  TRY(check_mode(e, mode));
  TRY(ready(e));
  if (n < 1) return fail(KIE_E_ARG, "prefill needs at least one token");
  if (e->pos_h + n > e->s.max_seq)
    return fail(KIE_E_STATE, "%d tokens from position %d do not fit the context of %d", n, e->pos_h, e->s.max_seq);
  for (int i = 0; i < n; i++)
    if (tokens[i] < 0 || tokens[i] >= e->s.vocab)
      return fail(KIE_E_ARG, "token %d at prompt index %d is outside the vocabulary of %d", tokens[i], i, e->s.vocab);
  CU(cudaSetDevice(e->device));
  for (int at = 0; at < n; at += e->tmax) {
    const int T = std::min(e->tmax, n - at);
    const bool last = at + T == n;
    CU(cudaMemcpyAsync(e->tokbuf, tokens + at, (size_t)T * 4, cudaMemcpyHostToDevice, e->stream));
    TRY(enqueue_forward(e, T, last ? mode : KIE_MODE_ADVANCE));
    e->pos_h += T;
  }
  if (mode != KIE_MODE_ADVANCE) e->step_h++;
  return KIE_OK;
}

int kie_set_token(kie_engine *e, int32_t token) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  if (token < 0 || token >= e->s.vocab) return fail(KIE_E_ARG, "token %d is outside the vocabulary of %d", token, e->s.vocab);
  CU(cudaSetDevice(e->device));
  CU(cudaMemcpyAsync(e->tokbuf, &token, 4, cudaMemcpyHostToDevice, e->stream));
  CU(cudaStreamSynchronize(e->stream));
  return KIE_OK;
}

int kie_decode(kie_engine *e, int n, int mode, int use_graph) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  TRY(check_mode(e, mode));
  TRY(ready(e));
  if (n < 0) return fail(KIE_E_ARG, "n=%d", n);
  if (e->pos_h + n > e->s.max_seq)
    return fail(KIE_E_STATE, "%d more steps from position %d do not fit the context of %d", n, e->pos_h, e->s.max_seq);
  CU(cudaSetDevice(e->device));
  if (use_graph) TRY(capture(e, mode));
  for (int i = 0; i < n; i++) {
    if (use_graph) CU(cudaGraphLaunch(e->graph[mode], e->stream));
    else TRY(enqueue_step(e, mode));
    e->pos_h++;
    if (mode != KIE_MODE_ADVANCE) e->step_h++;
  }
  return KIE_OK;
}

int kie_wait_token(kie_engine *e, int step, int timeout_ms, int32_t *token) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  if (step < 0 || step >= e->step_h)
    return fail(KIE_E_STATE, "step %d has not been enqueued (%d so far)", step, e->step_h);
  if (e->step_h - step > KIE_RING)
    return fail(KIE_E_STATE, "step %d was overwritten in the ring (%d steps enqueued since)", step, e->step_h - step);
  const double deadline = now_s() + timeout_ms / 1000.0;
  double next_check = 0;
  long spins = 0;
  const volatile uint32_t *seq = &e->ring_h->seq[step % KIE_RING];
  for (;;) {
    if (*seq == (uint32_t)step + 1u) {
      __sync_synchronize();
      *token = *(volatile int32_t *)&e->ring_h->token[step % KIE_RING];
      TRY(device_error(e));
      return KIE_OK;
    }
    TRY(device_error(e));
    const double t = now_s();
    if (t > next_check) {
      next_check = t + 0.001;
      TRY(check_comm(e));
      const cudaError_t q = cudaStreamQuery(e->stream);
      if (q != cudaSuccess && q != cudaErrorNotReady)
        return fail(KIE_E_CUDA, "the decode stream failed: %s", cudaGetErrorString(q));
      if (q == cudaSuccess) { /* all done: the token must be there now */
        __sync_synchronize();
        if (*seq != (uint32_t)step + 1u) {
          TRY(device_error(e));
          return fail(KIE_E_STATE, "the stream is idle but step %d never arrived", step);
        }
        continue;
      }
    }
    if (t > deadline)
      return fail(KIE_E_TIMEOUT, "step %d did not arrive within %d ms", step, timeout_ms);
    if (++spins > 2000) {
      timespec ts = {0, 20000};
      nanosleep(&ts, nullptr);
    }
  }
}

int kie_logits(kie_engine *e, float *out, size_t n) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  CU(cudaSetDevice(e->device));
  CU(cudaStreamSynchronize(e->stream));
  TRY(device_error(e));
  const float *src = e->logits;
  if (e->s.tp_size > 1) {
    const int rc = ((fn_all_gather)e->c.all_gather)(e->logits, e->logits_all, (size_t)e->s.vocab_part, KCCL_FLOAT32,
                                                    e->c.comm, e->stream);
    if (rc) return comm_fail(e, rc, "all-gather of the logits");
    src = e->logits_all;
  }
  const size_t m = std::min(n, (size_t)e->s.vocab);
  CU(cudaMemcpyAsync(out, src, m * 4, cudaMemcpyDeviceToHost, e->stream));
  CU(cudaStreamSynchronize(e->stream));
  return check_comm(e);
}

int kie_sync(kie_engine *e) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  CU(cudaSetDevice(e->device));
  CU(cudaStreamSynchronize(e->stream));
  TRY(device_error(e));
  return check_comm(e);
}

int kie_get_info(kie_engine *e, kie_info *info) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  memset(info, 0, sizeof *info);
  info->sms = e->sms;
  info->nsplit = e->nsplit;
  info->prefill_tokens = e->tmax;
  info->gemv_blocks = e->gemv_grid_max;
  info->device_bytes = e->bytes;
  info->graph_nodes = e->graph_nodes;
  info->kernel = e->s.kernel;
  info->mono_slots = e->mono_ready ? e->mono_nslots : 0;
  info->mono_slot_bytes = e->mono_ready ? e->mono_slot : 0;
  info->mono_smem = e->mono_ready ? (int)e->mono_smem : 0;
  info->mono_stages = e->mono_n;
  info->mono_blocks = e->mono_ready ? e->mono_grid : 0;
  info->mono_reducers = e->mono_ready ? e->mono_nred : 0;
  CU(cudaSetDevice(e->device));
  CU(cudaStreamSynchronize(e->stream));
  DevState st;
  CU(cudaMemcpy(&st, e->st, sizeof st, cudaMemcpyDeviceToHost));
  info->pos = st.pos;
  info->step = st.step;
  return KIE_OK;
}

int kie_bench_gemv(kie_engine *e, int rows, int cols, int iters, double *us_per_call) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  if (rows < 2 || cols < 8 || cols % 8 || iters < 1)
    return fail(KIE_E_ARG, "bench_gemv: rows >= 2, cols a positive multiple of 8, iters >= 1");
  CU(cudaSetDevice(e->device));
  /* Enough matrices to rotate through that none is still in L2 (50 MB) when it
   * comes round again. */
  const size_t mbytes = (size_t)rows * cols * 2;
  const int nmat = (int)std::max<size_t>(2, (512u << 20) / mbytes);
  bf16 *w = nullptr;
  float *x = nullptr, *y = nullptr;
  CU(cudaMalloc((void **)&w, mbytes * nmat));
  CU(cudaMalloc((void **)&x, (size_t)cols * 4));
  CU(cudaMalloc((void **)&y, (size_t)rows * 4));
  CU(cudaMemsetAsync(x, 0, (size_t)cols * 4, e->stream));
  CU(kie_launch_fill_random(w, mbytes / 2 * nmat, 1234u, 0.1f, e->stream));
  CU(kie_launch_fill_random((bf16 *)x, (size_t)cols, 99u, 1.0f, e->stream));
  double ms = 0;
  const int rc = bench_graph(e, iters, [&](int i) {
    GemvArgs a = plain(e, 1, x, cols, cols);
    a.w = w + (size_t)(i % nmat) * rows * cols;
    a.rows = rows;
    a.out = y;
    a.out_ld = rows;
    return gemv(e, a, EPI_STORE);
  }, &ms);
  cudaFree(w);
  cudaFree(x);
  cudaFree(y);
  TRY(rc);
  *us_per_call = 1000.0 * ms / iters;
  return KIE_OK;
}

int kie_bench_layer_gemvs(kie_engine *e, int iters, double *us_per_layer) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  TRY(ready(e));
  if (iters < 1) return fail(KIE_E_ARG, "iters >= 1");
  if (e->pos_h >= e->s.max_seq) return fail(KIE_E_STATE, "the context is full");
  CU(cudaSetDevice(e->device));
  const Layer &y = e->L[0];
  double ms = 0;
  TRY(bench_graph(e, iters, [&](int) {
    GemvArgs a = normed(e, 1, e->R[0], e->R[1], y.n1);
    qkv_args(e, 0, a);
    GemvArgs o = partial_sum_args(e, 1, e->att, e->qdim, e->qdim, y.wo, e->sums);
    GemvArgs b = normed(e, 1, e->R[1], e->R[0], y.n2);
    gate_up_args(e, 0, b);
    GemvArgs dn = partial_sum_args(e, 1, e->act, e->s.inter, e->inter_pad, y.wd, e->sums);
    int rc = gemv(e, a, EPI_QKV);
    if (rc == KIE_OK) rc = gemv(e, o, EPI_STORE);
    if (rc == KIE_OK) rc = gemv(e, b, EPI_SWIGLU);
    if (rc == KIE_OK) rc = gemv(e, dn, EPI_STORE);
    return rc;
  }, &ms));
  *us_per_layer = 1000.0 * ms / iters;
  return KIE_OK;
}

int kie_bench_steps(kie_engine *e, int iters, int mode, double *us_per_step) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  TRY(check_mode(e, mode));
  TRY(ready(e));
  if (iters < 1) return fail(KIE_E_ARG, "iters >= 1");
  if (e->pos_h + iters > e->s.max_seq)
    return fail(KIE_E_STATE, "%d steps from position %d do not fit the context of %d", iters, e->pos_h, e->s.max_seq);
  CU(cudaSetDevice(e->device));
  TRY(capture(e, mode));
  cudaEvent_t a, b;
  CU(cudaEventCreate(&a));
  CU(cudaEventCreate(&b));
  CU(cudaEventRecord(a, e->stream));
  for (int i = 0; i < iters; i++) CU(cudaGraphLaunch(e->graph[mode], e->stream));
  CU(cudaEventRecord(b, e->stream));
  CU(cudaEventSynchronize(b));
  float ms = 0.f;
  CU(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  e->pos_h += iters;
  if (mode != KIE_MODE_ADVANCE) e->step_h += iters;
  *us_per_step = 1000.0 * ms / iters;
  TRY(device_error(e));
  return check_comm(e);
}

int kie_mono_marks(kie_engine *e, uint64_t *out, size_t n) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  if (n < 2 * (size_t)e->mono_n) return fail(KIE_E_ARG, "mono_marks: %zu slots, the step has %d", n, 2 * e->mono_n);
  CU(cudaSetDevice(e->device));
  CU(cudaStreamSynchronize(e->stream));
  CU(cudaMemcpy(out, e->mono_marks, 2 * (size_t)e->mono_n * 8, cudaMemcpyDeviceToHost));
  return KIE_OK;
}

}  // extern "C"
