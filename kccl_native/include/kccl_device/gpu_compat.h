/*
 * kccl_device/gpu_compat.h - the only place where KCCL's GPU code names CUDA (or HIP).
 * Internal, as all of kccl_device/: installed because kccl_device.cuh includes it,
 * not an API (its kgpu* names may change in any release).  Code outside KCCL that
 * launches kernels as KCCL does (programmatic dependent launch) uses kccl_launch.cuh,
 * the public names of kgpu_launch_ex / kgpu_pdl_wait / kgpu_pdl_trigger.
 *
 * Everything vendor-specific that the GPU transport uses is spelled here: the
 * runtime calls (kgpu*), the handle types, and the few memory operations whose
 * ordering the protocols rely on (written as inline PTX on CUDA and as clang
 * atomic builtins on HIP).  The .cu files use only these names plus the
 * kernel-language subset CUDA and HIP share (__global__, threadIdx, ...).
 *
 * The HIP branch is compiled, never run: tests/test_hip_build.py builds the GPU
 * sources with it through hipcc (Debian's ROCm 5.2 / clang 15 in CI) for gfx90a
 * and gfx940; that clang does not know gfx942 (MI300X), and no AMD GPU has run it.
 */
#ifndef KCCL_GPU_COMPAT_H_
#define KCCL_GPU_COMPAT_H_

#include <stdint.h>

/* clang defines __HIP__ whenever it compiles HIP (hipcc, -x hip); ROCm's own
 * __HIP_PLATFORM_AMD__ is defined by hip_runtime.h itself (hipcc 5.x does not
 * pass it), so it cannot choose the branch alone. */
#if defined(__HIP__) || defined(__HIP_PLATFORM_AMD__) || defined(KCCL_USE_HIP)
#define KGPU_HIP 1
#endif

#ifdef KGPU_HIP
/* ------------------------------------------------------------------ HIP ----- */
#include <hip/hip_runtime.h>
typedef hipError_t kgpuError_t;
typedef hipStream_t kgpuStream_t;
typedef hipEvent_t kgpuEvent_t;
typedef hipIpcMemHandle_t kgpuIpcMemHandle_t;
#define kgpuSuccess hipSuccess
#define kgpuGetErrorString hipGetErrorString
#define kgpuGetLastError hipGetLastError
#define kgpuGetDevice hipGetDevice
#define kgpuSetDevice hipSetDevice
#define kgpuGetDeviceCount hipGetDeviceCount
#define kgpuDeviceGetPCIBusId hipDeviceGetPCIBusId
#define kgpuDeviceGetAttribute hipDeviceGetAttribute
#define kgpuOccupancyMaxActiveBlocksPerMultiprocessor hipOccupancyMaxActiveBlocksPerMultiprocessor
#define kgpuFuncAttributes hipFuncAttributes
#define kgpuFuncGetAttributes(attr, kernel) hipFuncGetAttributes((attr), (const void *)(kernel))
#define kgpuFuncSetCarveout(kernel, pct) \
  hipFuncSetAttribute((const void *)(kernel), hipFuncAttributePreferredSharedMemoryCarveout, (pct))
#define kgpuDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define kgpuDevAttrClockRate hipDeviceAttributeClockRate
#define kgpuMalloc hipMalloc
#define kgpuFree hipFree
#define kgpuMemset hipMemset
#define kgpuMemsetAsync hipMemsetAsync
#define kgpuMemcpy hipMemcpy
#define kgpuMemcpyAsync hipMemcpyAsync
#define kgpuMemcpyDefault hipMemcpyDefault
#define kgpuHostAlloc hipHostMalloc
#define kgpuHostAllocMapped hipHostMallocMapped
#define kgpuFreeHost hipHostFree
#define kgpuHostGetDevicePointer hipHostGetDevicePointer
#define kgpuIpcGetMemHandle hipIpcGetMemHandle
#define kgpuIpcOpenMemHandle hipIpcOpenMemHandle
#define kgpuIpcCloseMemHandle hipIpcCloseMemHandle
#define kgpuIpcMemLazyEnablePeerAccess hipIpcMemLazyEnablePeerAccess
#define kgpuDeviceSynchronize hipDeviceSynchronize
#define kgpuStreamSynchronize hipStreamSynchronize
#define kgpuEventCreate hipEventCreate
#define kgpuEventRecord hipEventRecord
#define kgpuEventSynchronize hipEventSynchronize
#define kgpuEventElapsedTime hipEventElapsedTime
#define kgpuEventDestroy hipEventDestroy
#define kgpuEventCreateWithFlags hipEventCreateWithFlags
#define kgpuEventDisableTiming hipEventDisableTiming
#define kgpuStreamCreateWithFlags hipStreamCreateWithFlags
#define kgpuStreamNonBlocking hipStreamNonBlocking
#define kgpuStreamWaitEvent(st, ev) hipStreamWaitEvent((st), (ev), 0)
#define kgpuStreamDestroy hipStreamDestroy
#define kgpuPointerGetAttributes hipPointerGetAttributes
typedef hipPointerAttribute_t kgpuPointerAttributes;
/* ROCm 6 names the memory type `type`, as CUDA does; ROCm 5.0-5.4 name it
 * memoryType (5.5-5.7 have both). */
#if HIP_VERSION_MAJOR >= 6
#define KGPU_PTR_IS_DEVICE(a) ((a).type == hipMemoryTypeDevice)
#else
#define KGPU_PTR_IS_DEVICE(a) ((a).memoryType == hipMemoryTypeDevice)
#endif
#define KGPU_PTR_DEVICE(a) ((a).device)
#define KGPU_WARP 64

#ifdef __HIPCC__
/* clang's vector of four u32: one 16-byte access (uint4 is a struct, which
 * the nontemporal builtins do not take). */
typedef uint32_t kgpu_v4u32 __attribute__((ext_vector_type(4)));
/* One 16-byte volatile store/load: volatile, as PTX's .volatile, so that a
 * poll is never merged or hoisted out of its loop; each 8-byte half is
 * single-copy atomic, as in the PTX version. */
__device__ static inline void kgpu_st_volatile_v4(uint32_t *p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  kgpu_v4u32 v = {a, b, c, d};
  *(volatile kgpu_v4u32 *)p = v;
}
__device__ static inline void kgpu_ld_volatile_v4(const uint32_t *p, uint32_t *a, uint32_t *b, uint32_t *c,
                                                  uint32_t *d) {
  kgpu_v4u32 v = *(const volatile kgpu_v4u32 *)p;
  *a = v.x; *b = v.y; *c = v.z; *d = v.w;
}
/* 16-byte load that bypasses the (non-coherent) L1: data another process wrote. */
__device__ static inline uint4 kgpu_ld_cg_v4(const void *p) {
  kgpu_v4u32 v = __builtin_nontemporal_load((const kgpu_v4u32 *)p);
  return make_uint4(v.x, v.y, v.z, v.w);
}
#define kgpu_st_weak_v4 kgpu_st_volatile_v4
#define kgpu_ld_weak_v4 kgpu_ld_volatile_v4
__device__ static inline void kgpu_st_release_sys_u64(uint64_t *p, uint64_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
__device__ static inline uint64_t kgpu_ld_acquire_sys_u64(const uint64_t *p) {
  return __hip_atomic_load((uint64_t *)p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
__device__ static inline void kgpu_st_relaxed_sys_u64(uint64_t *p, uint64_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
__device__ static inline uint64_t kgpu_ld_cg_u64(const void *p) { return __builtin_nontemporal_load((const uint64_t *)p); }
__device__ static inline uint32_t kgpu_ld_cg_u8(const void *p) { return __builtin_nontemporal_load((const uint8_t *)p); }
__device__ static inline unsigned kgpu_smid(void) { return __smid(); }
__device__ static inline uint64_t kgpu_opaque_u64(uint64_t x) { asm volatile("" : "+v"(x)); return x; }
__device__ static inline uint32_t kgpu_opaque_u32(uint32_t x) { asm volatile("" : "+v"(x)); return x; }
__device__ static inline long long kgpu_clock64(void) { return clock64(); }
__device__ static inline uint32_t kgpu_ld_volatile_u32(const volatile uint32_t *p) { return *p; }
/* A warp vote over the lanes in `mask` (every one of them must take part). */
typedef uint64_t kgpu_lanes_t;
__device__ static inline kgpu_lanes_t kgpu_lane_mask(int lanes) {
  return lanes >= 64 ? ~0ull : ((1ull << lanes) - 1);
}
__device__ static inline bool kgpu_any(kgpu_lanes_t mask, bool pred) { (void)mask; return __any(pred); }
__device__ static inline void kgpu_st_volatile_u64(uint64_t *p, uint64_t v) { *(volatile uint64_t *)p = v; }
__device__ static inline uint64_t kgpu_ld_volatile_u64(const uint64_t *p) { return *(const volatile uint64_t *)p; }
__device__ static inline void kgpu_st_relaxed_gpu_u64(uint64_t *p, uint64_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ static inline uint64_t kgpu_ld_relaxed_gpu_u64(const uint64_t *p) {
  return __hip_atomic_load((uint64_t *)p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ static inline void kgpu_fence_system(void) { __threadfence_system(); }
__device__ static inline void kgpu_fence_gpu(void) { __threadfence(); }
__device__ static inline void kgpu_st_release_gpu_u64(uint64_t *p, uint64_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ static inline uint64_t kgpu_ld_acquire_gpu_u64(const uint64_t *p) {
  return __hip_atomic_load((uint64_t *)p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
}
/* wall_clock64 taken to count at 100 MHz, MI300X's rate (the device reports its own as
 * hipDeviceAttributeWallClockRate); ROCm 5.x declares it in the device pass only. */
__device__ static inline uint64_t kgpu_time_ns(void) {
#ifdef __HIP_DEVICE_COMPILE__
  return (uint64_t)wall_clock64() * 10;
#else
  return 0;
#endif
}
__device__ static inline void kgpu_pause(void) { __builtin_amdgcn_s_sleep(1); }
__device__ static inline void kgpu_pdl_wait(void) {}
__device__ static inline void kgpu_pdl_trigger(void) {}
template <typename... Params, typename... Args>
static inline kgpuError_t kgpu_launch_ex(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                         kgpuStream_t st, int pdl, Args... args) {
  (void)pdl;
  hipLaunchKernelGGL(kernel, grid, block, smem, st, args...);
  return hipGetLastError();
}
template <typename... Params, typename... Args>
static inline kgpuError_t kgpu_launch(void (*kernel)(Params...), unsigned grid, unsigned block, kgpuStream_t st,
                                      int pdl, Args... args) {
  return kgpu_launch_ex(kernel, dim3(grid), dim3(block), 0, st, pdl, args...);
}
#endif /* __HIPCC__ */

#else
/* ----------------------------------------------------------------- CUDA ----- */
#include <cuda_runtime.h>
typedef cudaError_t kgpuError_t;
typedef cudaStream_t kgpuStream_t;
typedef cudaEvent_t kgpuEvent_t;
typedef cudaIpcMemHandle_t kgpuIpcMemHandle_t;
#define kgpuSuccess cudaSuccess
#define kgpuGetErrorString cudaGetErrorString
#define kgpuGetLastError cudaGetLastError
#define kgpuGetDevice cudaGetDevice
#define kgpuSetDevice cudaSetDevice
#define kgpuGetDeviceCount cudaGetDeviceCount
#define kgpuDeviceGetPCIBusId cudaDeviceGetPCIBusId
#define kgpuDeviceGetAttribute cudaDeviceGetAttribute
#define kgpuOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
#define kgpuFuncAttributes cudaFuncAttributes
#define kgpuFuncGetAttributes cudaFuncGetAttributes
#define kgpuFuncSetCarveout(kernel, pct) cudaFuncSetAttribute((kernel), cudaFuncAttributePreferredSharedMemoryCarveout, (pct))
#define kgpuDevAttrMultiProcessorCount cudaDevAttrMultiProcessorCount
#define kgpuDevAttrClockRate cudaDevAttrClockRate
#define kgpuMalloc cudaMalloc
#define kgpuFree cudaFree
#define kgpuMemset cudaMemset
#define kgpuMemsetAsync cudaMemsetAsync
#define kgpuMemcpy cudaMemcpy
#define kgpuMemcpyAsync cudaMemcpyAsync
#define kgpuMemcpyDefault cudaMemcpyDefault
#define kgpuHostAlloc cudaHostAlloc
#define kgpuHostAllocMapped cudaHostAllocMapped
#define kgpuFreeHost cudaFreeHost
#define kgpuHostGetDevicePointer cudaHostGetDevicePointer
#define kgpuIpcGetMemHandle cudaIpcGetMemHandle
#define kgpuIpcOpenMemHandle cudaIpcOpenMemHandle
#define kgpuIpcCloseMemHandle cudaIpcCloseMemHandle
#define kgpuIpcMemLazyEnablePeerAccess cudaIpcMemLazyEnablePeerAccess
#define kgpuDeviceSynchronize cudaDeviceSynchronize
#define kgpuStreamSynchronize cudaStreamSynchronize
#define kgpuEventCreate cudaEventCreate
#define kgpuEventRecord cudaEventRecord
#define kgpuEventSynchronize cudaEventSynchronize
#define kgpuEventElapsedTime cudaEventElapsedTime
#define kgpuEventDestroy cudaEventDestroy
#define kgpuEventCreateWithFlags cudaEventCreateWithFlags
#define kgpuEventDisableTiming cudaEventDisableTiming
#define kgpuStreamCreateWithFlags cudaStreamCreateWithFlags
#define kgpuStreamNonBlocking cudaStreamNonBlocking
#define kgpuStreamWaitEvent(st, ev) cudaStreamWaitEvent((st), (ev), 0)
#define kgpuStreamDestroy cudaStreamDestroy
#define kgpuPointerGetAttributes cudaPointerGetAttributes
typedef struct cudaPointerAttributes kgpuPointerAttributes;
#define KGPU_PTR_IS_DEVICE(a) ((a).type == cudaMemoryTypeDevice || (a).type == cudaMemoryTypeManaged)
#define KGPU_PTR_DEVICE(a) ((a).device)
#define KGPU_WARP 32

#ifdef __CUDACC__
/* 16-byte store of two (data, flag) pairs.  PTX guarantees single-copy
 * atomicity for each naturally aligned 8-byte half, which is all the LL
 * protocol needs: a reader accepts a half only when its flag matches. */
__device__ static inline void kgpu_st_volatile_v4(uint32_t *p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}
__device__ static inline void kgpu_ld_volatile_v4(const uint32_t *p, uint32_t *a, uint32_t *b, uint32_t *c,
                                                  uint32_t *d) {
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(*a), "=r"(*b), "=r"(*c), "=r"(*d)
               : "l"(p)
               : "memory");
}
/* 16-byte load that bypasses the (non-coherent) L1: data another process wrote. */
__device__ static inline uint4 kgpu_ld_cg_v4(const void *p) { return __ldcg((const uint4 *)p); }
/* The same 16-byte line with weak (non-volatile) accesses, cached at L2 only
 * (.cg: L1 is not coherent).  PTX keeps a thread's volatile accesses in order,
 * so a thread that pushes a line to each of 7 peers and then polls 7 lines
 * waits out every round trip in turn; weak accesses overlap.  Each aligned
 * 8-byte half stays single-copy atomic, which is all LL needs; asm volatile
 * keeps the compiler from merging or hoisting a poll. */
__device__ static inline void kgpu_st_weak_v4(uint32_t *p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.global.cg.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ static inline void kgpu_ld_weak_v4(const uint32_t *p, uint32_t *a, uint32_t *b, uint32_t *c,
                                              uint32_t *d) {
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(*a), "=r"(*b), "=r"(*c), "=r"(*d) : "l"(p) : "memory");
}
/* Release/acquire at system scope: everything this thread (and, after a
 * preceding __syncthreads, its block) wrote before the release is visible to a
 * thread of any process or GPU that acquires the value. */
__device__ static inline void kgpu_st_release_sys_u64(uint64_t *p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ static inline uint64_t kgpu_ld_acquire_sys_u64(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
/* A strong store at system scope without the release's own fence: after a
 * kgpu_fence_system it is a release as well (PTX: fence, then a strong write),
 * and a second copy of a flag written this way does not wait for the first. */
__device__ static inline void kgpu_st_relaxed_sys_u64(uint64_t *p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
/* Plain loads past L1 of words written before the kernel started (tables). */
__device__ static inline uint64_t kgpu_ld_cg_u64(const void *p) { return __ldcg((const unsigned long long *)p); }
__device__ static inline uint32_t kgpu_ld_cg_u8(const void *p) { return __ldcg((const unsigned char *)p); }
/* The SM this thread runs on, and its cycle counter. */
__device__ static inline unsigned kgpu_smid(void) {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
__device__ static inline long long kgpu_clock64(void) { return clock64(); }
/* The same value, but the compiler cannot see through it: what is computed
 * from it stays where the code computes it (not hoisted to where x was loaded). */
__device__ static inline uint64_t kgpu_opaque_u64(uint64_t x) {
  asm volatile("mov.b64 %0, %0;" : "+l"(x));
  return x;
}
__device__ static inline uint32_t kgpu_opaque_u32(uint32_t x) {
  asm volatile("mov.b32 %0, %0;" : "+r"(x));
  return x;
}
__device__ static inline uint32_t kgpu_ld_volatile_u32(const volatile uint32_t *p) {
  uint32_t v;
  asm volatile("ld.volatile.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ static inline void kgpu_fence_system(void) { asm volatile("fence.sc.sys;" ::: "memory"); }
/* The same orderings at GPU scope: every thread on this GPU, whatever its
 * process (PTX: .gpu is the set of all threads executing on the same device),
 * which is all the chunked kernels need when every rank shares one GPU.  A
 * fence.acq_rel is cumulative like fence.sc (enough for release patterns) and
 * orders only at the L2, where a system-scope fence also waits for the
 * writes to be visible beyond the GPU. */
__device__ static inline void kgpu_fence_gpu(void) { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ static inline void kgpu_st_release_gpu_u64(uint64_t *p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ static inline uint64_t kgpu_ld_acquire_gpu_u64(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
/* A warp vote over the lanes in `mask` (every one of them must take part). */
typedef unsigned kgpu_lanes_t;
__device__ static inline kgpu_lanes_t kgpu_lane_mask(int lanes) { return lanes >= 32 ? ~0u : ((1u << lanes) - 1); }
__device__ static inline bool kgpu_any(kgpu_lanes_t mask, bool pred) { return __any_sync(mask, pred); }
/* Flag words with weaker orderings (the flag-hop benchmark compares them). */
__device__ static inline void kgpu_st_volatile_u64(uint64_t *p, uint64_t v) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ static inline uint64_t kgpu_ld_volatile_u64(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ static inline void kgpu_st_relaxed_gpu_u64(uint64_t *p, uint64_t v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ static inline uint64_t kgpu_ld_relaxed_gpu_u64(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ static inline uint64_t kgpu_time_ns(void) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ static inline void kgpu_pause(void) { __nanosleep(32); }
/* Programmatic dependent launch (sm_90): a kernel launched with the PDL
 * attribute may start while its predecessor runs; it must wait (pdl_wait)
 * before touching anything the predecessor writes.  pdl_trigger lets our
 * successor start launching now.  KCCL's kernels trigger only after their
 * own wait: with the trigger first, every kernel of a long chain could launch
 * early and sit resident, which is the likely cause of the deadlock seen at 8
 * ranks under MPS (waiting blocks holding the SMs that running ones need).  After the wait, at most two kernels of a
 * stream are resident at once (the running one and its successor). */
__device__ static inline void kgpu_pdl_wait(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ static inline void kgpu_pdl_trigger(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
/* Launch, with programmatic dependent launch when pdl != 0: the one PDL launcher
 * of KCCL's kernels, and (as kcclLaunch, kccl_launch.cuh) of KIE's engine. */
template <typename... Params, typename... Args>
static inline kgpuError_t kgpu_launch_ex(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                         kgpuStream_t st, int pdl, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}
template <typename... Params, typename... Args>
static inline kgpuError_t kgpu_launch(void (*kernel)(Params...), unsigned grid, unsigned block, kgpuStream_t st,
                                      int pdl, Args... args) {
  return kgpu_launch_ex(kernel, dim3(grid), dim3(block), 0, st, pdl, args...);
}
#endif /* __CUDACC__ */
#endif

#endif /* KCCL_GPU_COMPAT_H_ */
