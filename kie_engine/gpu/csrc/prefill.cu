/* prefill.cu - a batched prefill pass: every token of a prompt chunk through each
 * layer at once, each weight matrix one GEMM over the chunk (its weights read
 * once per chunk, not once per token), with the decode step's sublayer order and
 * its sums across the lanes:
 *
 *   per sublayer i:
 *     k_pf_norm     residual R (+ the sums due, by the DTP schedule) -> R, RMSNorm -> x (bf16)
 *     attention:    GEMM x Wqkv^T -> y (f32); k_pf_rope -> q (bf16), KV cache; k_pf_attention -> a (bf16);
 *                   GEMM a Wo^T -> S_i
 *     MLP:          GEMM x Wgu^T -> gu (bf16); k_pf_swiglu -> act (bf16); GEMM act Wd^T -> S_i
 *     lanes:        KCCL all-reduce of S_i (delay 0) or its split phase (delay d)
 *   the last token's final norm and LM head: the decode step's GEMV, then its pick
 *
 * With one lane and no delay, S_i is the GEMM's bf16 output, which the next norm adds to R (the
 * last sublayer's: added by its GEMM, beta = 1 into R, for the head); KIE_GPU_PREFILL_F32_SUMS
 * has every S_i added by its GEMM in f32.
 * The activations of a product are bf16 (the tensor cores' input), so the
 * logits differ from the token-by-token path by bf16 rounding of activations.
 *
 * The last layer's keys and values go into the cache for every token, but nothing
 * reads its other outputs but the last token's (the LM head; a later chunk starts
 * again from the embeddings): from its attention on, that layer runs one row, the
 * last (its o and MLP products are most of a layer's FLOPs). */
#include "step_args.h"

namespace kie_host {

namespace {

float *pf_sum_buf(kie_engine *e, int j) {
  return e->pf_sums + (size_t)(j % (e->s.dtp_delay + 1)) * e->pf_chunk * e->hid_pad;
}

}  // namespace

int enqueue_prefill(kie_engine *e, int T, int mode) {
  const kie_shape &s = e->s;
  const int nsub = 2 * s.layers, d = s.dtp_delay, tp = s.tp_size, hp = e->hid_pad;
  const bool direct = tp == 1 && d == 0, s16 = direct && !e->s.prefill_f32_sums;
  float *R = e->pf_R;
  const size_t last_row = (size_t)(T - 1) * hp;
  e->req.assign((size_t)nsub, 0);
  for (int i = 0; i < nsub; i++) {
    const int l = i / 2, sub = i % 2;
    const Layer &y = e->L[(size_t)l];
    /* Rows of this sublayer's output still needed (past the last layer's K and V: the
     * last one), and where they start in the chunk's residual and sums. */
    const bool trim = l == s.layers - 1 && T > 1;
    const int rows = trim ? 1 : T;
    const size_t off = trim ? last_row : 0;
    PfNormArgs n;
    memset(&n, 0, sizeof n);
    /* the attention sublayer's norm takes every row (its K and V go into the cache) */
    const size_t noff = sub ? off : 0;
    n.r_in = i == 0 ? nullptr : R + noff;
    n.embed = e->embed;
    n.tokens = e->pf_tok;
    n.r_out = R + noff;
    n.ld = hp;
    n.hidden = s.hidden;
    n.T = sub ? rows : T;
    n.gamma = sub ? y.n2 : y.n1;
    n.eps = s.eps;
    n.x = e->pf_x;
    n.x_ld = hp;
    if (s16 && i > 0) n.add16 = e->pf_s16 + noff;
    const int j = i - 1 - d;
    if (!direct && j >= 0) {
      if (tp > 1 && d > 0) TRY(sum_wait(e, e->req[(size_t)j]));
      n.adds[n.nadd++] = pf_sum_buf(e, j) + noff;
    }
    CU(kie_launch_pf_norm(n, e->stream, e->s.pdl));
    float *S = (direct ? R : pf_sum_buf(e, i)) + off;
    const bool out16 = s16 && i < nsub - 1;
    void *Sy = out16 ? (void *)(e->pf_s16 + off) : (void *)S;
    const float beta = direct && !out16 ? 1.f : 0.f;
    if (sub == 0) {
      TRY(blas_gemm(e, T, e->qkv_rows, s.hidden, e->pf_x, hp, y.wqkv, hp, e->pf_y, e->qkv_rows, true, 0.f));
      PfRopeArgs r;
      memset(&r, 0, sizeof r);
      r.y = e->pf_y;
      r.y_ld = e->qkv_rows;
      r.T = T;
      r.nh = s.heads;
      r.nkv = s.kv_heads;
      r.hd = s.head_dim;
      r.max_seq = s.max_seq;
      r.pos = &e->st->pos;
      r.cosv = e->rcos;
      r.sinv = e->rsin;
      r.q = e->pf_q;
      r.q_ld = e->qdim;
      r.kc = y.kc;
      r.vc = y.vc;
      r.ring = e->ring_d;
      CU(kie_launch_pf_rope(r, e->stream, e->s.pdl));
      PfAttnArgs at;
      memset(&at, 0, sizeof at);
      at.first = trim ? T - 1 : 0;
      at.q = e->pf_q + (size_t)at.first * e->qdim;
      at.q_ld = e->qdim;
      at.kc = y.kc;
      at.vc = y.vc;
      at.max_seq = s.max_seq;
      at.hd = s.head_dim;
      at.nh = s.heads;
      at.g = e->g;
      at.T = rows;
      at.pos = &e->st->pos;
      at.scale_log2 = (float)(1.4426950408889634 / sqrt((double)s.head_dim));
      at.out = e->pf_att;
      at.out_ld = e->qdim;
      at.order = e->pf_attn;
      at.part = e->pf_apart;
      at.cnt = e->pf_acnt;
      at.keys = e->pf_keys;
      CU(kie_launch_pf_attention(at, e->stream, e->s.pdl));
      TRY(blas_gemm(e, rows, s.hidden, e->qdim, e->pf_att, e->qdim, y.wo, e->qdim, Sy, hp, !out16, beta));
    } else {
      TRY(blas_gemm(e, rows, 2 * s.inter, s.hidden, e->pf_x, hp, y.wgu, hp, e->pf_gu, 2 * s.inter, false, 0.f));
      PfSwigluArgs g;
      g.gu = e->pf_gu;
      g.gu_ld = 2 * s.inter;
      g.cols = s.inter;
      g.T = rows;
      g.act = e->pf_act;
      g.act_ld = e->inter_pad;
      CU(kie_launch_pf_swiglu(g, e->stream, e->s.pdl));
      TRY(blas_gemm(e, rows, s.hidden, s.inter, e->pf_act, e->inter_pad, y.wd, e->inter_pad, Sy, hp, !out16, beta));
    }
    if (tp > 1) {
      const size_t count = (size_t)rows * hp;
      if (d == 0) TRY(all_reduce(e, S, count));
      else TRY(sum_start(e, S, count, &e->req[(size_t)i]));
    }
  }
  /* The sums still in flight: the final norm adds them (a chunk without a head only joins them). */
  if (tp > 1 && d > 0) TRY(sum_wait(e, e->req[(size_t)nsub - 1]));
  if (mode == KIE_MODE_ADVANCE) return enqueue_pick(e, T, mode);
  GemvArgs h = head_args(e, R + last_row);
  if (!direct)
    for (int j = std::max(0, nsub - 1 - d); j < nsub; j++) h.adds[h.nadd++] = pf_sum_buf(e, j) + last_row;
  TRY(gemv(e, h, EPI_HEAD));
  return enqueue_pick(e, T, mode);
}

}  // namespace kie_host
