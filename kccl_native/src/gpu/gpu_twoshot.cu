/* gpu_twoshot.cu - the two-shot all-reduce and the reduce-scatter: one kernel,
 * three stages per chunk (flags and scratch reuse: chunked_flags.cuh).
 *
 * Stage 1: each rank copies its portion b of every peer's segment into its
 *          own in-area;
 * stage 2: block b of the segment's owner reduces portion b over every rank's
 *          in-area, into its out-area and the user's buffer;
 * stage 3: (all-reduce only) each rank copies every other segment's portion b
 *          from its owner's out-area. */
#include "chunked_copy.cuh"
#include "chunked_flags.cuh"

/* The scratch layout is the same for every chunk of a call: segment s at
 * s * stride and block b's portion at [b * P, (b + 1) * P) of it, both from
 * the first (largest) chunk.  The reuse rules (chunked_flags.cuh) are per
 * block, so block b must touch the same scratch bytes in every step: with the
 * layout of the (smaller) last chunk, block b could overwrite what another
 * block of a peer, still a step behind, was reading. */
struct TsLayout {
  size_t piece_max; /* reduce-scatter: elements of one rank's segment a chunk holds */
  size_t stride;    /* elements from one segment's scratch to the next */
  size_t P;         /* elements of block b's portion of a segment */
};

__device__ static __forceinline__ TsLayout ts_layout(const TwoShot &a) {
  const int n = a.dc.nranks, G = gridDim.x;
  const size_t total = a.count;
  TsLayout L;
  L.piece_max = a.scatter ? (a.chunk_elems / n) / 16 * 16 : a.chunk_elems;
  const size_t S0 = a.scatter ? (total < L.piece_max ? total : L.piece_max)
                              : (((total < a.chunk_elems ? total : a.chunk_elems) + n - 1) / n + 15) / 16 * 16;
  L.stride = (S0 + 15) / 16 * 16;
  L.P = ((S0 + G - 1) / G + 15) / 16 * 16;
  return L;
}

/* One chunk, from user element o (per rank for reduce-scatter): segment s
 * covers user elements [useg(s), useg(s)+slen(s)) and scratch elements
 * [s*stride, ...). */
struct TsChunk {
  size_t o;
  size_t CE, S;    /* elements of the chunk, of a segment */
  size_t plo, phi; /* block b's portion of a segment, within S */
};

__device__ static __forceinline__ TsChunk ts_chunk(const TwoShot &a, const TsLayout &L, size_t o) {
  const int n = a.dc.nranks;
  const size_t total = a.count;
  TsChunk c;
  c.o = o;
  if (a.scatter) {
    c.S = total - o < L.piece_max ? total - o : L.piece_max;
    c.CE = c.S * n;
  } else {
    c.CE = total - o < a.chunk_elems ? total - o : a.chunk_elems;
    c.S = ((c.CE + n - 1) / n + 15) / 16 * 16;
  }
  const size_t b = blockIdx.x;
  c.plo = b * L.P < c.S ? b * L.P : c.S;
  c.phi = c.plo + L.P < c.S ? c.plo + L.P : c.S;
  return c;
}

/* Elements of segment s in this chunk (the all-reduce's last segments may be
 * short or empty). */
__device__ static __forceinline__ size_t seg_len(const TwoShot &a, const TsChunk &c, int s) {
  return a.scatter ? c.S : (c.CE > s * c.S ? (c.CE - s * c.S < c.S ? c.CE - s * c.S : c.S) : 0);
}

/* Block b's portion [lo, hi) of a segment of slen elements. */
__device__ static __forceinline__ void portion(const TsChunk &c, size_t slen, size_t *lo, size_t *hi) {
  *lo = c.plo < slen ? c.plo : slen;
  *hi = c.phi < slen ? c.phi : slen;
}

/* Stage 1: my portion b of every peer's segment into my in-area.  My own
 * segment stays where it is: only I reduce it, and stage 2 reads it from
 * the send buffer (2 / n of the traffic saved). */
__device__ static __forceinline__ void ts_stage1(const TwoShot &a, const TsLayout &L, const TsChunk &c) {
  const kcclDevComm &dc = a.dc;
  const int n = dc.nranks, me = dc.rank;
  const size_t es = a.es;
  char *in_area = dc.peer_base[me] + a.off_in;
  for (int s = 0; s < n; s++) {
    if (s == me) continue;
    size_t lo, hi;
    portion(c, seg_len(a, c, s), &lo, &hi);
    if (lo >= hi) continue;
    size_t ubase = a.scatter ? (size_t)s * a.count + c.o : c.o + (size_t)s * c.S;
    copy_range(in_area + (size_t)s * L.stride * es, a.send + ubase * es, lo * es, hi * es, false);
  }
}

/* Bytes [x, x+16) of segment `me` reduced over every rank's in-area in rank
 * order (this rank's own from `own`, its send buffer, which ends at `end`). */
__device__ static __forceinline__ uint4 reduce16(const TwoShot &a, size_t sbase, const char *own, bool own_vec,
                                                 size_t x, size_t end) {
  const kcclDevComm &dc = a.dc;
  const int n = dc.nranks, me = dc.rank;
  const kcclDataType_t dt = (kcclDataType_t)a.dt;
  const kcclRedOp_t op = (kcclRedOp_t)a.op;
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
               : own_vec && x + 16 <= end ? kgpu_ld_cg_v4(own + x)
                                          : load16(own, x, end);
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
  return r;
}

/* Stage 2: reduce segment `me`, portion b, over every rank's in-area (rank
 * order), into my out-area and the user's buffer. */
__device__ static __forceinline__ void ts_stage2(const TwoShot &a, const TsLayout &L, const TsChunk &c) {
  const kcclDevComm &dc = a.dc;
  const int me = dc.rank;
  const size_t es = a.es;
  size_t lo, hi;
  portion(c, seg_len(a, c, me), &lo, &hi);
  const size_t sbase = (size_t)me * L.stride * es;
  char *outp = dc.peer_base[me] + a.off_out + sbase;
  char *user = a.recv + (a.scatter ? c.o * es : (c.o + (size_t)me * c.S) * es);
  /* In place (send == recv) this thread reads own + x before it writes user + x, the same bytes. */
  const char *own = a.send + (a.scatter ? (size_t)me * a.count + c.o : c.o + (size_t)me * c.S) * es;
  const bool own_vec = (((uintptr_t)own) & 15) == 0;
  for (size_t x = lo * es + threadIdx.x * 16; x < hi * es; x += (size_t)blockDim.x * 16) {
    const uint4 r = reduce16(a, sbase, own, own_vec, x, hi * es);
    *(uint4 *)(outp + x) = r;
    store16(user, x, hi * es, r);
  }
}

/* Stage 3 (all-reduce): every other segment's portion b from its owner's out-area. */
__device__ static __forceinline__ void ts_stage3(const TwoShot &a, const TsLayout &L, const TsChunk &c) {
  const kcclDevComm &dc = a.dc;
  const int n = dc.nranks, me = dc.rank;
  const size_t es = a.es;
  for (int s = 0; s < n; s++) {
    if (s == me) continue;
    size_t lo, hi;
    portion(c, seg_len(a, c, s), &lo, &hi);
    if (lo >= hi) continue;
    const char *src = dc.peer_base[s] + a.off_out + (size_t)s * L.stride * es;
    char *dst = a.recv + (c.o + (size_t)s * c.S) * es;
    copy_range(dst, src, lo * es, hi * es, true);
  }
}

/* (768, 1): at most 80 registers, without spills (at 64
 * they spill in the inner loops); launched with shape.ts_threads threads. */
__global__ void __launch_bounds__(KCCL_GPU_MAX_CHUNK_THREADS, 1) k_twoshot(TwoShot a) {
  kgpu_pdl_wait();
  /* No kgpu_pdl_trigger: a successor launched with PDL (a one-shot call) then
   * starts only when this kernel ends, so at most one chunked kernel per rank
   * is resident and the block counts of kgpu_connect hold. */
  __shared__ uint32_t s_step;
  __shared__ volatile int s_fail;
  const kcclDevComm &dc = a.dc;
  if (threadIdx.x == 0) s_fail = 0;
  const RepLines rl = rep_lines(dc, a.rep);
  const TsLayout L = ts_layout(a);
  for (size_t o = 0; o < a.count;) {
    const TsChunk c = ts_chunk(a, L, o);
    const uint32_t step = next_step(dc, a.off_steps, &s_step);
    const uint64_t val = ((uint64_t)a.sig << 32) | step;
    ts_stage1(a, L, c);
    signal_peers(dc, a.off_flags, a.rep, rl, 0, val);
    if (!wait_peers(dc, a.off_flags, a.off_steps, a.rep, rl, 0, step, a.sig, -1, &s_fail)) break;
    ts_stage2(a, L, c);
    /* The flag-2 exchange is written out in each branch: with one copy before
     * the branch, ptxas (CUDA 13, sm_90) spills 96 bytes at the 80-register bound. */
    if (a.scatter) {
      /* Nobody reads the out-area; flag 2 only keeps the in-area reuse rule. */
      signal_peers(dc, a.off_flags, a.rep, rl, 1, val);
      if (!wait_peers(dc, a.off_flags, a.off_steps, a.rep, rl, 1, step, a.sig, -1, &s_fail)) break;
      o += c.S;
      continue;
    }
    signal_peers(dc, a.off_flags, a.rep, rl, 1, val);
    if (!wait_peers(dc, a.off_flags, a.off_steps, a.rep, rl, 1, step, a.sig, -1, &s_fail)) break;
    ts_stage3(a, L, c);
    __syncthreads();
    o += c.CE;
  }
}
