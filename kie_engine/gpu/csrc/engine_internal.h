/* engine_internal.h - the host side of KIE's GPU engine, shared by its files (not
 * installed: kie_gpu.h is the engine's C API).  What each file does:
 *   weights.cu      the sizes that follow from the shape, the arena's layout, weight uploads
 *   step_args.h     the arguments of each op of a step (inline: bench/kie_native builds them too)
 *   forward_walk.h  the ops of one forward pass, in order, handed to a visitor
 *   forward.cu      the per-sublayer path: launches, the lanes' sums, the pick
 *   graph.cu        a decode step by the engine's kernel, captured as a CUDA graph
 *   mono_host.cu    the monokernel's stage table, its sizing and its launch
 *   prefill.cu      a batched prefill pass: a chunk of tokens through GEMMs (blas.cu: cuBLAS, loaded at run
 *                   time) and the row kernels of prefill_kernels.cu / prefill_attention.cu
 *   api.cu          the C API of kie_gpu.h, its errors, the token ring
 * The kernels are in gemv.cu, attention.cu, pick.cu, mono.cu and prefill_*.cu (kie_kernels.h).
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
#ifndef KIE_ENGINE_INTERNAL_H_
#define KIE_ENGINE_INTERNAL_H_
#include <stdarg.h>
#include <stdio.h>

#include <vector>

#include "kie_kernels.h" /* and through it kccl.h, whose functions the lanes' sums call */

namespace kie_host {

/* The calling thread's last error (kie_last_error; a module built from these
 * sources, such as bench/kie_native's, has its own), and setting it: returns code. */
inline thread_local char g_err[1024];
inline int fail(int code, const char *fmt, ...) {
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

const size_t XS_MAX = 64 * 1024;   /* shared memory for x in a GEMV block: two blocks per SM still fit */

/* The monokernel's lanes: floats a reducer block sums per call (an 8-byte line
 * per consumer thread, KCCL's one-line-per-thread path), and SMs left free of
 * its blocks when lanes share a GPU, for the kernels the other lanes run
 * before theirs (KCCL's rule for waiting kernels, kccl_device.cuh). */
const int MONO_RED_FLOATS = 2 * MONO_CONSUMERS;
const int MONO_FREE_SMS = 4;

inline size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

struct Layer {
  bf16 *wqkv, *wo, *wgu, *wd, *kc, *vc;
  float *n1, *n2;
};

}  // namespace kie_host

struct kie_engine {
  kie_shape s;
  kcclComm_t comm;                /* the lanes' (NULL when tp_size == 1) */
  int device, sms;
  int hid_pad, qdim, kvdim, qkv_rows, inter_pad, tmax;
  int g, gper, hgroups, nsplit, att_chunk, gemv_grid_max, gemv_u;
  int dec_attn, att_keys, att_split, att_gper, att_heads1, nsplit_smem, att_blocks; /* the graph path's decode attention (kie_shape
                                          .decode_attn, att_keys, att_split_keys, att_heads) and its splits at most */
  int att_combine;                        /* ATT_COMBINE_*: the split attention's combine, both kernels */
  size_t bytes;
  char *arena;
  std::vector<kie_host::Layer> L;
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
  unsigned long long *mono_ll;    /* kie_shape.mono_ll 1 or 3: the LL words of each layer's attention, o, gate/up
                                     and down outputs (mono_ll_words), else NULL */
  unsigned long long *step_marks; /* kie_shape.step_clock: [mono_n][KIE_CLK_MARKS][KIE_CLK_BLOCKS], a launch of
                                     a decode step's each (its GEMVs and attentions, in order), else NULL */
  int mono_n, mono_ready, mono_slot, mono_nslots, mono_xbytes, mono_grid, mono_nred, mono_red_per;
  int mono_ll_n;                  /* stages that read LL words (mono_ll_plan) */
  int mono_attn, mono_att_keys, mono_att_split, mono_att_splits; /* its attention stage (kie_shape.mono_attn;
                                  the shared-memory one's keys held, keys a split and splits at most; 0: items) */
  size_t mono_smem;
  kcclDevComm dc;                 /* tp > 1 and the monokernel: the communicator's device-API handle */
  /* The batched prefill (pf_chunk > 0: tokens per pass; 0: prefill runs as decode-shaped
   * passes of tmax tokens): its cuBLAS handle, workspace and activations. */
  int pf_chunk;
  void *blas;
  char *pf_ws;
  size_t pf_ws_bytes;
  float *pf_R, *pf_sums, *pf_y;
  bf16 *pf_x, *pf_q, *pf_att, *pf_gu, *pf_act;
  int *pf_tok;
  bf16 *pf_s16;            /* a sublayer's product in bf16, added by the next norm (one lane, no delay) */
  float *pf_apart;         /* the split attention blocks' shares (PfAttnArgs.part) */
  unsigned *pf_acnt;       /* and their counts (zero between launches) */
  int pf_attn;             /* the prefill attention's blocks (PF_ORDER_*) */
  int pf_keys;             /* its keys per tile (32, 64) */
  std::vector<char> have; /* which uploads have arrived */
  std::vector<uint64_t> req;
  int pos_h, step_h;      /* the host's count of what it enqueued */
  int sampling_set;
};


namespace kie_host {

/* KIE_OK once every weight has been uploaded. */
inline int weights_loaded(kie_engine *e) {
  for (size_t i = 0; i < e->have.size(); i++)
    if (!e->have[i]) return fail(KIE_E_STATE, "weights are missing (upload %zu of %zu not done)", i, e->have.size());
  return KIE_OK;
}

/* The shared-memory decode attention's keys a split and splits at most, for blocks that
 * hold kcap keys (the graph path's kernel and the monokernel's stage, each with its kcap).
 * Splits of 96 keys by default: the fastest of 96 / 128 / 192 at a context of 1,024 on the
 * 2b shape (more blocks fetch at once, each computes less after its wait).  At most 48
 * splits: a block that has none to do ends at once, but a grid of thousands costs their
 * launch every step, so a long cache caps them and a split walks longer runs of keys. */
inline void smem_attention_splits(const kie_shape &s, int kcap, int *ksplit, int *splits) {
  *ksplit = s.att_split_keys > 0 ? (s.att_split_keys < kcap ? s.att_split_keys : kcap) : (96 < kcap ? 96 : kcap);
  const int need = (s.max_seq + *ksplit - 1) / *ksplit, most = s.att_splits > 0 ? s.att_splits : 48;
  *splits = need < most ? need : most;
}

/* weights.cu */
int derive(kie_engine *e, const kie_shape &s, int sms);
size_t layout(kie_engine *e, char *base);
int n_uploads(const kie_shape &s);
/* Copies weight `kind` (of `layer`) from src (rows x cols, dense) into its place. */
int upload(kie_engine *e, int kind, int layer, const void *src, size_t rows, size_t cols, int on_device);

/* forward.cu */
int comm_fail(kie_engine *e, int rc, const char *what);
int all_reduce(kie_engine *e, float *p, size_t count);
int sum_start(kie_engine *e, float *p, size_t count, uint64_t *req);
int sum_wait(kie_engine *e, uint64_t req);
int enqueue_forward(kie_engine *e, int T, int mode);
int enqueue_pick(kie_engine *e, int T, int mode);

/* mono_host.cu */
int mono_prepare(kie_engine *e);
int enqueue_mono(kie_engine *e, int mode);

/* blas.cu */
int blas_load(const char *path);
int blas_loaded();
const char *blas_path();
int blas_create(kie_engine *e);
void blas_destroy(kie_engine *e);
int blas_gemm(kie_engine *e, int T, int N, int K, const bf16 *x, int ldx, const bf16 *w, int ldw, void *y, int ldy,
              bool y_f32, float beta);

/* prefill.cu: one batched pass of T <= pf_chunk tokens (pf_tok) from the device position, ending with `mode` */
int enqueue_prefill(kie_engine *e, int T, int mode);

/* kie_shape.mono_ll asks for LL words (1: into every GEMV stage after the attention; 3: between
 * the GEMV stages only; 4: as 1 but the down stage, which waits for gate/up's count; 5 and 6: as
 * 1 and 4, and into the attention stage). */
inline bool mono_ll_on(const kie_shape &s) { return s.mono_ll == 1 || (s.mono_ll >= 3 && s.mono_ll <= 6); }

/* The monokernel's LL words (kie_shape.mono_ll): a layer's QKV, attention, o, gate/up and down
 * outputs, each padded to 8 words. */
inline size_t mono_ll_words(const kie_engine *e) {
  return (size_t)e->s.layers * (round_up((size_t)e->qkv_rows, 8) + round_up((size_t)e->qdim, 8) +
                                2 * (size_t)e->hid_pad + e->inter_pad);
}

/* graph.cu */
int enqueue_step(kie_engine *e, int mode);
int capture(kie_engine *e, int mode);

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

}  // namespace kie_host

#endif
