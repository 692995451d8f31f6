/* cpu_internal.h: the engine's state, shared by cpu_model.c (set-up) and cpu_step.c
 * (the forward walk). */
#ifndef KIE_CPU_INTERNAL_H
#define KIE_CPU_INTERNAL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "cpu_attn.h"
#include "cpu_pool.h"
#include "kie_cpu.h"

#define KIE_MAX_THREADS 256
#define KIE_MAX_HEAD_DIM 512
#define KIE_ROW_ALIGN KQ_GROUP /* a thread's share of a product starts on a multiple of this row: a packed group */
#define KIE_MAX_ROWS 512 /* rows of a batch step, at most */

/* A thread's share of one stage: rows [r0, r1) of up to three matrices. */
typedef struct {
  int r0[3], r1[3];
} kie_share;

/* Weight stages of a token, in the order a thread reads them: per layer q/k/v, o,
 * gate/up, down, then the LM head (KIE_STAGE(L, 0)). */
#define KIE_STAGE(l, i) (4 * (l) + (i))

/* Bytes a wait prefetches between its polls (an idle callback of kpool_barrier_idle) */
#define KIE_PF_CHUNK 1024

/* A thread's weights for one token as byte spans in reading order, and a cursor: while
 * it waits (a barrier, a lanes' sum) it prefetches from the next stage's start up to
 * KIE_PF_AHEAD bytes into it, so that waiting time streams memory too. */
typedef struct {
  const char *p;
  size_t n, cum; /* cum: bytes of the spans before this one */
} kie_span;

typedef struct {
  kie_span *spans;
  int nspans;
  int *first;    /* [stage]: its first span; [stages] = nspans */
  int next;      /* the stage the thread reads next (where prefetching starts) */
  int at;        /* cursor: span, offset */
  size_t off;
} kie_prefetch;

/* Per thread: its copy of the residual (every thread applies the same updates, so no
 * stage writes a shared residual), the normed input, the prepared inputs of the
 * products, and attention scratch (the token's roped queries, its keys and values as
 * the cache holds them, kie_attn's tiles). */
typedef struct {
  float *x, *h, *attn, *q, *kcur, *vcur;
  float *gu;             /* gate outputs [0, inter), up outputs [inter, 2 inter): this thread's rows */
  unsigned char *act[3]; /* one per distinct weight type of a stage */
  int act_type[3];
  int bad;               /* a product's input held a NaN or an infinity (this run) */
  kie_prefetch pf;
  /* the batch step with a few rows: the thread's own residuals, inputs and prepared inputs */
  float *bx, *bh;
  unsigned char *bact[3];
} kie_thread;

/* A sequence: its KV cache ([layer][kv_head][cap] positions, cpu_attn.h's layouts) and
 * how far it is. */
typedef struct {
  void *k, *v;
  int cap;       /* positions allocated, a multiple of 16 */
  int limit;     /* positions asked for (<= cap): rows past it are refused */
  int pos;
  int bad;       /* one of its rows met a NaN or an infinity: its logits are NaN from then on */
  int live;
  size_t bytes;  /* of k and v together */
} kie_seq;

#define KIE_MAX_SEQS 1024

/* The batch step's state (cpu_batch.c): buffers for max_rows rows, and the current call */
typedef struct {
  int max_rows;
  float *x;      /* [row][hidden] residuals */
  float *h;      /* [row][max(hidden, inter)] a product's input */
  float *qkv;    /* [row][q rows, k rows, v rows] */
  float *q;      /* [row][heads * head_dim] roped queries */
  float *cs;     /* [row][head_dim] cos then sin of the row's position (kie_rope_angles) */
  float *att;    /* [row][heads * head_dim] */
  float *gu;     /* [row][2 * inter]: gate then up outputs */
  float *m;      /* [row][inter] SwiGLU */
  float *y;      /* [row][hidden] a sublayer's output (this lane's partial sum when tp > 1) */
  float *ring;   /* [dtp_delay + 1][row][hidden] sums not yet added */
  float *lg;     /* [row][vocab_part] this lane's logits, then [tp][row][vocab_part] gathered */
  unsigned char *act[3]; /* prepared inputs, one per distinct weight type of a stage */
  size_t act_bytes, own_act_bytes;
  /* the call */
  int n, nlog;
  int seq[KIE_MAX_ROWS], pos[KIE_MAX_ROWS], tok[KIE_MAX_ROWS], bad[KIE_MAX_ROWS];
  int logrow[KIE_MAX_ROWS];  /* the rows whose logits are wanted, in order */
  int arow[KIE_MAX_THREADS + 1]; /* attention: thread t's rows [arow[t], arow[t + 1]) */
  int apiece[KIE_MAX_THREADS + 1]; /* attention by pieces (cpu_batch.c): thread t's [apiece[t], apiece[t + 1]) */
  atomic_int *claim;  /* [stage]: the next piece of a stage's work to take (a few rows: cpu_batch.c) */
  int nclaim;
  int distinct;       /* every row is a different sequence's */
  float *logits;
  uint64_t req[KIE_CPU_MAX_DELAY + 1];
} kie_batch;

struct kie_cpu {
  kie_cpu_shape s;
  int cpus[KIE_MAX_THREADS];
  int has_cpus;
  kcclComm_t comm; /* NULL when tp_size == 1 */
  kie_cpu_layer *layers;
  int *layer_set;
  kie_cpu_mat embed, head;
  const float *final_norm;
  int globals_set;
  kpool *pool;
  int nthreads;
  kie_thread *th;
  /* shared activations */
  float *qkv;    /* q rows, k rows, v rows of the current token */
  float *att;    /* heads * head_dim */
  float *m;      /* SwiGLU output, inter */
  float *y;      /* a sublayer's output (this lane's partial sum) */
  float *ring;   /* (dtp_delay + 1) * hidden: sublayer sums not yet added */
  float *logits_part; /* vocab_part scratch when the caller wants no logits */
  kie_seq *seqs;  /* [KIE_MAX_SEQS]; 0 is the engine's own (kie_cpu_run) */
  size_t kv_bytes, kv_reserved, work_bytes, act_bytes;
  kie_batch b;
  /* shares, set by plan_shares once the weights are in */
  kie_share *sh_qkv, *sh_o, *sh_gu, *sh_down, *sh_head; /* [layer * nthreads + tid] (head: [tid]) */
  int *head0;    /* [tid]: first query head of each thread, [nthreads] = heads */
  int planned;
  /* the current run */
  const int32_t *tokens;
  int ntokens;
  int run_seq;   /* the sequence the token step runs */
  float *logits;
  int rc;        /* set by thread 0 when a collective fails */
  char err[512];
  /* profile */
  int profiling;
  double prof[KIE_CPU_STAGES];
  double inv_freq[KIE_MAX_HEAD_DIM / 2]; /* RoPE: theta^(-2i/head_dim) */
  uint64_t req[KIE_CPU_MAX_DELAY + 1];   /* split-phase requests, by ring slot */
  int prof_steps;
};

void kie_set_error(const char *fmt, ...);
/* a sequence's cache of `cap` positions (cpu_seq.c); 0 or KIE_CPU_E_MEMORY */
int kie_seq_alloc(kie_cpu *e, kie_seq *q, int cap);
void kie_seq_release(kie_cpu *e, kie_seq *q);
/* where layer l, KV head j of sequence q starts, in elements */
static inline size_t kie_seq_head(const kie_cpu *e, const kie_seq *q, int l, int j) {
  return ((size_t)l * e->s.kv_heads + j) * (size_t)q->cap * e->s.head_dim;
}
/* What attention over layer l, KV head j of sequence q up to position pos reads: its keys
 * (blocks of 16 positions) and values (cpu_attn.h's layouts), for a call before it to fetch */
static inline kie_attn_next kie_kv_reads(const kie_cpu *e, const kie_seq *q, int l, int j, int pos) {
  size_t esz = e->s.kv_type == KIE_CPU_KV_F16 ? 2 : 4, off = kie_seq_head(e, q, l, j) * esz;
  size_t hd = (size_t)e->s.head_dim, p = (size_t)pos;
  kie_attn_next r = {{(const char *)q->k + off, (const char *)q->v + off},
                     {(p / 16 + 1) * 16 * hd * esz, (p + 1) * hd * esz}};
  return r;
}
void kie_batch_free(kie_cpu *e);
/* The token step (cpu_step.c): n tokens of sequence seq, one pass each; the last one's
 * logits (NaN when the sequence met a non-finite value) unless logits is NULL */
int kie_token_run(kie_cpu *e, int seq, const int32_t *tokens, int n, float *logits);
/* records a failed KCCL call as the run's error (e->rc, e->err) */
void kie_comm_fail(kie_cpu *e, const char *what, int rc);
/* Splits the rows of up to three matrices between n threads (cpu_model.c) */
void kie_share_rows(const kie_cpu_mat *const *mats, int nm, int n, kie_share *out);
void kie_step_all(void *arg, int tid, int n);
int kie_plan_shares(kie_cpu *e);
/* Prefetches the next piece of thread th's weights from stage `next` on; 0 when there
 * is nothing more to do within KIE_PF_AHEAD (an idle callback of kpool_barrier_idle). */
int kie_prefetch_more(void *th);

#endif
