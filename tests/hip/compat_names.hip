/* Every name of kccl_gpu_compat.h's HIP branch, used once with the argument types
 * KCCL's sources pass (tests/test_hip_build.py compiles this with hipcc and checks
 * that no name of the branch is missing here).  Compiled, never run. */
#include "kccl_device/gpu_compat.h"

#ifndef KGPU_HIP
#error "kccl_gpu_compat.h did not take its HIP branch"
#endif
static_assert(KGPU_WARP == 64, "AMD's wavefront is 64 lanes");

__global__ void compat_device_names(uint32_t *line, uint64_t *flag, const void *table, uint64_t *out, int lanes) {
  uint32_t a, b, c, d;
  kgpu_v4u32 raw = {1, 2, 3, 4};
  kgpu_st_volatile_v4(line, raw.x, raw.y, raw.z, raw.w);
  kgpu_ld_volatile_v4(line, &a, &b, &c, &d);
  kgpu_st_weak_v4(line, a, b, c, d);
  kgpu_ld_weak_v4(line, &a, &b, &c, &d);
  uint4 v = kgpu_ld_cg_v4(table);
  kgpu_st_release_sys_u64(flag, v.x);
  uint64_t x = kgpu_ld_acquire_sys_u64(flag);
  kgpu_st_relaxed_sys_u64(flag, x);
  x += kgpu_ld_cg_u64(table) + kgpu_ld_cg_u8(table) + kgpu_smid();
  x = kgpu_opaque_u64(x);
  uint32_t y = kgpu_opaque_u32((uint32_t)x) + kgpu_ld_volatile_u32(line);
  long long t = kgpu_clock64();
  kgpu_lanes_t mask = kgpu_lane_mask(lanes);
  bool any = kgpu_any(mask, y != 0);
  kgpu_st_volatile_u64(flag, x);
  x += kgpu_ld_volatile_u64(flag);
  kgpu_st_relaxed_gpu_u64(flag, x);
  x += kgpu_ld_relaxed_gpu_u64(flag);
  kgpu_fence_system();
  kgpu_fence_gpu();
  kgpu_st_release_gpu_u64(flag, x);
  x += kgpu_ld_acquire_gpu_u64(flag);
  kgpu_pdl_wait();
  kgpu_pause();
  kgpu_pdl_trigger();
  out[0] = x + (uint64_t)t + kgpu_time_ns() + any + a + b + c + d;
}

/* The runtime names, as gpu_runtime.cu and gpu_l2map.cu call them. */
kgpuError_t compat_host_names(kgpuStream_t st, const kgpuIpcMemHandle_t *peer) {
  kgpuError_t e = kgpuSuccess;
  int n = 0, dev = 0, sms = 0, khz = 0, blocks = 0;
  char pci[32];
  e = kgpuGetDeviceCount(&n);
  e = kgpuGetDevice(&dev);
  e = kgpuSetDevice(dev);
  e = kgpuDeviceGetPCIBusId(pci, (int)sizeof pci, dev);
  e = kgpuDeviceGetAttribute(&sms, kgpuDevAttrMultiProcessorCount, dev);
  e = kgpuDeviceGetAttribute(&khz, kgpuDevAttrClockRate, dev);
  e = kgpuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, compat_device_names, 256, 0);
  kgpuFuncAttributes fa;
  e = kgpuFuncGetAttributes(&fa, compat_device_names);
  e = kgpuFuncSetCarveout(compat_device_names, 100);

  char *buf = nullptr, *mapped = nullptr;
  uint64_t *host = nullptr, *host_d = nullptr;
  e = kgpuMalloc((void **)&buf, 4096);
  e = kgpuMemset(buf, 0, 4096);
  e = kgpuMemsetAsync(buf, 0, 4096, st);
  e = kgpuMemcpy(buf, buf + 2048, 64, kgpuMemcpyDefault);
  e = kgpuMemcpyAsync(buf, buf + 2048, 64, kgpuMemcpyDefault, st);
  e = kgpuHostAlloc((void **)&host, 64, kgpuHostAllocMapped);
  e = kgpuHostGetDevicePointer((void **)&host_d, (void *)host, 0);
  kgpuIpcMemHandle_t h;
  e = kgpuIpcGetMemHandle(&h, buf);
  e = kgpuIpcOpenMemHandle((void **)&mapped, *peer, kgpuIpcMemLazyEnablePeerAccess);
  e = kgpuIpcCloseMemHandle(mapped);

  kgpuPointerAttributes pa;
  e = kgpuPointerGetAttributes(&pa, buf);
  if (!KGPU_PTR_IS_DEVICE(pa) || KGPU_PTR_DEVICE(pa) != dev) e = kgpuGetLastError();

  kgpuStream_t side;
  kgpuEvent_t ev0, ev1, fork;
  float ms = 0;
  e = kgpuStreamCreateWithFlags(&side, kgpuStreamNonBlocking);
  e = kgpuEventCreate(&ev0);
  e = kgpuEventCreate(&ev1);
  e = kgpuEventCreateWithFlags(&fork, kgpuEventDisableTiming);
  e = kgpuEventRecord(ev0, st);
  e = kgpuEventRecord(fork, st);
  e = kgpuStreamWaitEvent(side, fork);
  e = kgpu_launch(compat_device_names, 1, 256, side, 1, (uint32_t *)buf, (uint64_t *)(buf + 1024),
                  (const void *)(buf + 2048), (uint64_t *)host_d, 64);
  e = kgpu_launch_ex(compat_device_names, dim3(1), dim3(256), 0, side, 1, (uint32_t *)buf, (uint64_t *)(buf + 1024),
                     (const void *)(buf + 2048), (uint64_t *)host_d, 64);
  e = kgpuEventRecord(ev1, st);
  e = kgpuEventSynchronize(ev1);
  e = kgpuEventElapsedTime(&ms, ev0, ev1);
  e = kgpuStreamSynchronize(side);
  e = kgpuDeviceSynchronize();
  e = kgpuEventDestroy(fork);
  e = kgpuEventDestroy(ev1);
  e = kgpuEventDestroy(ev0);
  e = kgpuStreamDestroy(side);
  e = kgpuFreeHost(host);
  e = kgpuFree(buf);
  (void)kgpuGetErrorString(e);
  return e;
}
