/* cpu_seq.c: the engine's sequences (kie_cpu.h): each a KV cache and a position, within
 * the engine's KV limit. */
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

size_t kie_cpu_seq_bytes(kie_cpu *e, int positions) {
  const kie_cpu_shape *s = &e->s;
  size_t cap = ((size_t)(positions > 0 ? positions : 1) + 15) / 16 * 16;
  size_t esz = s->kv_type == KIE_CPU_KV_F16 ? 2 : 4;
  return 2 * (size_t)s->layers * s->kv_heads * cap * s->head_dim * esz;
}

/* The caches are calloc'ed: the kernel maps their pages as positions fill, so a long
 * context costs only what is used.  Sequence 0's does not count against kv_limit: a
 * caller that runs other sequences (the server) leaves it unused, so untouched. */
int kie_seq_alloc(kie_cpu *e, kie_seq *q, int cap) {
  size_t bytes = kie_cpu_seq_bytes(e, cap);
  int counted = q != &e->seqs[0];
  if (counted && e->s.kv_limit && e->kv_reserved + bytes > e->s.kv_limit) {
    kie_set_error("a KV cache of %zu bytes (%d positions) does not fit the KV memory: %zu of %zu bytes are held",
                  bytes, cap, e->kv_reserved, e->s.kv_limit);
    return KIE_CPU_E_MEMORY;
  }
  memset(q, 0, sizeof *q);
  q->k = calloc(bytes / 2, 1);
  q->v = calloc(bytes / 2, 1);
  if (!q->k || !q->v) {
    free(q->k);
    free(q->v);
    q->k = q->v = NULL;
    kie_set_error("out of memory: a KV cache of %zu bytes (%d positions)", bytes, cap);
    return KIE_CPU_E_MEMORY;
  }
  q->cap = (cap + 15) / 16 * 16;
  q->limit = cap;
  q->bytes = bytes;
  q->live = 1;
  if (counted) e->kv_reserved += bytes;
  e->kv_bytes += bytes;
  return KIE_CPU_OK;
}

void kie_seq_release(kie_cpu *e, kie_seq *q) {
  if (!q->live) return;
  free(q->k);
  free(q->v);
  if (q != &e->seqs[0]) e->kv_reserved -= q->bytes;
  e->kv_bytes -= q->bytes;
  memset(q, 0, sizeof *q);
}

static kie_seq *live_seq(kie_cpu *e, int seq) {
  if (seq < 0 || seq >= KIE_MAX_SEQS || !e->seqs[seq].live) {
    kie_set_error("sequence %d does not exist", seq);
    return NULL;
  }
  return &e->seqs[seq];
}

int kie_cpu_seq_new(kie_cpu *e, int positions, int *seq) {
  *seq = -1;
  if (positions < 1) {
    kie_set_error("a sequence needs room for at least one position, not %d", positions);
    return KIE_CPU_E_ARG;
  }
  for (int i = 1; i < KIE_MAX_SEQS; i++)
    if (!e->seqs[i].live) {
      int rc = kie_seq_alloc(e, &e->seqs[i], positions);
      if (!rc) *seq = i;
      return rc;
    }
  kie_set_error("%d sequences are live: the engine holds at most that many", KIE_MAX_SEQS - 1);
  return KIE_CPU_E_MEMORY;
}

int kie_cpu_seq_free(kie_cpu *e, int seq) {
  kie_seq *q = live_seq(e, seq);
  if (!q) return KIE_CPU_E_ARG;
  if (seq == 0) return kie_cpu_seq_reset(e, 0);
  kie_seq_release(e, q);
  return KIE_CPU_OK;
}

int kie_cpu_seq_reset(kie_cpu *e, int seq) {
  kie_seq *q = live_seq(e, seq);
  if (!q) return KIE_CPU_E_ARG;
  q->pos = 0;
  q->bad = 0;
  return KIE_CPU_OK;
}

int kie_cpu_seq_pos(kie_cpu *e, int seq) {
  if (seq < 0 || seq >= KIE_MAX_SEQS || !e->seqs[seq].live) return -1;
  return e->seqs[seq].pos;
}

int kie_cpu_seq_count(kie_cpu *e) {
  int n = 0;
  for (int i = 1; i < KIE_MAX_SEQS; i++) n += e->seqs[i].live;
  return n;
}
