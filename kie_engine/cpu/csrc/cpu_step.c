/* cpu_step.c: the forward walk.  Every thread of the pool runs kie_step_all over the
 * same tokens; they meet at a barrier after each product (its output is shared) and
 * nowhere else.  Small per-token work that every thread needs (the embedding row,
 * RMSNorm, converting a product's input for the kernels, adding a sublayer's sum to the
 * residual) is done by every thread on its own copy: that costs a few microseconds of
 * arithmetic on a few kB, where handing it to one thread would cost a barrier.
 *
 * Per sublayer the lanes' partial sums go through KCCL (thread 0 calls it, the others
 * wait at the next barrier); with DTP delay d the sum of sublayer k is started at once
 * and added to the residual after sublayer k + d (ring of d + 1 buffers), as
 * kie_engine/reference/model.py's reference does. */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "cpu_attn.h"
#include "cpu_internal.h"
#include "cpu_ops.h"
#include "kq.h"


static void matvec(const kie_cpu_mat *m, const void *act, float *y, int r0, int r1) {
  if (r1 > r0) kq_matvec_mat(m->type, m->data, m->rows, m->cols, act, y, r0, r1);
}

/* The prepared input of x for matrix m in this thread's slots (converting it once per
 * distinct weight type of the stage). */
static const void *act_for(kie_thread *th, int *used, const kie_cpu_mat *m, const float *x) {
  for (int i = 0; i < *used; i++)
    if (th->act_type[i] == m->type) return th->act[i];
  int i = (*used)++;
  th->act_type[i] = m->type;
  if (kie_nonfinite(x, m->cols)) th->bad = 1;
  kq_prepare_act(m->type, x, m->cols, th->act[i]);
  return th->act[i];
}

/* Prefetching while waiting: how far into the next stage (within one core's L2 with room
 * to spare). */
#define KIE_PF_AHEAD (256 * 1024)

int kie_prefetch_more(void *arg) {
  kie_prefetch *pf = &((kie_thread *)arg)->pf;
  if (pf->next < 0) return 0;
  int first = pf->first[pf->next];
  if (pf->at < first) {
    pf->at = first;
    pf->off = 0;
  }
  if (pf->at >= pf->nspans) return 0;
  const kie_span *sp = &pf->spans[pf->at];
  if (sp->cum + pf->off - pf->spans[first].cum >= KIE_PF_AHEAD) return 0;
  size_t end = pf->off + KIE_PF_CHUNK < sp->n ? pf->off + KIE_PF_CHUNK : sp->n;
  for (size_t o = pf->off; o < end; o += 64) __builtin_prefetch(sp->p + o, 0, 2);
  if (end >= sp->n) {
    pf->at++;
    pf->off = 0;
  } else {
    pf->off = end;
  }
  return 1;
}

/* Waits for the other threads, prefetching stage `next` (-1: none) meanwhile. */
static void wait_all(kie_cpu *e, kie_thread *th, int tid, int next) {
  th->pf.next = next;
  kpool_barrier_idle(e->pool, tid, kie_prefetch_more, th);
}

/* Thread 0 waits for split-phase sum `req`, prefetching its next stage while it is not in. */
static int wait_sum(kie_cpu *e, kie_thread *th, uint64_t req) {
  int done = 0;
  while (!done && kie_prefetch_more(th)) {
    int rc = kcclAllReduceTest(e->comm, req, &done);
    if (rc) return rc;
  }
  return kcclAllReduceWait(e->comm, req);
}

void kie_comm_fail(kie_cpu *e, const char *what, int rc) {
  const char *detail = kcclGetLastError(e->comm);
  snprintf(e->err, sizeof e->err, "%s failed (KCCL result %d): %s", what, rc, detail ? detail : "");
  e->rc = KIE_CPU_E_COMM;
}

/* Thread 0, after sublayer k's output is complete in e->y (tp > 1) or in its ring slot
 * (tp == 1): starts its sum and waits for the one that is due.  Returns the ring slot
 * whose sum the residual takes now, or -1 when none is due yet. */
static int lanes_sum(kie_cpu *e, int k, int tid, kie_thread *th) {
  const kie_cpu_shape *s = &e->s;
  int d = s->dtp_delay, H = s->hidden, slot = k % (d + 1);
  int due = k >= d ? (k - d) % (d + 1) : -1;
  if (s->tp_size == 1 || tid != 0 || e->rc) return due;
  float *dst = e->ring + (size_t)slot * H;
  /* split phase, also with no delay: the wait prefetches the next weights */
  int rc = kcclAllReduceStart(e->y, dst, H, kcclFloat32, kcclSum, e->comm, &e->req[slot]);
  if (rc) {
    kie_comm_fail(e, "kcclAllReduceStart of a sublayer's output", rc);
    return due;
  }
  if (due >= 0) {
    rc = wait_sum(e, th, e->req[due]);
    if (rc) kie_comm_fail(e, "kcclAllReduceWait", rc);
  }
  return due;
}

static void one_token(kie_cpu *e, int tid, int n, int32_t tok, int pos, int want_logits) {
  const kie_cpu_shape *s = &e->s;
  kie_thread *th = &e->th[tid];
  int H = s->hidden, hd = s->head_dim, L = s->layers, d = s->dtp_delay, tp = s->tp_size;
  int qrows = s->heads * hd, kvrows = s->kv_heads * hd, g = s->q_group, qf = s->q_first;
  int kv16 = s->kv_type == KIE_CPU_KV_F16;
  size_t esz = kv16 ? 2 : 4;
  float scale = 1.0f / sqrtf((float)hd);
  int prof = e->profiling && tid == 0;
  double t_prev = prof ? kie_now_s() : 0;

  float cs[KIE_MAX_HEAD_DIM]; /* cos then sin of this position */
  kie_rope_angles(e, pos, cs);
  kie_seq *sq = &e->seqs[e->run_seq];

  th->pf.at = 0; /* the prefetch cursor starts the token again */
  th->pf.off = 0;
  size_t rb_embed = kq_row_bytes(e->embed.type, H);
  kq_dequant_row(e->embed.type, (const char *)e->embed.data + (size_t)tok * rb_embed, H, th->x);
  STAMP(7);

  for (int l = 0; l < L; l++) {
    const kie_cpu_layer *w = &e->layers[l];
    for (int sub = 0; sub < 2; sub++) {
      int k = 2 * l + sub;
      float *y = tp > 1 ? e->y : e->ring + (size_t)(k % (d + 1)) * H;
      if (sub == 0) {
        /* q, k, v */
        kie_rms_norm(th->x, w->attn_norm, H, s->eps, th->h);
        int used = 0;
        const void *aq = act_for(th, &used, &w->q, th->h), *ak = act_for(th, &used, &w->k, th->h),
                   *av = act_for(th, &used, &w->v, th->h);
        const kie_share *sh = &e->sh_qkv[(size_t)l * n + tid];
        matvec(&w->q, aq, e->qkv, sh->r0[0], sh->r1[0]);
        matvec(&w->k, ak, e->qkv + qrows, sh->r0[1], sh->r1[1]);
        matvec(&w->v, av, e->qkv + qrows + kvrows, sh->r0[2], sh->r1[2]);
        wait_all(e, th, tid, KIE_STAGE(l, 1));
        STAMP(0);
        /* attention: this thread's query heads, those of one KV head together */
        for (int h = e->head0[tid]; h < e->head0[tid + 1];) {
          int j = (h + qf) / g; /* this lane's KV head of query head h */
          float *kcur = th->kcur + (size_t)j * hd, *vcur = th->vcur + (size_t)j * hd;
          size_t off = kie_seq_head(e, sq, l, j);
          kie_rope(e->qkv + qrows + (size_t)j * hd, kcur, hd, s->rope_mode, cs);
          memcpy(vcur, e->qkv + qrows + kvrows + (size_t)j * hd, sizeof(float) * hd);
          /* the thread of the group's first query head writes the cache at pos; every
           * thread uses its own kcur / vcur for pos, rounded as the cache holds them */
          int lead = j * g - qf > 0 ? j * g - qf : 0; /* the group's first query head here */
          int writer = lead >= e->head0[tid] && lead < e->head0[tid + 1];
          for (int i = 0; i < hd; i++) {
            kcur[i] = kie_cache_round(kcur[i], kv16);
            vcur[i] = kie_cache_round(vcur[i], kv16);
            if (!writer) continue;
            size_t ki = off + kie_k_index(pos, i, hd), vi = off + kie_v_index(pos, hd) + i;
            if (kv16) {
              ((uint16_t *)sq->k)[ki] = kie_float_to_half(kcur[i]);
              ((uint16_t *)sq->v)[vi] = kie_float_to_half(vcur[i]);
            } else {
              ((float *)sq->k)[ki] = kcur[i];
              ((float *)sq->v)[vi] = vcur[i];
            }
          }
          kie_attn_job job = {.k = (const char *)sq->k + off * esz, .v = (const char *)sq->v + off * esz,
                              .f16 = kv16, .hd = hd, .scale = scale, .kcur = kcur, .vcur = vcur, .cur = pos};
          for (; h < e->head0[tid + 1] && (h + qf) / g == j; h++, job.nq++) {
            float *qh = th->q + (size_t)job.nq * hd;
            kie_rope(e->qkv + (size_t)h * hd, qh, hd, s->rope_mode, cs);
            job.q[job.nq] = qh;
            job.n[job.nq] = pos + 1;
            job.out[job.nq] = e->att + (size_t)h * hd;
          }
          if (h < e->head0[tid + 1]) /* the thread's next KV head: its cache, fetched meanwhile */
            job.pf = kie_kv_reads(e, sq, l, (h + qf) / g, pos);
          kie_attn(&job, th->attn);
        }
        wait_all(e, th, tid, KIE_STAGE(l, 1));
        STAMP(1);
        /* o */
        used = 0;
        const void *ao = act_for(th, &used, &w->o, e->att);
        sh = &e->sh_o[(size_t)l * n + tid];
        matvec(&w->o, ao, y, sh->r0[0], sh->r1[0]);
        wait_all(e, th, tid, KIE_STAGE(l, 2));
        STAMP(2);
      } else {
        /* gate / up with SwiGLU on this thread's rows, then down */
        kie_rms_norm(th->x, w->mlp_norm, H, s->eps, th->h);
        int used = 0;
        const void *ag = act_for(th, &used, &w->gate, th->h), *au = act_for(th, &used, &w->up, th->h);
        const kie_share *sh = &e->sh_gu[(size_t)l * n + tid];
        int r0 = sh->r0[0], r1 = sh->r1[0];
        matvec(&w->gate, ag, th->gu, r0, r1);
        matvec(&w->up, au, th->gu + s->inter, r0, r1);
        kie_swiglu(th->gu, th->gu + s->inter, e->m, r0, r1);
        wait_all(e, th, tid, KIE_STAGE(l, 3));
        STAMP(3);
        used = 0;
        const void *ad = act_for(th, &used, &w->down, e->m);
        sh = &e->sh_down[(size_t)l * n + tid];
        matvec(&w->down, ad, y, sh->r0[0], sh->r1[0]);
        wait_all(e, th, tid, KIE_STAGE(l + 1, 0));
        STAMP(4);
      }
      /* the residual */
      /* the stage after this sum: gate/up after attention, the next layer's q/k/v (or
       * the head) after the MLP */
      th->pf.next = sub == 0 ? KIE_STAGE(l, 2) : KIE_STAGE(l + 1, 0);
      int due = lanes_sum(e, k, tid, th);
      if (tp > 1 && due >= 0) wait_all(e, th, tid, th->pf.next); /* thread 0's sum is in */
      if (e->rc) return;
      if (due >= 0) kie_add(th->x, e->ring + (size_t)due * H, H);
      STAMP(5);
    }
  }
  /* the sums still in flight (d > 0) */
  for (int k = 2 * L - d; k < 2 * L; k++) {
    int slot = k % (d + 1);
    if (tp > 1) {
      if (tid == 0 && !e->rc) {
        int rc = kcclAllReduceWait(e->comm, e->req[slot]);
        if (rc) kie_comm_fail(e, "kcclAllReduceWait", rc);
      }
      kpool_barrier(e->pool, tid);
      if (e->rc) return;
    }
    kie_add(th->x, e->ring + (size_t)slot * H, H);
  }
  STAMP(5);
  if (!want_logits) return;
  kie_rms_norm(th->x, e->final_norm, H, s->eps, th->h);
  int used = 0;
  const void *ah = act_for(th, &used, &e->head, th->h);
  float *part = e->logits ? e->logits + (size_t)s->tp_rank * s->vocab_part : e->logits_part;
  matvec(&e->head, ah, part, e->sh_head[tid].r0[0], e->sh_head[tid].r1[0]);
  kpool_barrier(e->pool, tid);
  if (tid == 0) {
    int bad = e->seqs[e->run_seq].bad;
    for (int t = 0; t < n; t++) bad |= e->th[t].bad;
    if (bad) /* this lane's slice, before the gather: every lane then sees NaN logits */
      for (int r = 0; r < s->vocab_part; r++) part[r] = NAN;
  }
  if (tp > 1 && tid == 0 && e->logits) {
    int rc = kcclAllGather(part, e->logits, s->vocab_part, kcclFloat32, e->comm, NULL);
    if (rc) kie_comm_fail(e, "kcclAllGather of the logits", rc);
  }
  STAMP(6);
}

void kie_step_all(void *arg, int tid, int n) {
  kie_cpu *e = arg;
  int pos = e->seqs[e->run_seq].pos;
  for (int i = 0; i < e->ntokens; i++) {
    one_token(e, tid, n, e->tokens[i], pos + i, i == e->ntokens - 1 && e->logits != NULL);
    if (e->rc) return;
    if (tid == 0 && e->profiling) e->prof_steps++;
  }
}

int kie_token_run(kie_cpu *e, int seq, const int32_t *tokens, int n, float *logits) {
  if (n < 1 || !tokens) {
    kie_set_error("kie_cpu_run needs at least one token");
    return KIE_CPU_E_ARG;
  }
  if (!e->planned) {
    int rc = kie_plan_shares(e);
    if (rc) return rc;
  }
  kie_seq *q = &e->seqs[seq];
  if (q->pos + n > q->limit) {
    kie_set_error("%d more tokens do not fit the context of %d (%d used)", n, q->limit, q->pos);
    return KIE_CPU_E_STATE;
  }
  for (int i = 0; i < n; i++)
    if (tokens[i] < 0 || tokens[i] >= e->embed.rows) {
      kie_set_error("token id %d is outside the embedding table (%d rows)", tokens[i], e->embed.rows);
      return KIE_CPU_E_ARG;
    }
  e->run_seq = seq;
  e->tokens = tokens;
  e->ntokens = n;
  e->logits = logits;
  e->rc = 0;
  e->err[0] = 0;
  for (int t = 0; t < e->nthreads; t++) e->th[t].bad = 0;
  kpool_run(e->pool, kie_step_all, e);
  e->tokens = NULL;
  if (e->rc) {
    kie_set_error("%s", e->err);
    return e->rc;
  }
  for (int t = 0; t < e->nthreads; t++) q->bad |= e->th[t].bad;
  q->pos += n;
  return KIE_CPU_OK;
}

int kie_cpu_run(kie_cpu *e, const int32_t *tokens, int n, float *logits) {
  return kie_token_run(e, 0, tokens, n, logits);
}
