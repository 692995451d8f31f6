/* stage_count.cuh - a counter in global memory that blocks of one grid publish to and poll:
 * how the monokernel orders its stages (mono.cu), and what bench/gpu/poll_stream.cu times.
 * A publisher adds with a release reduction (its earlier writes visible to whoever sees the
 * sum); a poller spins on relaxed loads, which leave the SM's L1 alone (an acquire load
 * invalidates it each time), and orders its reads after the count with one acquire load. */
#ifndef KIE_STAGE_COUNT_CUH_
#define KIE_STAGE_COUNT_CUH_

namespace kie {

__device__ __forceinline__ unsigned ld_acquire(const unsigned *p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned ld_relaxed(const unsigned *p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release(unsigned *p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

}  // namespace kie
#endif
