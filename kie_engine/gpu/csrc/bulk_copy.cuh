/* bulk_copy.cuh - the Hopper bulk-copy engine (cp.async.bulk, TMA's unit without a
 * tensor map) and the mbarriers that count its bytes, for the kernels that copy
 * global memory into shared memory this way: the monokernel's weight ring, and the
 * graph path's GEMV and attention, whose inputs then do not queue behind the weight
 * loads a block has in flight (a block's own loads wait for free miss slots of its
 * SM's L1; the bulk copies do not take those slots). */
#ifndef KIE_BULK_COPY_CUH_
#define KIE_BULK_COPY_CUH_
#include <stdint.h>

#include "kie_kernels.h" /* kie_gtime */

namespace kie {

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t *bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
/* After a block's mbar_init, before any other thread or the copy engine uses them. */
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ bool mbar_done(uint64_t *bar, unsigned parity) {
  unsigned ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(ok)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return ok != 0;
}
/* Global -> this block's shared memory, counted on `bar` (16-byte aligned, a multiple of 16 bytes). */
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, unsigned bytes, uint64_t *bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
/* Waits for phase `parity` of bar.  The copies it counts either land or fault (a fault ends
 * the kernel with an error the host reports); a count that never completes would be a bug,
 * and past 2 s the kernel traps rather than hang the stream. */
__device__ __forceinline__ void mbar_wait(uint64_t *bar, unsigned parity) {
  unsigned long long t0 = 0;
  for (unsigned n = 0; !mbar_done(bar, parity); n++) {
    if ((n & 1023u) != 1023u) continue;
    const unsigned long long t = kie_gtime();
    if (!t0) t0 = t;
    else if (t - t0 > 2000000000ull) __trap();
  }
}

/* What the previous kernel wrote (seen once its grid completed) read by the copy engine:
 * the generic proxy's view ordered before this thread's bulk copies. */
__device__ __forceinline__ void bulk_after_generic() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

}  // namespace kie
#endif
