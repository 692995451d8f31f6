/* cpu_internal.h: the engine's state, shared by cpu_model.c (set-up) and cpu_step.c
 * (the forward walk). */
#ifndef KIE_CPU_INTERNAL_H
#define KIE_CPU_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "cpu_pool.h"
#include "kie_cpu.h"

#define KIE_MAX_THREADS 256
#define KIE_MAX_HEAD_DIM 512
#define KIE_ROW_ALIGN 4 /* a thread's share of a product starts on a multiple of this row */

/* A thread's share of one stage: rows [r0, r1) of up to three matrices. */
typedef struct {
  int r0[3], r1[3];
} kie_share;

/* Weight stages of a token, in the order a thread reads them: per layer q/k/v, o,
 * gate/up, down, then the LM head (KIE_STAGE(L, 0)). */
#define KIE_STAGE(l, i) (4 * (l) + (i))

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
 * products, and attention scratch. */
typedef struct {
  float *x, *h, *scores, *q, *kcur, *vcur;
  float *gu;             /* gate outputs [0, inter), up outputs [inter, 2 inter): this thread's rows */
  unsigned char *act[3]; /* one per distinct weight type of a stage */
  int act_type[3];
  int bad;               /* a product's input held a NaN or an infinity (this run) */
  kie_prefetch pf;
} kie_thread;

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
  void *kc, *vc; /* KV cache: [layer][kv_head][max_seq][head_dim] */
  size_t kv_bytes, work_bytes, act_bytes;
  int pos;
  /* shares, set by plan_shares once the weights are in */
  kie_share *sh_qkv, *sh_o, *sh_gu, *sh_down, *sh_head; /* [layer * nthreads + tid] (head: [tid]) */
  int *head0;    /* [tid]: first query head of each thread, [nthreads] = heads */
  int planned;
  /* the current run */
  const int32_t *tokens;
  int ntokens;
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
void kie_step_all(void *arg, int tid, int n);
int kie_plan_shares(kie_cpu *e);
/* Prefetches the next piece of thread th's weights from stage `next` on; 0 when there
 * is nothing more to do within KIE_PF_AHEAD (an idle callback of kpool_barrier_idle). */
int kie_prefetch_more(void *th);

#endif
