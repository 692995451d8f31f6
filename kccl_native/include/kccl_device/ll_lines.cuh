/*
 * kccl_device/ll_lines.cuh - LL lines: where a line lives (regions, pull/push slots),
 * the 8 data bytes of a line as floats (encode/decode, combine), and
 * unaligned-safe 8-byte loads and stores.
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
 * Part of kccl_device.cuh, which defines kcclDevComm and the limits and
 * includes this file; include that header, not this one.
 */
#ifndef KCCL_DEVICE_LL_LINES_CUH_
#define KCCL_DEVICE_LL_LINES_CUH_


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

/* This thread's input lines of the round starting at line `base` (line
 * base + tid + k * nt into mine[k]; tid, nt: the thread in its group and the
 * group's size), zero past the last. */
__device__ static inline void ll_load_round(uint32_t (&mine)[KCCL_LL_MAX_LPT][2], const char *in, uint32_t base,
                                            uint32_t lines, uint32_t nbytes, int tid, int nt) {
#pragma unroll
  for (int k = 0; k < KCCL_LL_MAX_LPT; k++) {
    const uint32_t l = base + (uint32_t)tid + (uint32_t)(k * nt);
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

}  // namespace kccl_detail

#endif /* KCCL_DEVICE_LL_LINES_CUH_ */
