/* kie_cpu.h: KIE's native CPU decode step (one lane of a possibly tensor-parallel
 * Llama-style model), one call per token from Python.
 *
 * The engine does not own weights: each matrix is a pointer to its rows in a GGUF
 * block format (kq.h's type codes), into the memory-mapped file or into buffers that
 * the caller keeps alive until kie_cpu_destroy.  It owns the KV cache (f16 or f32),
 * its activations and a thread pool whose threads split every stage by rows.
 *
 * A step walks the model once: per layer RMSNorm, the q/k/v products, RoPE and the
 * cache write, attention, the o product, the lanes' sum, RMSNorm, gate/up with SwiGLU
 * in their epilogue, down, the lanes' sum; then the final norm and this lane's slice
 * of the LM head.  Lanes sum through KCCL's split-phase host all-reduce called from C
 * (a lane waiting for a sum prefetches its next weights; with a DTP delay the sum is
 * added sublayers later), and join the vocabulary slices with its all-gather.
 *
 * Every call returns KIE_CPU_OK or an error code; kie_cpu_last_error() gives the text
 * of the calling thread's last error. */
#ifndef KIE_CPU_H
#define KIE_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "kccl.h"

#define KIE_CPU_OK 0
#define KIE_CPU_E_ARG 1       /* a bad argument or shape */
#define KIE_CPU_E_TYPE 2      /* a weight type the kernels do not take */
#define KIE_CPU_E_MEMORY 3    /* an allocation failed */
#define KIE_CPU_E_COMM 4      /* a KCCL call failed (a peer died, aborted, timed out) */
#define KIE_CPU_E_STATE 5     /* out of order: weights missing, context full */
#define KIE_CPU_E_THREADS 6   /* the thread pool could not start */

/* How RoPE pairs the elements of a head */
#define KIE_CPU_ROPE_HALVES 0 /* element i with i + head_dim/2 (Hugging Face's layout) */
#define KIE_CPU_ROPE_PAIRS 1  /* element 2i with 2i + 1 (GGUF files: llama.cpp permutes Q and K rows so) */

/* KV cache element type */
#define KIE_CPU_KV_F32 0
#define KIE_CPU_KV_F16 1

#define KIE_CPU_MAX_DELAY 7   /* dtp_delay at most */
#define KIE_CPU_STAGES 8      /* profile slots: see kie_cpu_profile */

typedef struct kie_cpu kie_cpu;

typedef struct {
  int hidden, inter, layers;      /* inter: this lane's MLP columns */
  int heads, kv_heads, head_dim;  /* this lane's query and KV heads (heads a multiple of kv_heads) */
  int vocab_part;                 /* rows of this lane's LM-head slice (equal on every lane) */
  int max_seq;
  float eps;
  double rope_theta;
  int rope_mode;                  /* KIE_CPU_ROPE_* */
  int kv_type;                    /* KIE_CPU_KV_* */
  int dtp_delay;                  /* 0..KIE_CPU_MAX_DELAY */
  int tp_size, tp_rank;
  int threads;                    /* pool size, the calling thread included (>= 1) */
  const int *cpus;                /* NULL, or `threads` CPU ids: pool thread i (i >= 1) is pinned to
                                     cpus[i]; the calling thread (0) is left as it is (it is Python's) */
  int q_group;                    /* 0: heads / kv_heads query heads per KV head; else the model's
                                     group size, for a lane whose query heads start inside a group */
  int q_first;                    /* (q_group > 0) the lane's first query head's place in its first
                                     KV group; the lane's KV heads are the groups its heads use */
  int max_rows;                   /* rows of one kie_cpu_batch call, at most (0: 64) */
  size_t kv_limit;                /* bytes of KV cache all sequences may hold together (0: no limit
                                     but the machine's) */
} kie_cpu_shape;

/* One matrix: rows x cols in block format `type`, rows packed kq_row_bytes(type, cols)
 * apart (a lane's column slice is copied out by the caller). */
typedef struct {
  const void *data;
  int type;
  int rows, cols;
} kie_cpu_mat;

typedef struct {
  kie_cpu_mat q, k, v, o, gate, up, down;  /* (out, in) as stored; q, k rows by head */
  const float *attn_norm, *mlp_norm;       /* hidden floats each */
} kie_cpu_layer;

typedef struct {
  int threads;                   /* the pool's */
  int pos;                       /* tokens in the KV cache of sequence 0 */
  size_t kv_bytes;               /* the KV caches' size, every sequence's */
  size_t work_bytes;             /* activations and other buffers */
  size_t weight_bytes;           /* bytes of weights one decode step reads */
  const char *kernels;           /* kq_level() */
  int attn_simd;                 /* 1: attention uses the AVX2/F16C path */
} kie_cpu_info;

const char *kie_cpu_last_error(void);
/* comm: the lanes' host communicator (its ranks are the lanes), or NULL when tp_size == 1.
 * The engine links libkccl.so, the library that made it, and calls kccl.h on it. */
int kie_cpu_create(const kie_cpu_shape *s, kcclComm_t comm, kie_cpu **out);
void kie_cpu_destroy(kie_cpu *e);
/* Layer `layer`'s weights (pointers kept, nothing copied); checks shapes and types. */
int kie_cpu_set_layer(kie_cpu *e, int layer, const kie_cpu_layer *w);
/* embed: (vocab, hidden), one row read per token; head: (vocab_part, hidden), this
 * lane's slice; final_norm: hidden floats. */
int kie_cpu_set_globals(kie_cpu *e, const kie_cpu_mat *embed, const float *final_norm, const kie_cpu_mat *head);
/* Position 0 (the cache is overwritten as it fills again). */
int kie_cpu_reset(kie_cpu *e);
/* n tokens from the current position, one step each; the last one's logits (the whole
 * vocabulary: vocab_part * tp_size floats, lanes in rank order) into `logits` unless it
 * is NULL.  Earlier tokens skip the LM head. */
int kie_cpu_run(kie_cpu *e, const int32_t *tokens, int n, float *logits);
int kie_cpu_get_info(kie_cpu *e, kie_cpu_info *info);

/* -- several sequences, many tokens per pass over the weights --------------------------------
 *
 * Sequence 0 is the engine's own (max_seq positions; kie_cpu_run and kie_cpu_reset use
 * it).  Others are made and freed at will, each with its own KV cache and position, up
 * to kv_limit bytes of caches in all.  kie_cpu_batch runs rows of any of them in one pass
 * over the weights: a prompt's chunk, a decode step of several sequences, or both.  Every
 * row gets the bits it would get run alone, token by token through kie_cpu_run. */

/* A new sequence with room for `positions` tokens: its id in *seq (> 0).  KIE_CPU_E_MEMORY
 * when its cache would pass kv_limit (with what the live sequences hold) or cannot be
 * allocated; its pages are taken as positions fill. */
int kie_cpu_seq_new(kie_cpu *e, int positions, int *seq);
/* Frees sequence seq's cache (sequence 0 is only reset). */
int kie_cpu_seq_free(kie_cpu *e, int seq);
/* Back to position 0 (and its NaN flag cleared). */
int kie_cpu_seq_reset(kie_cpu *e, int seq);
/* Its position (tokens in its cache), or -1 when seq is not a live sequence. */
int kie_cpu_seq_pos(kie_cpu *e, int seq);
/* Live sequences other than 0 */
int kie_cpu_seq_count(kie_cpu *e);
/* KV cache bytes a sequence of `positions` tokens takes */
size_t kie_cpu_seq_bytes(kie_cpu *e, int positions);
/* n rows (1..max_rows): row i is token tokens[i] of sequence seqs[i] at its next position
 * (a sequence's rows, in their order, take consecutive positions).  For each row with
 * want[i] != 0, in row order, the whole vocabulary's logits (vocab_part * tp_size floats)
 * into logits; bad[i] (when bad is not NULL) set to 1 when row i's sequence met a NaN or
 * an infinity, now or in an earlier call: its logits are NaN, the other rows'
 * unaffected.  Fails as a whole (KIE_CPU_E_ARG, KIE_CPU_E_STATE: a sequence's cache is
 * full) before any row runs. */
int kie_cpu_batch(kie_cpu *e, const int32_t *seqs, const int32_t *tokens, int n, const uint8_t *want, float *logits,
                  int32_t *bad);
/* Seconds per stage summed over the steps since the last call (then zeroed), as the
 * calling thread saw them: 0 norm+q/k/v, 1 attention, 2 o, 3 gate/up, 4 down, 5 lanes'
 * sums (waits included), 6 head (+ gather), 7 the rest; steps: how many.  Timing costs
 * a clock read per stage: on only after kie_cpu_set_profiling(e, 1). */
int kie_cpu_set_profiling(kie_cpu *e, int on);
int kie_cpu_profile(kie_cpu *e, double *seconds, int n, int *steps);
/* Microseconds the pool's threads poll for the next call before they sleep (default
 * 2000: a decode loop's next call comes sooner; a server, whose own work between calls
 * needs the cores, sets less). */
int kie_cpu_set_idle_spin(kie_cpu *e, int us);
/* m = silu(gate) * up over n values as the steps compute it at the kernels' current
 * level (kq_set_level); every level gives the same bits. */
void kie_cpu_swiglu(const float *gate, const float *up, float *m, int n);

#endif
