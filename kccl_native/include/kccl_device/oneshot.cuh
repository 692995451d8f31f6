/*
 * kccl_device/oneshot.cuh - one block's LL all-reduce in one kernel: sending and
 * reducing lines, the two-hop path for blocks of one line per thread,
 * the block's epoch, trace marks (TRACE copies), and ll_block.
 *
 * Two hops (dc.ll_hops == 2, for a block of one line per thread, L lines, N
 * ranks, S = ceil(L / N), when N * S <= the threads calling): rank r owns lines [r*S,
 * r*S + S) of the block.  Thread t = p*S + j of rank r sends its input line t
 * (pull: into its own slot; push: to the line's owner only), then takes line
 * r*S + j of rank p; after a block barrier thread r*S + j reduces its N values
 * (in rank order, as one hop does: the same bits on every rank) and sends the
 * reduced line (region line KCCL_LL_SHARD_LINE + j), and thread p*S + j (p !=
 * r) waits for rank p's reduced line j and stores it.  Each thread waits for
 * one line per hop, and a rank reads 2 (N-1) S lines instead of (N-1) L: at 8
 * ranks in pull mode the one-hop call's polls (each thread 7 lines per round)
 * keep the L2 busy.  Both hops' lines carry {e, e ^ sig}, so a mismatch shows
 * in the first hop as in one.
 *
 * Part of kccl_device.cuh, which defines kcclDevComm and the limits and
 * includes this file; include that header, not this one.
 */
#ifndef KCCL_DEVICE_ONESHOT_CUH_
#define KCCL_DEVICE_ONESHOT_CUH_

namespace kccl_detail {

/* Line l of every rank (this rank's m0, m1; the peers' in got[]) combined in
 * rank order (the same order on every rank: bitwise the same result
 * everywhere) and stored to out. */
template <int MAXR, int DT, int OP>
__device__ static __forceinline__ void ll_reduce_line(const kcclDevComm &dc, const uint4 *got, uint32_t m0,
                                                      uint32_t m1, bool avg, char *out, uint32_t l, uint32_t nbytes) {
  const int me = dc.rank, n = dc.nranks;
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int p = 0; p < MAXR; p++) {
    if (p < n) {
      decode(p == me ? m0 : got[p].x, p == me ? m1 : got[p].z, (kcclDataType_t)DT, v);
#pragma unroll
      for (int j = 0; j < 4; j++) acc[j] = p == 0 ? v[j] : combine(acc[j], v[j], (kcclRedOp_t)OP);
    }
  }
  if (avg) {
#pragma unroll
    for (int j = 0; j < 4; j++) acc[j] /= (float)n;
  }
  uint32_t w0, w1;
  encode(acc, (kcclDataType_t)DT, &w0, &w1);
  store8(out, (size_t)l * 8, nbytes, w0, w1);
}

/* Sends line l, {m0, e, m1, e ^ sig}: into every peer's inbox (push) or once
 * into this rank's own slot (pull). */
template <int MAXR>
__device__ static __forceinline__ void ll_send_line(const kcclDevComm &dc, uint32_t set, int block, uint32_t l,
                                                    uint32_t m0, uint32_t m1, uint32_t e, uint32_t ew) {
  const int me = dc.rank, n = dc.nranks;
  if (dc.pull) {
    kgpu_st_weak_v4(ll_line(ll_region(dc, me, set, me, block), l), m0, e, m1, ew);
    return;
  }
#pragma unroll
  for (int p = 0; p < MAXR; p++)
    if (p < n && p != me) kgpu_st_weak_v4(ll_line(ll_region(dc, p, set, me, block), l), m0, e, m1, ew);
}

/* Where a block's reduced lines (two hops) start in its region: past the
 * data lines of a call of one line per thread (at most KCCL_LL_THREADS). */
#define KCCL_LL_SHARD_LINE KCCL_LL_THREADS

/* Lines of the block owned by rank q with two hops: [q*S, q*S + S) cut at `lines`. */
__device__ static inline uint32_t ll_shard_len(uint32_t lines, uint32_t S, int q) {
  const uint32_t first = (uint32_t)q * S;
  return first >= lines ? 0 : lines - first < S ? lines - first : S;
}

/* The two hops of a block of one line per thread (see "Two hops"), after this
 * thread (with its input line m0, m1 if it has one) has its epoch.  Returns
 * with s_fail set when the block failed; the caller's end barrier follows.
 * grp: the calling threads (groups.cuh). */
template <int MAXR, int DT, int OP, typename G>
__device__ static __forceinline__ void ll_two_hops(const kcclDevComm &dc, int block, char *out, uint32_t nbytes,
                                                   uint32_t lines, uint32_t S, bool avg, uint32_t sig, uint32_t e,
                                                   uint32_t set, uint32_t m0, uint32_t m1, volatile int *s_fail,
                                                   const G &grp) {
  __shared__ uint2 s_part[KCCL_LL_THREADS]; /* hop 1: [p*S + j] = rank p's line me*S + j */
  const int tid = grp.tid(), me = dc.rank, n = dc.nranks;
  const uint32_t ew = e ^ sig;
  const int p = tid / (int)S;
  const uint32_t j = (uint32_t)tid - (uint32_t)p * S;
  if ((uint32_t)tid < lines) { /* the input line, owned by rank p (line p*S + j) */
    if (dc.pull)
      kgpu_st_weak_v4(ll_line(ll_region(dc, me, set, me, block), tid), m0, e, m1, ew);
    else if (p != me)
      kgpu_st_weak_v4(ll_line(ll_region(dc, p, set, me, block), tid), m0, e, m1, ew);
  }
  const uint32_t my_len = ll_shard_len(lines, S, me);
  if (p < n && j < my_len) {
    if (p == me) {
      s_part[tid] = make_uint2(m0, m1);
    } else {
      uint4 g;
      if (ll_wait_one(dc, ll_line(ll_from(dc, set, p, block), (uint32_t)me * S + j), p, e, ew, sig, nbytes, &g,
                      s_fail, grp))
        s_part[tid] = make_uint2(g.x, g.z);
    }
  }
  grp.sync();
  if (*s_fail || p >= n) return;
  if (p == me) {
    if (j >= my_len) return;
    float acc[4] = {0.f, 0.f, 0.f, 0.f}, v[4];
#pragma unroll
    for (int q = 0; q < MAXR; q++) {
      if (q < n) {
        const uint2 w = s_part[q * S + j];
        decode(w.x, w.y, (kcclDataType_t)DT, v);
#pragma unroll
        for (int k = 0; k < 4; k++) acc[k] = q == 0 ? v[k] : combine(acc[k], v[k], (kcclRedOp_t)OP);
      }
    }
    if (avg) {
#pragma unroll
      for (int k = 0; k < 4; k++) acc[k] /= (float)n;
    }
    uint32_t w0, w1;
    encode(acc, (kcclDataType_t)DT, &w0, &w1);
    ll_send_line<MAXR>(dc, set, block, KCCL_LL_SHARD_LINE + j, w0, w1, e, ew);
    store8(out, (size_t)tid * 8, nbytes, w0, w1);
  } else if (j < ll_shard_len(lines, S, p)) {
    uint4 g;
    if (ll_wait_one(dc, ll_line(ll_from(dc, set, p, block), KCCL_LL_SHARD_LINE + j), p, e, ew, sig, nbytes, &g,
                    s_fail, grp))
      store8(out, (size_t)tid * 8, nbytes, g.x, g.z);
  }
}

/* The block's next epoch.  Only thread 0 touches it in memory (read, then
 * write back) and the others take it from shared memory after the barrier:
 * when every thread read it from memory, nothing kept a read still in flight
 * at the barrier from seeing thread 0's new value.  Also clears the block's
 * failure flag.  Every thread of the group calls it (a barrier). */
template <typename G>
__device__ static __forceinline__ uint32_t ll_next_epoch(const kcclDevComm &dc, int block, uint32_t *s_epoch,
                                                        volatile int *s_fail, const G &grp) {
  if (grp.tid() == 0) {
    uint32_t *ep = dc.epochs + dc.channel * KCCL_DEV_MAX_BLOCKS + block;
    const uint32_t next = kgpu_ld_volatile_u32(ep) + 1;
    *ep = next;
    *s_epoch = next;
    *s_fail = 0;
  }
  grp.sync();
  return *s_epoch;
}

/* Where one call's time goes, for the benchmark (TRACE copies only; thread 0
 * of block 0 adds clock64 cycles): [0] entry to pushes issued (the epoch and
 * input loads), [1] to its first line received from every peer, [2] to the
 * end (the rest of its lines, combine, store, barrier), [3] poll rounds of its
 * first line. */
#define KCCL_LL_TRACE_SLOTS 4

/* TRACE copies: adds the cycles since *t_mark to `slot` and restarts the mark. */
__device__ static __forceinline__ void ll_trace_mark(long long *trace, int slot, long long *t_mark) {
  const long long now = kgpu_clock64();
  trace[slot] += now - *t_mark;
  *t_mark = now;
}

/* One block's LL all-reduce of nbytes (<= KCCL_LL_MAX_BYTES) from `in` to `out`
 * (may alias), for one data type DT and operation OP (kcclAvg: OP kcclSum and
 * avg).  Every thread of the group grp calls it (default: every thread of the
 * block; groups.cuh), at most KCCL_LL_THREADS of them; `block` is the slot of
 * the channel's per-block state (inbox regions, epoch) the call uses.
 *
 * The shape follows what bench/gpu/ll_ladder.cu measured on the H200:
 * - small code.  DT and OP are compile-time and the receive is one loop over
 *   a thread's lines, not an unrolled copy per line: ~28 KB of machine code
 *   per kernel instead of ~80 KB, which alone takes ~2 us off the 8-rank call
 *   in a CUDA graph;
 * - no header line.  The call signature rides in every line's second flag
 *   word (epoch ^ sig), so checking it costs no extra load and no extra wait;
 *   a separate header line per (sender, block) is one more wait per call
 *   (several tenths of a microsecond), whichever warp polls it;
 * - one line per thread (the common case: 8 KB in 4 blocks of 256 threads, a
 *   device-API call of up to 2 KB per block) takes a straight path: one load,
 *   one send, one wait, one store;
 * - peer loops run to MAXR with a run-time rank count; that costs ~0.7 us per
 *   call at 2 ranks in an 8-rank body, so 2 ranks get their own bodies;
 * - round trips few and overlapped: a thread loads its input lines once into
 *   registers, pushes them back to back (stores do not wait), and reduces from
 *   the same registers; thread 0's epoch read overlaps the input loads;
 * - every lane polls its own lines: letting only lane 0 of a warp poll until
 *   its line has come from every peer cuts poll traffic but costs ~1 us per
 *   call more at 8 ranks;
 * - each thread waits on its own: no warp votes or shared-memory reads per
 *   poll round.  A failure in one thread reaches the block's others through
 *   s_fail within 64 of their rounds, and every thread meets at the end
 *   barrier. */
template <int MAXR, int DT, int OP, bool TRACE, typename G = WholeBlock>
__device__ static __forceinline__ kcclResult_t ll_block(const kcclDevComm &dc, int block, const char *in, char *out,
                                               uint32_t nbytes, bool avg, uint32_t sig, long long *trace,
                                               const G &grp = G()) {
  const bool tr = TRACE && grp.tid() == 0 && block == 0;
  long long t_mark = tr ? kgpu_clock64() : 0;
  __shared__ volatile int s_fail;
  __shared__ uint32_t s_epoch;
  const int tid = grp.tid(), nt = grp.size(), me = dc.rank, n = dc.nranks;
  const uint32_t lines = (nbytes + 7) / 8;
  const uint32_t all_peers = (n >= 32 ? 0xffffffffu : ((1u << n) - 1)) & ~(1u << me);
  uint32_t rounds = 0;

  if (lines <= (uint32_t)nt) { /* one line per thread at most */
    const bool have = (uint32_t)tid < lines;
    uint32_t m0 = 0, m1 = 0;
    if (have) load8(in, (size_t)tid * 8, nbytes, &m0, &m1);
    const uint32_t e = ll_next_epoch(dc, block, &s_epoch, &s_fail, grp), ew = e ^ sig, set = e % KCCL_LL_SETS;
    const uint32_t S = (lines + n - 1) / n; /* two hops: lines per owner */
    if (MAXR > 2 && dc.ll_hops == 2 && lines && S * n <= (uint32_t)nt) { /* 2 ranks: 1 hop reads as few lines */
      ll_two_hops<MAXR, DT, OP>(dc, block, out, nbytes, lines, S, avg, sig, e, set, m0, m1, &s_fail, grp);
    } else if (have) {
      ll_send_line<MAXR>(dc, set, block, tid, m0, m1, e, ew);
      if (tr) ll_trace_mark(trace, 0, &t_mark);
      uint4 got[MAXR];
      if (ll_wait_line<MAXR>(dc, set, block, tid, e, ew, all_peers, sig, nbytes, got, &s_fail, &rounds, grp)) {
        if (tr) {
          ll_trace_mark(trace, 1, &t_mark);
          trace[3] += rounds;
        }
        ll_reduce_line<MAXR, DT, OP>(dc, got, m0, m1, avg, out, tid, nbytes);
      }
    }
    grp.sync();
    if (tr) trace[2] += kgpu_clock64() - t_mark;
    return s_fail ? (kcclResult_t)(dc.status->code ? dc.status->code : kcclRemoteError) : kcclSuccess;
  }

  /* Several lines per thread: rounds of up to KCCL_LL_MAX_LPT per thread (one
   * round when KCCL_LL_THREADS threads call); each round is a whole push +
   * receive. */
  uint32_t mine[KCCL_LL_MAX_LPT][2];
  ll_load_round(mine, in, 0, lines, nbytes, tid, nt);
  const uint32_t e = ll_next_epoch(dc, block, &s_epoch, &s_fail, grp), ew = e ^ sig, set = e % KCCL_LL_SETS;
  for (uint32_t base = 0; base < lines; base += (uint32_t)nt * KCCL_LL_MAX_LPT) {
    /* A later round (small blocks): its input lines.  Each line is read and
     * written by one thread only, so in place needs no barrier. */
    if (base) ll_load_round(mine, in, base, lines, nbytes, tid, nt);
#pragma unroll 1
    for (int k = 0; k < KCCL_LL_MAX_LPT; k++) {
      const uint32_t l = base + tid + k * nt;
      if (l >= lines) break;
      ll_send_line<MAXR>(dc, set, block, l, ll_pick(mine, k, 0), ll_pick(mine, k, 1), e, ew);
    }
    if (tr && base == 0) ll_trace_mark(trace, 0, &t_mark);
    bool ok = true;
#pragma unroll 1
    for (int k = 0; k < KCCL_LL_MAX_LPT; k++) {
      const uint32_t l = base + tid + k * nt;
      if (l >= lines) break;
      uint4 got[MAXR]; /* a peer's line stays here once it has arrived */
      if (!(ok = ll_wait_line<MAXR>(dc, set, block, l, e, ew, all_peers, sig, nbytes, got, &s_fail, &rounds, grp)))
        break;
      if (tr && base == 0 && k == 0) {
        ll_trace_mark(trace, 1, &t_mark);
        trace[3] += rounds;
      }
      ll_reduce_line<MAXR, DT, OP>(dc, got, ll_pick(mine, k, 0), ll_pick(mine, k, 1), avg, out, l, nbytes);
    }
    if (!ok || s_fail) break;
  }
  grp.sync();
  if (tr) trace[2] += kgpu_clock64() - t_mark;
  return s_fail ? (kcclResult_t)(dc.status->code ? dc.status->code : kcclRemoteError) : kcclSuccess;
}

}  // namespace kccl_detail

#endif /* KCCL_DEVICE_ONESHOT_CUH_ */
