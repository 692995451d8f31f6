/* mono.cu - the monokernel: one decode step (T = 1) as one persistent kernel,
 * a block per SM, instead of a graph of five kernels per layer.
 *
 * Each block runs the stages of the host's table in order: for a GEMV, the
 * units [b U / B, (b + 1) U / B) of its U units; for attention, the graph
 * path's shared-memory items (attention_smem.cuh), item i on block i, or with
 * KIE_GPU_MONO_ATTN=1 the split items (head group, split) round-robin over its
 * ATT_THREADS-thread halves (attention.cuh).  The arithmetic is the per-sublayer
 * kernels', so the results are theirs to the bit.
 *
 * What it saves against those kernels:
 *  - no kernel boundaries: a stage waits for the one before through a counter
 *    in global memory (every block adds one when its share is written; the
 *    split items' attention stage counts head groups), not for a grid to drain
 *    and the next to launch (measured: these waits cost 2-5 us a boundary under
 *    the weight stream's load, more than PDL's, so the graph path is faster:
 *    bench/RESULTS.md);
 *  - the weights never stop streaming: a producer warp copies the block's
 *    weight tiles, in the order the block will use them, into a ring of
 *    shared-memory slots with bulk copies (cp.async.bulk, completion on an
 *    mbarrier per slot).  It depends on nothing but free slots, so while the
 *    consumers wait for a stage (or run attention) the ring fills with the
 *    next GEMVs' rows.
 *
 * Every wait is bounded (timeout_ns, measured on %globaltimer): a stuck step
 * sets KIE_DERR_STALL in the host ring and the abort flag, and every block
 * leaves.
 *
 * Lanes (tp > 1: the kernel's TP copy; the tp = 1 copy has none of this):
 * after a stage that writes this lane's partial sum of a sublayer (o or down
 * projection, every block's rows of it), the grid's last nred blocks, the
 * reducers, wait for that stage to be complete and add up the lanes' sums of
 * their slices (at most 512 floats each: one 8-byte line per consumer thread,
 * KCCL's quickest path) with kcclDevAllReduceGroup, each on its own KCCL slot,
 * then count the stage in rcnt.  The stage that adds the sum (the normed
 * GEMV of the sublayer d + 1 later, or the LM head) waits for that count
 * besides its own predecessor; the other blocks go on to the next stages
 * meanwhile (with DTP delay d > 0 the next stage needs nothing of the sum).
 * The sum is KCCL's one-shot, the lanes' values combined in rank order: the
 * graph path's all-reduce to the bit.  The greedy pick adds the lanes'
 * candidates the same way (slot 0, after the head).
 *
 * Who calls KCCL: the 256 consumer threads of a reducer, meeting at their own
 * named barrier (BAR_CONSUMERS) instead of __syncthreads, which the producer
 * warp never reaches.  The call's waits also end when the abort flag is set
 * (its cancel word), so a step that gives up anywhere takes its reducers out
 * of calls whose peers will not come; a failed call (a peer died, aborted,
 * timed out, or the call was cancelled) sets KIE_DERR_COMM and the abort flag,
 * and KCCL marks the communicator broken.  A dead or aborted peer ends the
 * reducers' calls at once (KCCL's watcher sets its stop word); a peer that is
 * only slow gets KCCL's timeout, which the host adds to every wait's bound
 * here, since any wait may depend on a reducer's call. */
#include "attention_smem.cuh"
#include "bulk_copy.cuh"
#include "stage_count.cuh"

using namespace kie;

namespace {

#define BAR_CONSUMERS 1 /* named barrier of the consumer warps; 2 + i: attention item i */

__device__ __forceinline__ void bar_consumers() {
  asm volatile("bar.sync %0, %1;" ::"n"(BAR_CONSUMERS), "n"(MONO_CONSUMERS) : "memory");
}

/* Every block's clock at the points of stage k (MARK_*: where a step's time goes,
 * read by bench/kie_native's kb_mono_marks), written by consumer thread 0 or, for
 * MARK_ISSUED of a GEMV stage, by the producer's first lane.  An attention stage
 * has no tiles: its STAGED and ISSUED are thread 0's first item's scores and values. */
enum { MARK_START = 0, MARK_STAGED = 1, MARK_END = 2, MARK_ISSUED = 3, MARKS = 4 };
__device__ __forceinline__ void mark(const MonoArgs &m, int k, int what) {
  m.marks[((size_t)k * MARKS + what) * gridDim.x + blockIdx.x] = kie_gtime();
}
__device__ __forceinline__ void mark0(const MonoArgs &m, int k, int what) {
  if (threadIdx.x == 0) mark(m, k, what);
}

/* Shared state of one block. */
struct Block {
  const MonoArgs *m;
  uint64_t *full, *empty; /* per slot: filled (producer's tx), freed (one arrive per consumer warp) */
  char *ring;
  volatile int *stop;     /* set when this block gives up; the producer watches it too */
  /* The consumers' verdict at a wait: written by consumer thread 0 alone, before
   * the barrier after which all of them read it.  They leave only on it, all at
   * once: a consumer that left alone would never reach the named barriers the
   * others wait at, and `stop` itself may change between their reads (the
   * producer sets it when it sees the abort flag). */
  volatile int *quit;
};

/* Gives up the step: the first to fail says why (KIE_DERR_*, its argument),
 * everyone leaves. */
__device__ void give_up(const Block &b, int code, int arg) {
  kie_set_error(b.m->ring, code, arg);
  atomicExch(&b.m->sync->abort, 1u);
  *b.stop = 1;
}

/* A bounded spin: true while `done()` is false and neither the bound, this
 * block's stop flag nor the grid's abort flag has ended it; past the bound,
 * the step ends with error `code` (argument: the stage). */
template <typename Done>
__device__ bool spin_as(const Block &b, int code, int stage, Done done) {
  if (done()) return true;
  const unsigned long long t0 = kie_gtime();
  for (unsigned n = 1;; n++) {
    if (done()) return true;
    if (n > 32) __nanosleep(n > 1024 ? 256 : 32);
    if ((n & 63) == 0) {
      if (*b.stop || *(volatile unsigned *)&b.m->sync->abort) {
        *b.stop = 1;
        return false;
      }
      if ((long long)(kie_gtime() - t0) > b.m->timeout_ns) {
        give_up(b, code, stage);
        return false;
      }
    }
  }
}

template <typename Done>
__device__ __forceinline__ bool spin(const Block &b, int stage, Done done) {
  return spin_as(b, KIE_DERR_STALL, stage, done);
}

/* This block's units of a GEMV stage. */
__device__ __forceinline__ void unit_range(const MonoStage &s, int &u0, int &u1) {
  int units;
  switch (s.epi) {
    case EPI_SWIGLU: units = gemv_units<EPI_SWIGLU>(s.g); break;
    default: units = gemv_units<EPI_STORE>(s.g);
  }
  u0 = (int)((long long)blockIdx.x * units / gridDim.x);
  u1 = (int)((long long)(blockIdx.x + 1) * units / gridDim.x);
}


/* A position in the block's sequence of weight tiles: stage k, units [tu, tu + upt)
 * of its [., u1), and what the producer needs of the stage, held in registers
 * (the table is in global memory, and one warp issuing a ring's worth of copies
 * must not wait on a load per row). */
struct Cursor {
  int k, tu, u1, upt;
  const bf16 *w;
  int epi, ld;
  GemvArgs g; /* the fields unit_rows reads */
};

/* The first tile of stage k or after it; false past the last. */
__device__ bool cursor_seek(const MonoArgs &m, Cursor &c) {
  for (; c.k < m.nstages; c.k++) {
    const MonoStage &s = m.stages[c.k];
    if (s.kind != MONO_GEMV) continue;
    unit_range(s, c.tu, c.u1);
    if (c.tu >= c.u1) continue;
    c.upt = s.upt;
    c.w = s.g.w;
    c.epi = s.epi;
    c.ld = s.g.ld;
    c.g.rows = s.g.rows;
    c.g.cols = s.g.cols;
    c.g.hd = s.g.hd;
    c.g.nh = s.g.nh;
    c.g.nkv = s.g.nkv;
    return true;
  }
  return false;
}

__device__ __forceinline__ bool cursor_next(const MonoArgs &m, Cursor &c) {
  c.tu += c.upt;
  if (c.tu < c.u1) return true;
  c.k++;
  return cursor_seek(m, c);
}

/* Asks L2 to fetch [p, p + bytes) (16-byte aligned, a multiple of 16). */
__device__ __forceinline__ void prefetch_l2(const void *p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

/* Row i of the tile at c (unit tu + i / 2, its first or second row), -1: none. */
__device__ __forceinline__ int cursor_row(const Cursor &c, int i) {
  if (i >= 2 * min(c.upt, c.u1 - c.tu)) return -1;
  int r0, r1;
  switch (c.epi) {
    case EPI_QKV: unit_rows<EPI_QKV>(c.g, c.tu + i / 2, r0, r1); break;
    case EPI_SWIGLU: unit_rows<EPI_SWIGLU>(c.g, c.tu + i / 2, r0, r1); break;
    default: unit_rows<EPI_STORE>(c.g, c.tu + i / 2, r0, r1);
  }
  return (i & 1) ? r1 : r0;
}

/* The tile at c into the ring slot (its bytes counted on `bar`, its lines under L2
 * policy `pol`), or asked of L2 (dst == NULL; pol unused).  Lane i takes rows i, i + 32, ... */
__device__ void tile_rows(const Cursor &c, char *dst, uint64_t *bar, uint64_t pol) {
  const int lane = threadIdx.x & 31;
  const unsigned row_bytes = (unsigned)c.ld * 2u;
  const int row = cursor_row(c, lane); /* a tile has 2 upt <= 2 GEMV_WARPS rows: one per lane at most */
  if (dst) {
    const unsigned bytes = __reduce_add_sync(0xffffffffu, row >= 0 ? row_bytes : 0u);
    if (lane == 0) mbar_expect_tx(bar, bytes);
    __syncwarp();
  }
  if (row < 0) return;
  const bf16 *src = c.w + (size_t)row * c.ld;
  if (dst) bulk_copy(dst + (size_t)lane * row_bytes, src, row_bytes, bar, pol);
  else prefetch_l2(src, row_bytes);
}

/* The producer leaving: the bulk copies of the first `tiles` tiles (the last
 * one into each slot may still be in flight) land before the block can exit,
 * so that none writes into shared memory (or completes an mbarrier) that a
 * later kernel's block holds, also when the consumers leave a step given up
 * before they used them.  Copies from global memory always complete; the wait
 * is bounded all the same. */
__device__ void drain(const Block &b, int tiles) {
  const MonoArgs &m = *b.m;
  for (int slot = 0; slot < m.nslots && slot < tiles; slot++) {
    const unsigned last = (unsigned)((tiles - 1 - slot) / m.nslots) & 1u;
    const unsigned long long t0 = kie_gtime();
    while (!mbar_done(&b.full[slot], last) && (long long)(kie_gtime() - t0) < b.m->timeout_ns) __nanosleep(64);
  }
}

/* The producer warp, for attention stage s ahead of the consumers: the keys and values
 * of this block's items that earlier steps wrote, asked of L2 (HBM's latency then is
 * paid while the consumers are still at the stages before it). */
__device__ void prefetch_attention(const MonoArgs &m, const MonoStage &s) {
  const AttnArgs &a = s.at;
  const int lane = threadIdx.x & 31, groups = a.nh / a.g * a.hgroups, items = groups * a.nsplit;
  const int S = *a.pos + 1, old = S - 1; /* keys 0 .. pos; the last is written in this step */
  const int ns = min(a.nsplit, (S + a.min_chunk - 1) / a.min_chunk), len = (S + ns - 1) / ns;
  const int per = gridDim.x * m.subs;
  for (int i = lane; ; i += 32) {
    const int it = (int)blockIdx.x * m.subs + (i >> 1) % m.subs + (i >> 1) / m.subs * per;
    if (it >= items) break;
    const int grp = it % groups, split = it / groups;
    if (split >= ns) continue;
    const int c0 = min(old, split * len), c1 = min(old, c0 + len);
    if (c1 <= c0) continue;
    const bf16 *base = ((i & 1) ? a.vc : a.kc) + ((size_t)(grp / a.hgroups) * a.max_seq + c0) * a.hd;
    prefetch_l2(base, (unsigned)((c1 - c0) * a.hd * 2));
  }
}

/* The producer warp: every weight tile of the step, in the consumers' order,
 * into the ring; the tile `prefetch` places further on asked of L2 meanwhile, so
 * that more of HBM's latency is covered than the ring alone holds. */
__device__ void produce(const Block &b) {
  const MonoArgs &m = *b.m;
  Cursor c, p;
  c.k = p.k = 0;
  const uint64_t pol = l2_stream_policy(m.l2_first);
  bool more = cursor_seek(m, c), ahead = cursor_seek(m, p);
  for (int i = 0; ahead && i < m.prefetch; i++) {
    tile_rows(p, nullptr, nullptr, 0);
    ahead = cursor_next(m, p);
  }
  int tile = 0, marked = -1;
  for (; more; tile++, more = cursor_next(m, c)) {
    const int slot = tile % m.nslots, use = tile / m.nslots;
    /* Before a slot's next copy: the consumers are done with its last tile
     * (empty) and that tile's copy has landed (full).  In a step that runs on,
     * full holds whenever empty does (a consumer frees a tile only after
     * waiting for it); in one given up, consumers free tiles without waiting,
     * and a copy issued while the slot's last one is in flight would arrive on
     * a full phase that is still open and leave drain's count of phases wrong.
     * The verdict is the warp's: a lane that left alone would leave the others
     * in tile_rows's warp reduction. */
    if (use > 0) {
      const unsigned par = (unsigned)(use - 1) & 1u;
      const bool free = spin(b, c.k, [&] { return mbar_done(&b.empty[slot], par) && mbar_done(&b.full[slot], par); });
      if (!__all_sync(0xffffffffu, free)) break;
    }
    tile_rows(c, b.ring + (size_t)slot * m.slot_bytes, &b.full[slot], pol);
    if (c.k != marked) {
      if ((threadIdx.x & 31) == 0) mark(m, c.k, MARK_ISSUED);
      for (int k = max(marked + 1, 0); k < c.k; k++)
        if (m.stages[k].kind == MONO_ATTN) prefetch_attention(m, m.stages[k]);
      marked = c.k;
    }
    if (ahead) {
      tile_rows(p, nullptr, nullptr, 0);
      ahead = cursor_next(m, p);
    }
  }
  drain(b, tile);
}

/* Thread 0: spins until stage k is complete for this step. */
__device__ __forceinline__ void spin_stage(const Block &b, int k, unsigned epoch) {
  const MonoArgs &m = *b.m;
  const unsigned share = m.stages[k].kind == MONO_ATTN ? (unsigned)(m.stages[k].at.nh / m.stages[k].at.g *
                                                                    m.stages[k].at.hgroups)
                                                       : gridDim.x;
  const unsigned target = (epoch + 1u) * share;
  if (m.sync_release) {
    /* Relaxed polls (an acquire load invalidates the SM's L1 each time), then one acquire
     * load: the count only grows, so it reads from the release sequence of every
     * increment the polls saw and orders this block's reads of the stage after them. */
    if (spin(b, k, [&] { return (int)(ld_relaxed(m.cnt + k) - target) >= 0; })) (void)ld_acquire(m.cnt + k);
  } else {
    spin(b, k, [&] { return (int)(ld_acquire(m.cnt + k) - target) >= 0; });
  }
}

/* Consumers: wait until stage k is complete for this step; false: leave (all of them). */
__device__ bool wait_stage(const Block &b, int k, unsigned epoch) {
  if (threadIdx.x == 0) {
    spin_stage(b, k, epoch);
    *b.quit = *b.stop;
  }
  bar_consumers();
  return !*b.quit;
}

/* The block is done with stage k: the consumers meet and, with `count`, thread 0 counts the
 * stage (without it, the stage after reads this one's LL words and nothing waits for the count). */
__device__ void signal_stage(const MonoArgs &m, int k, bool count) {
  bar_consumers();
  mark0(m, k, MARK_END);
  if (count && threadIdx.x == 0) {
    if (m.sync_release) { /* the barrier orders the block's writes before thread 0's release */
      red_release(m.cnt + k, 1u);
    } else {
      __threadfence();
      atomicAdd(m.cnt + k, 1u);
    }
  }
}

/* TP: thread 0 waits for stage k - 1 and for the lanes' sums stage k adds,
 * then the consumers meet. */
__device__ bool wait_inputs(const Block &b, int k, unsigned epoch) {
  const MonoArgs &m = *b.m;
  if (threadIdx.x == 0) {
    if (k > 0) spin_stage(b, k - 1, epoch);
    const MonoLink &l = m.links[k];
    const unsigned target = (epoch + 1u) * (unsigned)m.nred;
    for (int i = 0; i < l.nneed && !*b.stop; i++) {
      const unsigned *c = m.rcnt + l.need[i];
      spin_as(b, KIE_DERR_PEER, l.need[i], [&] { return (int)(ld_acquire(c) - target) >= 0; });
    }
    *b.quit = *b.stop;
  }
  bar_consumers();
  return !*b.quit;
}

/* TP: the lanes' sum of n floats at xs (this block's shared memory), in
 * place, on KCCL slot `slot`; every consumer thread calls it.  False (the
 * step given up) when the call failed.  This and the two below are out of
 * line: the kernel is at its register cap (168 a thread with 9 warps), and
 * inlined, KCCL's registers made ptxas spill across the whole TP copy; out of
 * line, the saves sit at the calls (measured with -Xptxas -v: the TP copy
 * without the calls spills as the tp = 1 copy does). */
__device__ __noinline__ bool lanes_sum(const Block &b, int slot, float *xs, int n) {
  const MonoArgs &m = *b.m;
  const kcclDevGroup g = {slot, BAR_CONSUMERS, MONO_CONSUMERS, &m.sync->abort};
  const kcclResult_t rc = kcclDevAllReduceGroup<KIE_MONO_MAX_LANES>(m.dc, g, xs, n, kcclFloat32, kcclSum);
  if (rc == kcclSuccess) return true;
  if (threadIdx.x == 0) give_up(b, KIE_DERR_COMM, (int)rc);
  return false;
}

/* TP, after stage k (which wrote this lane's partial sum to links[k].sum):
 * a reducer waits for every block's rows of it, sums its slice over the
 * lanes and counts the stage in rcnt[k].  The slice goes through shared
 * memory: KCCL loads its data with plain loads, which may hit lines of this
 * SM's L1 older than what other blocks wrote since (the reads here and the
 * stage_norm that adds the sum load it through L2). */
__device__ __noinline__ bool reduce_stage(const Block &b, int k, unsigned epoch, float *xs) {
  const MonoArgs &m = *b.m;
  const int slot = (int)blockIdx.x - ((int)gridDim.x - m.nred), tid = threadIdx.x;
  if (slot < 0) return true;
  if (!wait_stage(b, k, epoch)) return false;
  float4 *sum = reinterpret_cast<float4 *>(m.links[k].sum + (size_t)slot * m.red_per);
  float4 *x4 = reinterpret_cast<float4 *>(xs);
  const int n = min(m.red_per, m.sum_count - slot * m.red_per); /* a multiple of 4 (host) */
  for (int i = tid; i < n / 4; i += MONO_CONSUMERS) x4[i] = __ldcg(sum + i);
  bar_consumers();
  if (!lanes_sum(b, slot, xs, n)) return false;
  for (int i = tid; i < n / 4; i += MONO_CONSUMERS) sum[i] = x4[i];
  bar_consumers(); /* every thread's stores before the count; nobody still in the call */
  if (tid == 0) {
    __threadfence();
    atomicAdd(m.rcnt + k, 1u);
  }
  return true;
}

/* TP, greedy: after the LM head, reducer 0 (KCCL slot 0) adds up the lanes'
 * candidates (each lane's pair in its own places, zero elsewhere: the sum
 * hands every lane all of them, as the graph path's all-reduce of cand does)
 * and commits the pick.  h: the head stage, k its index; head0: its count
 * when this block started.  The head's count is not a multiple of the epoch
 * (a step in KIE_MODE_ADVANCE skips the head), but no block counts this
 * step's head before this block has started (no block passes the last o
 * stage before every block has counted a stage of this step: the last QKV
 * stage, which the attention waits for, or with the attention in shared
 * memory the attention stage itself), so the step's head is done at head0 +
 * the grid. */
__device__ __noinline__ bool lanes_pick(const Block &b, const MonoStage &h, int k, unsigned head0, float *xs) {
  const MonoArgs &m = *b.m;
  if (threadIdx.x == 0) { /* every block's best key is in amax */
    const unsigned target = head0 + gridDim.x;
    spin(b, k, [&] { return (int)(ld_acquire(m.cnt + k) - target) >= 0; });
    *b.quit = *b.stop;
  }
  bar_consumers();
  if (*b.quit) return false;
  const int n = 2 * h.g.tp;
  if (threadIdx.x == 0) {
    head_candidate(h.g, atomicExch(&m.sync->amax, 0ull));
    for (int i = 0; i < n; i++) xs[i] = h.g.cand[i];
  }
  bar_consumers();
  if (!lanes_sum(b, 0, xs, n)) return false;
  if (threadIdx.x == 0) {
    for (int i = 0; i < n; i++) h.g.cand[i] = xs[i];
    kie_finalize_pick(xs, h.g.tp, m.c);
  }
  return true;
}

/* Two LL words in one 16-byte load, relaxed at GPU scope (from L2, never this SM's older copy in L1). */
__device__ __forceinline__ ulonglong2 ll_get2(const unsigned long long *p) {
  ulonglong2 w;
  asm volatile("ld.relaxed.gpu.global.v2.b64 {%0, %1}, [%2];" : "=l"(w.x), "=l"(w.y) : "l"(p) : "memory");
  return w;
}

/* The consumers meet; true when any of them passed `p` true. */
__device__ __forceinline__ bool bar_consumers_any(bool p) {
  unsigned r;
  asm volatile(
      "{ .reg .pred a, o; setp.ne.u32 a, %1, 0; bar.red.or.pred o, %2, %3, a; selp.u32 %0, 1, 0, o; }"
      : "=r"(r)
      : "r"((unsigned)p), "n"(BAR_CONSUMERS), "n"(MONO_CONSUMERS)
      : "memory");
  return r != 0;
}

/* The attention's inputs from the QKV stage's LL words (kie_shape.mono_ll 5 and 6: s.ll_in, a
 * word per QKV row, q's rotated, k's and v's the bf16 the cache holds): the item's G query
 * heads into qs and, where the item holds this step's key (krow, vrow not NULL), its k and v
 * rows, each consumer thread polling its pairs of words until both carry the step's tag.
 * Nothing else of the QKV stage is read after it: the rows of earlier steps were written
 * before this kernel started.  False when the step was given up (one verdict for all). */
struct AttInLL {
  static constexpr bool LL = true;
  const Block *b;
  const unsigned long long *ll; /* NULL: the stage waits for the QKV stage's count, then reads q and the cache */
  unsigned tag;
  int k; /* the stage, for a stall's report */
  __device__ bool on() const { return ll != nullptr; }
  __device__ bool operator()(const AttnArgs &a, int h0, int G, int kvh, bf16 *krow, bf16 *vrow, float *qs,
                             int tid) const {
    const int hd = a.hd, nq = G * hd, nw = nq + (krow ? 2 * hd : 0);
    const unsigned long long *q = ll + (size_t)h0 * hd, *kw = ll + (size_t)(a.nh + kvh) * hd,
                             *vw = ll + (size_t)(a.nh + a.nh / a.g + kvh) * hd;
    bool ok = true;
    for (int i = 2 * tid; i < nw; i += 2 * MONO_CONSUMERS) {
      const unsigned long long *p = i < nq ? q + i : i < nq + hd ? kw + (i - nq) : vw + (i - nq - hd);
      ulonglong2 w = ll_get2(p);
      auto ready = [&] { return (unsigned)(w.x >> 32) == tag && (unsigned)(w.y >> 32) == tag; };
      if (ok && !ready())
        ok = spin(*b, k, [&] {
          w = ll_get2(p);
          return ready();
        });
      const float x = __uint_as_float((unsigned)w.x), y = __uint_as_float((unsigned)w.y);
      if (i < nq) {
        qs[i] = x;
        qs[i + 1] = y;
      } else {
        bf16 *r = i < nq + hd ? krow + (i - nq) : vrow + (i - nq - hd);
        r[0] = __float2bfloat16_rn(x); /* exact: the word holds a bf16 value */
        r[1] = __float2bfloat16_rn(y);
      }
    }
    return !bar_consumers_any(!ok);
  }
};

/* The attention's outputs: a.out, and when the stage has them (mono_ll but 3), its LL words (ll,
 * tagged; the float4 of four outputs as two 16-byte stores of two words each). */
struct AttOutLL {
  unsigned long long *ll;
  unsigned tag;
  __device__ __forceinline__ void operator()(const AttnArgs &a, size_t i, float v) const {
    AttOutPlain{}(a, i, v);
    if (ll) ll_put(ll + i, v, tag);
  }
  __device__ __forceinline__ void operator()(const AttnArgs &a, size_t i, float4 v) const {
    AttOutPlain{}(a, i, v);
    if (ll) {
      ll_put2(ll + i, v.x, v.y, tag);
      ll_put2(ll + i + 2, v.z, v.w, tag);
    }
  }
};

/* Attention stage k in shared memory (MONO_ATTN_SMEM): this block's items of the graph
 * kernel's grid, only those with work (a query head each while the context fits one
 * item, else (group, split)), item i on block i, i + grid, ...  The first item's rows of
 * earlier steps are on their way before the block waits for the QKV stage; a block
 * without items does not wait.  False: leave (all consumers). */
template <int HD>
__device__ bool attend_smem(const Block &b, const AttnArgs &a, int k, unsigned epoch, unsigned char *smem,
                            AttOutLL out, AttInLL in) {
  const MonoArgs &m = *b.m;
  __shared__ AttSmemHeads hs;
  const int tid = threadIdx.x, groups = a.nh / a.g * a.hgroups;
  const int ns = att_smem_splits(a, *a.pos + 1);
  const bool per_head = ns == 1 && a.heads1;
  const int items = per_head ? a.nh : groups * ns;
  /* scores and softmax done, values done; the third, its rows landed, the stage clock has no mark for */
  unsigned long long *clk[3] = {m.marks + ((size_t)k * MARKS + MARK_STAGED) * gridDim.x + blockIdx.x,
                                m.marks + ((size_t)k * MARKS + MARK_ISSUED) * gridDim.x + blockIdx.x, nullptr};
  bool waited = false;
  auto wait = [&] {
    if (waited) return true;
    waited = true;
    if (!in.on() && !wait_stage(b, k - 1, epoch)) return false;
    mark0(m, k, MARK_START);
    return true;
  };
  for (int it = blockIdx.x; it < items; it += gridDim.x) {
    int bx = it, split = 0;
    if (!per_head) { /* the group's first query head under heads1, as the graph kernel's grid has it */
      const int grp = it % groups;
      split = it / groups;
      bx = a.heads1 ? grp / a.hgroups * a.g + grp % a.hgroups * a.gper : grp;
    }
    if (it != (int)blockIdx.x) bar_consumers(); /* the last item is done with the shared memory */
    if (!att_smem_item<HD, MONO_CONSUMERS>(a, bx, split, 0, tid, smem, m.att_cap, hs,
                                           SyncNamed{BAR_CONSUMERS, MONO_CONSUMERS}, wait,
                                           it == (int)blockIdx.x ? clk : nullptr, out, in))
      return false;
  }
  if (!waited) mark0(m, k, MARK_START);
  return true;
}

/* One ring tile: warp w takes unit w / segs of it, segment w % segs of the row.  EPI_RESID:
 * the residual's rows of the block's range (row0 on) are in sres when it holds them (nres
 * rows), else lane 0 loads its unit's before the dot products.  LL (one lane): the outputs
 * also as LL words at s.ll_out when the stage has them, tagged `tag`. */
template <int EPI, bool LL>
__device__ void gemv_tile(const Block &b, const MonoStage &s, int tu, int n, int slot, const float *xs,
                          float (*part)[2 * GEMV_MAX_T], unsigned long long &best, const float *rope,
                          unsigned tag, const float *sres = nullptr, int row0 = 0, int nres = 0) {
  const GemvArgs &a = s.g;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int segs = s.segs, j = warp / segs, seg = warp & (segs - 1);
  const int nvec = a.ld >> 3, seg_vecs = (nvec + segs - 1) / segs;
  const int vb = min(nvec, seg * seg_vecs), ve = min(nvec, vb + seg_vecs);
  const bool active = j < n;
  const int u = tu + j;
  int r0 = 0, r1 = -1;
  float acc0[1] = {0.f}, acc1[1] = {0.f}, res0 = 0.f, res1 = 0.f;
  if (active) {
    unit_rows<EPI>(a, u, r0, r1);
    if (EPI == EPI_RESID && seg == 0 && lane == 0) {
      res0 = r0 - row0 < nres ? sres[r0 - row0] : __ldcg(a.r_in + r0);
      if (r1 >= 0) res1 = r1 - row0 < nres ? sres[r1 - row0] : __ldcg(a.r_in + r1);
    }
    const char *tile = b.ring + (size_t)slot * b.m->slot_bytes;
    const uint4 *w0 = reinterpret_cast<const uint4 *>(tile + (size_t)(2 * j) * a.ld * 2);
    const uint4 *w1 = reinterpret_cast<const uint4 *>(tile + (size_t)(2 * j + 1) * a.ld * 2);
    for (int v = vb + lane; v < ve; v += 32) {
      const float4 *xp = reinterpret_cast<const float4 *>(xs + (size_t)v * 8);
      const float4 xa = xp[0], xb = xp[1];
      acc0[0] = dot8(w0[v], xa, xb, acc0[0]);
      if (r1 >= 0) acc1[0] = dot8(w1[v], xa, xb, acc1[0]);
    }
  }
  __syncwarp();
  if (lane == 0) mbar_arrive(&b.empty[slot]); /* this warp is done with the slot */
  finish_unit<1, EPI, EPI == EPI_RESID, LL>(a, u, r0, r1, active, acc0, acc1, best, part, tid,
                                             SyncNamed{BAR_CONSUMERS, MONO_CONSUMERS}, rope, res0, res1, s.ll_out, tag);
}

/* kie_shape.mono_ll (one lane): the stage's input from the LL words of the stage before
 * (s.ll_in; mono_ll_plan in mono_host.cu says which stages), each consumer thread polling its
 * own float4s (the float4s of stage_norm's order: i = tid + j MONO_CONSUMERS) until all
 * four carry this step's tag, instead of thread 0 waiting for the stage's count and every
 * thread then loading x.  The words are loaded relaxed at GPU scope (from L2, never this
 * SM's older copy in L1).  Nothing but the words is read from the stage before: each word's
 * tag orders its value.  Stores this block makes after (into buffers that a slower block
 * may still read from an earlier stage) depend on values that stage's blocks wrote only
 * after reading, and a GPU does not perform a store before the loads it depends on return.
 * x into xs, zero past s.g.in; false when the step was given up (the consumers' verdict,
 * the same for all: one barrier that ORs whether any gave up). */
struct Ll4 {
  ulonglong2 a, b;
};
__device__ __forceinline__ Ll4 ll_get4(const unsigned long long *p) { return Ll4{ll_get2(p), ll_get2(p + 2)}; }
__device__ __forceinline__ bool ll_ready(const Ll4 &w, int i, int n, unsigned tag) {
  return (unsigned)(w.a.x >> 32) == tag && (4 * i + 1 >= n || (unsigned)(w.a.y >> 32) == tag) &&
         (4 * i + 2 >= n || (unsigned)(w.b.x >> 32) == tag) && (4 * i + 3 >= n || (unsigned)(w.b.y >> 32) == tag);
}
__device__ __forceinline__ float4 ll_value(const Ll4 &w, int i, int n) {
  return f4_clip(make_float4(__uint_as_float((unsigned)w.a.x), __uint_as_float((unsigned)w.a.y),
                             __uint_as_float((unsigned)w.b.x), __uint_as_float((unsigned)w.b.y)),
                 i, n);
}

#define LL_BATCH 4 /* float4s (32 bytes of words) a thread has in flight: more spill at the register cap */
__device__ bool stage_ll(const Block &b, int k, const MonoStage &s, unsigned tag, float *xs, int tid) {
  const int n = s.g.in, n4 = s.g.ld >> 2;
  const unsigned long long *ll = s.ll_in;
  float4 *x4 = reinterpret_cast<float4 *>(xs);
  bool ok = true;
  for (int i0 = tid; i0 < n4; i0 += MONO_CONSUMERS * LL_BATCH) {
    Ll4 w[LL_BATCH];
#pragma unroll
    for (int j = 0; j < LL_BATCH; j++) {
      const int i = i0 + j * MONO_CONSUMERS;
      if (i < n4 && 4 * i < n) w[j] = ll_get4(ll + 4 * (size_t)i);
    }
#pragma unroll
    for (int j = 0; j < LL_BATCH; j++) {
      const int i = i0 + j * MONO_CONSUMERS;
      if (i >= n4) continue;
      if (4 * i >= n) {
        x4[i] = f4_zero();
        continue;
      }
      Ll4 v = w[j];
      if (ok && !ll_ready(v, i, n, tag))
        ok = spin(b, k, [&] {
          v = ll_get4(ll + 4 * (size_t)i);
          return ll_ready(v, i, n, tag);
        });
      x4[i] = ll_value(v, i, n);
    }
  }
  return !bar_consumers_any(!ok);
}

/* The norm of the residual stage_ll put in xs, in place: stage_norm's arithmetic for one
 * token with r_in alone (each thread the same float4s in the same order, the block's sums
 * meeting in warp order), so the same bits.  ld / 4 <= MONO_LL_NORM_VEC4 (the host's plan):
 * a thread's float4s stay in registers. */
__device__ void norm_staged(const GemvArgs &a, float *xs, int tid, float *red) {
  static_assert(MONO_LL_NORM_VEC4 == MONO_CONSUMERS * STAGE_BATCH, "one batch of stage_norm's");
  const int hidden = a.in, n4 = a.ld >> 2;
  float4 *x4 = reinterpret_cast<float4 *>(xs);
  const float4 *g4 = reinterpret_cast<const float4 *>(a.gamma);
  float4 v[STAGE_BATCH], g[STAGE_BATCH];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < STAGE_BATCH; j++) {
    const int i = tid + j * MONO_CONSUMERS;
    v[j] = f4_zero();
    g[j] = f4_zero();
    if (i >= n4) continue;
    v[j] = f4_clip(x4[i], i, hidden);
    if (4 * i < hidden) g[j] = __ldg(g4 + i);
    ss = fmaf(v[j].x, v[j].x, ss);
    ss = fmaf(v[j].y, v[j].y, ss);
    ss = fmaf(v[j].z, v[j].z, ss);
    ss = fmaf(v[j].w, v[j].w, ss);
  }
  const float ms = block_sum(ss, red, tid, SyncNamed{BAR_CONSUMERS, MONO_CONSUMERS}) / (float)hidden;
  const float root = sqrtf(ms + a.eps);
#pragma unroll
  for (int j = 0; j < STAGE_BATCH; j++) {
    const int i = tid + j * MONO_CONSUMERS;
    if (i < n4) x4[i] = f4_norm(v[j], root, g[j]);
  }
}

template <int HD, bool TP>
__device__ void consume(const Block &b, char *xunion) {
  const MonoArgs &m = *b.m;
  __shared__ float red[GEMV_WARPS];
  __shared__ float part[2][GEMV_WARPS][2 * GEMV_MAX_T];
  __shared__ unsigned long long sbest[GEMV_WARPS];
  __shared__ unsigned s_epoch, s_head0;
  __shared__ float rope[2 * ROPE_MAX_HALF];
  /* EPI_RESID stages (kie_shape.mono_residual, one lane): the residual's rows of the block's
   * units, loaded while x is staged */
  __shared__ float sres[TP ? 1 : MONO_RESID_ROWS];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const bool picker = TP && m.pick && (int)blockIdx.x == (int)gridDim.x - m.nred; /* lanes_pick's block */
  if (tid == 0) {
    s_epoch = *(volatile unsigned *)&m.sync->epoch;
    if (picker) s_head0 = ld_acquire(m.cnt + m.nstages - 1);
  }
  bar_consumers();
  const unsigned epoch = s_epoch;
  const unsigned tag = epoch + 1u; /* this step's LL words (the arena starts zeroed, as kie_reset leaves it) */
  float *xs = reinterpret_cast<float *>(xunion);
  int tile = 0;
  unsigned long long best = 0;
  /* The stage being run, copied: its fields are read on every tile.  With m.stage_ahead
   * stage k's copy is st[k & 1]: each consumer thread copies its word of stage k + 1 into
   * st[(k + 1) & 1] as stage k starts (cp.async, its own group) and waits for it as k + 1
   * starts, so that the table's L2 round trip is not on the path of a block that ends a stage
   * last and starts the next one at once.  The copy goes straight to shared memory: a word
   * kept in a register across the stage is spilled (the stage calls functions), and the
   * spill's store, right after the load, waited for it.  Without stage_ahead, st[0] is copied
   * as each stage starts.  One lane's copy only (the TP copy's st has one entry). */
  __shared__ MonoStage st[TP ? 1 : 2];
  constexpr int WORDS = (int)(sizeof(MonoStage) / 4);
  static_assert(WORDS <= MONO_CONSUMERS, "a stage's copy ahead is a word a consumer thread");
  const bool ahead_on = !TP && m.stage_ahead;
  auto fetch = [&](int k) {
    if (tid < WORDS)
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((uint32_t)__cvta_generic_to_shared(
                       reinterpret_cast<int *>(&st[k & 1]) + tid)),
                   "l"(reinterpret_cast<const int *>(m.stages + k) + tid)
                   : "memory");
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  if (ahead_on) fetch(0);
  /* The position's rotation, the same for every layer's QKV stage (one position, one table)
   * and final since the kernel started.  One lane: loaded once, so that no QKV stage, which
   * reads LL words without a wait, starts with two L2 round trips (the position, then its
   * row); the first stage's barrier publishes it.  TP: each QKV stage loads it before its wait
   * for the lanes' sum, which covers it (hoisted, the TP copy spills more). */
  if (!TP && m.stages[0].kind == MONO_GEMV && m.stages[0].epi == EPI_QKV)
    stage_rope(m.stages[0].g, rope, tid, MONO_CONSUMERS);
  for (int k = 0; k < m.nstages; k++) {
    MonoStage *sk = &st[ahead_on ? k & 1 : 0];
    if (ahead_on) {
      asm volatile("cp.async.wait_all;" ::: "memory");
      bar_consumers();
      if (k + 1 < m.nstages) fetch(k + 1); /* into stage k - 1's copy: every thread is past it */
    } else {
      bar_consumers(); /* nobody still reads the previous stage's copy */
      for (int i = tid; i < WORDS; i += MONO_CONSUMERS)
        reinterpret_cast<int *>(sk)[i] = reinterpret_cast<const int *>(m.stages + k)[i];
      bar_consumers();
    }
    const MonoStage &s = *sk;
    if (s.kind == MONO_ATTN) {
      if (!wait_stage(b, k - 1, epoch)) return;
      mark0(m, k, MARK_START);
      const int groups = s.at.nh / s.at.g * s.at.hgroups, items = groups * s.at.nsplit;
      const int sub = tid / ATT_THREADS, subs = m.subs;
      if (sub < subs) {
        AttSmem<HD> *sm = reinterpret_cast<AttSmem<HD> *>(xunion) + sub;
        /* thread 0's first item's clock: scores and softmax done (MARK_STAGED), values done
         * (MARK_ISSUED, which the producer leaves alone for attention stages) */
        unsigned long long *clk[2] = {m.marks + ((size_t)k * MARKS + MARK_STAGED) * gridDim.x + blockIdx.x,
                                      m.marks + ((size_t)k * MARKS + MARK_ISSUED) * gridDim.x + blockIdx.x};
        for (int it = blockIdx.x * subs + sub; it < items; it += gridDim.x * subs)
          attend<HD, true>(s.at, it % groups, it / groups, 0, tid % ATT_THREADS, *sm,
                           SyncNamed{BAR_CONSUMERS + 1 + sub, ATT_THREADS}, m.cnt + k,
                           it == (int)blockIdx.x * subs + sub ? clk : nullptr);
      }
      bar_consumers();
      mark0(m, k, MARK_END); /* this block's items done (the groups' last splits count the stage) */
      continue;
    }
    if (s.kind == MONO_ATTN_SMEM) {
      if (!attend_smem<HD>(b, s.at, k, epoch, reinterpret_cast<unsigned char *>(xunion),
                           AttOutLL{TP ? nullptr : s.ll_out, tag}, AttInLL{&b, TP ? nullptr : s.ll_in, tag, k}))
        return;
      signal_stage(m, k, TP || s.signal);
      continue;
    }
    int u0, u1;
    unit_range(s, u0, u1);
    if (u0 < u1) {
      if (TP && s.epi == EPI_QKV) stage_rope(s.g, rope, tid, MONO_CONSUMERS);
      const bool ll = !TP && s.ll_in;
      if (TP) {
        if (!wait_inputs(b, k, epoch)) return;
      } else if (k > 0 && !ll && !wait_stage(b, k - 1, epoch)) {
        return;
      }
      mark0(m, k, MARK_START);
      /* EPI_RESID: the rows are 2 u0 .. 2 u1, complete since the stage two or more back that
       * wrote them (the wait above orders them; a stage that stages LL words has no wait, and
       * mono_ll_plan gives it words only where this block wrote those rows itself, ordered by
       * the barriers since); the barrier after the staging publishes them */
      const int row0 = 2 * u0, nres = TP || s.epi != EPI_RESID ? 0 : min(2 * (u1 - u0), MONO_RESID_ROWS);
      if (!TP && tid < nres && row0 + tid < s.g.rows) sres[tid] = __ldcg(s.g.r_in + row0 + tid);
      if (ll) {
        if (!stage_ll(b, k, s, tag, xs, tid)) return;
        if (!s.g.x) norm_staged(s.g, xs, tid, red);
      } else if (s.g.x) {
        stage_plain(s.g, xs, tid);
      } else {
        stage_norm(s.g, xs, tid, u0 == 0, SyncNamed{BAR_CONSUMERS, MONO_CONSUMERS}, red);
      }
      bar_consumers();
      mark0(m, k, MARK_STAGED);
      for (int tu = u0; tu < u1; tu += s.upt, tile++) {
        const int slot = tile % m.nslots, use = tile / m.nslots;
        /* Each consumer waits for the tile itself, so they can give up at different
         * times: one that has goes on through the stage (its results no longer
         * matter) and all leave together at the next wait. */
        spin(b, k, [&] { return mbar_done(&b.full[slot], (unsigned)use & 1u); });
        const int n = min(s.upt, u1 - tu);
        switch (s.epi) {
          case EPI_QKV: gemv_tile<EPI_QKV, !TP>(b, s, tu, n, slot, xs, part[tile & 1], best, rope, tag); break;
          case EPI_SWIGLU: gemv_tile<EPI_SWIGLU, !TP>(b, s, tu, n, slot, xs, part[tile & 1], best, rope, tag); break;
          case EPI_HEAD: gemv_tile<EPI_HEAD, false>(b, s, tu, n, slot, xs, part[tile & 1], best, rope, tag); break;
          default: /* EPI_STORE, or with one lane EPI_RESID */
            if (!TP && s.epi == EPI_RESID)
              gemv_tile<EPI_RESID, true>(b, s, tu, n, slot, xs, part[tile & 1], best, rope, tag, sres, row0, nres);
            else
              gemv_tile<EPI_STORE, false>(b, s, tu, n, slot, xs, part[tile & 1], best, rope, tag);
        }
      }
      if (s.epi == EPI_HEAD) { /* the block's best key, then the grid's */
        if (lane == 0) sbest[warp] = best;
        bar_consumers();
        if (tid == 0) {
          unsigned long long x = 0;
          for (int w = 0; w < GEMV_WARPS; w++) x = sbest[w] > x ? sbest[w] : x;
          if (x) atomicMax(&m.sync->amax, x);
        }
      }
    }
    signal_stage(m, k, TP || s.signal);
    if (TP && m.links[k].sum && !reduce_stage(b, k, epoch, xs)) return;
  }
  const MonoStage &last = st[ahead_on ? (m.nstages - 1) & 1 : 0];
  if (picker && !lanes_pick(b, last, m.nstages - 1, s_head0, xs)) return;

  /* The last block out picks the token (greedy, one lane) and opens the next epoch. */
  bar_consumers();
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(&m.sync->done, 1u) == gridDim.x - 1) {
      __threadfence();
      const MonoStage &h = last;
      if (h.kind == MONO_GEMV && h.epi == EPI_HEAD && !(TP && m.pick)) {
        head_candidate(h.g, atomicExch(&m.sync->amax, 0ull));
        if (m.pick) kie_finalize_pick(m.cand, 1, m.c);
      }
      m.sync->done = 0;
      __threadfence();
      *(volatile unsigned *)&m.sync->epoch = epoch + 1u;
    }
  }
}

template <int HD, bool TP>
__global__ void __launch_bounds__(MONO_THREADS, 1) k_mono(const __grid_constant__ MonoArgs m) {
  extern __shared__ __align__(128) char smem[];
  __shared__ int stop, quit;
  Block b;
  b.m = &m;
  b.full = reinterpret_cast<uint64_t *>(smem);
  b.empty = b.full + m.nslots;
  b.ring = smem + m.ring_off;
  b.stop = &stop;
  b.quit = &quit;
  if (threadIdx.x == 0) {
    stop = quit = 0;
    for (int i = 0; i < m.nslots; i++) {
      mbar_init(&b.full[i], 1);
      mbar_init(&b.empty[i], GEMV_WARPS);
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x >= MONO_CONSUMERS) {
    produce(b);
  } else {
    consume<HD, TP>(b, smem + m.x_off);
    if (!TP) asm volatile("cp.async.wait_all;" ::: "memory"); /* a step given up may leave a stage's copy in flight */
  }
}

template <int HD>
cudaError_t launch_hd(const MonoArgs &m, int grid, size_t smem, cudaStream_t st) {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  cfg.gridDim = dim3((unsigned)grid);
  cfg.blockDim = dim3(MONO_THREADS);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  attr[0].id = cudaLaunchAttributeCooperative; /* every block resident at once, or no launch */
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return m.tp > 1 ? cudaLaunchKernelEx(&cfg, k_mono<HD, true>, m) : cudaLaunchKernelEx(&cfg, k_mono<HD, false>, m);
}

template <int HD, bool TP>
cudaError_t prepare_hd(size_t smem, int *per_sm) {
  cudaError_t e = cudaFuncSetAttribute(k_mono<HD, TP>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, k_mono<HD, TP>, MONO_THREADS, smem);
  return e;
}

template <int HD, bool TP>
cudaError_t static_smem_hd(size_t *bytes) {
  cudaFuncAttributes a;
  const cudaError_t e = cudaFuncGetAttributes(&a, k_mono<HD, TP>);
  *bytes = e == cudaSuccess ? a.sharedSizeBytes : 0;
  return e;
}

}  // namespace

size_t kie_mono_attention_smem(int hd, int cap) {
  return kie_with_hd(hd, (size_t)0, [&](auto h) {
    constexpr int HD = decltype(h)::value;
    return cap > 0 ? SmemShape<HD, MONO_CONSUMERS>::bytes(cap) : MONO_SUBS_MAX * sizeof(AttSmem<HD>);
  });
}

cudaError_t kie_mono_static_smem(int hd, int tp, size_t *bytes) {
  *bytes = 0;
  return kie_with_hd(hd, cudaErrorInvalidValue, [&](auto h) {
    return tp > 1 ? static_smem_hd<decltype(h)::value, true>(bytes) : static_smem_hd<decltype(h)::value, false>(bytes);
  });
}

cudaError_t kie_mono_prepare(int hd, int tp, size_t smem, int *per_sm) {
  *per_sm = 0;
  return kie_with_hd(hd, cudaErrorInvalidValue, [&](auto h) {
    return tp > 1 ? prepare_hd<decltype(h)::value, true>(smem, per_sm) : prepare_hd<decltype(h)::value, false>(smem, per_sm);
  });
}

cudaError_t kie_launch_mono(const MonoArgs &m, int hd, int grid, size_t smem, cudaStream_t st) {
  return kie_with_hd(hd, cudaErrorInvalidValue, [&](auto h) { return launch_hd<decltype(h)::value>(m, grid, smem, st); });
}
