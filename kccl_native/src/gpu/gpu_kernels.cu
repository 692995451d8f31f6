/* gpu_kernels.cu - the library's collective kernels and their launchers.
 *
 * one-shot all-reduce: the LL protocol of kccl_device.cuh (channel 0), one
 *   block per <= 8 KB slice: each rank pushes its slice into every peer's
 *   inbox and reduces what arrives in its own.  No flag, no barrier.
 * two-shot all-reduce / reduce-scatter / all-gather / broadcast: chunked
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
#include "kgpu.h"

using namespace kccl_detail;

/* ------------------------------------------------------------- one-shot ---- */

/* MAXR: 8 for communicators of up to 8 ranks (fewer registers, so more blocks
 * fit on an SM beside the peers' and the next call's), else KCCL_GPU_MAX_RANKS.
 * One kernel per (MAXR, data type, operation): the body stays small (see
 * ll_block); kcclAvg runs the kcclSum kernel with avg set. */
template <int MAXR, int DT, int OP>
__global__ void __launch_bounds__(KCCL_LL_THREADS) k_oneshot(kcclDevComm dc, const char *in, char *out,
                                                             size_t nbytes, uint32_t per_block, int avg,
                                                             uint32_t sig) {
  kgpu_pdl_wait();    /* everything below may read what the previous kernel wrote */
  kgpu_pdl_trigger(); /* after the wait: see kgpu_pdl_trigger */
  const size_t off = (size_t)blockIdx.x * per_block;
  const uint32_t nb = (uint32_t)(nbytes - off < per_block ? nbytes - off : per_block);
  ll_block<MAXR, DT, OP, false>(dc, blockIdx.x, in + off, out + off, nb, avg != 0, sig, nullptr);
}

typedef void (*oneshot_fn)(kcclDevComm, const char *, char *, size_t, uint32_t, int, uint32_t);

/* [MAXR 2 / 8 / 16][bf16, f16, f32][sum, prod, max, min].  2 ranks get their own
 * kernels: peer loops run to MAXR with a run-time rank count, which costs ~0.7 us
 * per call at 2 ranks in the 8-rank kernel (bench/gpu/ll_ladder.cu). */
#define KCCL_ONESHOT_OPS(M, D) {k_oneshot<M, D, kcclSum>, k_oneshot<M, D, kcclProd>, k_oneshot<M, D, kcclMax>, \
                                k_oneshot<M, D, kcclMin>}
#define KCCL_ONESHOT_TYPES(M) {KCCL_ONESHOT_OPS(M, kcclBfloat16), KCCL_ONESHOT_OPS(M, kcclFloat16), \
                               KCCL_ONESHOT_OPS(M, kcclFloat32)}
static const oneshot_fn oneshot_kernels[3][3][4] = {KCCL_ONESHOT_TYPES(2), KCCL_ONESHOT_TYPES(8),
                                                     KCCL_ONESHOT_TYPES(KCCL_GPU_MAX_RANKS)};
#undef KCCL_ONESHOT_TYPES
#undef KCCL_ONESHOT_OPS

static oneshot_fn oneshot_kernel(int nranks, int dtype, int op) {
  const int t = dtype == kcclBfloat16 ? 0 : dtype == kcclFloat16 ? 1 : 2;
  return oneshot_kernels[nranks <= 2 ? 0 : nranks <= 8 ? 1 : 2][t][op == kcclAvg ? kcclSum : op];
}

/* ------------------------------------------------ flags of the chunked path -- */

__device__ static inline uint64_t *flag_slot(char *base, size_t off, int stage, int block, int src) {
  return (uint64_t *)(base + off) + ((size_t)stage * KGPU_TS_MAX_BLOCKS + block) * KCCL_GPU_MAX_RANKS + src;
}

/* How the flags are reached.  Flag replicas: where the tables are (the same
 * offsets in every rank's buffer) and whether to use them (on); the flags
 * region above is used as without replicas.  gpu_scope: every rank runs on
 * this GPU, so signals and waits order at GPU scope, not system scope (a
 * system-scope fence also waits for the writes to be visible beyond the GPU,
 * which costs the 64 MB call a few percent). */
struct Replicas {
  size_t off_pool, off_tab, off_map;
  int on;
  int gpu_scope;
};

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

/* --------------------------------------------------- 16-byte data helpers -- */

/* Bytes [off, off+16) of p, zero past n; one vector load when aligned and whole. */
__device__ static inline uint4 load16(const char *p, size_t off, size_t n) {
  if (off + 16 <= n && (((uintptr_t)(p + off)) & 15) == 0) return *(const uint4 *)(p + off);
  uint32_t w[4] = {0, 0, 0, 0};
  for (int i = 0; i < 16 && off + i < n; i++) w[i >> 2] |= (uint32_t)(uint8_t)p[off + i] << (8 * (i & 3));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ static inline void store16(char *p, size_t off, size_t n, uint4 v) {
  if (off + 16 <= n && (((uintptr_t)(p + off)) & 15) == 0) {
    *(uint4 *)(p + off) = v;
    return;
  }
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
  for (int i = 0; i < 16 && off + i < n; i++) p[off + i] = (char)(w[i >> 2] >> (8 * (i & 3)));
}

/* Block-wide copy of bytes [lo, hi) from src (another rank's scratch when
 * remote: loaded past L1) to dst.  Four 16-byte loads per thread are issued
 * before their stores: one outstanding load per thread leaves HBM idle when
 * few blocks run (bandwidth = bytes in flight / latency). */
#define KCCL_COPY_UNROLL 4
__device__ static inline void copy_range(char *dst, const char *src, size_t lo, size_t hi, bool src_remote) {
  const size_t stride = (size_t)blockDim.x * 16;
  size_t o = lo + (size_t)threadIdx.x * 16;
  for (; o + (KCCL_COPY_UNROLL - 1) * stride < hi; o += KCCL_COPY_UNROLL * stride) {
    uint4 v[KCCL_COPY_UNROLL];
#pragma unroll
    for (int j = 0; j < KCCL_COPY_UNROLL; j++)
      v[j] = src_remote ? kgpu_ld_cg_v4(src + o + j * stride) : load16(src, o + j * stride, hi);
#pragma unroll
    for (int j = 0; j < KCCL_COPY_UNROLL; j++) store16(dst, o + j * stride, hi, v[j]);
  }
  for (; o < hi; o += stride) store16(dst, o, hi, src_remote ? kgpu_ld_cg_v4(src + o) : load16(src, o, hi));
}

/* ---------------------------------------------------- two-shot / scatter -- */

struct TwoShot {
  kcclDevComm dc;
  size_t off_in, off_out, off_flags, off_steps;
  const char *send;
  char *recv;
  size_t count;       /* all-reduce: elements; reduce-scatter: elements per rank */
  size_t chunk_elems; /* scratch capacity in elements */
  int dt, op, es, scatter;
  uint32_t sig;
  Replicas rep;
};

/* (768, 1), as (256, 3) before it: at most 80 registers, without spills (at 64
 * they spill in the inner loops); launched with shape.ts_threads threads. */
__global__ void __launch_bounds__(KCCL_GPU_MAX_CHUNK_THREADS, 1) k_twoshot(TwoShot a) {
  kgpu_pdl_wait();
  /* No kgpu_pdl_trigger: a successor launched with PDL (a one-shot call) then
   * starts only when this kernel ends, so at most one chunked kernel per rank
   * is resident and the block counts of kgpu_connect hold. */
  __shared__ uint32_t s_step;
  __shared__ volatile int s_fail;
  const kcclDevComm &dc = a.dc;
  const int n = dc.nranks, me = dc.rank, G = gridDim.x, b = blockIdx.x;
  const kcclDataType_t dt = (kcclDataType_t)a.dt;
  const kcclRedOp_t op = (kcclRedOp_t)a.op;
  const size_t es = a.es;
  if (threadIdx.x == 0) s_fail = 0;
  char *in_area = dc.peer_base[me] + a.off_in;
  const size_t total = a.count; /* elements (per rank for reduce-scatter) */
  const size_t piece_max = a.scatter ? (a.chunk_elems / n) / 16 * 16 : a.chunk_elems;
  const RepLines rl = rep_lines(dc, a.rep);

  /* The scratch layout is the same for every chunk of a call: segment s at
   * s * stride and block b's portion at [b * P, (b + 1) * P) of it, both from
   * the first (largest) chunk.  The reuse rules above are per block, so block
   * b must touch the same scratch bytes in every step: with the layout of the
   * (smaller) last chunk, block b could overwrite what another block of a
   * peer, still a step behind, was reading. */
  const size_t S0 = a.scatter ? (total < piece_max ? total : piece_max)
                              : (((total < a.chunk_elems ? total : a.chunk_elems) + n - 1) / n + 15) / 16 * 16;
  const size_t stride = (S0 + 15) / 16 * 16;
  const size_t P = ((S0 + G - 1) / G + 15) / 16 * 16; /* block b's portion of a segment */
  for (size_t o = 0; o < total;) {
    /* This chunk: segment s covers user elements [useg(s), useg(s)+slen(s)) and
     * scratch elements [s*stride, ...). */
    size_t CE, S;
    if (a.scatter) {
      S = total - o < piece_max ? total - o : piece_max;
      CE = S * n;
    } else {
      CE = total - o < a.chunk_elems ? total - o : a.chunk_elems;
      S = ((CE + n - 1) / n + 15) / 16 * 16;
    }
    const size_t plo = (size_t)b * P < S ? (size_t)b * P : S, phi = plo + P < S ? plo + P : S;
    const uint32_t step = next_step(dc, a.off_steps, &s_step);
    const uint64_t val = ((uint64_t)a.sig << 32) | step;

    /* Stage 1: my portion b of every peer's segment into my in-area.  My own
     * segment stays where it is: only I reduce it, and stage 2 reads it from
     * the send buffer (2 / n of the traffic saved). */
    for (int s = 0; s < n; s++) {
      if (s == me) continue;
      size_t slen = a.scatter ? S : (CE > s * S ? (CE - s * S < S ? CE - s * S : S) : 0);
      size_t lo = plo < slen ? plo : slen, hi = phi < slen ? phi : slen;
      if (lo >= hi) continue;
      size_t ubase = a.scatter ? (size_t)s * a.count + o : o + (size_t)s * S;
      copy_range(in_area + (size_t)s * stride * es, a.send + ubase * es, lo * es, hi * es, false);
    }
    signal_peers(dc, a.off_flags, a.rep, rl, 0, val);
    if (!wait_peers(dc, a.off_flags, a.off_steps, a.rep, rl, 0, step, a.sig, -1, &s_fail)) break;

    /* Stage 2: reduce segment `me`, portion b, over every rank's in-area (rank order). */
    {
      size_t slen = a.scatter ? S : (CE > me * S ? (CE - me * S < S ? CE - me * S : S) : 0);
      size_t lo = plo < slen ? plo : slen, hi = phi < slen ? phi : slen;
      const size_t sbase = (size_t)me * stride * es;
      char *outp = dc.peer_base[me] + a.off_out + sbase;
      char *user = a.recv + (a.scatter ? o * es : (o + (size_t)me * S) * es);
      /* In place (send == recv) this thread reads own + x before it writes user + x, the same bytes. */
      const char *own = a.send + (a.scatter ? (size_t)me * a.count + o : o + (size_t)me * S) * es;
      const bool own_vec = (((uintptr_t)own) & 15) == 0;
      for (size_t x = lo * es + threadIdx.x * 16; x < hi * es; x += (size_t)blockDim.x * 16) {
        /* 8 slots with constant indices (registers); float32 uses slots 0-1 and 4-5.
         * Four ranks' 16 bytes are loaded before any is used: 4 loads in flight, not one
         * (groups of 4 keep the registers in bounds; rank order is kept). */
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int g0 = 0; g0 < n; g0 += 4) {
          uint4 u[4];
#pragma unroll
          for (int j = 0; j < 4; j++)
            if (g0 + j < n)
              u[j] = g0 + j != me ? kgpu_ld_cg_v4(dc.peer_base[g0 + j] + a.off_in + sbase + x)
                     : own_vec && x + 16 <= hi * es ? kgpu_ld_cg_v4(own + x)
                                                    : load16(own, x, hi * es);
#pragma unroll
          for (int j = 0; j < 4; j++) {
            if (g0 + j >= n) break;
            decode(u[j].x, u[j].y, dt, v);
            decode(u[j].z, u[j].w, dt, v + 4);
#pragma unroll
            for (int k = 0; k < 8; k++) acc[k] = g0 + j == 0 ? v[k] : combine(acc[k], v[k], op);
          }
        }
        if (op == kcclAvg) {
#pragma unroll
          for (int k = 0; k < 8; k++) acc[k] /= (float)n;
        }
        uint4 r;
        encode(acc, dt, &r.x, &r.y);
        encode(acc + 4, dt, &r.z, &r.w);
        *(uint4 *)(outp + x) = r;
        store16(user, x, hi * es, r);
      }
    }
    if (a.scatter) {
      /* Nobody reads the out-area; flag 2 only keeps the in-area reuse rule. */
      signal_peers(dc, a.off_flags, a.rep, rl, 1, val);
      if (!wait_peers(dc, a.off_flags, a.off_steps, a.rep, rl, 1, step, a.sig, -1, &s_fail)) break;
      o += S;
      continue;
    }
    signal_peers(dc, a.off_flags, a.rep, rl, 1, val);
    if (!wait_peers(dc, a.off_flags, a.off_steps, a.rep, rl, 1, step, a.sig, -1, &s_fail)) break;

    /* Stage 3: every other segment's portion b from its owner's out-area. */
    for (int s = 0; s < n; s++) {
      if (s == me) continue;
      size_t slen = CE > s * S ? (CE - s * S < S ? CE - s * S : S) : 0;
      size_t lo = plo < slen ? plo : slen, hi = phi < slen ? phi : slen;
      if (lo >= hi) continue;
      const char *src = dc.peer_base[s] + a.off_out + (size_t)s * stride * es;
      char *dst = a.recv + (o + (size_t)s * S) * es;
      copy_range(dst, src, lo * es, hi * es, true);
    }
    __syncthreads();
    o += CE;
  }
}

/* ---------------------------------------------------- all-gather / bcast -- */

struct Gather {
  kcclDevComm dc;
  size_t off_g0, off_g1, off_flags, off_steps;
  const char *send;
  char *recv;
  size_t bytes;       /* per rank */
  size_t chunk_bytes;
  int root;           /* < 0: all-gather */
  uint32_t sig;
  Replicas rep;
};

__global__ void __launch_bounds__(KCCL_GPU_MAX_CHUNK_THREADS, 1) k_gather(Gather a) {
  kgpu_pdl_wait();
  /* No kgpu_pdl_trigger: a successor launched with PDL (a one-shot call) then
   * starts only when this kernel ends, so at most one chunked kernel per rank
   * is resident and the block counts of kgpu_connect hold. */
  __shared__ uint32_t s_step;
  __shared__ volatile int s_fail;
  const kcclDevComm &dc = a.dc;
  const int n = dc.nranks, me = dc.rank, G = gridDim.x, b = blockIdx.x;
  if (threadIdx.x == 0) s_fail = 0;
  const bool bcast = a.root >= 0;
  const bool publish = !bcast || me == a.root;
  const RepLines rl = rep_lines(dc, a.rep);
  /* Block b's portion of every chunk comes from the first (largest) one: see k_twoshot. */
  const size_t cb0 = a.bytes < a.chunk_bytes ? a.bytes : a.chunk_bytes;
  const size_t P = ((cb0 + G - 1) / G + 15) / 16 * 16;
  for (size_t o = 0; o < a.bytes || (o == 0 && a.bytes == 0);) {
    const size_t cb = a.bytes - o < a.chunk_bytes ? a.bytes - o : a.chunk_bytes;
    const size_t lo = (size_t)b * P < cb ? (size_t)b * P : cb, hi = lo + P < cb ? lo + P : cb;
    const uint32_t step = next_step(dc, a.off_steps, &s_step);
    const size_t half = (step & 1) ? a.off_g1 : a.off_g0;
    const uint64_t val = ((uint64_t)a.sig << 32) | step;
    char *my_recv = a.recv + (bcast ? 0 : (size_t)me * a.bytes);

    if (publish && lo < hi) copy_range(dc.peer_base[me] + half - o, a.send, o + lo, o + hi, false);
    signal_peers(dc, a.off_flags, a.rep, rl, 0, val);
    if (!wait_peers(dc, a.off_flags, a.off_steps, a.rep, rl, 0, step, a.sig, bcast && me != a.root ? a.root : -1,
                    &s_fail))
      break;
    if (lo < hi) {
      if (!bcast) {
        for (int p = 0; p < n; p++) {
          if (p == me) continue;
          copy_range(a.recv + (size_t)p * a.bytes + o, dc.peer_base[p] + half, lo, hi, true);
        }
        if (a.send != my_recv) copy_range(my_recv, a.send, o + lo, o + hi, false);
      } else if (me != a.root) {
        copy_range(a.recv + o, dc.peer_base[a.root] + half, lo, hi, true);
      } else if (a.send != a.recv) {
        copy_range(a.recv, a.send, o + lo, o + hi, false);
      }
    }
    __syncthreads();
    if (a.bytes == 0) break;
    o += cb;
  }
}

/* -------------------------------------------------------------- launchers -- */

static unsigned ts_grid(const kgpu *g) { return (unsigned)g->shape.ts_blocks; }

/* The chunked kernels launch without PDL: with it, the 8-rank two-shot
 * benchmark under MPS timed out at the first eager call after a graph capture
 * (cause unknown), and their calls are long enough that PDL gains little. */
#define KGPU_CHUNKED_PDL 0

static Replicas replicas(const kgpu *g) {
  Replicas r;
  r.off_pool = g->lay.l2pool;
  r.off_tab = g->lay.l2tab;
  r.off_map = g->lay.l2map;
  r.on = g->rep_on;
  r.gpu_scope = g->one_gpu;
  return r;
}

/* Why the kernels that wait for their peers ask for the largest
 * shared-memory carveout (KCCL_GPU_CARVEOUT, default 100; kgpu_preload_kernels).
 * An SM's L1 / shared-memory split is set for the blocks it holds; a kernel
 * that wants a larger shared part than an SM is set to cannot start there
 * while those blocks run.  A late rank's own kernel before a collective
 * (torch's, say) would then find no SM while its peers' blocks wait on all of
 * them, and everyone times out (bench/gpu/residency.py --foreign 2).  With the
 * largest shared part asked for, other kernels' shared memory fits beside
 * these blocks; these kernels read remote data past L1 and need little of it. */

/* Loads every kernel of this file now.  With lazy loading (CUDA's default
 * since 12.2) a kernel's code is loaded at its first launch, and the CUDA
 * programming guide warns that a load may need a context synchronization, so
 * kernels that wait for each other can deadlock.  Here a rank's first launch
 * would wait while its peers' kernels spin waiting for it (until
 * KCCL_TIMEOUT_MS).  Getting a kernel's attributes loads it. */
kgpuError_t kgpu_preload_kernels(int carveout) {
  kgpuError_t e;
  for (int m = 0; m < 3; m++)
    for (int t = 0; t < 3; t++)
      for (int o = 0; o < 4; o++)
        if ((e = kgpu_load_waiting_kernel((const void *)oneshot_kernels[m][t][o], carveout)) != kgpuSuccess)
          return e;
  if ((e = kgpu_load_waiting_kernel((const void *)k_twoshot, carveout)) != kgpuSuccess) return e;
  return kgpu_load_waiting_kernel((const void *)k_gather, carveout);
}

kgpuError_t kgpu_kernel_occupancy(int nranks, int8_t *ts_per_sm, int *ll_per_sm) {
  int a = 0, b = 0, c = 0;
  kgpuError_t e;
  for (int w = 1; w <= KCCL_GPU_MAX_CHUNK_THREADS / 32; w++) {
    if ((e = kgpuOccupancyMaxActiveBlocksPerMultiprocessor(&a, k_twoshot, 32 * w, 0)) != kgpuSuccess ||
        (e = kgpuOccupancyMaxActiveBlocksPerMultiprocessor(&b, k_gather, 32 * w, 0)) != kgpuSuccess)
      return e;
    a = a < b ? a : b;
    ts_per_sm[w - 1] = (int8_t)(a > 127 ? 127 : a);
  }
  if ((e = kgpuOccupancyMaxActiveBlocksPerMultiprocessor(&c, oneshot_kernel(nranks, kcclFloat32, kcclSum),
                                                         KCCL_LL_THREADS, 0)) != kgpuSuccess)
    return e;
  *ll_per_sm = c;
  return kgpuSuccess;
}

static kcclResult_t launched(kgpuError_t e, const char *what) {
  if (e != kgpuSuccess) {
    kgpuGetLastError();
    return kccl_err(kcclUnhandledCudaError, "launching the %s kernel: %s", what, kgpuGetErrorString(e));
  }
  return kgpu_launch_error(what);
}

/* count: elements (per rank for reduce-scatter); chunk_elems: scratch capacity in elements. */
static kcclResult_t launch_twoshot(kgpu *g, const void *send, void *recv, size_t count, size_t chunk_elems,
                                   int dtype, int op, int scatter, uint32_t sig, kgpuStream_t st, const char *what) {
  TwoShot a;
  a.dc = g->dc[0];
  a.off_in = g->lay.in;
  a.off_out = g->lay.out;
  a.off_flags = g->lay.flags;
  a.off_steps = g->lay.steps;
  a.send = (const char *)send;
  a.recv = (char *)recv;
  a.count = count;
  a.chunk_elems = chunk_elems;
  a.dt = dtype;
  a.op = op;
  a.es = dtype == kcclFloat32 ? 4 : 2;
  a.scatter = scatter;
  a.sig = sig;
  a.rep = replicas(g);
  g->ll_prev_grid = 0;
  return launched(kgpu_launch(k_twoshot, ts_grid(g), (unsigned)g->shape.ts_threads, st, KGPU_CHUNKED_PDL, a), what);
}

extern "C" kcclResult_t kgpu_allreduce(struct kgpu *g, const void *send, void *recv, size_t count, int dtype,
                                       int op, int twoshot, uint32_t sig, void *stream) {
  if (dtype != kcclFloat32 && dtype != kcclFloat16 && dtype != kcclBfloat16)
    return kccl_err(kcclInvalidArgument, "the GPU all-reduce takes float32, float16 or bfloat16 (dtype %d)", dtype);
  if (count == 0) return kcclSuccess;
  const size_t es = dtype == kcclFloat32 ? 4 : 2, nbytes = count * es;
  kgpuStream_t st = (kgpuStream_t)stream;
  if (!twoshot && nbytes <= kgpu_oneshot_max_bytes(g)) {
    /* One line per thread (KCCL_GPU_LL_THREADS x 8 bytes per block) until the
     * blocks run out, then more lines per thread.  256 by default: 128 was
     * slower across processes at 8 KB, and slower from 64 KB on, where the
     * blocks run out and each thread carries more lines. */
    const unsigned threads = (unsigned)g->shape.ll_threads;
    size_t blocks = (nbytes + threads * 8 - 1) / (threads * 8);
    if (blocks > (size_t)g->shape.ll_blocks) blocks = (size_t)g->shape.ll_blocks;
    size_t per = (nbytes + blocks - 1) / blocks;
    per = (per + 7) / 8 * 8;
    blocks = (nbytes + per - 1) / per;
    /* With PDL this kernel may be resident while the previous one-shot call
     * still runs (it triggers at once): both grids must fit the budget
     * (gpu_runtime.cu), else this one launches plainly, after it. */
    const int pdl = g->shape.pdl && (int)blocks + g->ll_prev_grid <= g->shape.ll_room;
    kgpuError_t e = kgpu_launch(oneshot_kernel(g->shape.nranks, dtype, op), (unsigned)blocks, threads, st,
                                pdl, g->dc[0], (const char *)send, (char *)recv, nbytes, (uint32_t)per,
                                op == kcclAvg ? 1 : 0, sig);
    g->ll_prev_grid = (int)blocks;
    return launched(e, "one-shot all-reduce");
  }
  /* Whole 16-element units per rank segment. */
  const size_t unit = 16 * (size_t)g->shape.nranks;
  return launch_twoshot(g, send, recv, count, g->shape.chunk_bytes / es / unit * unit, dtype, op, 0, sig, st,
                        "two-shot all-reduce");
}

extern "C" kcclResult_t kgpu_reduce_scatter(struct kgpu *g, const void *send, void *recv, size_t recvcount,
                                            int dtype, int op, uint32_t sig, void *stream) {
  if (dtype != kcclFloat32 && dtype != kcclFloat16 && dtype != kcclBfloat16)
    return kccl_err(kcclInvalidArgument, "the GPU reduce-scatter takes float32, float16 or bfloat16 (dtype %d)",
                    dtype);
  if (recvcount == 0) return kcclSuccess;
  const size_t es = dtype == kcclFloat32 ? 4 : 2;
  return launch_twoshot(g, send, recv, recvcount, g->shape.chunk_bytes / es, dtype, op, 1, sig,
                        (kgpuStream_t)stream, "reduce-scatter");
}

extern "C" kcclResult_t kgpu_gather(struct kgpu *g, const void *send, void *recv, size_t bytes, int root,
                                    uint32_t sig, void *stream) {
  Gather a;
  a.dc = g->dc[0];
  a.off_g0 = g->lay.g[0];
  a.off_g1 = g->lay.g[1];
  a.off_flags = g->lay.flags;
  a.off_steps = g->lay.steps;
  a.send = (const char *)send;
  a.recv = (char *)recv;
  a.bytes = bytes;
  a.chunk_bytes = g->shape.chunk_bytes / 16 * 16;
  a.root = root;
  a.sig = sig;
  a.rep = replicas(g);
  g->ll_prev_grid = 0;
  return launched(kgpu_launch(k_gather, ts_grid(g), (unsigned)g->shape.ts_threads, (kgpuStream_t)stream, KGPU_CHUNKED_PDL, a),
                  root < 0 ? "all-gather" : "broadcast");
}
