/*
 * kccl_device/groups.cuh - the threads that make one device-API call together,
 * as a policy the LL code is written against: which thread this is, how many
 * take part, the barrier they meet at, the slot of the channel's per-block
 * state the call uses, and whether the caller can cancel its waits.
 *
 *   WholeBlock   every thread of the block, __syncthreads(), slot blockIdx.x,
 *                never cancelled (kcclDevAllReduce; the library's kernels)
 *   NamedGroup   threads [0, threads) of the block, a named barrier, the
 *                slot the caller names, cancelled when the caller's word is
 *                nonzero (kcclDevAllReduceGroup: a kernel whose other warps do
 *                something else, e.g. a producer warp that must not be made to
 *                wait at __syncthreads)
 *
 * WholeBlock's members are the expressions the code used before the policy
 * existed, and its cancel check is a compile-time false, so the library's
 * kernels compile to what they were.
 *
 * Part of kccl_device.cuh, which defines kcclDevComm, kcclDevGroup and the
 * limits and includes this file; include that header, not this one.
 */
#ifndef KCCL_DEVICE_GROUPS_CUH_
#define KCCL_DEVICE_GROUPS_CUH_

namespace kccl_detail {

struct WholeBlock {
  static constexpr bool kCancellable = false;
  __device__ int tid() const { return (int)threadIdx.x; }
  __device__ int size() const { return (int)blockDim.x; }
  __device__ int slot() const { return (int)blockIdx.x; }
  __device__ void sync() const { __syncthreads(); }
  __device__ bool cancelled() const { return false; }
  __device__ bool valid() const { return blockIdx.x < KCCL_DEV_MAX_BLOCKS && blockDim.x <= KCCL_LL_THREADS; }
};

struct NamedGroup {
  static constexpr bool kCancellable = true;
  const kcclDevGroup &g;
  __device__ int tid() const { return (int)threadIdx.x; }
  __device__ int size() const { return g.threads; }
  __device__ int slot() const { return g.slot; }
  /* barrier.sync, not bar.sync: the non-.aligned form is defined when the
   * threads of a warp arrive from divergent paths (the waits before the
   * call's barriers are per thread). */
  __device__ void sync() const {
#if defined(__HIP_PLATFORM_AMD__) || defined(KCCL_USE_HIP)
    __syncthreads(); /* no named barriers: the group must be the whole block there */
#else
    asm volatile("barrier.sync %0, %1;" ::"r"(g.barrier), "r"(g.threads) : "memory");
#endif
  }
  __device__ bool cancelled() const { return g.cancel && *g.cancel != 0u; }
  __device__ bool valid() const {
#if defined(__HIP_PLATFORM_AMD__) || defined(KCCL_USE_HIP)
    if (g.threads != (int)blockDim.x) return false;
#endif
    return g.slot >= 0 && g.slot < KCCL_DEV_MAX_BLOCKS && g.threads >= 32 && g.threads <= KCCL_LL_THREADS &&
           g.threads % 32 == 0 && g.threads <= (int)blockDim.x && g.barrier >= 1 && g.barrier <= 15;
  }
};

}  // namespace kccl_detail

#endif /* KCCL_DEVICE_GROUPS_CUH_ */
