/* forward_walk.h - the ops of one forward pass (forward.cu launches them one by
 * one; mono_host.cu turns them into the monokernel's stage table). */
#ifndef KIE_FORWARD_WALK_H_
#define KIE_FORWARD_WALK_H_
#include "step_args.h"

namespace kie_host {

/* The ops of one forward pass of T tokens, in order, handed to the visitor v:
 *   v.gemv(GemvArgs &, epi)    a GEMV and its epilogue
 *   v.attention(AttnArgs &)    attention of one layer
 *   v.sum(S, i)                the lanes' sum of sublayer i (tp > 1)
 *   v.wait(i)                  the split-phase sum of sublayer i joined (tp > 1, delay > 0)
 * and, with `head`, the final norm and the LM head (its argmax candidate).
 * resid_ok: the o and down GEMVs may update the residual themselves (one lane, delay 0; the
 * caller's setting, kie_shape.gemv_residual or mono_residual): each writes r + y to the other
 * residual buffer, where the next normed GEMV reads it with nothing to add and nothing to write. */
template <typename V>
int walk_forward(kie_engine *e, int T, bool head, V &v, bool resid_ok = false) {
  const kie_shape &s = e->s;
  const int nsub = 2 * s.layers, d = s.dtp_delay, tp = s.tp_size;
  const bool resid = resid_ok && tp == 1 && d == 0;
  int cur = 0;
  for (int i = 0; i < nsub; i++) {
    const int l = i / 2, sub = i % 2;
    const Layer &y = e->L[(size_t)l];
    const float *gamma = sub ? y.n2 : y.n1;
    /* resid: R[cur] holds the whole residual past the first sublayer (the embedding's rows
     * are written by the first normed GEMV) */
    GemvArgs a = resid && i > 0 ? normed(e, T, e->R[cur], nullptr, gamma)
                                : normed(e, T, i == 0 ? nullptr : e->R[cur], e->R[cur ^ 1], gamma);
    const int j = i - 1 - d;
    if (j >= 0 && !resid) {
      if (tp > 1 && d > 0) TRY(v.wait(j));
      a.adds[a.nadd++] = sum_buf(e, j);
    }
    if (!resid || i == 0) cur ^= 1;
    float *S = resid ? e->R[cur ^ 1] : sum_buf(e, i);
    if (sub == 0) {
      qkv_args(e, l, a);
      /* Past the pass's first kernel the position is final before the wait: the pick that
       * advances it ended a pass before this one */
      if (a.early && i > 0) a.early |= EARLY_ROPE;
      TRY(v.gemv(a, EPI_QKV));
      AttnArgs at = attention_args(e, l);
      TRY(v.attention(at));
      GemvArgs o = partial_sum_args(e, T, e->att, e->qdim, e->qdim, y.wo, S);
      o.blocks_per_sm = s.o_blocks_per_sm;
      o.trigger_early = s.o_trigger_early;
      if (resid) residual_add(e, o, e->R[cur]);
      TRY(v.gemv(o, resid ? EPI_RESID : EPI_STORE));
    } else {
      gate_up_args(e, l, a);
      TRY(v.gemv(a, EPI_SWIGLU));
      GemvArgs dn = partial_sum_args(e, T, e->act, s.inter, e->inter_pad, y.wd, S);
      if (resid) residual_add(e, dn, e->R[cur]);
      TRY(v.gemv(dn, resid ? EPI_RESID : EPI_STORE));
    }
    if (resid) cur ^= 1;
    if (tp > 1) TRY(v.sum(S, i));
  }
  /* The sums still in flight: the final norm adds them (or, without a head,
   * they are only joined, so that nothing is outstanding when the pass ends). */
  if (tp > 1 && d > 0) TRY(v.wait(nsub - 1));
  if (!head) return KIE_OK;
  const size_t last_row = (size_t)(T - 1) * e->hid_pad;
  GemvArgs h = head_args(e, e->R[cur] + last_row);
  if (!resid)
    for (int j = std::max(0, nsub - 1 - d); j < nsub; j++) h.adds[h.nadd++] = sum_buf(e, j) + last_row;
  return v.gemv(h, EPI_HEAD);
}

}  // namespace kie_host

#endif
