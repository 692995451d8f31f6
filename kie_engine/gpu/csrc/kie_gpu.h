/*
 * kie_gpu.h - the C interface of KIE's GPU decode engine (one lane of a
 * tensor-parallel model on one CUDA device).
 *
 * The engine holds one lane's weights in bf16 (row-major, (out, in), rows padded
 * to 16 bytes), a bf16 KV cache and f32 activations.  A decode step is a fixed
 * sequence of fused kernels (per sublayer: RMSNorm folded into the GEMV that
 * follows it, with RoPE and the KV-cache write or SwiGLU in its epilogue;
 * attention split over the context; the row-parallel GEMV writing the
 * sublayer's partial sum) and, between lanes, KCCL's GPU all-reduce on the same
 * stream, or its stream-ordered split phase for DTP; or one persistent kernel
 * (KIE_KERNEL_MONO) that sums the lanes itself through KCCL's device API.  The
 * step is captured once as a CUDA graph per sampling mode and replayed from C;
 * the picked token goes to the next step on the device and to a host-mapped
 * ring that the caller reads.
 *
 * Every call returns KIE_OK or an error code; kie_last_error() gives the text
 * of the calling thread's last error.
 */
#ifndef KIE_GPU_H_
#define KIE_GPU_H_
#include <stddef.h>
#include <stdint.h>

#include "kccl.h" /* kcclComm_t: the lanes' communicator */

#ifdef __cplusplus
extern "C" {
#endif

#define KIE_OK 0
#define KIE_E_ARG 1      /* a bad argument or shape */
#define KIE_E_CUDA 2     /* a CUDA call failed */
#define KIE_E_MEMORY 3   /* the model does not fit the device */
#define KIE_E_COMM 4     /* a KCCL call failed (a peer died, aborted, mismatched) */
#define KIE_E_STATE 5    /* a call out of order (no weights, context full) */
#define KIE_E_TIMEOUT 6  /* a token did not arrive in time */
#define KIE_E_NOCUDA 7   /* built without CUDA, or no device */
#define KIE_E_DEVICE 8   /* a kernel found bad data (non-finite logits, position past the cache) */

#define KIE_RING 256     /* host-mapped token slots: steps in flight must stay below this */
#define KIE_MAX_ADDS 8   /* sums one kernel adds to the residual: dtp_delay + 1 at most */

/* What a step ends with. */
#define KIE_MODE_ADVANCE 0 /* nothing picked: the position moves on (all but the last prompt chunk) */
#define KIE_MODE_GREEDY 1  /* argmax, ties to the lowest id */
#define KIE_MODE_SAMPLE 2  /* temperature, top-k, top-p, seeded (kie_set_sampling) */

/* How a decode step (one token) runs; prefill always takes the per-sublayer kernels. */
#define KIE_KERNEL_GRAPH 0 /* a kernel per GEMV and attention, captured as a CUDA graph */
#define KIE_KERNEL_MONO 1  /* one persistent kernel, a block per SM; lanes sum through KCCL's device API */

/* Weight kinds for kie_upload.  Matrices are bf16 bits, (out, in) row-major as
 * stored by Hugging Face; the f32 kinds are vectors or tables. */
#define KIE_W_EMBED 0      /* (vocab, hidden) */
#define KIE_W_QKV 1        /* (q + k + v rows of this lane, hidden) */
#define KIE_W_O 2          /* (hidden, q of this lane) */
#define KIE_W_GATE_UP 3    /* (2 * columns: gate rows then up rows, hidden) */
#define KIE_W_DOWN 4       /* (hidden, columns) */
#define KIE_W_HEAD 5       /* (vocab_part, hidden): this lane's vocabulary slice, zero rows past the end */
#define KIE_F_ATTN_NORM 10 /* f32 (hidden,) */
#define KIE_F_MLP_NORM 11  /* f32 (hidden,) */
#define KIE_F_FINAL_NORM 12/* f32 (hidden,) */
#define KIE_F_ROPE_COS 13  /* f32 (max_seq, head_dim / 2) */
#define KIE_F_ROPE_SIN 14  /* f32 (max_seq, head_dim / 2) */

typedef struct kie_engine kie_engine;

typedef struct {
  int hidden, inter, layers;   /* inter: this lane's MLP columns */
  int heads, kv_heads, head_dim; /* this lane's query / KV heads */
  int vocab;                   /* the whole vocabulary */
  int vocab_part;              /* rows of this lane's LM-head slice (padded: equal on every lane) */
  int vocab_valid;             /* of those, rows that are real tokens */
  int vocab_off;               /* token id of the slice's first row */
  int max_seq;
  float eps;
  int dtp_delay;               /* 0..7 */
  int tp_size, tp_rank;
  int pdl;                     /* 1: the engine's kernels use programmatic dependent launch */
  int prefetch;                /* what a GEMV does before waiting for the previous kernel: 0 nothing,
                                  1 an L2 prefetch of its first rows, 2 its first loads into registers */
  int gemv_blocks_per_sm;      /* 0: auto */
  int gemv_u;                  /* 16-byte loads per row per lane in one batch: 4 or 8 (0: auto) */
  int att_chunk;               /* keys per attention block at least (0: auto) */
  int decode_attn;             /* the graph path's decode attention: 0 auto (2), 1 the monokernel's split items,
                                  2 a block holding its keys in shared memory (attention_smem.cu) */
  int att_keys;                /* decode_attn 2: keys a block holds at most (0: auto, the most that fit) */
  int att_split_keys;          /* decode_attn 2: keys of a split at most, past att_keys (0: auto, 96) */
  int att_splits;              /* decode_attn 2: splits of a context at most (0: auto, 48) */
  int att_heads;               /* decode_attn 2: query heads a block: 0 auto (one while the context fits a block,
                                  past it a KV head's all, up to 8), 1 one, 2 a KV head's all */
  int gemv_pipe;               /* 1: GEMVs load the next round's weights while using this round's */
  int gemv_x_l1;               /* 1: the o and down GEMVs read x through L1 instead of staging it */
  int kernel;                  /* KIE_KERNEL_GRAPH or KIE_KERNEL_MONO: how a decode step runs */
  int mono_prefetch;           /* monokernel: weight tiles past its shared-memory ring asked of L2 (-1: auto: 0) */
  int lanes_per_device;        /* lanes sharing this GPU (under MPS); 0 or 1: this lane has it alone */
  int mono_blocks;             /* monokernel: blocks of its grid (0: auto: every SM, or a share of them when
                                  lanes share the GPU) */
  int mono_attn;               /* monokernel: its attention stage: 0 auto (2), 1 the split items (decode_attn 1's
                                  arithmetic), 2 a block's keys in shared memory (decode_attn 2's, with the keys
                                  that fit beside its weight ring: att_keys, or auto) */
  int prefill;                 /* 1: a prompt runs as batched passes (cuBLAS GEMMs over a chunk of tokens; needs
                                  kie_blas_load first); 0: as decode-shaped passes of a few tokens */
  int prefill_chunk;           /* tokens of a batched pass at most (0: auto, 1024; at most max_seq) */
  int prefill_attn;            /* the batched prefill's attention blocks: 0 auto (split), 1 launch order (a
                                  head's query tiles in turn), 2 zigzag, 3 split (kie_kernels.h) */
  int prefill_f32_sums;        /* 1: the batched prefill's sublayer sums added to the residual by their GEMMs in f32
                                  (one lane, no delay); 0: each GEMM's output in bf16, added by the next norm */
  int prefill_attn_keys;       /* keys per tile of the batched prefill's attention: 0 auto (32), 32 or 64 */
  int mono_wait_ms;            /* monokernel: the bound on each of its waits, ms (0: auto, 2,000); a wait
                                  past it ends the step with a GpuError */
  int qkv_blocks_per_sm;       /* the graph path's QKV GEMV: blocks an SM at most (0: gemv_blocks_per_sm); fewer
                                  leave each SM room for the attention's block to start before the GEMV ends */
  int o_blocks_per_sm;         /* the o GEMV likewise (0: gemv_blocks_per_sm): room for gate/up's blocks, whose
                                  first loads then start during the attention and the o GEMV */
  int step_clock;              /* 1: the graph path's GEMV and attention kernels mark each block's clock
                                  (a profiling build of the step, read by bench/kie_native; 0: off) */
  int o_trigger_early;         /* 1: the graph path's o GEMV lets gate/up's launch start before its own wait (gate/up's
                                  blocks then load their first weights during the attention where SMs have room:
                                  o_blocks_per_sm=1 leaves it); 0: after it, as every other kernel */
  int l2_evict_first;          /* the weights' stream with L2's evict_first policy, so that the small data every
                                  step reads again stays in L2: -1 auto (the GEMVs' loads, not the monokernel's
                                  ring copies), 0 neither (the hardware's default policy), 1 both */
  int mono_slots;              /* monokernel: slots of its weight ring at most (0: auto, all that fit beside its
                                  attention, 3 on the 2b shape; 2..8): fewer keep fewer bytes in flight, which
                                  every load queued behind them (a stage's counter, its input) waits for; on
                                  the 2b shape 2 slots were as fast as 3 (bench/RESULTS.md) */
  int gemv_early;              /* 1: the graph path's normed GEMVs copy their norm's gamma (and QKV its RoPE row) into
                                  shared memory before waiting for the previous kernel, so that neither is an L2
                                  round trip after it; 0: after it.  It shortened QKV's staging and left the step's
                                  speed as it was (bench/RESULTS.md): the staging is off the critical path */
  int gemv_carveout;           /* the decode GEMVs' preferred shared-memory carveout, percent of the most an SM has
                                  (1..100; 0: the driver's choice).  An SM whose carveout is too small for an
                                  attention block takes it only once it has drained; with room, the attention's
                                  block can start beside the QKV GEMV's last block.  A process-wide attribute of
                                  the kernels: the engine made last sets it */
  int mono_sync;               /* monokernel: how a stage's count is published and polled: 0 auto (2), 1 a full fence
                                  then an atomic add, polled with acquire loads; 2 a release reduction, polled with
                                  relaxed loads and one acquire load once reached (no fence.sc, no L1 invalidation
                                  per poll; about 1 % faster on the 2b shape, bench/RESULTS.md) */
  int mono_ahead;              /* monokernel with one lane: 0 auto (1); 1 each stage's entry of its stage table loaded
                                  while the stage before runs, so that a block that ends a stage last starts the next
                                  without an L2 round trip for it (1-2 % faster on the 2b shape); 2 as the stage
                                  starts.  With several lanes every stage loads its entry as it starts */
  int gemv_residual;           /* the graph path with one lane and delay 0: 0 auto (1); 1 the o and down GEMVs add
                                  their sums to the residual and write it, so that the next normed GEMV reads one
                                  vector, not two, and writes none (the same values to the bit; about 1 % faster on
                                  the 2b shape, bench/RESULTS.md); 2 the normed GEMV adds them, as every other
                                  lane count and delay do */
  int mono_residual;           /* the monokernel with one lane and delay 0: 0 auto (1); 1 its o and down stages
                                  write the residual as gemv_residual 1 has the graph path's GEMVs do (the same
                                  bits; about 2 % faster on the 2b shape, bench/RESULTS.md); 2 its normed stages
                                  add the sums */
  int att_warm;                /* 1: the graph path's attention block runs its arithmetic once over the rows of
                                  earlier steps before its wait (results dropped), so that the instructions after
                                  the wait are in the SM's instruction cache; 0: off */
  int att_blocks;              /* the graph path's decode attention: N >= 1 at most N blocks, each taking the step's
                                  items i, i + N, ... (the same arithmetic, the same bits); 0 auto, an SM's count
                                  (at most the items); -1 a block per (head or group, split) of the most splits the
                                  cache can need, those past the context's ending at once, which every step launches:
                                  on the 2b shape about 2 % slower (bench/RESULTS.md) */
  int att_combine;             /* the split attention's combine, both kernels: 0 auto (1); 1 one acquire-release
                                  count and one round trip to L2 for the splits' rows (16 splits a round trip;
                                  the graph path 2.7 % faster at a context of 1,024 on the 2b shape,
                                  bench/RESULTS.md); 2 a fence and a count, then the splits' maxima and sums,
                                  then their rows */
  int mono_ll;                 /* the monokernel with one lane, delay 0 and mono_residual 1: 0 auto (6 where
                                  allowed, else 2); 1 the
                                  attention, o, gate/up and down stages also write their outputs as LL words (a
                                  float and the step's tag in one 8-byte store), and the GEMV stage after each
                                  reads its input from them, word by word as they land, instead of waiting for
                                  the stage's count; 2 every stage waits for the count of the one before; 3 as 1
                                  but the o stage waits for the attention's count; 4 as 1 but the down stage waits
                                  for gate/up's count and reads its floats; 5 and 6 as 1 and 4, and the attention
                                  stage reads the QKV stage's q, k and v rows as words, where every split's keys
                                  fit its shared memory */
} kie_shape;

typedef struct {
  int sms, nsplit, prefill_tokens, gemv_blocks;
  int pos, step;               /* after a kie_sync */
  size_t device_bytes;         /* what the engine allocated */
  int graph_nodes;             /* of the last graph captured */
  int kernel;                  /* KIE_KERNEL_* */
  int mono_slots, mono_slot_bytes, mono_smem; /* the monokernel's weight ring (0 before its first step) */
  int mono_stages;             /* per layer QKV, attention, o, gate/up, down; then the head */
  int mono_blocks;             /* its grid (0 before its first step) */
  int mono_reducers;           /* of those, the blocks that sum the lanes' sublayer sums (tp > 1) */
  int mono_att_keys;          /* mono_attn 2: keys a block's attention holds, keys of a split past them and splits
                                  at most (0 before its first step; decode_attn 2 with these as att_keys,
                                  att_split_keys and att_splits computes the same bits) */
  int mono_att_split_keys, mono_att_splits;
  int prefill_chunk;           /* tokens of a batched prefill pass (0: prefill runs as decode-shaped passes of
                                  prefill_tokens) */
  int mono_ll_stages;          /* stages that read their input from LL words (kie_shape.mono_ll; 0 before the
                                  monokernel's first step) */
} kie_info;

int kie_built(void);
/* Loads cuBLAS for the batched prefill (once per process): from `path`, or when
 * it is NULL or empty from the loader's search path (libcublas.so.13, .12). */
int kie_blas_load(const char *path);
/* The cuBLAS file loaded ("" before). */
const char *kie_blas_path(void);
int kie_device_count(int *n);
const char *kie_last_error(void);
/* Bytes of device memory an engine of this shape allocates on `device`
 * (kie_create checks them against the free memory before allocating). */
int kie_plan_bytes(const kie_shape *s, int device, size_t *bytes);
/* comm: the lanes' GPU communicator (NULL when tp_size == 1), made by the one
 * libkccl.so this module links (the Python package's: kccl.capi.handle). */
int kie_create(const kie_shape *s, kcclComm_t comm, int device, kie_engine **out);
void kie_destroy(kie_engine *e);
/* Copies a weight in: bf16 bits for matrices (rows x cols), f32 for the rest;
 * src in host memory, or device memory when on_device. */
int kie_upload(kie_engine *e, int kind, int layer, const void *src, size_t rows, size_t cols, int on_device);
/* Position 0, step 0, ring emptied. */
int kie_reset(kie_engine *e);
int kie_set_sampling(kie_engine *e, float temperature, int top_k, float top_p, uint64_t seed);
/* Runs n prompt tokens through the model from the current position, in chunks;
 * the last chunk ends with `mode` (its token lands in the ring at the current step). */
int kie_prefill(kie_engine *e, const int32_t *tokens, int n, int mode);
/* The token the next step reads (the last one picked, unless set here). */
int kie_set_token(kie_engine *e, int32_t token);
/* n decode steps enqueued (graph replays when use_graph, else eager launches). */
int kie_decode(kie_engine *e, int n, int mode, int use_graph);
/* Waits (bounded) for the token of step `step` and returns it. */
int kie_wait_token(kie_engine *e, int step, int timeout_ms, int32_t *token);
/* The last step's logits of the whole vocabulary (a collective when tp_size > 1). */
int kie_logits(kie_engine *e, float *out, size_t n);
int kie_sync(kie_engine *e);
int kie_get_info(kie_engine *e, kie_info *info);

#ifdef __cplusplus
}
#endif
#endif
