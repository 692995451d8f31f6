/* bulk_copy.cuh - the Hopper bulk-copy engine (cp.async.bulk, TMA's unit without a
 * tensor map) and the mbarriers that count its bytes: how the monokernel fills its
 * weight ring (mono.cu), whose waits on them are bounded there; and the L2 policy of a
 * stream of weights (the ring's copies, the GEMV's loads). */
#ifndef KIE_BULK_COPY_CUH_
#define KIE_BULK_COPY_CUH_
#include <stdint.h>

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
/* Global -> this block's shared memory, counted on `bar` (16-byte aligned, a multiple of 16 bytes),
 * its lines in L2 under cache policy `pol` (createpolicy). */
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, unsigned bytes, uint64_t *bar, uint64_t pol) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(pol)
      : "memory");
}

/* L2's policy for a stream of weights, none read twice in a step: evict_first (first != 0) keeps
 * the small data every step reads again (gamma, the RoPE row, the KV cache) in L2 beside them;
 * evict_normal is the hardware's default. */
__device__ __forceinline__ uint64_t l2_stream_policy(int first) {
  uint64_t pol;
  if (first)
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  else
    asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

}  // namespace kie
#endif
