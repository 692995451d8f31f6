/* weights.cu - what follows from the shape (checked, with the device's SM count),
 * the arena's layout (weights, KV cache, activations, the monokernel's tables), and
 * where each uploaded weight goes. */
#include <algorithm>

#include "engine_internal.h"

namespace kie_host {

/* Sizes that follow from the shape and the device; an error names what does not fit. */
int derive(kie_engine *e, const kie_shape &s, int sms) {
  if (s.hidden < 1 || s.inter < 1 || s.layers < 1 || s.heads < 1 || s.kv_heads < 1 || s.vocab < 1 ||
      s.vocab_part < 1 || s.max_seq < 1)
    return fail(KIE_E_ARG, "every size of the shape must be positive");
  if (s.heads % s.kv_heads)
    return fail(KIE_E_ARG, "heads=%d is not a multiple of kv_heads=%d", s.heads, s.kv_heads);
  if (s.head_dim < 16 || s.head_dim > 256 || (s.head_dim & (s.head_dim - 1)))
    return fail(KIE_E_ARG, "head_dim=%d: the GPU attention takes a power of two from 16 to 256", s.head_dim);
  if (s.vocab_valid < 0 || s.vocab_valid > s.vocab_part || s.vocab_off < 0 || s.vocab_off + s.vocab_valid > s.vocab)
    return fail(KIE_E_ARG, "vocabulary slice [%d, %d + %d) of %d rows does not fit the vocabulary of %d", s.vocab_off,
                s.vocab_off, s.vocab_valid, s.vocab_part, s.vocab);
  if (s.vocab > (1 << 23))
    return fail(KIE_E_ARG, "vocab=%d: the GPU sampler takes at most %d tokens", s.vocab, 1 << 23);
  if (s.dtp_delay < 0 || s.dtp_delay > KIE_MAX_ADDS - 1)
    return fail(KIE_E_ARG, "dtp_delay=%d: 0..%d", s.dtp_delay, KIE_MAX_ADDS - 1);
  if (s.tp_size < 1 || s.tp_rank < 0 || s.tp_rank >= s.tp_size)
    return fail(KIE_E_ARG, "tp_rank=%d of tp_size=%d", s.tp_rank, s.tp_size);
  if (!(s.eps > 0.f)) return fail(KIE_E_ARG, "eps must be positive");
  e->s = s;
  e->sms = sms;
  e->hid_pad = (int)round_up((size_t)s.hidden, 8);
  e->inter_pad = (int)round_up((size_t)s.inter, 8);
  e->qdim = s.heads * s.head_dim;
  e->kvdim = s.kv_heads * s.head_dim;
  e->qkv_rows = e->qdim + 2 * e->kvdim;
  e->tmax = (int)std::min<size_t>(GEMV_MAX_T, XS_MAX / (4 * (size_t)e->hid_pad));
  if (e->tmax < 1)
    return fail(KIE_E_ARG, "hidden=%d: the normed GEMV keeps a token's activations in %zu KB of shared memory",
                s.hidden, XS_MAX / 1024);
  e->g = s.heads / s.kv_heads;
  e->gper = std::min(e->g, ATT_MAXG);
  e->hgroups = (e->g + e->gper - 1) / e->gper;
  const int groups = s.kv_heads * e->hgroups;
  /* Enough blocks to cover the SMs twice at a long context; a short one uses fewer. */
  e->nsplit = std::max(1, std::min(std::min(s.max_seq, 1024), (2 * sms + groups - 1) / groups));
  if (s.att_chunk < 0) return fail(KIE_E_ARG, "att_chunk=%d", s.att_chunk);
  e->att_chunk = s.att_chunk ? s.att_chunk : 32; /* the fastest of 16..256 on the 2b shape (bench/RESULTS.md) */
  if (s.decode_attn < 0 || s.decode_attn > 2)
    return fail(KIE_E_ARG, "decode_attn=%d: 0 (auto), 1 (split items) or 2 (shared memory)", s.decode_attn);
  e->dec_attn = s.decode_attn == 1 ? 1 : 2;
  if (s.att_keys < 0 || s.att_keys > ATT_SMEM_KEYS(s.head_dim))
    return fail(KIE_E_ARG, "att_keys=%d: 0 (auto) or 1..%d for head size %d", s.att_keys, ATT_SMEM_KEYS(s.head_dim),
                s.head_dim);
  e->att_keys = s.att_keys ? s.att_keys : ATT_SMEM_KEYS(s.head_dim);
  if (s.att_split_keys < 0 || s.att_split_keys > e->att_keys)
    return fail(KIE_E_ARG, "att_split_keys=%d: 0 (auto) or 1..att_keys (%d)", s.att_split_keys, e->att_keys);
  if (s.att_splits < 0) return fail(KIE_E_ARG, "att_splits=%d: 0 (auto) or a count", s.att_splits);
  smem_attention_splits(s, e->att_keys, &e->att_split, &e->nsplit_smem);
  if (s.att_heads < 0 || s.att_heads > 2)
    return fail(KIE_E_ARG, "att_heads=%d: 0 (auto), 1 (one a block) or 2 (a KV head's together)", s.att_heads);
  e->att_gper = s.att_heads == 1 ? 1 : e->gper;
  e->att_heads1 = s.att_heads == 0;
  if (s.att_blocks < -1) return fail(KIE_E_ARG, "att_blocks=%d: 0 (auto), -1 (an item slot a block) or a count", s.att_blocks);
  {
    /* the most items a step has: a query head each while the context fits one, else
     * (group, split) pairs */
    const int items = std::max(e->att_heads1 ? s.heads : 0, s.kv_heads * ((e->g + e->att_gper - 1) / e->att_gper) *
                                                               e->nsplit_smem);
    /* auto: a block an SM at most (an attention block fills an SM's shared memory, so a grid
     * past them waits for a second wave) */
    e->att_blocks = s.att_blocks > 0 ? std::min(s.att_blocks, items) : s.att_blocks == 0 ? std::min(items, sms) : 0;
  }
  const int bps = s.gemv_blocks_per_sm > 0 ? s.gemv_blocks_per_sm : 2;
  e->gemv_grid_max = bps * sms;
  if (s.gemv_u != 0 && s.gemv_u != 4 && s.gemv_u != 8) return fail(KIE_E_ARG, "gemv_u=%d: 4 or 8 (0: auto)", s.gemv_u);
  e->gemv_u = s.gemv_u ? s.gemv_u : 8;
  if (s.prefetch < 0 || s.prefetch > 2) return fail(KIE_E_ARG, "prefetch=%d: 0, 1 or 2", s.prefetch);
  if (s.kernel != KIE_KERNEL_GRAPH && s.kernel != KIE_KERNEL_MONO)
    return fail(KIE_E_ARG, "kernel=%d: KIE_KERNEL_GRAPH (0) or KIE_KERNEL_MONO (1)", s.kernel);
  if (s.kernel == KIE_KERNEL_MONO && s.tp_size > KIE_MONO_MAX_LANES)
    return fail(KIE_E_ARG, "the monokernel sums at most %d lanes; use the graph kernel for tp_size=%d",
                KIE_MONO_MAX_LANES, s.tp_size);
  if (s.kernel == KIE_KERNEL_MONO && s.tp_size > 1 &&
      round_up((size_t)s.hidden, 8) > (size_t)KCCL_DEV_MAX_BLOCKS * (KCCL_LL_MAX_BYTES / 4))
    return fail(KIE_E_ARG, "hidden=%d: the monokernel's lanes sum at most %d floats per sublayer (%d KCCL slots "
                "of %d bytes); use the graph kernel", s.hidden, KCCL_DEV_MAX_BLOCKS * (KCCL_LL_MAX_BYTES / 4),
                KCCL_DEV_MAX_BLOCKS, KCCL_LL_MAX_BYTES);
  if (s.mono_prefetch < -1 || s.mono_prefetch > 64) return fail(KIE_E_ARG, "mono_prefetch=%d: -1..64", s.mono_prefetch);
  if (s.lanes_per_device < 0) return fail(KIE_E_ARG, "lanes_per_device=%d", s.lanes_per_device);
  if (s.mono_wait_ms < 0) return fail(KIE_E_ARG, "mono_wait_ms=%d: 0 (auto, 2,000) or a bound in ms", s.mono_wait_ms);
  if (s.mono_blocks < 0) return fail(KIE_E_ARG, "mono_blocks=%d: 0 (auto) or a block count", s.mono_blocks);
  if (s.mono_attn < 0 || s.mono_attn > 2)
    return fail(KIE_E_ARG, "mono_attn=%d: 0 (auto), 1 (split items) or 2 (shared memory)", s.mono_attn);
  e->mono_attn = s.mono_attn == 1 ? 1 : 2;
  e->mono_n = 5 * s.layers + 1; /* per layer QKV, attention, o, gate/up, down; the head */
  if (s.prefill != 0 && s.prefill != 1) return fail(KIE_E_ARG, "prefill=%d: 0 or 1", s.prefill);
  if (s.step_clock != 0 && s.step_clock != 1) return fail(KIE_E_ARG, "step_clock=%d: 0 or 1", s.step_clock);
  if (s.o_trigger_early != 0 && s.o_trigger_early != 1)
    return fail(KIE_E_ARG, "o_trigger_early=%d: 0 or 1", s.o_trigger_early);
  if (s.l2_evict_first < -1 || s.l2_evict_first > 1)
    return fail(KIE_E_ARG, "l2_evict_first=%d: -1 (auto), 0 (off) or 1 (on)", s.l2_evict_first);
  if (s.mono_slots != 0 && (s.mono_slots < 2 || s.mono_slots > 8))
    return fail(KIE_E_ARG, "mono_slots=%d: 0 (auto) or 2..8", s.mono_slots);
  if (s.gemv_early != 0 && s.gemv_early != 1) return fail(KIE_E_ARG, "gemv_early=%d: 0 or 1", s.gemv_early);
  if (s.gemv_carveout < 0 || s.gemv_carveout > 100)
    return fail(KIE_E_ARG, "gemv_carveout=%d: 0 (auto) or 1..100 (percent)", s.gemv_carveout);
  if (s.mono_sync < 0 || s.mono_sync > 2)
    return fail(KIE_E_ARG, "mono_sync=%d: 0 (auto), 1 (fence) or 2 (release)", s.mono_sync);
  if (s.mono_ahead < 0 || s.mono_ahead > 2)
    return fail(KIE_E_ARG, "mono_ahead=%d: 0 (auto), 1 (ahead) or 2 (as each stage starts)", s.mono_ahead);
  if (s.att_warm != 0 && s.att_warm != 1) return fail(KIE_E_ARG, "att_warm=%d: 0 or 1", s.att_warm);
  if (s.att_combine < 0 || s.att_combine > 2)
    return fail(KIE_E_ARG, "att_combine=%d: 0 (auto), 1 (one pass) or 2 (a chain of round trips)", s.att_combine);
  e->att_combine = s.att_combine == 2 ? ATT_COMBINE_CHAIN : ATT_COMBINE_ONE_PASS;
  if (s.mono_residual < 0 || s.mono_residual > 2)
    return fail(KIE_E_ARG, "mono_residual=%d: 0 (auto), 1 (o and down write it) or 2 (the norm adds the sums)",
                s.mono_residual);
  if (s.mono_ll < 0 || s.mono_ll > 6)
    return fail(KIE_E_ARG, "mono_ll=%d: 0 (auto), 1 (LL words into the o, gate/up, down and normed stages), 2 "
                "(counts), 3 (LL words between the GEMV stages only), 4 (LL words but into the down stage), 5 "
                "or 6 (as 1 or 4, and into the attention stage)", s.mono_ll);
  if (mono_ll_on(s) && (s.tp_size > 1 || s.dtp_delay > 0 || s.mono_residual == 2))
    return fail(KIE_E_ARG, "mono_ll=%d needs one lane, delay 0 and the stages writing the residual (mono_residual "
                "0 or 1): the lanes' sums and the normed stages' adds are read after a count", s.mono_ll);
  /* Auto takes the words wherever they are allowed but into the down stage (6): on the 2b shape 4-6 % more
   * tokens/s at a context of 128 than 1, which was 2-7 % ahead of the counts (bench/RESULTS.md).  The graph
   * kernel never reads them, so it allocates none. */
  if (s.mono_ll == 0)
    e->s.mono_ll = s.tp_size == 1 && s.dtp_delay == 0 && s.mono_residual != 2 ? 6 : 2;
  if (s.gemv_residual < 0 || s.gemv_residual > 2)
    return fail(KIE_E_ARG, "gemv_residual=%d: 0 (auto), 1 (o and down write it) or 2 (the norm adds the sums)",
                s.gemv_residual);
  if (s.qkv_blocks_per_sm < 0 || s.qkv_blocks_per_sm > 8)
    return fail(KIE_E_ARG, "qkv_blocks_per_sm=%d: 0 (auto) or 1..8", s.qkv_blocks_per_sm);
  if (s.o_blocks_per_sm < 0 || s.o_blocks_per_sm > 8)
    return fail(KIE_E_ARG, "o_blocks_per_sm=%d: 0 (auto) or 1..8", s.o_blocks_per_sm);
  if (s.prefill_chunk < 0) return fail(KIE_E_ARG, "prefill_chunk=%d: 0 (auto) or a token count", s.prefill_chunk);
  e->pf_chunk = s.prefill ? std::min(s.prefill_chunk ? s.prefill_chunk : 1024, s.max_seq) : 0;
  if (s.prefill_attn < 0 || s.prefill_attn > 3)
    return fail(KIE_E_ARG, "prefill_attn=%d: 0 (auto), 1 (launch order), 2 (zigzag) or 3 (split)", s.prefill_attn);
  e->pf_attn = s.prefill_attn == 1 ? PF_ORDER_LAUNCH : s.prefill_attn == 2 ? PF_ORDER_ZIGZAG : PF_ORDER_SPLIT;
  if (s.prefill_attn_keys != 0 && s.prefill_attn_keys != 32 && s.prefill_attn_keys != 64)
    return fail(KIE_E_ARG, "prefill_attn_keys=%d: 0 (auto), 32 or 64 (keys per attention tile)", s.prefill_attn_keys);
  e->pf_keys = s.prefill_attn_keys == 64 ? 64 : 32;
  return KIE_OK;
}

/* Carves the arena (base == NULL: only counts).  Returns its size. */
size_t layout(kie_engine *e, char *base) {
  size_t at = 0;
  auto take = [&](size_t bytes) -> char * {
    at = round_up(at, 256);
    char *p = base ? base + at : nullptr;
    at += bytes;
    return p;
  };
  const kie_shape &s = e->s;
  const size_t hp = (size_t)e->hid_pad, T = (size_t)e->tmax, hd = (size_t)s.head_dim;
  e->embed = (bf16 *)take((size_t)s.vocab * hp * 2);
  e->L.assign((size_t)s.layers, Layer{});
  for (int l = 0; l < s.layers; l++) {
    Layer &y = e->L[(size_t)l];
    y.wqkv = (bf16 *)take((size_t)e->qkv_rows * hp * 2);
    y.wo = (bf16 *)take((size_t)s.hidden * e->qdim * 2);
    y.wgu = (bf16 *)take(2 * (size_t)s.inter * hp * 2);
    y.wd = (bf16 *)take((size_t)s.hidden * e->inter_pad * 2);
    y.n1 = (float *)take(hp * 4);
    y.n2 = (float *)take(hp * 4);
    y.kc = (bf16 *)take((size_t)s.kv_heads * s.max_seq * hd * 2);
    y.vc = (bf16 *)take((size_t)s.kv_heads * s.max_seq * hd * 2);
  }
  e->head = (bf16 *)take((size_t)s.vocab_part * hp * 2);
  e->normf = (float *)take(hp * 4);
  e->rcos = (float *)take((size_t)s.max_seq * (hd / 2) * 4);
  e->rsin = (float *)take((size_t)s.max_seq * (hd / 2) * 4);
  e->R[0] = (float *)take(T * hp * 4);
  e->R[1] = (float *)take(T * hp * 4);
  e->qbuf = (float *)take(T * e->qdim * 4);
  e->att = (float *)take(T * e->qdim * 4);
  e->act = (float *)take(T * e->inter_pad * 4);
  e->sums = (float *)take((size_t)(s.dtp_delay + 1) * T * hp * 4);
  e->logits = (float *)take((size_t)s.vocab_part * 4);
  e->logits_all = (float *)take((size_t)s.tp_size * s.vocab_part * 4);
  e->cand = (float *)take(256);
  e->part = (float *)take(T * s.heads * std::max(e->nsplit, e->nsplit_smem) * (hd + 4) * 4);
  e->att_cnt = (unsigned *)take(T * s.heads * 4); /* a count per (token, block group): at most a query head each */
  e->head_cnt = (unsigned *)take(16);
  e->amax = (unsigned long long *)take(16);
  e->tokbuf = (int *)take(T * 4);
  e->st = (DevState *)take(sizeof(DevState));
  e->samp = (SampParams *)take(sizeof(SampParams));
  e->mono_stages = (MonoStage *)take((size_t)e->mono_n * sizeof(MonoStage));
  e->mono_sync = (MonoSync *)take(sizeof(MonoSync));
  e->mono_cnt = (unsigned *)take((size_t)e->mono_n * 8);
  e->mono_links = (MonoLink *)take((size_t)e->mono_n * sizeof(MonoLink));
  e->mono_marks = (unsigned long long *)take((size_t)e->mono_n * 4 * e->sms * 8);
  e->mono_ll = s.kernel == KIE_KERNEL_MONO && mono_ll_on(s) ? (unsigned long long *)take(mono_ll_words(e) * 8)
                                                             : nullptr;
  e->step_marks = s.step_clock ? (unsigned long long *)take((size_t)e->mono_n * KIE_CLK_MARKS * KIE_CLK_BLOCKS * 8)
                               : nullptr;
  if (e->pf_chunk > 0) {
    const size_t P = (size_t)e->pf_chunk;
    e->pf_ws_bytes = 32u << 20; /* cuBLAS's workspace: what its Hopper GEMMs ask for at most */
    e->pf_ws = take(e->pf_ws_bytes);
    e->pf_R = (float *)take(P * hp * 4);
    e->pf_sums = s.tp_size > 1 || s.dtp_delay > 0 ? (float *)take((size_t)(s.dtp_delay + 1) * P * hp * 4) : nullptr;
    e->pf_y = (float *)take(P * e->qkv_rows * 4);
    e->pf_x = (bf16 *)take(P * hp * 2);
    e->pf_s16 = (bf16 *)take(P * hp * 2);
    e->pf_q = (bf16 *)take(P * e->qdim * 2);
    e->pf_att = (bf16 *)take(P * e->qdim * 2);
    e->pf_gu = (bf16 *)take(P * 2 * s.inter * 2);
    e->pf_act = (bf16 *)take(P * e->inter_pad * 2);
    e->pf_tok = (int *)take(P * 4);
    const size_t qtiles = PF_QUERY_TILES(s.heads, P);
    e->pf_apart = (float *)take(qtiles * 2 * PF_PART_FLOATS(hd) * 4);
    e->pf_acnt = (unsigned *)take(qtiles * 4);
  }
  return round_up(at, 256);
}

int n_uploads(const kie_shape &s) { return 5 + 6 * s.layers; }
int upload_index(const kie_shape &s, int kind, int layer) {
  switch (kind) {
    case KIE_W_EMBED: return 0;
    case KIE_W_HEAD: return 1;
    case KIE_F_FINAL_NORM: return 2;
    case KIE_F_ROPE_COS: return 3;
    case KIE_F_ROPE_SIN: return 4;
    case KIE_W_QKV: return 5 + 6 * layer;
    case KIE_W_O: return 6 + 6 * layer;
    case KIE_W_GATE_UP: return 7 + 6 * layer;
    case KIE_W_DOWN: return 8 + 6 * layer;
    case KIE_F_ATTN_NORM: return 9 + 6 * layer;
    case KIE_F_MLP_NORM: return 10 + 6 * layer;
  }
  (void)s;
  return -1;
}

int upload(kie_engine *e, int kind, int layer, const void *src, size_t rows, size_t cols, int on_device) {
  const kie_shape &s = e->s;
  const int idx = upload_index(s, kind, layer);
  if (idx < 0) return fail(KIE_E_ARG, "unknown weight kind %d", kind);
  const bool per_layer = idx >= 5;
  if (per_layer && (layer < 0 || layer >= s.layers))
    return fail(KIE_E_ARG, "layer %d of %d", layer, s.layers);
  size_t want_r = 0, want_c = 0, ld = 0;
  void *dst = nullptr;
  int f32 = 0;
  const Layer *y = per_layer ? &e->L[(size_t)layer] : nullptr;
  switch (kind) {
    case KIE_W_EMBED: want_r = s.vocab, want_c = s.hidden, ld = e->hid_pad, dst = e->embed; break;
    case KIE_W_HEAD: want_r = s.vocab_part, want_c = s.hidden, ld = e->hid_pad, dst = e->head; break;
    case KIE_W_QKV: want_r = e->qkv_rows, want_c = s.hidden, ld = e->hid_pad, dst = y->wqkv; break;
    case KIE_W_O: want_r = s.hidden, want_c = e->qdim, ld = e->qdim, dst = y->wo; break;
    case KIE_W_GATE_UP: want_r = 2 * (size_t)s.inter, want_c = s.hidden, ld = e->hid_pad, dst = y->wgu; break;
    case KIE_W_DOWN: want_r = s.hidden, want_c = s.inter, ld = e->inter_pad, dst = y->wd; break;
    case KIE_F_ATTN_NORM: want_r = 1, want_c = s.hidden, ld = e->hid_pad, dst = y->n1, f32 = 1; break;
    case KIE_F_MLP_NORM: want_r = 1, want_c = s.hidden, ld = e->hid_pad, dst = y->n2, f32 = 1; break;
    case KIE_F_FINAL_NORM: want_r = 1, want_c = s.hidden, ld = e->hid_pad, dst = e->normf, f32 = 1; break;
    case KIE_F_ROPE_COS: want_r = s.max_seq, want_c = s.head_dim / 2, ld = want_c, dst = e->rcos, f32 = 1; break;
    case KIE_F_ROPE_SIN: want_r = s.max_seq, want_c = s.head_dim / 2, ld = want_c, dst = e->rsin, f32 = 1; break;
  }
  if (rows != want_r || cols != want_c)
    return fail(KIE_E_ARG, "weight kind %d layer %d: got %zu x %zu, the shape needs %zu x %zu", kind, layer, rows,
                cols, want_r, want_c);
  if (!src) return fail(KIE_E_ARG, "weight kind %d: NULL source", kind);
  CU(cudaSetDevice(e->device));
  const size_t es = f32 ? 4 : 2;
  CU(cudaMemcpy2DAsync(dst, ld * es, src, cols * es, cols * es, rows, on_device ? cudaMemcpyDefault
                                                                                 : cudaMemcpyHostToDevice,
                       e->stream));
  CU(cudaStreamSynchronize(e->stream));
  e->have[(size_t)idx] = 1;
  return KIE_OK;
}

}  // namespace kie_host
