/* cpu_model.c: the engine's set-up: shapes checked, buffers and KV cache allocated, the
 * weight table filled (pointers only), each product's rows shared out to the threads. */
#define _GNU_SOURCE
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_attn.h"
#include "cpu_internal.h"
#include "kq.h"

static __thread char last_error[640];

void kie_set_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
}

const char *kie_cpu_last_error(void) { return last_error; }

#define ALIGN 64

static void *zalloc(size_t n, size_t *total) {
  size_t rounded = (n + ALIGN - 1) / ALIGN * ALIGN;
  void *p = aligned_alloc(ALIGN, rounded ? rounded : ALIGN);
  if (p) memset(p, 0, rounded ? rounded : ALIGN);
  if (total) *total += rounded;
  return p;
}

static int check_shape(const kie_cpu_shape *s) {
  if (s->hidden < 1 || s->inter < 1 || s->layers < 1 || s->heads < 1 || s->kv_heads < 1 || s->head_dim < 2 ||
      s->head_dim % 2 || s->vocab_part < 1 || s->max_seq < 1) {
    kie_set_error("bad shape: hidden=%d inter=%d layers=%d heads=%d kv_heads=%d head_dim=%d vocab_part=%d max_seq=%d",
                  s->hidden, s->inter, s->layers, s->heads, s->kv_heads, s->head_dim, s->vocab_part, s->max_seq);
    return KIE_CPU_E_ARG;
  }
  if (s->head_dim > KIE_MAX_HEAD_DIM) {
    kie_set_error("head_dim=%d: at most %d", s->head_dim, KIE_MAX_HEAD_DIM);
    return KIE_CPU_E_ARG;
  }
  if (s->q_group == 0 && s->heads % s->kv_heads) {
    kie_set_error("heads=%d is not a multiple of kv_heads=%d", s->heads, s->kv_heads);
    return KIE_CPU_E_ARG;
  }
  if (s->q_group && (s->q_group < 1 || s->q_first < 0 || s->q_first >= s->q_group ||
                     s->kv_heads != (s->q_first + s->heads + s->q_group - 1) / s->q_group)) {
    kie_set_error("q_group=%d, q_first=%d: %d query heads from there use %d KV heads, not %d", s->q_group,
                  s->q_first, s->heads, s->q_group > 0 ? (s->q_first + s->heads + s->q_group - 1) / s->q_group : 0,
                  s->kv_heads);
    return KIE_CPU_E_ARG;
  }
  if (s->dtp_delay < 0 || s->dtp_delay > KIE_CPU_MAX_DELAY) {
    kie_set_error("dtp_delay=%d: 0..%d", s->dtp_delay, KIE_CPU_MAX_DELAY);
    return KIE_CPU_E_ARG;
  }
  if (s->tp_size < 1 || s->tp_rank < 0 || s->tp_rank >= s->tp_size) {
    kie_set_error("tp_rank=%d of tp_size=%d", s->tp_rank, s->tp_size);
    return KIE_CPU_E_ARG;
  }
  if (s->max_rows < 0 || s->max_rows > KIE_MAX_ROWS) {
    kie_set_error("max_rows=%d: 1..%d (0: 64)", s->max_rows, KIE_MAX_ROWS);
    return KIE_CPU_E_ARG;
  }
  if (s->threads < 1 || s->threads > KIE_MAX_THREADS) {
    kie_set_error("threads=%d: 1..%d", s->threads, KIE_MAX_THREADS);
    return KIE_CPU_E_ARG;
  }
  if (s->rope_mode != KIE_CPU_ROPE_HALVES && s->rope_mode != KIE_CPU_ROPE_PAIRS) {
    kie_set_error("rope_mode=%d", s->rope_mode);
    return KIE_CPU_E_ARG;
  }
  if (s->kv_type != KIE_CPU_KV_F32 && s->kv_type != KIE_CPU_KV_F16) {
    kie_set_error("kv_type=%d", s->kv_type);
    return KIE_CPU_E_ARG;
  }
  if (!(s->eps > 0) || !(s->rope_theta > 0)) {
    kie_set_error("eps and rope_theta must be positive");
    return KIE_CPU_E_ARG;
  }
  return KIE_CPU_OK;
}

void kie_cpu_destroy(kie_cpu *e) {
  if (!e) return;
  kpool_destroy(e->pool);
  kie_batch_free(e); /* before the threads' state: it holds their batch buffers */
  if (e->th) {
    for (int t = 0; t < e->nthreads; t++) {
      kie_thread *th = &e->th[t];
      free(th->x);
      free(th->h);
      free(th->gu);
      free(th->attn);
      free(th->q);
      free(th->kcur);
      free(th->vcur);
      for (int i = 0; i < 3; i++) free(th->act[i]);
      free(th->pf.spans);
      free(th->pf.first);
    }
    free(e->th);
  }
  free(e->layers);
  free(e->layer_set);
  free(e->qkv);
  free(e->att);
  free(e->m);
  free(e->y);
  free(e->ring);
  free(e->logits_part);
  if (e->seqs)
    for (int i = 0; i < KIE_MAX_SEQS; i++) kie_seq_release(e, &e->seqs[i]);
  free(e->seqs);
  free(e->sh_qkv);
  free(e->sh_o);
  free(e->sh_gu);
  free(e->sh_down);
  free(e->sh_head);
  free(e->head0);
  free(e);
}

int kie_cpu_create(const kie_cpu_shape *s, kcclComm_t comm, kie_cpu **out) {
  *out = NULL;
  int rc = check_shape(s);
  if (rc) return rc;
  if (s->tp_size > 1 && !comm) {
    kie_set_error("tp_size=%d needs the lanes' communicator", s->tp_size);
    return KIE_CPU_E_ARG;
  }
  kie_cpu *e = calloc(1, sizeof *e);
  if (!e) {
    kie_set_error("out of memory");
    return KIE_CPU_E_MEMORY;
  }
  e->s = *s;
  if (!e->s.q_group) e->s.q_group = s->heads / s->kv_heads; /* q_first is 0 then */
  if (!e->s.max_rows) e->s.max_rows = 64;
  e->s.cpus = NULL; /* copied below: the caller's array need not outlive this call */
  if (s->cpus) {
    memcpy(e->cpus, s->cpus, sizeof(int) * s->threads);
    e->has_cpus = 1;
  }
  if (s->tp_size > 1) e->comm = comm;
  e->nthreads = s->threads;
  for (int i = 0; i < s->head_dim / 2; i++) e->inv_freq[i] = 1.0 / pow((double)s->rope_theta, 2.0 * i / s->head_dim);
  int H = s->hidden, hd = s->head_dim, L = s->layers;
  size_t qkv_rows = (size_t)(s->heads + 2 * s->kv_heads) * hd;
  size_t wb = 0;
  e->layers = calloc(L, sizeof(kie_cpu_layer));
  e->layer_set = calloc(L, sizeof(int));
  e->qkv = zalloc(sizeof(float) * qkv_rows, &wb);
  e->att = zalloc(sizeof(float) * s->heads * hd, &wb);
  e->m = zalloc(sizeof(float) * s->inter, &wb);
  e->y = zalloc(sizeof(float) * H, &wb);
  e->ring = zalloc(sizeof(float) * H * (s->dtp_delay + 1), &wb);
  e->logits_part = zalloc(sizeof(float) * s->vocab_part, &wb);
  e->th = calloc(e->nthreads, sizeof(kie_thread));
  int ok = e->layers && e->layer_set && e->qkv && e->att && e->m && e->y && e->ring && e->logits_part && e->th;
  for (int t = 0; ok && t < e->nthreads; t++) {
    kie_thread *th = &e->th[t];
    th->x = zalloc(sizeof(float) * H, &wb);
    th->h = zalloc(sizeof(float) * (H > s->inter ? H : s->inter), &wb);
    th->gu = zalloc(sizeof(float) * 2 * s->inter, &wb);
    th->attn = zalloc(sizeof(float) * kie_attn_scratch_floats(hd), &wb);
    th->q = zalloc(sizeof(float) * s->heads * hd, &wb);
    th->kcur = zalloc(sizeof(float) * s->kv_heads * hd, &wb);
    th->vcur = zalloc(sizeof(float) * s->kv_heads * hd, &wb);
    ok = th->x && th->h && th->gu && th->attn && th->q && th->kcur && th->vcur;
    for (int i = 0; i < 3; i++) th->act_type[i] = -1;
  }
  e->seqs = calloc(KIE_MAX_SEQS, sizeof(kie_seq));
  e->work_bytes = wb;
  if (!ok || !e->seqs) {
    kie_cpu_destroy(e);
    kie_set_error("out of memory (buffers of %zu bytes)", wb);
    return KIE_CPU_E_MEMORY;
  }
  if ((rc = kie_seq_alloc(e, &e->seqs[0], s->max_seq))) { /* sets the error */
    kie_cpu_destroy(e);
    return rc;
  }
  const char *why = NULL;
  if (kpool_create(e->nthreads, e->has_cpus ? e->cpus : NULL, &e->pool, &why)) {
    kie_cpu_destroy(e);
    kie_set_error("thread pool of %d threads: %s", s->threads, why);
    return KIE_CPU_E_THREADS;
  }
  kie_attn_simd();
  *out = e;
  return KIE_CPU_OK;
}

static int check_mat(const kie_cpu_mat *m, int rows, int cols, const char *what, int layer) {
  if (!m->data) {
    kie_set_error("layer %d %s: no data", layer, what);
    return KIE_CPU_E_ARG;
  }
  if (!kq_supported(m->type)) {
    kie_set_error("layer %d %s: weight type %s (%d) is not supported by the CPU kernels", layer, what,
                  kq_type_name(m->type), m->type);
    return KIE_CPU_E_TYPE;
  }
  if (m->rows != rows || m->cols != cols) {
    kie_set_error("layer %d %s: shape %dx%d, expected %dx%d", layer, what, m->rows, m->cols, rows, cols);
    return KIE_CPU_E_ARG;
  }
  if (kq_row_bytes(m->type, cols) == 0) {
    kie_set_error("layer %d %s: %d columns are not a multiple of the %s block (%lld)", layer, what, cols,
                  kq_type_name(m->type), (long long)kq_block_elems(m->type));
    return KIE_CPU_E_ARG;
  }
  return KIE_CPU_OK;
}

int kie_cpu_set_layer(kie_cpu *e, int layer, const kie_cpu_layer *w) {
  const kie_cpu_shape *s = &e->s;
  if (layer < 0 || layer >= s->layers) {
    kie_set_error("layer %d of %d", layer, s->layers);
    return KIE_CPU_E_ARG;
  }
  int H = s->hidden, q = s->heads * s->head_dim, kv = s->kv_heads * s->head_dim, rc;
  if ((rc = check_mat(&w->q, q, H, "q", layer)) || (rc = check_mat(&w->k, kv, H, "k", layer)) ||
      (rc = check_mat(&w->v, kv, H, "v", layer)) || (rc = check_mat(&w->o, H, q, "o", layer)) ||
      (rc = check_mat(&w->gate, s->inter, H, "gate", layer)) || (rc = check_mat(&w->up, s->inter, H, "up", layer)) ||
      (rc = check_mat(&w->down, H, s->inter, "down", layer)))
    return rc;
  if (!w->attn_norm || !w->mlp_norm) {
    kie_set_error("layer %d: a norm vector is missing", layer);
    return KIE_CPU_E_ARG;
  }
  e->layers[layer] = *w;
  e->layer_set[layer] = 1;
  e->planned = 0;
  return KIE_CPU_OK;
}

int kie_cpu_set_globals(kie_cpu *e, const kie_cpu_mat *embed, const float *final_norm, const kie_cpu_mat *head) {
  int rc;
  if ((rc = check_mat(embed, embed->rows, e->s.hidden, "embedding", -1)) ||
      (rc = check_mat(head, e->s.vocab_part, e->s.hidden, "LM head", -1)))
    return rc;
  if (embed->type & KQ_PACKED) {
    kie_set_error("the embedding table is read a row at a time: give it in GGUF rows, not packed (%s)",
                  kq_type_name(embed->type));
    return KIE_CPU_E_ARG;
  }
  if (embed->rows < 1 || !final_norm) {
    kie_set_error("the embedding table is empty or the final norm is missing");
    return KIE_CPU_E_ARG;
  }
  e->embed = *embed;
  e->head = *head;
  e->final_norm = final_norm;
  e->globals_set = 1;
  e->planned = 0;
  return KIE_CPU_OK;
}

int kie_cpu_reset(kie_cpu *e) { return kie_cpu_seq_reset(e, 0); }

/* -- sharing rows out ----------------------------------------------------------------------- */

/* Splits the rows of up to three matrices (one input) between n threads so that each
 * reads about the same number of weight bytes; a share starts on a multiple of
 * KIE_ROW_ALIGN rows. */
void kie_share_rows(const kie_cpu_mat *const *mats, int nm, int n, kie_share *out) {
  size_t rb[3], total = 0;
  for (int i = 0; i < nm; i++) {
    rb[i] = kq_row_bytes(mats[i]->type, mats[i]->cols);
    total += rb[i] * (size_t)mats[i]->rows;
  }
  /* cut points in bytes -> (matrix, row) */
  for (int t = 0; t < n; t++)
    for (int i = 0; i < 3; i++) out[t].r0[i] = out[t].r1[i] = 0;
  int prev_m = 0, prev_r = 0;
  for (int t = 0; t < n; t++) {
    int end_m, end_r;
    if (t == n - 1) {
      end_m = nm - 1;
      end_r = mats[nm - 1]->rows;
    } else {
      size_t cut = total * (size_t)(t + 1) / n, acc = 0;
      end_m = nm - 1;
      end_r = mats[nm - 1]->rows;
      for (int i = 0; i < nm; i++) {
        size_t bytes = rb[i] * (size_t)mats[i]->rows;
        if (acc + bytes >= cut) {
          int r = (int)((cut - acc + rb[i] / 2) / rb[i]);
          r = (r + KIE_ROW_ALIGN / 2) / KIE_ROW_ALIGN * KIE_ROW_ALIGN;
          if (r > mats[i]->rows) r = mats[i]->rows;
          end_m = i;
          end_r = r;
          break;
        }
        acc += bytes;
      }
      if (end_m < prev_m || (end_m == prev_m && end_r < prev_r)) { /* rounding went backwards: empty share */
        end_m = prev_m;
        end_r = prev_r;
      }
    }
    for (int i = prev_m; i <= end_m; i++) {
      out[t].r0[i] = i == prev_m ? prev_r : 0;
      out[t].r1[i] = i == end_m ? end_r : mats[i]->rows;
    }
    prev_m = end_m;
    prev_r = end_r;
  }
}

static void add_spans(kie_prefetch *pf, const kie_cpu_mat *m, int r0, int r1) {
  const void *p[2];
  size_t n[2];
  int k = kq_share_spans(m->type, m->data, m->rows, m->cols, r0, r1, p, n);
  for (int i = 0; i < k; i++) {
    kie_span *sp = &pf->spans[pf->nspans];
    sp->p = p[i];
    sp->n = n[i];
    sp->cum = pf->nspans ? sp[-1].cum + sp[-1].n : 0;
    pf->nspans++;
  }
}

/* Thread t's weight spans of a token, in the order its stages read them. */
static int plan_prefetch(kie_cpu *e, int t) {
  const kie_cpu_shape *s = &e->s;
  int n = e->nthreads, L = s->layers, stages = KIE_STAGE(L, 0) + 1; /* the head is the last */
  kie_prefetch *pf = &e->th[t].pf;
  free(pf->spans);
  free(pf->first);
  pf->spans = calloc((size_t)L * 14 + 2, sizeof(kie_span)); /* at most 2 spans per matrix */
  pf->first = calloc((size_t)stages + 1, sizeof(int));
  if (!pf->spans || !pf->first) return -1;
  pf->nspans = 0;
  for (int l = 0; l < L; l++) {
    const kie_cpu_layer *w = &e->layers[l];
    const kie_share *q = &e->sh_qkv[(size_t)l * n + t], *o = &e->sh_o[(size_t)l * n + t],
                    *gu = &e->sh_gu[(size_t)l * n + t], *dn = &e->sh_down[(size_t)l * n + t];
    pf->first[KIE_STAGE(l, 0)] = pf->nspans;
    add_spans(pf, &w->q, q->r0[0], q->r1[0]);
    add_spans(pf, &w->k, q->r0[1], q->r1[1]);
    add_spans(pf, &w->v, q->r0[2], q->r1[2]);
    pf->first[KIE_STAGE(l, 1)] = pf->nspans;
    add_spans(pf, &w->o, o->r0[0], o->r1[0]);
    pf->first[KIE_STAGE(l, 2)] = pf->nspans;
    add_spans(pf, &w->gate, gu->r0[0], gu->r1[0]);
    add_spans(pf, &w->up, gu->r0[0], gu->r1[0]);
    pf->first[KIE_STAGE(l, 3)] = pf->nspans;
    add_spans(pf, &w->down, dn->r0[0], dn->r1[0]);
  }
  pf->first[KIE_STAGE(L, 0)] = pf->nspans;
  add_spans(pf, &e->head, e->sh_head[t].r0[0], e->sh_head[t].r1[0]);
  pf->first[stages] = pf->nspans;
  pf->next = 0;
  pf->at = 0;
  pf->off = 0;
  return 0;
}

int kie_plan_shares(kie_cpu *e) {
  const kie_cpu_shape *s = &e->s;
  for (int l = 0; l < s->layers; l++)
    if (!e->layer_set[l]) {
      kie_set_error("layer %d's weights were never set", l);
      return KIE_CPU_E_STATE;
    }
  if (!e->globals_set) {
    kie_set_error("the embedding, final norm and LM head were never set");
    return KIE_CPU_E_STATE;
  }
  int n = e->nthreads, L = s->layers;
  if (!e->sh_qkv) {
    e->sh_qkv = calloc((size_t)L * n, sizeof(kie_share));
    e->sh_o = calloc((size_t)L * n, sizeof(kie_share));
    e->sh_gu = calloc((size_t)L * n, sizeof(kie_share));
    e->sh_down = calloc((size_t)L * n, sizeof(kie_share));
    e->sh_head = calloc(n, sizeof(kie_share));
    e->head0 = calloc(n + 1, sizeof(int));
    if (!e->sh_qkv || !e->sh_o || !e->sh_gu || !e->sh_down || !e->sh_head || !e->head0) {
      kie_set_error("out of memory");
      return KIE_CPU_E_MEMORY;
    }
  }
  /* the prepared-input buffers: the largest a stage needs, per slot */
  size_t act = 0;
  for (int l = 0; l < L; l++) {
    kie_cpu_layer *w = &e->layers[l];
    const kie_cpu_mat *qkv[3] = {&w->q, &w->k, &w->v}, *o[1] = {&w->o}, *gu[1] = {&w->gate}, *dn[1] = {&w->down};
    kie_share_rows(qkv, 3, n, &e->sh_qkv[(size_t)l * n]);
    kie_share_rows(o, 1, n, &e->sh_o[(size_t)l * n]);
    kie_share_rows(gu, 1, n, &e->sh_gu[(size_t)l * n]); /* up takes the same rows: SwiGLU pairs them */
    kie_share_rows(dn, 1, n, &e->sh_down[(size_t)l * n]);
    const kie_cpu_mat *all[7] = {&w->q, &w->k, &w->v, &w->o, &w->gate, &w->up, &w->down};
    for (int i = 0; i < 7; i++) {
      size_t b = kq_act_bytes(all[i]->type, all[i]->cols);
      if (b > act) act = b;
    }
  }
  const kie_cpu_mat *hd[1] = {&e->head};
  kie_share_rows(hd, 1, n, e->sh_head);
  size_t b = kq_act_bytes(e->head.type, e->head.cols);
  if (b > act) act = b;
  if (act > e->act_bytes) {
    for (int t = 0; t < n; t++)
      for (int i = 0; i < 3; i++) {
        free(e->th[t].act[i]);
        e->th[t].act[i] = aligned_alloc(64, (act + 63) / 64 * 64);
        if (!e->th[t].act[i]) {
          kie_set_error("out of memory");
          return KIE_CPU_E_MEMORY;
        }
      }
    e->work_bytes += (act - e->act_bytes) * 3 * n;
    e->act_bytes = act;
  }
  /* attention: query heads as evenly as possible */
  for (int t = 0; t <= n; t++) e->head0[t] = (int)((long long)s->heads * t / n);
  for (int t = 0; t < n; t++)
    if (plan_prefetch(e, t)) {
      kie_set_error("out of memory");
      return KIE_CPU_E_MEMORY;
    }
  e->planned = 1;
  return KIE_CPU_OK;
}

int kie_cpu_get_info(kie_cpu *e, kie_cpu_info *info) {
  memset(info, 0, sizeof *info);
  info->threads = e->nthreads;
  info->pos = e->seqs[0].pos;
  info->kv_bytes = e->kv_bytes;
  info->work_bytes = e->work_bytes;
  size_t wb = 0;
  for (int l = 0; l < e->s.layers; l++) {
    if (!e->layer_set[l]) continue;
    kie_cpu_layer *w = &e->layers[l];
    const kie_cpu_mat *all[7] = {&w->q, &w->k, &w->v, &w->o, &w->gate, &w->up, &w->down};
    for (int i = 0; i < 7; i++) wb += kq_row_bytes(all[i]->type, all[i]->cols) * (size_t)all[i]->rows;
  }
  if (e->globals_set) wb += kq_row_bytes(e->head.type, e->head.cols) * (size_t)e->head.rows;
  info->weight_bytes = wb;
  info->kernels = kq_level();
  info->attn_simd = kie_attn_simd();
  return KIE_CPU_OK;
}

int kie_cpu_set_idle_spin(kie_cpu *e, int us) {
  kpool_set_idle_spin(e->pool, 1000LL * us);
  return KIE_CPU_OK;
}

int kie_cpu_set_profiling(kie_cpu *e, int on) {
  e->profiling = on != 0;
  memset(e->prof, 0, sizeof e->prof);
  e->prof_steps = 0;
  return KIE_CPU_OK;
}

int kie_cpu_profile(kie_cpu *e, double *seconds, int n, int *steps) {
  for (int i = 0; i < n && i < KIE_CPU_STAGES; i++) seconds[i] = e->prof[i];
  *steps = e->prof_steps;
  memset(e->prof, 0, sizeof e->prof);
  e->prof_steps = 0;
  return KIE_CPU_OK;
}
