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
 * call at most KCCL_LL_MAX_BYTES bytes.
 *
 * A kernel whose blocks hold threads that must not take part (a warp that
 * does other work and never reaches __syncthreads), or whose grid is larger
 * than KCCL_DEV_MAX_BLOCKS, calls the same all-reduce through a group:
 *
 *   kcclDevGroup g = {slot, barrier, threads, cancel};
 *   kcclDevAllReduceGroup(dc, g, data, count, kcclFloat32, kcclSum);  // threads [0, threads) call it
 *
 * The call then uses per-block state `slot` (0..KCCL_DEV_MAX_BLOCKS-1) in
 * place of blockIdx.x (slot s of every rank must make the same sequence of
 * calls; one block at a time per slot), meets at named barrier `barrier`
 * (1..15, with `threads` threads: a multiple of 32, at most KCCL_LL_THREADS;
 * the caller must not use that barrier meanwhile), and its waits also end
 * when *cancel (device memory the caller writes; NULL: never) is nonzero,
 * read every 64 polls: a kernel that gives up for its own reasons can take
 * its blocks out of a call whose peers will not come.  A cancelled call
 * returns an error and breaks the communicator (the ranks' calls on the slot
 * no longer pair up).
 *
 * All ranks' kernels must be resident at once (one GPU per rank, or several
 * ranks of one GPU under MPS with few enough blocks): a block waits for the
 * same block of every peer.  With several ranks on one GPU, two more rules
 * keep a late rank's own kernels (those before yours on its stream) able to
 * start, measured on the H200
 * (bench/gpu/residency.py): ask for the largest shared-memory carveout
 * (cudaFuncSetAttribute(my_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
 * 100)), or a kernel with more shared memory than your blocks' SMs are set
 * to cannot start beside them; and keep the blocks of all ranks but one
 * below the GPU's SM count, leaving a few SMs empty, for kernels that need
 * more registers or threads than an SM has left beside your blocks.
 *
 * How it works, by concept, in kccl_device/ (internal, as everything in that
 * folder: installed because this header includes it, not an API to include or
 * call; kccl.h, this file and kccl_launch.cuh are the only public headers):
 *   gpu_compat.h  every CUDA / HIP name KCCL's GPU code uses (kgpu*)
 *   gpu_status.h  the host-mapped record of a failed wait
 *   groups.cuh    the threads that make a call: the whole block, or a group
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
#include "kccl_device/gpu_compat.h"
#include "kccl_device/gpu_status.h"
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

/* The threads of a block that make a kcclDevAllReduceGroup call together. */
typedef struct {
  int slot;                        /* per-block state of the channel the call uses, 0..KCCL_DEV_MAX_BLOCKS-1 */
  int barrier;                     /* named barrier the group meets at, 1..15 */
  int threads;                     /* threads [0, threads) of the block call: a multiple of 32, <= KCCL_LL_THREADS */
  const volatile unsigned *cancel; /* nonzero: the call's waits give up (NULL: never) */
} kcclDevGroup;

/* ---------------------------------------------------------------- internals -- */
#include "kccl_device/groups.cuh"
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

/* kcclDevAllReduce made by the group g of the block's threads (see above):
 * threads [0, g.threads) call it, the others must not.  kcclInvalidArgument
 * for a group out of range (slot, barrier, threads); an error when cancelled.
 * data may be in global memory or in the block's shared memory (both calls
 * load it with plain loads, which may hit L1: data that other blocks of the
 * grid wrote during the kernel is best staged into shared memory first). */
template <int MaxRanks = KCCL_GPU_MAX_RANKS>
__device__ static __forceinline__ kcclResult_t kcclDevAllReduceGroup(const kcclDevComm &dc, const kcclDevGroup &g,
                                                                    void *data, int count, kcclDataType_t dt,
                                                                    kcclRedOp_t op) {
  return kccl_detail::dev_allreduce<MaxRanks, false>(dc, data, count, dt, op, nullptr, kccl_detail::NamedGroup{g});
}

#endif /* KCCL_DEVICE_CUH_ */
