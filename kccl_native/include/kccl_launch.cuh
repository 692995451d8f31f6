/*
 * kccl_launch.cuh - launching kernels the way KCCL launches its own, for code whose
 * kernels share a stream with KCCL's collectives (KIE's GPU engine is one).
 *
 *   cudaError_t rc = kcclLaunch(my_kernel, grid, block, smem, stream, pdl, args...);
 *
 *   __global__ void my_kernel(...) {
 *     kcclDevPdlWait();      // before touching anything the previous kernel writes
 *     kcclDevPdlTrigger();   // then let the next kernel of the stream start launching
 *     ...
 *   }
 *
 * kcclLaunch is cudaLaunchKernelEx, with programmatic dependent launch (Hopper,
 * sm_90) when pdl != 0: the kernel may start while its predecessor on the stream
 * still runs, so it must call kcclDevPdlWait before reading what that kernel
 * writes.  Trigger only after your own wait, as KCCL's kernels do: then at most
 * two kernels of a stream are resident at once (the running one and its
 * successor), and a chain of early-launched kernels never holds the SMs that the
 * running one needs (with several ranks on one GPU under MPS that is a deadlock).
 * Below sm_90, and on HIP, the two device calls do nothing and pdl is ignored.
 * The result is the runtime's error code (hipError_t on HIP).
 */
#ifndef KCCL_LAUNCH_CUH_
#define KCCL_LAUNCH_CUH_

#include "kccl_device/gpu_compat.h"

template <typename... Params, typename... Args>
static inline kgpuError_t kcclLaunch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                     kgpuStream_t stream, int pdl, Args... args) {
  return kgpu_launch_ex(kernel, grid, block, smem, stream, pdl, args...);
}

__device__ static inline void kcclDevPdlWait(void) { kgpu_pdl_wait(); }
__device__ static inline void kcclDevPdlTrigger(void) { kgpu_pdl_trigger(); }

#endif /* KCCL_LAUNCH_CUH_ */
