/* kgpu.h - one rank's GPU state, shared by the CUDA files (not installed). */
#ifndef KCCL_KGPU_H_
#define KCCL_KGPU_H_
#include "../gpu_api.h"
#include "kccl_device.cuh"

#define KGPU_TS_MAX_BLOCKS 132 /* blocks of the two-shot / gather kernels, at most */
#define KGPU_ALIGN 256

/* Layout of every rank's exported buffer (offsets are the same on every rank). */
struct kgpu_layout {
  size_t ll[KCCL_CHANNELS]; /* LL inboxes */
  size_t epochs;            /* uint32 [KCCL_CHANNELS][KCCL_DEV_MAX_BLOCKS] */
  size_t steps;             /* uint32 [KGPU_TS_MAX_BLOCKS]: step counter per two-shot / gather block */
  size_t fail;              /* int: claimed by the first failing block */
  size_t hop;               /* uint64 [2]: flag-hop benchmark words */
  size_t flags;             /* uint64 [2 stages][KGPU_TS_MAX_BLOCKS][KCCL_GPU_MAX_RANKS], pushed by senders */
  size_t in, out;           /* two-shot scratch: inputs, reduced segments */
  size_t g[2];              /* gather halves */
  size_t total;
};

struct kgpu {
  int device;
  kgpu_shape shape;
  kgpu_layout lay;
  char *buf;
  char *peer[KCCL_GPU_MAX_RANKS];
  kcclGpuStatus *status_h, *status_d;
  kcclDevComm dc[KCCL_CHANNELS];
  uint64_t hop_base;
  const void *ok_ptr[8];
  size_t ok_len[8];
  int ok_next;
};

#define KGPU_CHECK(call)                                                                              \
  do {                                                                                                \
    kgpuError_t e_ = (call);                                                                          \
    if (e_ != kgpuSuccess)                                                                            \
      return kccl_err(kcclUnhandledCudaError, "%s failed: %s (%s:%d)", #call, kgpuGetErrorString(e_), \
                      __FILE__, __LINE__);                                                            \
  } while (0)

kcclResult_t kgpu_launch_error(const char *what);
/* Blocks per multiprocessor of the chunked kernels (the smaller of two-shot's
 * and gather's) and of the one-shot kernel used for nranks (gpu_kernels.cu). */
kgpuError_t kgpu_kernel_occupancy(int nranks, int *ts_per_sm, int *ll_per_sm);
#endif
