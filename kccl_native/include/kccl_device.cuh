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
 * How it works, by concept, in kccl_device/ (internal; included below):
 *   ll_lines.cuh  the LL protocol and line format ("Protocol", "Pull"),
 *                 encode/decode, loads and stores
 *   waits.cuh     bounded waits, polling, failure recording
 *   oneshot.cuh   one block's all-reduce (one hop, "Two hops", traces)
 *   entry.cuh     dtype/op dispatch and kcclDevAllReduce's body
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
#ifdef KGPU_HIP
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
  int pull;                                 /* 1: every rank is on this GPU (see "Pull", ll_lines.cuh) */
  int ll_hops;                              /* 2: blocks of one line per thread take two hops ("Two hops", oneshot.cuh) */
  uint64_t timeout_ns;                      /* 0: no time limit (the stop word still applies) */
  char *peer_base[KCCL_GPU_MAX_RANKS];      /* every rank's device buffer, mapped here (own too) */
  uint64_t ll_off[KCCL_CHANNELS];           /* offset of each channel's LL inbox in a buffer */
  uint32_t *epochs;                         /* this rank's [KCCL_CHANNELS][KCCL_DEV_MAX_BLOCKS] */
  int *fail_owner;                          /* device word: the first failing block claims it */
  kcclGpuStatus *status;                    /* device pointer of the host-mapped record */
} kcclDevComm;

/* ---------------------------------------------------------------- internals -- */
#include "kccl_device/ll_lines.cuh"
#include "kccl_device/waits.cuh"
#include "kccl_device/oneshot.cuh"
#include "kccl_device/entry.cuh"

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
