/* attention.cu - the attention kernel of the per-sublayer path: a block per
 * (head group, split, token) of attention.cuh's items. */
#include "attention.cuh"

using namespace kie;

namespace {

template <int HD>
__global__ void __launch_bounds__(ATT_THREADS) k_attention(const AttnArgs a) {
  __shared__ AttSmem<HD> sm;
  kcclDevPdlWait();
  kcclDevPdlTrigger();
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
