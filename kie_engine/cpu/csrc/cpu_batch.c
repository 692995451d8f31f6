/* cpu_batch.c: the batch step (kie_cpu.h's kie_cpu_batch): rows of one or several
 * sequences through the model together, each weight matrix applied to every row in one
 * pass (kq_matmul_mat).
 *
 * The threads split each product by weight rows, as the token step does, and the work
 * per row (the embedding, RMSNorm, preparing a product's input, RoPE and the cache
 * writes, the residual) by rows, meeting at a barrier between stages; attention goes by
 * rows too, cut where the positions attended balance, and each thread prepares the o
 * product's input of its own rows.  Every row's arithmetic is the token step's
 * (cpu_ops.h, the kernels' bit-for-bit batch products, kie_attn's per-query results), so
 * a row gets the bits it would get alone. */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_attn.h"
#include "cpu_internal.h"
#include "cpu_ops.h"
#include "kq.h"

/* The batch step's work counters (see claim): per thread t, a run of its shares' counters
 * (KIE_STAGE(l, i), then attention's of each layer; in cache lines of its own: the owner
 * takes from them without passing a line back and forth) */
#define CLAIM_RUN(L) ((5 * (L) + 1 + 15) / 16 * 16)
#define CLAIM_SHARE(L, t, stage) ((t) * CLAIM_RUN(L) + (stage))
#define CLAIM_ATTN(L, t, l) CLAIM_SHARE(L, t, 4 * (L) + 1 + (l))
#define PIECES_PER_THREAD 2 /* pieces of a product per thread (more cost more calls than they save) */

void kie_batch_free(kie_cpu *e) {
  kie_batch *b = &e->b;
  free(b->x);
  free(b->h);
  free(b->qkv);
  free(b->q);
  free(b->cs);
  free(b->att);
  free(b->gu);
  free(b->m);
  free(b->y);
  free(b->ring);
  free(b->lg);
  free(b->claim);
  for (int i = 0; i < 3; i++) free(b->act[i]);
  for (int t = 0; e->th && t < e->nthreads; t++) {
    kie_thread *th = &e->th[t];
    free(th->bx);
    free(th->bh);
    for (int i = 0; i < 3; i++) free(th->bact[i]);
    th->bx = th->bh = NULL;
    memset(th->bact, 0, sizeof th->bact);
  }
  memset(b, 0, sizeof *b);
}

/* Rows that the threads run in their own buffers: fewer than four per thread */
static int own_rows(const kie_cpu *e) { return e->nthreads > 1 ? 4 * e->nthreads - 1 : 0; }

/* Every buffer is written before it is read: left untouched, its pages cost nothing
 * until rows use them. */
static float *falloc(size_t n) { return aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64); }

/* Bytes of the prepared inputs of nt rows for the largest matrix input */
static size_t acts_need(const kie_cpu *e, int nt) {
  size_t need = kq_acts_bytes(e->head.type, e->head.cols, nt);
  for (int l = 0; l < e->s.layers; l++) {
    const kie_cpu_layer *w = &e->layers[l];
    const kie_cpu_mat *all[7] = {&w->q, &w->k, &w->v, &w->o, &w->gate, &w->up, &w->down};
    for (int i = 0; i < 7; i++) {
      size_t n = kq_acts_bytes(all[i]->type, all[i]->cols, nt);
      if (n > need) need = n;
    }
  }
  return need;
}

static int realloc_acts(unsigned char **act, size_t need) {
  for (int i = 0; i < 3; i++) {
    free(act[i]);
    act[i] = aligned_alloc(64, (need + 63) / 64 * 64);
    if (!act[i]) return -1;
  }
  return 0;
}

/* The prepared-input buffers (shared, and each thread's), as large as the weights loaded
 * now need */
static int ensure_acts(kie_cpu *e) {
  kie_batch *b = &e->b;
  size_t need = acts_need(e, b->max_rows), own = own_rows(e) ? acts_need(e, own_rows(e)) : 0;
  if (need > b->act_bytes) {
    if (realloc_acts(b->act, need)) return -1;
    e->work_bytes += (need - b->act_bytes) * 3;
    b->act_bytes = need;
  }
  if (own > b->own_act_bytes) {
    for (int t = 0; t < e->nthreads; t++)
      if (realloc_acts(e->th[t].bact, own)) return -1;
    e->work_bytes += (own - b->own_act_bytes) * 3 * e->nthreads;
    b->own_act_bytes = own;
  }
  return 0;
}

static int alloc_batch(kie_cpu *e) {
  const kie_cpu_shape *s = &e->s;
  kie_batch *b = &e->b;
  size_t R = (size_t)s->max_rows, H = s->hidden, I = s->inter, hd = s->head_dim;
  size_t qrows = (size_t)s->heads * hd, qkv = qrows + 2 * (size_t)s->kv_heads * hd, vp = s->vocab_part;
  b->max_rows = (int)R;
  b->x = falloc(R * H);
  b->h = falloc(R * (H > I ? H : I));
  b->qkv = falloc(R * qkv);
  b->q = falloc(R * qrows);
  b->cs = falloc(R * hd);
  b->att = falloc(R * qrows);
  b->gu = falloc(R * 2 * I);
  b->m = falloc(R * I);
  b->y = falloc(R * H);
  b->ring = falloc((size_t)(s->dtp_delay + 1) * R * H);
  b->lg = s->tp_size > 1 ? falloc(R * vp * (size_t)(s->tp_size + 1)) : NULL; /* one lane: the caller's array */
  b->nclaim = e->nthreads * CLAIM_RUN(s->layers);
  b->claim = aligned_alloc(64, ((size_t)b->nclaim * sizeof(atomic_int) + 63) / 64 * 64);
  if (!b->claim) return -1;
  if (!b->x || !b->h || !b->qkv || !b->q || !b->cs || !b->att || !b->gu || !b->m || !b->y || !b->ring ||
      (s->tp_size > 1 && !b->lg))
    return -1;
  size_t own = (size_t)own_rows(e);
  for (int t = 0; own && t < e->nthreads; t++) {
    kie_thread *th = &e->th[t];
    th->bx = falloc(own * H);
    th->bh = falloc(own * (H > I ? H : I));
    if (!th->bx || !th->bh) return -1;
  }
  e->work_bytes += sizeof(float) * (R * I + own * (H + (H > I ? H : I)) * (size_t)e->nthreads);
  e->work_bytes += sizeof(float) * (R * H * (3 + (size_t)s->dtp_delay + 1) + R * (H > I ? H : I) + R * qkv +
                                    2 * R * qrows + R * hd + 2 * R * I + (s->tp_size > 1 ? R * vp * (size_t)(s->tp_size + 1) : 0));
  return 0;
}

/* The distinct weight types of a stage's matrices -> act slots: slot[i] for matrix i */
static void stage_slots(const kie_cpu_mat *const *m, int nm, int *slot) {
  for (int i = 0; i < nm; i++) {
    slot[i] = i;
    for (int k = 0; k < i; k++)
      if (m[k]->type == m[i]->type) {
        slot[i] = slot[k];
        break;
      }
  }
}

/* Where a thread does its per-row work (the embedding, norms, inputs of the products, the
 * residual): with many rows, its share of them in the shared buffers, whole groups of four
 * (a group's inputs are laid out together, kq's records of four, and two threads writing
 * one record's cache lines would pass them back and forth), a barrier after each such
 * stage; with a few rows (a batch of sequences decoding), every row in its own buffers,
 * as every thread of the token step does for its one token, and no barrier: that work is
 * cheap next to a meeting. */
typedef struct {
  float *x, *h;         /* residual rows (hidden apart), a product's input rows */
  unsigned char **act;  /* the prepared inputs, one per distinct type of a stage */
  int w0, w1;           /* the rows */
  int own;              /* every row, in the thread's own buffers */
  int flags;            /* this thread records non-finite rows (own: thread 0 alone) */
} rowwork;

/* Inputs [r0, r1) of nt (x rows ld floats apart) prepared for each distinct type of the
 * stage; a non-finite input flags its row (input i is row rows[i], or row i without rows). */
static void prepare(kie_cpu *e, const rowwork *rw, const kie_cpu_mat *const *m, int nm, const float *x, size_t ld,
                    int nt, int r0, int r1, const int *rows) {
  kie_batch *b = &e->b;
  int slot[3];
  stage_slots(m, nm, slot);
  for (int r = r0; r < r1 && rw->flags; r++)
    if (kie_nonfinite(x + (size_t)r * ld, m[0]->cols)) b->bad[rows ? rows[r] : r] = 1;
  for (int i = 0; i < nm; i++)
    if (slot[i] == i) kq_prepare_acts(m[i]->type, x, ld, m[i]->cols, nt, r0, r1, rw->act[i]);
}

static void product(const rowwork *rw, const kie_cpu_mat *const *m, int nm, int i, float *y, size_t ldy, int r0,
                    int r1, int nt) {
  int slot[3];
  stage_slots(m, nm, slot);
  if (r1 > r0) kq_matmul_mat(m[i]->type, m[i]->data, m[i]->rows, m[i]->cols, rw->act[slot[i]], nt, y, ldy, r0, r1);
}

/* A few rows (a batch of sequences decoding): the threads take a stage's work in pieces
 * from counters instead of fixed shares.  On a machine whose cores the threads share
 * with other work (the server's HTTP side, its clients), a thread that loses its core for
 * a while holds up only the piece it is in; the others take the rest.  A thread takes
 * the pieces of its own share of the token step (kie_share) first, in order, then those
 * left in the others' shares: the weights it prefetched while it waited (meet) are the
 * ones it reads first.  A piece of a product is a run of output rows (a multiple of
 * KIE_ROW_ALIGN: the kernels' bits do not depend on where a share starts), of attention
 * one row and KV head. */
static int claim(kie_cpu *e, int counter) {
  return atomic_fetch_add_explicit(&e->b.claim[counter], 1, memory_order_relaxed);
}

/* Rows per piece of a stage whose matrices have `rows` output rows in all */
static int piece_rows(int rows, int nth) {
  int c = (rows + PIECES_PER_THREAD * nth - 1) / (PIECES_PER_THREAD * nth);
  c = (c + KIE_ROW_ALIGN - 1) / KIE_ROW_ALIGN * KIE_ROW_ALIGN;
  return c < 16 ? 16 : c;
}

/* Piece k of share sh (its first `parts` matrices cut in runs of c rows): matrix *i,
 * rows [*r0, *r1); 0 when the share has fewer pieces. */
static int share_piece(const kie_share *sh, int parts, int c, int k, int *i, int *r0, int *r1) {
  for (int j = 0; j < parts; j++) {
    int n = sh->r1[j] > sh->r0[j] ? (sh->r1[j] - sh->r0[j] + c - 1) / c : 0;
    if (k < n) {
      *i = j;
      *r0 = sh->r0[j] + k * c;
      *r1 = *r0 + c < sh->r1[j] ? *r0 + c : sh->r1[j];
      return 1;
    }
    k -= n;
  }
  return 0;
}

/* Products of the stage's matrices m (matrix i into y[i], rows ldy floats apart) for nt
 * inputs, by pieces of the threads' shares sh[0 .. nth) (see claim).  swiglu: m is gate
 * and up, pieces cut gate's rows (up takes the same), and each piece's SwiGLU goes into
 * m_out (rows m_ld apart). */
static void claimed_products(kie_cpu *e, const rowwork *rw, const kie_cpu_mat *const *m, int nm, float *const *y,
                             size_t ldy, int nt, int stage, int tid, int nth, const kie_share *sh, float *m_out,
                             size_t m_ld) {
  int parts = m_out ? 1 : nm, total = 0, L = e->s.layers;
  for (int i = 0; i < parts; i++) total += m[i]->rows;
  int c = piece_rows(total, nth);
  for (int v = 0; v < nth; v++) {
    int u = (tid + v) % nth, counter = CLAIM_SHARE(L, u, stage), i, r0, r1;
    for (int k = claim(e, counter); share_piece(&sh[u], parts, c, k, &i, &r0, &r1); k = claim(e, counter)) {
      product(rw, m, nm, i, y[i], ldy, r0, r1, nt);
      if (!m_out) continue;
      product(rw, m, nm, 1, y[1], ldy, r0, r1, nt);
      for (int t = 0; t < nt; t++) {
        const float *gt = y[0] + (size_t)t * ldy;
        kie_swiglu(gt, y[1] + (size_t)t * ldy, m_out + (size_t)t * m_ld, r0, r1);
      }
    }
  }
}

/* The stage's products of m (matrix i into y[i]) without SwiGLU: by pieces of the
 * threads' shares sh[0 .. nth) (rw->own: a few rows), else this thread's fixed share
 * sh[tid]. */
static void stage_products(kie_cpu *e, const rowwork *rw, const kie_cpu_mat *const *m, int nm, float *const *y,
                           size_t ldy, int nt, int stage, int tid, int nth, const kie_share *sh) {
  if (rw->own) {
    claimed_products(e, rw, m, nm, y, ldy, nt, stage, tid, nth, sh, NULL, 0);
    return;
  }
  for (int i = 0; i < nm; i++) product(rw, m, nm, i, y[i], ldy, sh[tid].r0[i], sh[tid].r1[i], nt);
}

/* The meeting after a stage whose output is shared.  With a few rows (rw->own), a
 * thread that waits prefetches the start of its share of weight stage `next` (the token
 * step's spans: the pieces it takes first), as the token step does: the rows are few
 * enough that the products stream their weights slower than memory could give them, and
 * a wait would leave memory idle. */
static void meet(kie_cpu *e, const rowwork *rw, kie_thread *th, int tid, int next) {
  if (!rw->own || next < 0) {
    kpool_barrier(e->pool, tid);
    return;
  }
  th->pf.next = next;
  kpool_barrier_idle(e->pool, tid, kie_prefetch_more, th);
}

/* The wait before attention by pieces: the thread's first piece's cache (what kv_reads
 * names) is what it reads first, so it comes before the next weights (kie_prefetch_more) */
typedef struct {
  kie_thread *th;
  kie_attn_next first;
  int range;
  size_t off;
} kv_wait;

static int kv_wait_more(void *arg) {
  kv_wait *w = arg;
  while (w->range < 2 && w->off >= w->first.bytes[w->range]) {
    w->range++;
    w->off = 0;
  }
  if (w->range == 2) return kie_prefetch_more(w->th);
  const char *p = (const char *)w->first.at[w->range];
  size_t end = w->off + KIE_PF_CHUNK < w->first.bytes[w->range] ? w->off + KIE_PF_CHUNK : w->first.bytes[w->range];
  for (; w->off < end; w->off += 64) __builtin_prefetch(p + w->off, 0, 2);
  return 1;
}

/* A meeting that only the shared buffers need */
static void after_rows(kie_cpu *e, const rowwork *rw, int tid) {
  if (!rw->own) kpool_barrier(e->pool, tid);
}

/* Thread 0, once sublayer k's output is complete: its lanes' sum started (and the due
 * one waited for), as the token step's lanes_sum does for one row.  Returns the ring
 * slot whose sum the residual takes now, or -1. */
static int batch_sum(kie_cpu *e, int k, int tid) {
  const kie_cpu_shape *s = &e->s;
  kie_batch *b = &e->b;
  int d = s->dtp_delay, slot = k % (d + 1), due = k >= d ? (k - d) % (d + 1) : -1;
  size_t count = (size_t)b->n * s->hidden;
  if (s->tp_size == 1 || tid != 0 || e->rc) return due;
  float *dst = b->ring + (size_t)slot * b->max_rows * s->hidden;
  int rc;
  if (d == 0) {
    rc = kcclAllReduce(b->y, dst, count, kcclFloat32, kcclSum, e->comm, NULL);
    if (rc) kie_comm_fail(e, "kcclAllReduce of a sublayer's output", rc);
    return due;
  }
  rc = kcclAllReduceStart(b->y, dst, count, kcclFloat32, kcclSum, e->comm, &b->req[slot]);
  if (rc) {
    kie_comm_fail(e, "kcclAllReduceStart of a sublayer's output", rc);
    return due;
  }
  if (due >= 0) {
    rc = kcclAllReduceWait(e->comm, b->req[due]);
    if (rc) kie_comm_fail(e, "kcclAllReduceWait", rc);
  }
  return due;
}

/* The output of sublayer k: the lane's partial sum (tp > 1) or its ring slot */
static float *sublayer_out(kie_cpu *e, int k) {
  const kie_cpu_shape *s = &e->s;
  if (s->tp_size > 1) return e->b.y;
  return e->b.ring + (size_t)(k % (s->dtp_delay + 1)) * e->b.max_rows * s->hidden;
}

/* After sublayer k's product: the sum, then the due ring slot added to the thread's rows */
static void residual(kie_cpu *e, const rowwork *rw, int k, int tid) {
  const kie_cpu_shape *s = &e->s;
  int due = batch_sum(e, k, tid);
  if (s->tp_size > 1 && due >= 0) kpool_barrier(e->pool, tid);
  if (due < 0 || e->rc) return;
  const float *sum = e->b.ring + (size_t)due * e->b.max_rows * s->hidden;
  for (int r = rw->w0; r < rw->w1; r++) kie_add(rw->x + (size_t)r * s->hidden, sum + (size_t)r * s->hidden, s->hidden);
}

/* RoPE of row r's KV head j: its key, and its value, into its sequence's cache */
static void rope_kv(kie_cpu *e, int l, int r, int j) {
  const kie_cpu_shape *s = &e->s;
  kie_batch *b = &e->b;
  int hd = s->head_dim, qrows = s->heads * hd, kvrows = s->kv_heads * hd, QKV = qrows + 2 * kvrows;
  int kv16 = s->kv_type == KIE_CPU_KV_F16, pos = b->pos[r];
  const float *row = b->qkv + (size_t)r * QKV, *v = row + qrows + kvrows + (size_t)j * hd;
  kie_seq *sq = &e->seqs[b->seq[r]];
  size_t off = kie_seq_head(e, sq, l, j);
  float k[KIE_MAX_HEAD_DIM];
  kie_rope(row + qrows + (size_t)j * hd, k, hd, s->rope_mode, b->cs + (size_t)r * hd);
  if (kv16) {
    uint16_t kh[KIE_MAX_HEAD_DIM];
    kie_halves(k, kh, hd);
    kie_halves(v, (uint16_t *)sq->v + off + kie_v_index(pos, hd), hd);
    for (int i = 0; i < hd; i++) ((uint16_t *)sq->k)[off + kie_k_index(pos, i, hd)] = kh[i];
    return;
  }
  for (int i = 0; i < hd; i++) {
    ((float *)sq->k)[off + kie_k_index(pos, i, hd)] = k[i];
    ((float *)sq->v)[off + kie_v_index(pos, hd) + i] = v[i];
  }
}

/* RoPE of row r's query head h into b->q */
static void rope_q(kie_cpu *e, int r, int h) {
  const kie_cpu_shape *s = &e->s;
  int hd = s->head_dim, qrows = s->heads * hd, QKV = qrows + 2 * s->kv_heads * hd;
  const float *row = e->b.qkv + (size_t)r * QKV;
  kie_rope(row + (size_t)h * hd, e->b.q + (size_t)r * qrows + (size_t)h * hd, hd, s->rope_mode,
           e->b.cs + (size_t)r * hd);
}

/* RoPE of rows [r0, r1): their keys and values into their sequences' caches, their
 * queries into b->q */
static void rope_rows(kie_cpu *e, int l, int r0, int r1) {
  for (int r = r0; r < r1; r++) {
    for (int j = 0; j < e->s.kv_heads; j++) rope_kv(e, l, r, j);
    for (int h = 0; h < e->s.heads; h++) rope_q(e, r, h);
  }
}

/* Attention of rows [a, z) of one sequence for KV head j: its query heads of those rows
 * in calls of up to KIE_ATTN_MAXQ queries. */
static void attend_head(kie_cpu *e, kie_thread *th, int l, int a, int z, int j, kie_attn_next next) {
  const kie_cpu_shape *s = &e->s;
  kie_batch *b = &e->b;
  int hd = s->head_dim, qrows = s->heads * hd, g = s->q_group, qf = s->q_first;
  int kv16 = s->kv_type == KIE_CPU_KV_F16;
  size_t esz = kv16 ? 2 : 4, off = kie_seq_head(e, &e->seqs[b->seq[a]], l, j);
  const kie_seq *sq = &e->seqs[b->seq[a]];
  kie_attn_job job = {.k = (const char *)sq->k + off * esz, .v = (const char *)sq->v + off * esz, .f16 = kv16,
                      .hd = hd, .scale = 1.0f / sqrtf((float)hd), .cur = -1, .pf = next};
  for (int r = a; r < z; r++)
    for (int h = 0; h < s->heads; h++) {
      if ((h + qf) / g != j) continue;
      job.q[job.nq] = b->q + (size_t)r * qrows + (size_t)h * hd;
      job.n[job.nq] = b->pos[r] + 1;
      job.out[job.nq] = b->att + (size_t)r * qrows + (size_t)h * hd;
      if (++job.nq == KIE_ATTN_MAXQ) {
        kie_attn(&job, th->attn);
        job.nq = 0;
      }
    }
  if (job.nq) kie_attn(&job, th->attn);
}

/* Attention of rows [r0, r1): per run of rows of one sequence, per KV head */
static void attend_rows(kie_cpu *e, kie_thread *th, int l, int r0, int r1) {
  kie_batch *b = &e->b;
  for (int a = r0; a < r1;) {
    int z = a;
    while (z < r1 && b->seq[z] == b->seq[a]) z++;
    for (int j = 0; j < e->s.kv_heads; j++) attend_head(e, th, l, a, z, j, (kie_attn_next){0});
    a = z;
  }
}

/* What a piece of attention reads (row r's cache of KV head j in layer l), as the
 * prefetch of the call before it (kie_attn_job's pf): the batch's caches together pass
 * L2, so a piece reads them from memory unless fetched while the piece before it computed */
static kie_attn_next kv_reads(const kie_cpu *e, int l, int r, int j) {
  return kie_kv_reads(e, &e->seqs[e->b.seq[r]], l, j, e->b.pos[r]);
}

/* Attention of every row, by pieces (piece k: row k / kv_heads, KV head k % kv_heads):
 * a thread takes those of its own share (apiece) in order, then those left in the
 * others' shares; each call prefetches the next piece of the thread's share.  With rope,
 * each piece first writes its row's key and value of that head into the cache and ropes
 * the row's query heads of that group: only when every row is a different sequence's,
 * so that no row attends a position another piece writes. */
static void attend_claimed(kie_cpu *e, kie_thread *th, int l, int rope, int tid) {
  const kie_cpu_shape *s = &e->s;
  const int *ap = e->b.apiece;
  int nkv = s->kv_heads, nth = e->nthreads;
  for (int v = 0; v < nth; v++) {
    int u = (tid + v) % nth, counter = CLAIM_ATTN(s->layers, u, l);
    for (int k = ap[u] + claim(e, counter); k < ap[u + 1]; k = ap[u] + claim(e, counter)) {
      int r = k / nkv, j = k % nkv;
      kie_attn_next next = {0};
      if (u == tid && k + 1 < ap[u + 1]) next = kv_reads(e, l, (k + 1) / nkv, (k + 1) % nkv);
      if (rope) {
        rope_kv(e, l, r, j);
        for (int h = 0; h < s->heads; h++)
          if ((h + s->q_first) / s->q_group == j) rope_q(e, r, h);
      }
      attend_head(e, th, l, r, r + 1, j, next);
    }
  }
}

static void batch_all(void *arg, int tid, int nth) {
  kie_cpu *e = arg;
  const kie_cpu_shape *s = &e->s;
  kie_batch *b = &e->b;
  kie_thread *th = &e->th[tid];
  int R = b->n, H = s->hidden, I = s->inter, L = s->layers, d = s->dtp_delay, tp = s->tp_size;
  int hd = s->head_dim, qrows = s->heads * hd, kvrows = s->kv_heads * hd, QKV = qrows + 2 * kvrows;
  int G = (R + 3) / 4, r0 = 4 * (G * tid / nth), r1 = 4 * (G * (tid + 1) / nth); /* the cache writes' rows */
  r1 = r1 < R ? r1 : R;
  r0 = r0 < R ? r0 : R;
  rowwork rw = {b->x, b->h, b->act, r0, r1, 0, 1};
  if (nth > 1 && R < 4 * nth) { /* a few rows: all of them, in the thread's own buffers */
    rowwork own = {th->bx, th->bh, th->bact, 0, R, 1, tid == 0};
    rw = own;
  }
  if (rw.own) th->pf.at = 0; /* the prefetch cursor starts the step again */
  int prof = e->profiling && tid == 0;
  double t_prev = prof ? kie_now_s() : 0;
  size_t rb_embed = kq_row_bytes(e->embed.type, H);
  for (int r = rw.w0; r < rw.w1; r++)
    kq_dequant_row(e->embed.type, (const char *)e->embed.data + (size_t)b->tok[r] * rb_embed, H, rw.x + (size_t)r * H);
  for (int r = r0; r < r1; r++) kie_rope_angles(e, b->pos[r], b->cs + (size_t)r * hd); /* rope_rows' rows */
  for (int l = 0; l < L; l++) {
    const kie_cpu_layer *w = &e->layers[l];
    const kie_cpu_mat *qkv[3] = {&w->q, &w->k, &w->v}, *o[1] = {&w->o}, *gu[2] = {&w->gate, &w->up},
                      *dn[1] = {&w->down};
    /* q, k, v */
    for (int r = rw.w0; r < rw.w1; r++) kie_rms_norm(rw.x + (size_t)r * H, w->attn_norm, H, s->eps, rw.h + (size_t)r * H);
    prepare(e, &rw, qkv, 3, rw.h, H, R, rw.w0, rw.w1, NULL);
    after_rows(e, &rw, tid);
    const kie_share *sh = &e->sh_qkv[(size_t)l * nth];
    float *yq[3] = {b->qkv, b->qkv + qrows, b->qkv + qrows + kvrows};
    stage_products(e, &rw, qkv, 3, yq, QKV, R, KIE_STAGE(l, 0), tid, nth, sh);
    if (rw.own && b->apiece[tid] < b->apiece[tid + 1]) {
      kv_wait w = {th, kv_reads(e, l, b->apiece[tid] / s->kv_heads, b->apiece[tid] % s->kv_heads), 0, 0};
      th->pf.next = KIE_STAGE(l, 1);
      kpool_barrier_idle(e->pool, tid, kv_wait_more, &w);
    } else {
      meet(e, &rw, th, tid, KIE_STAGE(l, 1));
    }
    STAMP(0);
    /* RoPE and the cache writes, attention, then (many rows) the o product's input of the
     * same rows */
    if (rw.own && b->distinct) {
      attend_claimed(e, th, l, 1, tid);
    } else {
      rope_rows(e, l, r0, r1);
      kpool_barrier(e->pool, tid);
      if (rw.own)
        attend_claimed(e, th, l, 0, tid);
      else
        attend_rows(e, th, l, b->arow[tid], b->arow[tid + 1]);
    }
    if (!rw.own) prepare(e, &rw, o, 1, b->att, qrows, R, b->arow[tid], b->arow[tid + 1], NULL);
    meet(e, &rw, th, tid, KIE_STAGE(l, 1));
    if (rw.own) prepare(e, &rw, o, 1, b->att, qrows, R, 0, R, NULL);
    STAMP(1);
    sh = &e->sh_o[(size_t)l * nth];
    float *yo[1] = {sublayer_out(e, 2 * l)};
    stage_products(e, &rw, o, 1, yo, H, R, KIE_STAGE(l, 1), tid, nth, sh);
    meet(e, &rw, th, tid, KIE_STAGE(l, 2));
    STAMP(2);
    residual(e, &rw, 2 * l, tid);
    if (e->rc) return;
    STAMP(5);
    /* gate / up with SwiGLU into b->m, then down */
    for (int r = rw.w0; r < rw.w1; r++) kie_rms_norm(rw.x + (size_t)r * H, w->mlp_norm, H, s->eps, rw.h + (size_t)r * H);
    prepare(e, &rw, gu, 2, rw.h, H, R, rw.w0, rw.w1, NULL);
    after_rows(e, &rw, tid);
    sh = &e->sh_gu[(size_t)l * nth];
    float *ygu[2] = {b->gu, b->gu + I};
    if (rw.own) {
      claimed_products(e, &rw, gu, 2, ygu, 2 * (size_t)I, R, KIE_STAGE(l, 2), tid, nth, sh, b->m, I);
    } else {
      const kie_share *mine = &sh[tid];
      product(&rw, gu, 2, 0, b->gu, 2 * (size_t)I, mine->r0[0], mine->r1[0], R);
      product(&rw, gu, 2, 1, b->gu + I, 2 * (size_t)I, mine->r0[0], mine->r1[0], R);
      for (int t = 0; t < R; t++) {
        const float *gt = b->gu + (size_t)t * 2 * I;
        kie_swiglu(gt, gt + I, b->m + (size_t)t * I, mine->r0[0], mine->r1[0]);
      }
    }
    meet(e, &rw, th, tid, KIE_STAGE(l, 3));
    prepare(e, &rw, dn, 1, b->m, I, R, rw.w0, rw.w1, NULL);
    after_rows(e, &rw, tid);
    STAMP(3);
    sh = &e->sh_down[(size_t)l * nth];
    float *yd[1] = {sublayer_out(e, 2 * l + 1)};
    stage_products(e, &rw, dn, 1, yd, H, R, KIE_STAGE(l, 3), tid, nth, sh);
    meet(e, &rw, th, tid, KIE_STAGE(l + 1, 0)); /* after the last layer: the LM head's stage */
    STAMP(4);
    residual(e, &rw, 2 * l + 1, tid);
    if (e->rc) return;
    STAMP(5);
  }
  /* the sums still in flight (d > 0) */
  for (int k = 2 * L - d; k < 2 * L; k++) {
    int slot = k % (d + 1);
    if (tp > 1) {
      if (tid == 0 && !e->rc) {
        int rc = kcclAllReduceWait(e->comm, b->req[slot]);
        if (rc) kie_comm_fail(e, "kcclAllReduceWait", rc);
      }
      kpool_barrier(e->pool, tid);
      if (e->rc) return;
    }
    const float *sum = b->ring + (size_t)slot * b->max_rows * H;
    for (int r = rw.w0; r < rw.w1; r++) kie_add(rw.x + (size_t)r * H, sum + (size_t)r * H, H);
  }
  /* the logits of the rows that want them: row k of the head's input is row logrow[k] */
  int K = b->nlog;
  if (!K) return;
  after_rows(e, &rw, tid);
  int k0 = rw.own ? 0 : K * tid / nth, k1 = rw.own ? K : K * (tid + 1) / nth;
  for (int k = k0; k < k1; k++)
    kie_rms_norm(rw.x + (size_t)b->logrow[k] * H, e->final_norm, H, s->eps, rw.h + (size_t)k * H);
  const kie_cpu_mat *hm[1] = {&e->head};
  prepare(e, &rw, hm, 1, rw.h, H, K, k0, k1, b->logrow);
  after_rows(e, &rw, tid);
  size_t vp = s->vocab_part, ld = tp > 1 ? vp : vp * tp;
  float *part = tp > 1 ? b->lg : b->logits;
  stage_products(e, &rw, hm, 1, &part, ld, K, KIE_STAGE(L, 0), tid, nth, e->sh_head);
  kpool_barrier(e->pool, tid);
  if (tid != 0) return;
  STAMP(6);
  for (int k = 0; k < K; k++) { /* this lane's slice, before the gather: every lane sees the NaN */
    int r = b->logrow[k];
    if (b->bad[r] || e->seqs[b->seq[r]].bad)
      for (size_t i = 0; i < vp; i++) part[(size_t)k * ld + i] = NAN;
  }
  if (tp > 1) {
    float *all = b->lg + (size_t)b->max_rows * vp; /* [lane][k][vp] */
    int rc = kcclAllGather(b->lg, all, K * vp, kcclFloat32, e->comm, NULL);
    if (rc) {
      kie_comm_fail(e, "kcclAllGather of the logits", rc);
      return;
    }
    for (int k = 0; k < K; k++)
      for (int t = 0; t < tp; t++)
        memcpy(b->logits + ((size_t)k * tp + t) * vp, all + ((size_t)t * K + k) * vp, vp * sizeof(float));
  }
}

/* Attention's rows per thread: contiguous, cut where the positions attended balance; and
 * its pieces (rows and KV heads, attend_claimed) likewise */
static void split_attention(kie_cpu *e) {
  kie_batch *b = &e->b;
  int nth = e->nthreads;
  double total = 0, acc = 0;
  for (int r = 0; r < b->n; r++) total += b->pos[r] + 1;
  b->arow[0] = 0;
  int t = 1;
  for (int r = 0; r < b->n && t < nth; r++) {
    acc += b->pos[r] + 1;
    while (t < nth && acc >= total * t / nth) b->arow[t++] = r + 1;
  }
  while (t <= nth) b->arow[t++] = b->n;
  long nkv = e->s.kv_heads, all = 0, sum = 0; /* a piece's cost: its row's positions */
  for (int r = 0; r < b->n; r++) all += (b->pos[r] + 1) * nkv;
  b->apiece[0] = 0;
  t = 1;
  for (int k = 0; k < b->n * nkv && t < nth; k++) {
    sum += b->pos[k / nkv] + 1;
    while (t < nth && sum * nth >= all * t) b->apiece[t++] = k + 1;
  }
  while (t <= nth) b->apiece[t++] = b->n * nkv;
}

int kie_cpu_batch(kie_cpu *e, const int32_t *seqs, const int32_t *tokens, int n, const uint8_t *want, float *logits,
                  int32_t *bad) {
  kie_batch *b = &e->b;
  if (!e->planned) {
    int rc = kie_plan_shares(e);
    if (rc) return rc;
  }
  int R = e->s.max_rows;
  if (n < 1 || n > R || !seqs || !tokens) {
    kie_set_error("kie_cpu_batch takes 1..%d rows, not %d", R, n);
    return KIE_CPU_E_ARG;
  }
  for (int i = 0; i < n; i++) {
    if (seqs[i] < 0 || seqs[i] >= KIE_MAX_SEQS || !e->seqs[seqs[i]].live) {
      kie_set_error("row %d: sequence %d does not exist", i, seqs[i]);
      return KIE_CPU_E_ARG;
    }
    if (tokens[i] < 0 || tokens[i] >= e->embed.rows) {
      kie_set_error("token id %d is outside the embedding table (%d rows)", tokens[i], e->embed.rows);
      return KIE_CPU_E_ARG;
    }
  }
  /* positions: each sequence's rows, in order, from its current position */
  for (int i = 0; i < n; i++) {
    kie_seq *q = &e->seqs[seqs[i]];
    int before = 0;
    for (int k = 0; k < i; k++) before += seqs[k] == seqs[i];
    b->pos[i] = q->pos + before;
    if (b->pos[i] >= q->limit) {
      kie_set_error("sequence %d: %d more tokens do not fit its context of %d (%d used)", seqs[i], before + 1,
                    q->limit, q->pos);
      return KIE_CPU_E_STATE;
    }
  }
  /* one row: the token step, its bits and its speed (weights streamed with prefetching,
   * fewer meetings per layer) */
  if (n == 1) {
    int rc = kie_token_run(e, seqs[0], tokens, 1, want && want[0] ? logits : NULL);
    if (!rc && bad) bad[0] = e->seqs[seqs[0]].bad;
    return rc;
  }
  if (!b->x && alloc_batch(e)) {
    kie_batch_free(e);
    kie_set_error("out of memory (the batch step's buffers for %d rows)", R);
    return KIE_CPU_E_MEMORY;
  }
  if (ensure_acts(e)) {
    kie_set_error("out of memory (the batch step's prepared inputs for %d rows)", R);
    return KIE_CPU_E_MEMORY;
  }
  b->n = n;
  b->nlog = 0;
  for (int i = 0; i < n; i++) {
    b->seq[i] = seqs[i];
    b->tok[i] = tokens[i];
    b->bad[i] = 0;
    if (want && want[i] && logits) b->logrow[b->nlog++] = i;
  }
  b->logits = logits;
  b->distinct = 1;
  for (int i = 0; i < n; i++)
    for (int k = 0; k < i; k++) b->distinct &= seqs[k] != seqs[i];
  split_attention(e);
  for (int i = 0; i < b->nclaim; i++) atomic_store_explicit(&b->claim[i], 0, memory_order_relaxed);
  e->rc = 0;
  e->err[0] = 0;
  kpool_run(e->pool, batch_all, e);
  if (e->rc) {
    kie_set_error("%s", e->err);
    return e->rc;
  }
  if (e->profiling) e->prof_steps++;
  for (int i = 0; i < n; i++) e->seqs[seqs[i]].bad |= b->bad[i];
  for (int i = 0; i < n; i++) e->seqs[seqs[i]].pos++;
  if (bad)
    for (int i = 0; i < n; i++) bad[i] = e->seqs[seqs[i]].bad;
  return KIE_CPU_OK;
}
