/* attention.cu - the attention kernel of the per-sublayer path: a block per
 * (head group, split, token) of attention.cuh's items.
 *
 * Attention reads little (the KV cache of one layer), so HBM would idle while it
 * runs; with l2_bytes the blocks first ask L2 for the weights the next GEMVs
 * start on (the o projection, then gate/up), each block a share, so that those
 * GEMVs begin from L2. */
#include "attention.cuh"

using namespace kie;

namespace {

template <int HD>
__global__ void __launch_bounds__(ATT_THREADS) k_attention(const AttnArgs a) {
  __shared__ AttSmem<HD> sm;
  kcclDevPdlWait();
  kcclDevPdlTrigger();
  if (a.l2_bytes && threadIdx.x < 32) {
    constexpr unsigned PIECE = 16384;
    const unsigned nb = gridDim.x * gridDim.y * gridDim.z;
    const unsigned b = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const unsigned pieces = (a.l2_bytes + PIECE - 1) / PIECE;
    for (unsigned p = b * 32 + threadIdx.x; p < pieces; p += nb * 32) {
      const unsigned off = p * PIECE, n = min(PIECE, a.l2_bytes - off);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a.l2_ahead + off), "r"(n) : "memory");
    }
  }
  attend<HD, false>(a, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, sm, SyncBlock(), nullptr);
}

template <int HD>
cudaError_t launch_hd(const AttnArgs &a, int T, cudaStream_t st, int pdl) {
  const dim3 grid((unsigned)(a.nh / a.g * a.hgroups), (unsigned)a.nsplit, (unsigned)T);
  return kcclLaunch(k_attention<HD>, grid, dim3(ATT_THREADS), 0, st, pdl, a);
}

}  // namespace

cudaError_t kie_launch_attention(const AttnArgs &a, int T, cudaStream_t st, int pdl) {
  return kie_with_hd(a.hd, cudaErrorInvalidValue, [&](auto h) { return launch_hd<decltype(h)::value>(a, T, st, pdl); });
}
