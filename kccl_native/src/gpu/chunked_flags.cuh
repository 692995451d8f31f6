/* chunked_flags.cuh - the flags of the chunked kernels (gpu_twoshot.cu,
 * gpu_gather.cu): where a flag lives, the block's step number, signalling the
 * peers and waiting for them (not installed).
 *
 * Two-shot all-reduce / reduce-scatter / all-gather / broadcast: chunked
 *   through each rank's exported scratch areas, with per-block flags pushed to
 *   the peers (release at system scope, or GPU scope when every rank shares
 *   this GPU) and polled locally (acquire at the same scope).  Block b
 *   of every rank handles the same portion of every segment, so block b waits
 *   only for block b of its peers and blocks never wait for each other.
 *
 * Reuse of scratch without clearing (each flag value is a step number that
 * grows by one per chunk; step counters live in device memory):
 * - in-area: written in stage 1 of step s; peers read it in stage 2 of step
 *   s and then raise flag 2; this rank passes its stage-3 wait for flag 2
 *   before it starts step s+1.
 * - out-area: written in stage 2 of step s only after every peer's flag 1 of
 *   step s, raised after that peer finished step s-1 (its stage-3 reads).
 * - gather halves (step parity): half h is rewritten at step s+2; this rank's
 *   step s+1 waited for every peer's flag 1 of step s+1, raised after that
 *   peer finished reading step s.  A broadcast root also waits for those
 *   "arrived" flags, so it cannot run ahead of its readers.
 *
 * Flag replicas (KCCL_GPU_FLAG_REPLICAS=1, gpu_l2map.cu): every flag line has
 * two copies in the reader's buffer, each near one L2 partition's SMs.  The
 * writer writes the same value into both; the reader polls the copy near the
 * SM its block runs on.  Either copy carries every step in order, so a block
 * that lands on the other group's SM in a later launch reads a copy as current
 * as the one it polled before, and the rules above hold per copy. */
#ifndef KCCL_GPU_CHUNKED_FLAGS_CUH_
#define KCCL_GPU_CHUNKED_FLAGS_CUH_
#include "kernels.h"

using namespace kccl_detail; /* the waits and failure records of kccl_device/waits.cuh */

__device__ static inline uint64_t *flag_slot(char *base, size_t off, int stage, int block, int src) {
  return (uint64_t *)(base + off) + ((size_t)stage * KGPU_TS_MAX_BLOCKS + block) * KCCL_GPU_MAX_RANKS + src;
}

/* What thread t (the one that signals peer t and waits for it) needs of the
 * tables: peer t's entry for this block (its pool lines [stage][copy], four
 * uint16), this rank's, and the L2 group of this block's SM.  Loaded at kernel
 * start; nothing uses them before the first signal, so the loads overlap the
 * stage-1 copy (rep_field keeps the compiler from pulling that use up to the
 * loads). */
struct RepLines {
  uint64_t peer, own;
  uint32_t group;
};

__device__ static inline RepLines rep_lines(const kcclDevComm &dc, const Replicas &rep) {
  RepLines r = {0, 0, 0};
  const int t = threadIdx.x;
  if (rep.on && t < dc.nranks && t != dc.rank) {
    r.peer = kgpu_ld_cg_u64(dc.peer_base[t] + rep.off_tab + (size_t)blockIdx.x * 8);
    r.own = kgpu_ld_cg_u64(dc.peer_base[dc.rank] + rep.off_tab + (size_t)blockIdx.x * 8);
    const unsigned sm = kgpu_smid();
    r.group = sm < KGPU_SM_MAP ? kgpu_ld_cg_u8(dc.peer_base[dc.rank] + rep.off_map + sm) : 0;
  }
  return r;
}

/* Field k (stage * 2 + copy) of a packed entry.  The value goes through an
 * opaque asm first, so the compiler keeps the extraction at its use instead of
 * hoisting it next to the load, where it would wait for the load before the
 * stage-1 copy. */
__device__ static inline uint32_t rep_field(uint64_t packed, uint32_t k) {
  return (uint32_t)(kgpu_opaque_u64(packed) >> (16 * k)) & 0xffffu;
}
__device__ static inline uint32_t rep_copy(uint32_t group) { return kgpu_opaque_u32(group) == 1 ? 1 : 0; }

__device__ static inline uint64_t *rep_slot(char *base, const Replicas &rep, uint32_t line, int src) {
  return (uint64_t *)(base + rep.off_pool + (size_t)line * KGPU_LINE) + src;
}

/* The block's next step number: its counter in device memory (one per block,
 * shared by the chunked kernels) is read and advanced by thread 0 only; the
 * others take the value from shared memory after the barrier.  The read goes
 * past L1 (volatile): the counters of 32 blocks share a line, and another
 * block's plain read may have left a copy in this SM's L1 that is older than
 * this block's last write from another SM. */
__device__ static inline uint32_t next_step(const kcclDevComm &dc, size_t off_steps, uint32_t *s_step) {
  if (threadIdx.x == 0) {
    uint32_t *sp = (uint32_t *)(dc.peer_base[dc.rank] + off_steps) + blockIdx.x;
    *s_step = kgpu_ld_volatile_u32(sp) + 1;
    *sp = *s_step;
  }
  __syncthreads();
  return *s_step;
}

/* After the block's writes: tell peers (thread p signals peer p). */
__device__ static inline void signal_peers(const kcclDevComm &dc, size_t flags_off, const Replicas &rep,
                                           const RepLines &rl, int stage, uint64_t val) {
  __syncthreads();
  const int t = threadIdx.x;
  if (t < dc.nranks && t != dc.rank) {
    if (rep.gpu_scope)
      kgpu_fence_gpu();
    else
      kgpu_fence_system();
    if (!rep.on) {
      uint64_t *f = flag_slot(dc.peer_base[t], flags_off, stage, blockIdx.x, dc.rank);
      if (rep.gpu_scope)
        kgpu_st_release_gpu_u64(f, val);
      else
        kgpu_st_release_sys_u64(f, val);
    } else {
      /* Both copies, the first exactly as the single flag is written.  The fence
       * already orders the block's writes before the second (fence + strong store
       * is a release); a second release store would first wait for the first. */
      uint64_t *f0 = rep_slot(dc.peer_base[t], rep, rep_field(rl.peer, 2 * stage), dc.rank);
      uint64_t *f1 = rep_slot(dc.peer_base[t], rep, rep_field(rl.peer, 2 * stage + 1), dc.rank);
      if (rep.gpu_scope) {
        kgpu_st_release_gpu_u64(f0, val);
        kgpu_st_relaxed_gpu_u64(f1, val);
      } else {
        kgpu_st_release_sys_u64(f0, val);
        kgpu_st_relaxed_sys_u64(f1, val);
      }
    }
  }
}

/* A chunked wait timed out: record it with how far the peer got, read from
 * its step counters (thread 0 of each of its blocks raises its own at the
 * start of every step): the step of the same block, and how many of its
 * blocks have begun this step.  None of them means the peer's kernel has not
 * started (not launched, or not resident); some, that only part of it is.
 * Fields by value: see record_failure_at. */
__device__ __noinline__ static void record_chunked_timeout(int *fail_owner, kcclGpuStatus *st,
                                                           const char *peer_steps, int peer, uint32_t sig,
                                                           uint32_t step, int stage) {
  const uint32_t *ps = (const uint32_t *)peer_steps;
  const uint32_t same = kgpu_ld_volatile_u32(ps + blockIdx.x);
  uint32_t begun = 0;
  for (unsigned k = 0; k < gridDim.x; k++) begun += (int32_t)(kgpu_ld_volatile_u32(ps + k) - step) >= 0;
  record_failure_at(fail_owner, st, KCCL_GPU_TIMEOUT, kcclTimeout, peer, sig, 0, step, begun, same, stage);
}

/* Thread p waits for peer p's flag of `stage` to reach `step` (only == `only`
 * when only >= 0).  Returns false (the whole block) on failure. */
__device__ static inline bool wait_peers(const kcclDevComm &dc, size_t flags_off, size_t steps_off,
                                         const Replicas &rep, const RepLines &rl, int stage, uint32_t step,
                                         uint32_t sig, int only, volatile int *s_fail) {
  const int t = threadIdx.x;
  if (t < dc.nranks && t != dc.rank && (only < 0 || t == only)) {
    /* With replicas: the copy near this SM's group (an unmeasured SM: copy 0). */
    const uint64_t *f = !rep.on ? flag_slot(dc.peer_base[dc.rank], flags_off, stage, blockIdx.x, t)
                                : rep_slot(dc.peer_base[dc.rank], rep,
                                           rep_field(rl.own, 2 * stage + rep_copy(rl.group)), t);
    Waiter w = waiter(dc);
    for (;;) {
      uint64_t v = rep.gpu_scope ? kgpu_ld_acquire_gpu_u64(f) : kgpu_ld_acquire_sys_u64(f);
      uint32_t got = (uint32_t)v;
      if ((int32_t)(got - step) >= 0) {
        if (got == step && (uint32_t)(v >> 32) != sig) {
          record_failure(dc, KCCL_GPU_MISMATCH, kcclInvalidUsage, t, sig, (uint32_t)(v >> 32), step, 0, 0);
          *s_fail = 1;
        }
        break;
      }
      int why = keep_waiting(dc, w, s_fail);
      if (why == KCCL_GPU_STOPPED && !*s_fail && (int32_t)((uint32_t)kgpu_ld_acquire_sys_u64(f) - step) >= 0)
        continue; /* raised just before the peer went: the loop's next look takes it */
      /* Past a few polls, back off: a waiting warp's acquire loads take issue
       * slots and L2 bandwidth from the warps of this SM that are copying. */
      if (!why && w.polls > 8) kgpu_pause();
      if (why) {
        if (why == KCCL_GPU_TIMEOUT)
          record_chunked_timeout(dc.fail_owner, dc.status, dc.peer_base[t] + steps_off, t, sig, step, stage);
        else if (!*s_fail)
          record_failure(dc, KCCL_GPU_STOPPED, kcclRemoteError, dc.status->stop_peer, sig, 0, step, 0, 0);
        *s_fail = 1;
        break;
      }
    }
  }
  __syncthreads();
  return !*s_fail;
}

#endif
