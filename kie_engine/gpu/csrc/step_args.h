/* step_args.h - the arguments of each op of a decode or prefill step, and the
 * GEMV's launch shape: shared by the per-sublayer launches (forward.cu), the
 * monokernel's stage table (mono_host.cu) and the benchmarks (bench/kie_native). */
#ifndef KIE_STEP_ARGS_H_
#define KIE_STEP_ARGS_H_
#include <math.h>
#include <string.h>

#include <algorithm>

#include "engine_internal.h"

namespace kie_host {

/* Segments per unit: enough warps that each streams about one batch of loads
 * (a batch is 32 lanes x U 16-byte loads per row).  The monokernel takes the
 * same count, so that both sum in the same order. */
inline int gemv_segs(kie_engine *e, GemvArgs &a) {
  a.u = a.T > 1 ? 2 : e->s.gemv_pipe ? 4 : e->gemv_u;
  const int batch = 32 * a.u, nvec = a.ld / 8;
  int segs = 1;
  while (segs < GEMV_WARPS && (nvec + segs - 1) / segs > batch) segs *= 2;
  return segs;
}

inline int gemv(kie_engine *e, GemvArgs &a, int epi) {
  /* x, then (EARLY_GAMMA) the norm's gamma */
  const size_t xbytes = (size_t)(a.T + (a.early & EARLY_GAMMA ? 1 : 0)) * a.ld * 4;
  /* x in shared memory (staged by every block), or read through L1 where each
   * warp uses it (plain GEMVs only: the normed ones compute x in shared memory). */
  const int xs = a.x == nullptr || (xbytes <= XS_MAX && !e->s.gemv_x_l1);
  if (a.x == nullptr && xbytes > XS_MAX) return fail(KIE_E_ARG, "normed GEMV input of %zu bytes", xbytes);
  const int units = epi == EPI_SWIGLU ? a.cols : (a.rows + 1) / 2;
  a.segs = gemv_segs(e, a);
  /* The pipelined loop takes one batch per segment. */
  a.pipe = a.T == 1 && e->s.gemv_pipe && (a.ld / 8 + a.segs - 1) / a.segs <= 32 * a.u;
  const int upb = GEMV_WARPS / a.segs;
  const int grid_max = a.blocks_per_sm > 0 ? a.blocks_per_sm * e->sms : e->gemv_grid_max;
  const int grid = std::max(1, std::min(grid_max, (units + upb - 1) / upb));
  CU(kie_launch_gemv(a, epi, xs, grid, xs ? xbytes : 0, e->stream, e->s.pdl));
  return KIE_OK;
}

inline float *sum_buf(kie_engine *e, int j) {
  return e->sums + (size_t)(j % (e->s.dtp_delay + 1)) * e->tmax * e->hid_pad;
}

/* What every GEMV of a step shares: T tokens, the engine's launch switches and its ring. */
inline GemvArgs gemv_base(kie_engine *e, int T) {
  GemvArgs a;
  memset(&a, 0, sizeof a);
  a.T = T;
  a.prefetch = e->s.prefetch;
  a.l2_first = e->s.l2_evict_first != 0;
  a.ring = e->ring_d;
  return a;
}

inline GemvArgs normed(kie_engine *e, int T, const float *r_in, float *r_out, const float *gamma) {
  GemvArgs a = gemv_base(e, T);
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
  /* One token's pass, where gamma fits beside x (a longer pass reads it from memory) */
  a.early = T == 1 && e->s.gemv_early && (size_t)2 * a.ld * 4 <= XS_MAX ? EARLY_GAMMA : 0;
  return a;
}

inline GemvArgs plain(kie_engine *e, int T, const float *x, int in, int x_ld) {
  GemvArgs a = gemv_base(e, T);
  a.x = x;
  a.in = in;
  a.ld = x_ld;
  a.x_ld = x_ld;
  return a;
}

/* The arguments of each op of a step (shared by the per-sublayer launches,
 * the layer benchmark and the monokernel's stage table). */
inline void qkv_args(kie_engine *e, int l, GemvArgs &a) {
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
  a.blocks_per_sm = e->s.qkv_blocks_per_sm;
}

inline void gate_up_args(kie_engine *e, int l, GemvArgs &a) {
  a.w = e->L[(size_t)l].wgu;
  a.rows = 2 * e->s.inter;
  a.cols = e->s.inter;
  a.out = e->act;
  a.out_ld = e->inter_pad;
}

/* A row-parallel GEMV (o or down projection): this lane's partial sum of the sublayer to S. */
inline GemvArgs partial_sum_args(kie_engine *e, int T, const float *x, int in, int x_ld, const bf16 *w, float *S) {
  GemvArgs a = plain(e, T, x, in, x_ld);
  a.w = w;
  a.rows = e->s.hidden;
  a.out = S;
  a.out_ld = e->hid_pad;
  return a;
}

/* An o or down GEMV that writes the new residual: its sums plus the rows of r (hid_pad apart). */
inline void residual_add(kie_engine *e, GemvArgs &a, const float *r) {
  a.r_in = r;
  a.r_ld = e->hid_pad;
}

inline AttnArgs attention_args(kie_engine *e, int l) {
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
  a.combine = e->att_combine;
  return a;
}

/* attention_args for the shared-memory attention (attention_smem.cuh) holding kcap keys a
 * block: its query heads a block (att_heads), keys a split and splits at most. */
inline AttnArgs smem_attention_args(kie_engine *e, const AttnArgs &a, int kcap) {
  AttnArgs b = a;
  b.kcap = kcap;
  smem_attention_splits(e->s, kcap, &b.ksplit, &b.nsplit);
  b.gper = e->att_gper;
  b.hgroups = (e->g + b.gper - 1) / b.gper;
  b.heads1 = e->att_heads1;
  return b;
}

/* The final norm and the LM head on one token's residual row r_row (the sums still due
 * are the caller's to add): this lane's logits, and its argmax candidate in cand. */
inline GemvArgs head_args(kie_engine *e, const float *r_row) {
  const kie_shape &s = e->s;
  GemvArgs h = normed(e, 1, r_row, nullptr, e->normf);
  h.w = e->head;
  h.rows = s.vocab_part;
  h.out = e->logits;
  h.valid_rows = s.vocab_valid;
  h.row_off = s.vocab_off;
  h.tp = s.tp_size;
  h.rank = s.tp_rank;
  h.amax = e->amax;
  h.cnt = e->head_cnt;
  h.cand = e->cand;
  return h;
}

/* Where a step's token goes (the device state, the host ring, the next input). */
inline Commit commit_of(kie_engine *e, int T) {
  Commit c;
  c.st = e->st;
  c.ring = e->ring_d;
  c.tokbuf = e->tokbuf;
  c.T = T;
  return c;
}

}  // namespace kie_host

#endif
