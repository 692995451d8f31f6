/* chunked_copy.cuh - the chunked kernels' data movement (gpu_twoshot.cu,
 * gpu_gather.cu): 16-byte loads and stores that stop at a buffer's end, and
 * the block-wide copy of a byte range (not installed). */
#ifndef KCCL_GPU_CHUNKED_COPY_CUH_
#define KCCL_GPU_CHUNKED_COPY_CUH_
#include "kernels.h"

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

#endif
