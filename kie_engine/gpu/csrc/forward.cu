/* forward.cu - the per-sublayer path: each op of a step a kernel (or a KCCL call)
 * on the engine's stream, the lanes' sums, and the pick that ends a step. */
#include "forward_walk.h"

namespace kie_host {

int comm_fail(kie_engine *e, int rc, const char *what) {
  const char *why = kcclGetLastError(e->comm);
  return fail(KIE_E_COMM, "%s: KCCL error %d: %s", what, rc, why ? why : "");
}

int all_reduce(kie_engine *e, float *p, size_t count) {
  const int rc = kcclAllReduce(p, p, count, kcclFloat32, kcclSum, e->comm, e->stream);
  return rc ? comm_fail(e, rc, "all-reduce of a sublayer's sum") : KIE_OK;
}

int sum_start(kie_engine *e, float *p, size_t count, uint64_t *req) {
  const int rc = kcclAllReduceStartStream(p, p, count, kcclFloat32, kcclSum, e->comm, e->stream, req);
  return rc ? comm_fail(e, rc, "split-phase all-reduce start") : KIE_OK;
}

int sum_wait(kie_engine *e, uint64_t req) {
  const int rc = kcclAllReduceWaitStream(e->comm, req, e->stream);
  return rc ? comm_fail(e, rc, "split-phase all-reduce wait") : KIE_OK;
}

/* The per-sublayer path: each op a kernel (or KCCL call) on the engine's stream. */
struct Launcher {
  kie_engine *e;
  size_t sum_count;
  int T;
  int node = 0; /* the launch's index in the pass: its slots of the step clock */
  unsigned long long *clock() {
    const int k = node++;
    return e->step_marks && k < e->mono_n ? e->step_marks + (size_t)k * KIE_CLK_MARKS * KIE_CLK_BLOCKS : nullptr;
  }
  int gemv(GemvArgs &a, int epi) {
    a.clk = clock();
    return kie_host::gemv(e, a, epi);
  }
  int attention(AttnArgs &a) {
    if (e->dec_attn == 2) {
      AttnArgs b = smem_attention_args(e, a, e->att_keys);
      b.warm = e->s.att_warm;
      b.blocks = e->att_blocks;
      b.clk = clock();
      CU(kie_launch_attention_smem(b, T, e->stream, e->s.pdl));
    } else {
      clock(); /* the split items mark no clock: their slots stay empty */
      CU(kie_launch_attention(a, T, e->stream, e->s.pdl));
    }
    return KIE_OK;
  }
  int sum(float *S, int i) {
    if (e->s.dtp_delay == 0) return all_reduce(e, S, sum_count);
    return sum_start(e, S, sum_count, &e->req[(size_t)i]);
  }
  int wait(int j) { return sum_wait(e, e->req[(size_t)j]); }
};


/* One forward pass of T tokens (tokbuf, from the device position) ending with `mode`. */
int enqueue_forward(kie_engine *e, int T, int mode) {
  const kie_shape &s = e->s;
  e->req.assign((size_t)(2 * s.layers), 0);
  Launcher v{e, (size_t)T * e->hid_pad, T};
  TRY(walk_forward(e, T, mode != KIE_MODE_ADVANCE, v, s.gemv_residual != 2));
  return enqueue_pick(e, T, mode);
}

/* What follows the LM head: the pick that commits the token, or for a chunk
 * without a pick the position's advance. */
int enqueue_pick(kie_engine *e, int T, int mode) {
  const kie_shape &s = e->s;
  const int tp = s.tp_size;
  if (mode == KIE_MODE_ADVANCE) {
    CU(kie_launch_advance(commit_of(e, T), e->stream, e->s.pdl));
    return KIE_OK;
  }
  if (mode == KIE_MODE_GREEDY) {
    if (tp > 1) TRY(all_reduce(e, e->cand, 2 * (size_t)tp));
    FinalArgs f;
    f.cand = e->cand;
    f.tp = tp;
    f.c = commit_of(e, T);
    CU(kie_launch_finalize(f, e->stream, e->s.pdl));
  } else {
    const float *logits = e->logits;
    if (tp > 1) {
      const int rc = kcclAllGather(e->logits, e->logits_all, (size_t)s.vocab_part, kcclFloat32, e->comm, e->stream);
      if (rc) return comm_fail(e, rc, "all-gather of the logits");
      logits = e->logits_all;
    }
    SampleArgs sa;
    sa.logits = logits;
    sa.V = s.vocab;
    sa.p = e->samp;
    sa.c = commit_of(e, T);
    CU(kie_launch_sample(sa, e->stream, e->s.pdl));
  }
  return KIE_OK;
}

}  // namespace kie_host
