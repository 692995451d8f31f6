/*
 * kccl_device.cuh - KCCL's device-side API: a kernel performs a small
 * all-reduce itself, per block, with no kernel boundary.
 *
 *   kcclDevComm dc;                       // host: once, after kcclCommInitRankConfig(device >= 0)
 *   kcclCommGetDevComm(comm, &dc, sizeof dc);
 *   my_kernel<<<blocks, 256, 0, stream>>>(dc, ...);
 *
 *   __global__ void my_kernel(kcclDevComm dc, float *x, ...) {
 *     ...                                  // every thread of the block calls:
 *     kcclResult_t rc = kcclDevAllReduce(dc, x + blockIdx.x * n, n, kcclFloat32, kcclSum);
 *   }
 *
 * Block b of every rank must make the same sequence of calls with the same
 * count; blocks are independent (each has its own epoch and inbox region), so
 * blocks never wait for each other.  At most KCCL_DEV_MAX_BLOCKS blocks, each
 * call at most KCCL_LL_MAX_BYTES bytes.  All ranks' kernels must be resident
 * at once (one GPU per rank, or several ranks of one GPU under MPS with few
 * enough blocks): a block waits for the same block of every peer.  With
 * several ranks on one GPU, two more rules keep a late rank's own kernels
 * (those before yours on its stream) able to start, measured on the H200
 * (bench/gpu/residency.py): ask for the largest shared-memory carveout
 * (cudaFuncSetAttribute(my_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
 * 100)), or a kernel with more shared memory than your blocks' SMs are set
 * to cannot start beside them; and keep the blocks of all ranks but one
 * below the GPU's SM count, leaving a few SMs empty, for kernels that need
 * more registers or threads than an SM has left beside your blocks.
 *
 * Protocol (LL, "low latency"): the sender writes each 8 bytes of data as one
 * 16-byte line {data0, epoch, data1, epoch ^ sig} straight into every peer's
 * inbox, where sig is the call's signature (count, type, operation); the reader
 * polls its own inbox until the line's words are {epoch, epoch ^ sig} for the
 * epoch and signature it expects (weak .cg accesses: volatile ones would
 * serialise a thread's pushes and polls).  Each aligned 8-byte half is taken
 * as single-copy atomic, so a half with the right flag word carries the right
 * data: no separate flag, no fence, no barrier.  The epoch increments on every
 * call (it lives in device memory, so graph replays advance it) and inbox sets
 * rotate over three, so nothing is ever cleared: an older line of the same
 * slot has an older epoch in its first half, and in its second (epoch' ^ sig'),
 * which for the same signature differs from epoch ^ sig.  A peer that called
 * with another signature writes lines whose first word is this call's epoch
 * but whose second is not; a reader that keeps seeing that reports a
 * mismatch instead of reducing (KCCL_LL_MISMATCH_POLLS).  (Were the two halves
 * of one line ever seen from different stores, a stale second half would pass
 * only when epoch' ^ sig' == epoch ^ sig, which takes another signature and a
 * 32-bit coincidence; bench/gpu/ll_ladder.cu counted no half-old line in 4 x
 * 2 x 2000 calls of 8 KB per rank at 8 ranks on the H200.)
 *
 * Pull (dc.pull, set when every rank shares one GPU): the sender writes each
 * line once, into its own inbox's slot for itself, and readers poll that slot
 * in the sender's buffer.  On one GPU every buffer sits in the same L2, so a
 * remote poll costs what a local one does, and a call stores each line once
 * instead of once per peer.  A waiting thread polls every pending peer each
 * round.  (With KCCL_LL_SENTINEL 1 it polls only its lowest pending peer
 * between full rounds, to cut poll traffic; with the signature in the flag
 * word that is no faster, so the simpler wait is the default.)
 * Across GPUs a remote poll is a round trip over the link, so they push.
 *
 * Two hops (dc.ll_hops == 2, for a block of one line per thread, L lines, N
 * ranks, S = ceil(L / N), when N * S <= blockDim): rank r owns lines [r*S,
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
 * Waits are bounded: every few dozen polls a waiting thread checks the clock
 * (KCCL_TIMEOUT_MS), its block's failure flag, and the host-mapped stop word
 * that the host sets when a peer dies, aborts or closes.  A failed call
 * returns an error code and records it where the host reads it (the
 * communicator is then broken: kcclCommGetAsyncError and every later call
 * report it).
 */
#ifndef KCCL_DEVICE_CUH_
#define KCCL_DEVICE_CUH_

#include <stdint.h>

#include "kccl.h"
#include "kccl_gpu_compat.h"
#include "kccl_gpu_status.h"
#if defined(__HIP_PLATFORM_AMD__) || defined(KCCL_USE_HIP)
#include <hip/hip_fp16.h>
#else
#include <cuda_fp16.h>
#endif

#define KCCL_GPU_MAX_RANKS 16
#define KCCL_LL_SETS 3          /* inbox sets in rotation */
#define KCCL_LL_THREADS 256     /* threads per block of the library's LL kernels */
#define KCCL_LL_MAX_LPT 4       /* data lines per thread per call, at most */
#define KCCL_DEV_MAX_BLOCKS 32  /* blocks per channel */
/* A region: one (set, sender, block)'s data lines, 16 bytes each. */
#define KCCL_LL_REGION_BYTES (16 * KCCL_LL_THREADS * KCCL_LL_MAX_LPT)
#define KCCL_LL_MAX_BYTES (8 * KCCL_LL_THREADS * KCCL_LL_MAX_LPT) /* data bytes per block per call */
#define KCCL_CHANNELS 2         /* 0: the library's kernels, 1: user kernels through this API */


/* Everything a kernel needs, passed by value (POD; a copy per kernel launch). */
typedef struct {
  int rank, nranks;
  int channel;                              /* which LL inbox / epoch array this handle uses */
  int pull;                                 /* 1: every rank is on this GPU (see "Pull" above) */
  int ll_hops;                              /* 2: blocks of one line per thread take two hops ("Two hops") */
  uint64_t timeout_ns;                      /* 0: no time limit (the stop word still applies) */
  char *peer_base[KCCL_GPU_MAX_RANKS];      /* every rank's device buffer, mapped here (own too) */
  uint64_t ll_off[KCCL_CHANNELS];           /* offset of each channel's LL inbox in a buffer */
  uint32_t *epochs;                         /* this rank's [KCCL_CHANNELS][KCCL_DEV_MAX_BLOCKS] */
  int *fail_owner;                          /* device word: the first failing block claims it */
  kcclGpuStatus *status;                    /* device pointer of the host-mapped record */
} kcclDevComm;

/* ---------------------------------------------------------------- internals -- */
namespace kccl_detail {

/* Data line l of a region. */
__device__ static inline uint32_t *ll_line(uint32_t *region, uint32_t l) {
  return region + 4 * l;
}

__device__ static inline uint32_t *ll_region(const kcclDevComm &dc, int owner, uint32_t set, int sender,
                                             int block) {
  size_t idx = ((size_t)set * dc.nranks + sender) * KCCL_DEV_MAX_BLOCKS + block;
  return (uint32_t *)(dc.peer_base[owner] + dc.ll_off[dc.channel] + idx * KCCL_LL_REGION_BYTES);
}

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

__device__ static inline float bf16_to_f32(uint32_t h) { return __uint_as_float(h << 16); }
__device__ static inline uint32_t f32_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u; /* NaN stays a (quiet) NaN */
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;                  /* round to nearest even */
}

/* The 8 bytes of one line as up to 4 floats; n = elements per line. */
__device__ static inline void decode(uint32_t w0, uint32_t w1, kcclDataType_t dt, float v[4]) {
  if (dt == kcclFloat32) {
    v[0] = __uint_as_float(w0);
    v[1] = __uint_as_float(w1);
  } else if (dt == kcclBfloat16) {
    v[0] = bf16_to_f32(w0 & 0xffffu); v[1] = bf16_to_f32(w0 >> 16);
    v[2] = bf16_to_f32(w1 & 0xffffu); v[3] = bf16_to_f32(w1 >> 16);
  } else { /* kcclFloat16 */
    __half_raw r;
    r.x = (unsigned short)(w0 & 0xffffu); v[0] = __half2float(__half(r));
    r.x = (unsigned short)(w0 >> 16);     v[1] = __half2float(__half(r));
    r.x = (unsigned short)(w1 & 0xffffu); v[2] = __half2float(__half(r));
    r.x = (unsigned short)(w1 >> 16);     v[3] = __half2float(__half(r));
  }
}

__device__ static inline uint32_t h16(float f) {
  __half_raw r = __half_raw(__float2half_rn(f));
  return r.x;
}

__device__ static inline void encode(const float v[4], kcclDataType_t dt, uint32_t *w0, uint32_t *w1) {
  if (dt == kcclFloat32) {
    *w0 = __float_as_uint(v[0]);
    *w1 = __float_as_uint(v[1]);
  } else if (dt == kcclBfloat16) {
    *w0 = f32_to_bf16(v[0]) | (f32_to_bf16(v[1]) << 16);
    *w1 = f32_to_bf16(v[2]) | (f32_to_bf16(v[3]) << 16);
  } else {
    *w0 = h16(v[0]) | (h16(v[1]) << 16);
    *w1 = h16(v[2]) | (h16(v[3]) << 16);
  }
}

__device__ static inline float combine(float a, float b, kcclRedOp_t op) {
  switch (op) {
    case kcclProd: return a * b;
    /* NaN propagates (as numpy's maximum/minimum and the host path do). */
    case kcclMax: return (a > b || a != a) ? a : b;
    case kcclMin: return (a < b || a != a) ? a : b;
    default: return a + b; /* kcclSum, kcclAvg (divided at the end) */
  }
}

/* Bytes [off, off+8) of buf into two words, zero beyond n bytes; 8-byte
 * loads when aligned and whole (the byte-wise rest out of line). */
__device__ __noinline__ static uint2 load8_bytes(const char *buf, size_t off, size_t n) {
  uint32_t w[2] = {0, 0};
  for (int i = 0; i < 8 && off + i < n; i++) w[i >> 2] |= (uint32_t)(uint8_t)buf[off + i] << (8 * (i & 3));
  return make_uint2(w[0], w[1]);
}
__device__ static inline void load8(const char *buf, size_t off, size_t n, uint32_t *w0, uint32_t *w1) {
  const uint2 v = off + 8 <= n && (((uintptr_t)(buf + off)) & 7) == 0 ? *(const uint2 *)(buf + off)
                                                                      : load8_bytes(buf, off, n);
  *w0 = v.x;
  *w1 = v.y;
}

__device__ __noinline__ static void store8_bytes(char *buf, size_t off, size_t n, uint32_t w0, uint32_t w1) {
  uint32_t w[2] = {w0, w1};
  for (int i = 0; i < 8 && off + i < n; i++) buf[off + i] = (char)(w[i >> 2] >> (8 * (i & 3)));
}
__device__ static inline void store8(char *buf, size_t off, size_t n, uint32_t w0, uint32_t w1) {
  if (off + 8 <= n && (((uintptr_t)(buf + off)) & 7) == 0) *(uint2 *)(buf + off) = make_uint2(w0, w1);
  else store8_bytes(buf, off, n, w0, w1);
}

/* Where one call's time goes, for the benchmark (TRACE copies only; thread 0
 * of block 0 adds clock64 cycles): [0] entry to pushes issued (the epoch and
 * input loads), [1] to its first line received from every peer, [2] to the
 * end (the rest of its lines, combine, store, barrier), [3] poll rounds of its
 * first line. */
#define KCCL_LL_TRACE_SLOTS 4

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

/* This thread's input lines of the round starting at line `base` (line
 * base + threadIdx.x + k * blockDim.x into mine[k]), zero past the last. */
__device__ static inline void ll_load_round(uint32_t (&mine)[KCCL_LL_MAX_LPT][2], const char *in, uint32_t base,
                                            uint32_t lines, uint32_t nbytes) {
#pragma unroll
  for (int k = 0; k < KCCL_LL_MAX_LPT; k++) {
    const uint32_t l = base + threadIdx.x + k * blockDim.x;
    mine[k][0] = mine[k][1] = 0;
    if (l < lines) load8(in, (size_t)l * 8, nbytes, &mine[k][0], &mine[k][1]);
  }
}

/* mine[k][j] for a k known only at run time, without spilling mine[] to local memory. */
__device__ static inline uint32_t ll_pick(const uint32_t (&mine)[KCCL_LL_MAX_LPT][2], int k, int j) {
  static_assert(KCCL_LL_MAX_LPT == 4, "ll_pick selects among 4 lines");
  return k == 0 ? mine[0][j] : k == 1 ? mine[1][j] : k == 2 ? mine[2][j] : mine[3][j];
}

/* Where sender p's lines of `set` for `block` are read: this rank's inbox
 * (push), or p's own slot in p's buffer (pull). */
__device__ static inline uint32_t *ll_from(const kcclDevComm &dc, uint32_t set, int p, int block) {
  return ll_region(dc, dc.pull ? p : dc.rank, set, p, block);
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

/* Between two poll rounds of a wait for the peers in `pending`: 0 polls on,
 * 1 takes a last look at every pending peer (the wait was stopped, but a line
 * sent just before a peer went may be there), -1 gives up (recorded unless
 * another thread of the block failed first; s_fail set). */
__device__ static inline int ll_next_round(const kcclDevComm &dc, Waiter &wt, bool *last_look, uint32_t pending,
                                           uint32_t sig, uint32_t e, uint32_t nbytes, volatile int *s_fail) {
  const int why = keep_waiting(dc, wt, s_fail);
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
__device__ static inline bool ll_wait_one(const kcclDevComm &dc, const uint32_t *line, int from, uint32_t e,
                                          uint32_t ew, uint32_t sig, uint32_t nbytes, uint4 *got,
                                          volatile int *s_fail) {
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
    if (ll_next_round(dc, wt, &last_look, 1u << from, sig, e, nbytes, s_fail) < 0) return false;
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
template <int MAXR>
__device__ static inline bool ll_wait_line(const kcclDevComm &dc, uint32_t set, int block, uint32_t l, uint32_t e,
                                           uint32_t ew, uint32_t pending, uint32_t sig, uint32_t nbytes, uint4 *got,
                                           volatile int *s_fail, uint32_t *rounds) {
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
    const int next = ll_next_round(dc, wt, &last_look, pending, sig, e, nbytes, s_fail);
    if (next < 0) return false;
    if (next) full = true; /* the last look covers every pending peer, not only the sentinel */
  }
  *rounds += wt.polls + 1;
  return true;
}

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
 * with s_fail set when the block failed; the caller's end barrier follows. */
template <int MAXR, int DT, int OP>
__device__ static __forceinline__ void ll_two_hops(const kcclDevComm &dc, int block, char *out, uint32_t nbytes,
                                                   uint32_t lines, uint32_t S, bool avg, uint32_t sig, uint32_t e,
                                                   uint32_t set, uint32_t m0, uint32_t m1, volatile int *s_fail) {
  __shared__ uint2 s_part[KCCL_LL_THREADS]; /* hop 1: [p*S + j] = rank p's line me*S + j */
  const int tid = threadIdx.x, me = dc.rank, n = dc.nranks;
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
                      s_fail))
        s_part[tid] = make_uint2(g.x, g.z);
    }
  }
  __syncthreads();
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
                    s_fail))
      store8(out, (size_t)tid * 8, nbytes, g.x, g.z);
  }
}

/* The block's next epoch.  Only thread 0 touches it in memory (read, then
 * write back) and the others take it from shared memory after the barrier:
 * when every thread read it from memory, nothing kept a read still in flight
 * at the barrier from seeing thread 0's new value.  Also clears the block's
 * failure flag.  Every thread calls it (a barrier). */
__device__ static __forceinline__ uint32_t ll_next_epoch(const kcclDevComm &dc, int block, uint32_t *s_epoch,
                                                        volatile int *s_fail) {
  if (threadIdx.x == 0) {
    uint32_t *ep = dc.epochs + dc.channel * KCCL_DEV_MAX_BLOCKS + block;
    const uint32_t next = kgpu_ld_volatile_u32(ep) + 1;
    *ep = next;
    *s_epoch = next;
    *s_fail = 0;
  }
  __syncthreads();
  return *s_epoch;
}

/* TRACE copies: adds the cycles since *t_mark to `slot` and restarts the mark. */
__device__ static __forceinline__ void ll_trace_mark(long long *trace, int slot, long long *t_mark) {
  const long long now = kgpu_clock64();
  trace[slot] += now - *t_mark;
  *t_mark = now;
}

/* One block's LL all-reduce of nbytes (<= KCCL_LL_MAX_BYTES) from `in` to `out`
 * (may alias), for one data type DT and operation OP (kcclAvg: OP kcclSum and
 * avg).  Every thread of the block calls it; blockDim.x <= KCCL_LL_THREADS.
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
template <int MAXR, int DT, int OP, bool TRACE>
__device__ static __forceinline__ kcclResult_t ll_block(const kcclDevComm &dc, int block, const char *in, char *out,
                                               uint32_t nbytes, bool avg, uint32_t sig, long long *trace) {
  const bool tr = TRACE && threadIdx.x == 0 && block == 0;
  long long t_mark = tr ? kgpu_clock64() : 0;
  __shared__ volatile int s_fail;
  __shared__ uint32_t s_epoch;
  const int tid = threadIdx.x, nt = blockDim.x, me = dc.rank, n = dc.nranks;
  const uint32_t lines = (nbytes + 7) / 8;
  const uint32_t all_peers = (n >= 32 ? 0xffffffffu : ((1u << n) - 1)) & ~(1u << me);
  uint32_t rounds = 0;

  if (lines <= (uint32_t)nt) { /* one line per thread at most */
    const bool have = (uint32_t)tid < lines;
    uint32_t m0 = 0, m1 = 0;
    if (have) load8(in, (size_t)tid * 8, nbytes, &m0, &m1);
    const uint32_t e = ll_next_epoch(dc, block, &s_epoch, &s_fail), ew = e ^ sig, set = e % KCCL_LL_SETS;
    const uint32_t S = (lines + n - 1) / n; /* two hops: lines per owner */
    if (MAXR > 2 && dc.ll_hops == 2 && lines && S * n <= (uint32_t)nt) { /* 2 ranks: 1 hop reads as few lines */
      ll_two_hops<MAXR, DT, OP>(dc, block, out, nbytes, lines, S, avg, sig, e, set, m0, m1, &s_fail);
    } else if (have) {
      ll_send_line<MAXR>(dc, set, block, tid, m0, m1, e, ew);
      if (tr) ll_trace_mark(trace, 0, &t_mark);
      uint4 got[MAXR];
      if (ll_wait_line<MAXR>(dc, set, block, tid, e, ew, all_peers, sig, nbytes, got, &s_fail, &rounds)) {
        if (tr) {
          ll_trace_mark(trace, 1, &t_mark);
          trace[3] += rounds;
        }
        ll_reduce_line<MAXR, DT, OP>(dc, got, m0, m1, avg, out, tid, nbytes);
      }
    }
    __syncthreads();
    if (tr) trace[2] += kgpu_clock64() - t_mark;
    return s_fail ? (kcclResult_t)(dc.status->code ? dc.status->code : kcclRemoteError) : kcclSuccess;
  }

  /* Several lines per thread: rounds of up to KCCL_LL_MAX_LPT per thread (one
   * round when blockDim.x == KCCL_LL_THREADS); each round is a whole push +
   * receive. */
  uint32_t mine[KCCL_LL_MAX_LPT][2];
  ll_load_round(mine, in, 0, lines, nbytes);
  const uint32_t e = ll_next_epoch(dc, block, &s_epoch, &s_fail), ew = e ^ sig, set = e % KCCL_LL_SETS;
  for (uint32_t base = 0; base < lines; base += (uint32_t)nt * KCCL_LL_MAX_LPT) {
    /* A later round (small blocks): its input lines.  Each line is read and
     * written by one thread only, so in place needs no barrier. */
    if (base) ll_load_round(mine, in, base, lines, nbytes);
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
      if (!(ok = ll_wait_line<MAXR>(dc, set, block, l, e, ew, all_peers, sig, nbytes, got, &s_fail, &rounds)))
        break;
      if (tr && base == 0 && k == 0) {
        ll_trace_mark(trace, 1, &t_mark);
        trace[3] += rounds;
      }
      ll_reduce_line<MAXR, DT, OP>(dc, got, ll_pick(mine, k, 0), ll_pick(mine, k, 1), avg, out, l, nbytes);
    }
    if (!ok || s_fail) break;
  }
  __syncthreads();
  if (tr) trace[2] += kgpu_clock64() - t_mark;
  return s_fail ? (kcclResult_t)(dc.status->code ? dc.status->code : kcclRemoteError) : kcclSuccess;
}

/* The library's entry: dtype and op at run time, one compiled body each (only
 * the one that runs has to be fetched).  kcclInvalidArgument for others. */
template <int MAXR, bool TRACE = false> /* MAXR: ranks this copy handles (<= KCCL_GPU_MAX_RANKS): the registers scale with it */
__device__ static __forceinline__ kcclResult_t ll_allreduce_block(const kcclDevComm &dc, int block, const char *in, char *out,
                                                         uint32_t nbytes, kcclDataType_t dt, kcclRedOp_t op,
                                                         uint32_t sig, long long *trace = nullptr) {
  /* Two ranks get their own body: peer loops that run to MAXR with a run-time
   * rank count cost ~0.7 us per call at 2 ranks (bench/gpu/ll_ladder.cu). */
  if (MAXR > 2 && dc.nranks <= 2) return ll_allreduce_block<2, TRACE>(dc, block, in, out, nbytes, dt, op, sig, trace);
  const bool avg = op == kcclAvg;
  const int o = avg ? (int)kcclSum : (int)op;
#define KCCL_LL_CASE(D, O) \
  if (dt == D && o == O) return ll_block<MAXR, D, O, TRACE>(dc, block, in, out, nbytes, avg, sig, trace)
#define KCCL_LL_CASES(D) \
  KCCL_LL_CASE(D, kcclSum); KCCL_LL_CASE(D, kcclProd); KCCL_LL_CASE(D, kcclMax); KCCL_LL_CASE(D, kcclMin)
  KCCL_LL_CASES(kcclBfloat16);
  KCCL_LL_CASES(kcclFloat16);
  KCCL_LL_CASES(kcclFloat32);
#undef KCCL_LL_CASES
#undef KCCL_LL_CASE
  return kcclInvalidArgument;
}

/* kcclDevAllReduce's body; TRACE copies fill `trace` (see KCCL_LL_TRACE_SLOTS). */
template <int MaxRanks, bool TRACE>
__device__ static __forceinline__ kcclResult_t dev_allreduce(const kcclDevComm &dc, void *data, int count, kcclDataType_t dt,
                                                    kcclRedOp_t op, long long *trace) {
  static_assert(MaxRanks >= 1 && MaxRanks <= KCCL_GPU_MAX_RANKS, "MaxRanks: 1..KCCL_GPU_MAX_RANKS");
  const int es = dt == kcclFloat32 ? 4 : 2;
  const uint32_t nbytes = (uint32_t)count * es;
  if ((dt != kcclFloat32 && dt != kcclFloat16 && dt != kcclBfloat16) || op < 0 || op >= kcclNumOps ||
      count < 0 || nbytes > KCCL_LL_MAX_BYTES || blockIdx.x >= KCCL_DEV_MAX_BLOCKS ||
      blockDim.x > KCCL_LL_THREADS || dc.nranks > MaxRanks)
    return kcclInvalidArgument;
  /* The signature of a device call: kind 0x40 | dtype | op, and the size. */
  const uint32_t sig = 0x4b440000u ^ ((uint32_t)dt << 8) ^ (uint32_t)op ^ (nbytes * 2654435761u);
  return ll_allreduce_block<MaxRanks, TRACE>(dc, blockIdx.x, (const char *)data, (char *)data, nbytes, dt, op, sig,
                                             trace);
}

}  // namespace kccl_detail

/* ------------------------------------------------------------------ public -- */

/* In-place all-reduce of `count` elements at `data` across the same block of
 * every rank.  dt: kcclFloat32, kcclFloat16 or kcclBfloat16 (float accumulation);
 * op: any kcclRedOp_t.  Every thread of the block must call it.
 * MaxRanks bounds the communicator size this copy handles (a communicator
 * with more ranks gets kcclInvalidArgument); a kernel that knows it runs on
 * at most 8 ranks saves registers with kcclDevAllReduce<8>. */
template <int MaxRanks = KCCL_GPU_MAX_RANKS>
__device__ static __forceinline__ kcclResult_t kcclDevAllReduce(const kcclDevComm &dc, void *data, int count,
                                                       kcclDataType_t dt, kcclRedOp_t op) {
  return kccl_detail::dev_allreduce<MaxRanks, false>(dc, data, count, dt, op, nullptr);
}

#endif /* KCCL_DEVICE_CUH_ */
