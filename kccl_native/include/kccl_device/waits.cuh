/*
 * kccl_device/waits.cuh - bounded waits and failure recording: the per-thread
 * Waiter, the clock / stop-word / block-flag checks, polling a peer's
 * line, waiting for one line or for a line of every peer, and recording a
 * timeout, a stop, a signature mismatch or the caller's cancel for the host.
 *
 * See "Waits are bounded" in kccl_device.cuh.
 *
 * Part of kccl_device.cuh, which defines kcclDevComm and the limits and
 * includes this file; include that header, not this one.
 */
#ifndef KCCL_DEVICE_WAITS_CUH_
#define KCCL_DEVICE_WAITS_CUH_

namespace kccl_detail {

/* Records the first failure of this rank (one block wins the claim) for the host.
 * Cold paths are out of line (__noinline__, fields by value: a kernel
 * parameter whose address is taken is copied to local memory), so the
 * kernels' hot loops stay small (see ll_block). */
__device__ __noinline__ static void record_failure_at(int *fail_owner, kcclGpuStatus *s, int what, int code,
                                                      int peer, uint32_t sig_mine, uint32_t sig_peer, uint32_t epoch,
                                                      uint32_t bytes_mine, uint32_t bytes_peer, int stage) {
  if (atomicCAS(fail_owner, 0, 1) != 0) return;
  s->block = (int32_t)blockIdx.x;
  s->grid = (int32_t)gridDim.x;
  s->stage = stage;
  s->what = what;
  s->peer = peer;
  s->sig_mine = sig_mine;
  s->sig_peer = sig_peer;
  s->epoch = epoch;
  s->bytes_mine = bytes_mine;
  s->bytes_peer = bytes_peer;
  kgpu_fence_system();
  s->code = code;
  kgpu_fence_system();
}
__device__ static inline void record_failure(const kcclDevComm &dc, int what, int code, int peer, uint32_t sig_mine,
                                             uint32_t sig_peer, uint32_t epoch, uint32_t bytes_mine,
                                             uint32_t bytes_peer, int stage = -1) {
  record_failure_at(dc.fail_owner, dc.status, what, code, peer, sig_mine, sig_peer, epoch, bytes_mine, bytes_peer,
                    stage);
}

/* Bounded-wait bookkeeping of one thread.  The deadline is set at the first
 * clock check (64 polls in), so a wait that succeeds at once never reads the
 * clock: the timeout is KCCL_TIMEOUT_MS plus those few polls. */
struct Waiter {
  uint64_t deadline;  /* 0: not yet set */
  uint32_t polls;
};

__device__ static inline Waiter waiter(const kcclDevComm &dc) {
  (void)dc;
  Waiter w;
  w.deadline = 0;
  w.polls = 0;
  return w;
}

/* keep_waiting's every-64th-poll part, out of line: the deadline (set on
 * the first call), with the verdict (KCCL_GPU_*) in the top two bits.  The
 * host-mapped words are read every 1024th poll only: a read crosses PCIe, and
 * when thousands of threads wait at once (a 256 KB one-shot call: 8192) their
 * reads queue there (256 KB at 2 ranks: about 5 us per call with every
 * 1024th poll, 17-30 us with every 64th). */
__device__ __noinline__ static uint64_t wait_check(const kcclGpuStatus *st, uint64_t timeout_ns, uint64_t deadline,
                                                   uint32_t polls) {
  if ((polls & 1023) == 0 && (st->stop || st->code)) return deadline | ((uint64_t)KCCL_GPU_STOPPED << 62);
  if (timeout_ns) {
    const uint64_t now = kgpu_time_ns();
    if (!deadline) deadline = now + timeout_ns;
    else if (now > deadline) return deadline | ((uint64_t)KCCL_GPU_TIMEOUT << 62);
  }
  if (polls > (1u << 16)) kgpu_pause(); /* a long wait: let the peer's warps have the issue slots */
  return deadline;
}

/* Called between polls.  Returns KCCL_GPU_OK to keep polling.  The block's
 * shared failure flag and the clock are read every 64 polls, the host-mapped
 * words every 1024 (see wait_check): a wait that succeeds within a few polls
 * reads none of them. */
__device__ static inline int keep_waiting(const kcclDevComm &dc, Waiter &w, volatile int *block_fail) {
  if ((++w.polls & 63) != 0) return KCCL_GPU_OK;
  if (*block_fail) return KCCL_GPU_STOPPED;
  const uint64_t r = wait_check(dc.status, dc.timeout_ns, w.deadline, w.polls);
  w.deadline = r & ((1ull << 62) - 1);
  return (int)(r >> 62);
}

/* Polls for which a peer's line may show this call's epoch in its first half
 * and another word in its second before that counts as a mismatch (the two
 * halves of one 16-byte store become visible together in practice, but only
 * each half's atomicity is guaranteed). */
#define KCCL_LL_MISMATCH_POLLS 64

/* 1: a pull-mode wait polls only its lowest pending peer between full rounds
 * (the sentinel, see "Pull"); 0: every pending peer every round. */
#ifndef KCCL_LL_SENTINEL
#define KCCL_LL_SENTINEL 0
#endif

/* A wait that gave up (why: KCCL_GPU_TIMEOUT or KCCL_GPU_STOPPED): record it
 * for the host, unless this block already failed, and fail the block. */
__device__ static inline void ll_wait_failed(const kcclDevComm &dc, int why, int peer, uint32_t sig, uint32_t e,
                                             uint32_t nbytes, volatile int *s_fail) {
  if (why == KCCL_GPU_TIMEOUT)
    record_failure(dc, KCCL_GPU_TIMEOUT, kcclTimeout, peer, sig, 0, e, nbytes, 0);
  else if (!*s_fail)
    record_failure(dc, KCCL_GPU_STOPPED, kcclRemoteError, dc.status->stop_peer, sig, 0, e, nbytes, 0);
  *s_fail = 1;
}

/* Looks at line l of every peer in `look` (every load issued before any is
 * looked at: one round costs one round trip, not one per peer).  Returns the
 * peers whose line is this call's (first word e, second ew: in got[p]); *odd
 * gets those whose first word is e but whose second is not ew, which a peer
 * that made another call (another signature) writes. */
template <int MAXR>
__device__ static inline uint32_t ll_poll(const kcclDevComm &dc, uint32_t set, int block, uint32_t l, uint32_t e,
                                          uint32_t ew, uint32_t look, uint4 *got, uint32_t *odd) {
#pragma unroll
  for (int p = 0; p < MAXR; p++)
    if (look & (1u << p))
      kgpu_ld_weak_v4(ll_line(ll_from(dc, set, p, block), l), &got[p].x, &got[p].y, &got[p].z, &got[p].w);
  uint32_t came = 0, o = 0;
#pragma unroll
  for (int p = 0; p < MAXR; p++)
    if (look & (1u << p)) {
      came |= (got[p].y == e && got[p].w == ew) ? 1u << p : 0u;
      o |= (got[p].y == e && got[p].w != ew) ? 1u << p : 0u;
    }
  *odd = o;
  return came;
}

/* got[p].w for the lowest peer in `which` (constant indices: got[] stays in registers). */
template <int MAXR>
__device__ static inline uint32_t ll_second_word(const uint4 *got, uint32_t which) {
  uint32_t w = 0;
  const int hp = __ffs(which) - 1;
#pragma unroll
  for (int p = 0; p < MAXR; p++)
    if (p == hp) w = got[p].w;
  return w;
}

/* A peer's line seen with this call's epoch but another second word for more
 * than KCCL_LL_MISMATCH_POLLS rounds: the peer made another call (sig_peer
 * is its signature).  Recorded unless the block already failed. */
__device__ static inline void ll_mismatch(const kcclDevComm &dc, int peer, uint32_t sig, uint32_t sig_peer,
                                          uint32_t e, uint32_t nbytes, volatile int *s_fail) {
  if (!*s_fail)
    record_failure(dc, KCCL_GPU_MISMATCH, kcclInvalidUsage, peer, sig, sig_peer, e, nbytes, KCCL_GPU_BYTES_UNKNOWN);
  *s_fail = 1;
}

/* The caller of a cancellable group (kcclDevAllReduceGroup) set its cancel
 * word: this wait ends.  Recorded unless the block already failed, because
 * the ranks' calls on this slot no longer pair up (this rank's epoch moved on,
 * its peers' may not): the communicator is broken from here on. */
__device__ static inline void ll_cancelled(const kcclDevComm &dc, int peer, uint32_t sig, uint32_t e,
                                           uint32_t nbytes, volatile int *s_fail) {
  if (!*s_fail) record_failure(dc, KCCL_GPU_CANCELLED, kcclRemoteError, peer, sig, 0, e, nbytes, 0);
  *s_fail = 1;
}

/* Between two poll rounds of a wait for the peers in `pending`: 0 polls on,
 * 1 takes a last look at every pending peer (the wait was stopped, but a line
 * sent just before a peer went may be there), -1 gives up (recorded unless
 * another thread of the block failed first; s_fail set).  A cancellable group
 * reads its cancel word with the block's flag, every 64th round. */
template <typename G = WholeBlock>
__device__ static inline int ll_next_round(const kcclDevComm &dc, Waiter &wt, bool *last_look, uint32_t pending,
                                           uint32_t sig, uint32_t e, uint32_t nbytes, volatile int *s_fail,
                                           const G &grp = G()) {
  const int why = keep_waiting(dc, wt, s_fail);
  if (G::kCancellable && !why && (wt.polls & 63) == 0 && grp.cancelled()) {
    ll_cancelled(dc, __ffs(pending) - 1, sig, e, nbytes, s_fail);
    return -1;
  }
  if (!why) return 0;
  if (why == KCCL_GPU_STOPPED && !*s_fail && !*last_look) {
    *last_look = true;
    return 1;
  }
  if (!*s_fail || why == KCCL_GPU_TIMEOUT) ll_wait_failed(dc, why, __ffs(pending) - 1, sig, e, nbytes, s_fail);
  return -1;
}

/* Waits for the one line at `line`, sent by `from` (*got then holds it).
 * Returns false when the block failed (recorded; s_fail set). */
template <typename G = WholeBlock>
__device__ static inline bool ll_wait_one(const kcclDevComm &dc, const uint32_t *line, int from, uint32_t e,
                                          uint32_t ew, uint32_t sig, uint32_t nbytes, uint4 *got,
                                          volatile int *s_fail, const G &grp = G()) {
  Waiter wt = waiter(dc);
  uint32_t odd_rounds = 0;
  bool last_look = false;
  for (;;) {
    kgpu_ld_weak_v4(line, &got->x, &got->y, &got->z, &got->w);
    if (got->y == e && got->w == ew) return true;
    if (got->y != e) {
      odd_rounds = 0;
    } else if (++odd_rounds > KCCL_LL_MISMATCH_POLLS) {
      ll_mismatch(dc, from, sig, got->w ^ e, e, nbytes, s_fail);
      return false;
    }
    if (ll_next_round(dc, wt, &last_look, 1u << from, sig, e, nbytes, s_fail, grp) < 0) return false;
  }
}

/* Waits for line l from every peer in `pending` (got[p] then holds it).
 * Returns false when the block failed (recorded; s_fail set).  The sentinel
 * (KCCL_LL_SENTINEL 1, off by default): in pull mode, after a first full
 * round a waiting thread polls only its
 * lowest pending peer (and any whose line looked like a mismatch) until a
 * round brings a line, then all again (see "Pull").  The block's failure flag
 * and the clock are looked at every 64th round only (keep_waiting): a wait
 * that succeeds within a few rounds pays nothing for them. */
template <int MAXR, typename G = WholeBlock>
__device__ static inline bool ll_wait_line(const kcclDevComm &dc, uint32_t set, int block, uint32_t l, uint32_t e,
                                           uint32_t ew, uint32_t pending, uint32_t sig, uint32_t nbytes, uint4 *got,
                                           volatile int *s_fail, uint32_t *rounds, const G &grp = G()) {
  const bool pull = dc.pull != 0;
  Waiter wt = waiter(dc);
  uint32_t odd = 0, odd_rounds = 0;
  bool full = true, last_look = false;
  for (;;) {
    const uint32_t look = KCCL_LL_SENTINEL && pull && !full ? (pending & (0u - pending)) | odd : pending;
    const uint32_t came = ll_poll<MAXR>(dc, set, block, l, e, ew, look, got, &odd);
    pending &= ~came;
    full = came != 0;
    if (!pending) break;
    if (odd) {
      /* This call's epoch with another second word, round after round: the
       * peer called with another signature (count, type or operation). */
      if (++odd_rounds > KCCL_LL_MISMATCH_POLLS) {
        ll_mismatch(dc, __ffs(odd) - 1, sig, ll_second_word<MAXR>(got, odd) ^ e, e, nbytes, s_fail);
        return false;
      }
    } else {
      odd_rounds = 0;
    }
    const int next = ll_next_round(dc, wt, &last_look, pending, sig, e, nbytes, s_fail, grp);
    if (next < 0) return false;
    if (next) full = true; /* the last look covers every pending peer, not only the sentinel */
  }
  *rounds += wt.polls + 1;
  return true;
}

}  // namespace kccl_detail

#endif /* KCCL_DEVICE_WAITS_CUH_ */
