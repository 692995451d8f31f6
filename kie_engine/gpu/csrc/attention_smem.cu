/* attention_smem.cu - the graph path's decode attention: a block per (KV head group or
 * query head, split, token) holds its keys' rows of K and V in shared memory
 * (attention_smem.cuh, which says how and why).
 *
 * The block copies the rows of earlier steps before it waits for the QKV kernel
 * (programmatic dependent launch), so their DRAM round trip overlaps that kernel's tail.
 * Splits of AttnArgs.ksplit keys past kcap (smem_attention_splits, engine_internal.h).
 * The arithmetic differs from the monokernel's split items
 * (attention.cuh) in its summation order; KIE_GPU_DECODE_ATTN=1 gives the graph path
 * those items instead. */
#include "attention_smem.cuh"

using namespace kie;

namespace {

constexpr int AS_THREADS = 256;
constexpr unsigned PF_CHUNK = 32768; /* bytes an L2 prefetch asks for */

/* This item's share of AttnArgs.pf (one token): chunk c of the ranges, in order, goes to
 * item c % n, thread (c / n) % AS_THREADS, where n is the number of items that work, so
 * that the chunks spread over the SMs' copy engines.  Called after the wait, when the QKV
 * kernel's loads are done. */
__device__ __forceinline__ void att_prefetch(const AttnArgs &a, int bx, int split, int tid) {
  const int ns = att_smem_splits(a, *a.pos + 1), ng = att_smem_groups(a, ns);
  int grp, kvh, h0, G;
  att_smem_map(a, bx, ns, grp, kvh, h0, G);
  const unsigned n = (unsigned)(ng * ns), id = (unsigned)(split * ng + grp);
  unsigned first[4] = {0, 0, 0, 0}; /* range k's chunks: first[k] .. first[k + 1] - 1 */
  for (int k = 0; k < 3; k++) first[k + 1] = first[k] + (a.pf_bytes[k] + PF_CHUNK - 1) / PF_CHUNK;
  for (unsigned c = id + n * (unsigned)tid; c < first[3]; c += n * AS_THREADS) {
    const int k = c < first[1] ? 0 : c < first[2] ? 1 : 2;
    const unsigned off = (c - first[k]) * PF_CHUNK;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"((const char *)a.pf[k] + off),
                 "r"(min(PF_CHUNK, a.pf_bytes[k] - off))
                 : "memory");
  }
}

template <int HD>
__global__ void __launch_bounds__(AS_THREADS, 1) k_attention_smem(const AttnArgs a) {
  extern __shared__ __align__(16) unsigned char as_smem[];
  __shared__ AttSmemHeads hs;
  unsigned long long clk[KIE_CLK_MARKS] = {0, 0, 0, 0};
  if (a.clk) clk[KIE_CLK_START] = kie_gtime();
  auto wait = [&] {
    kcclDevPdlWait();
    kcclDevPdlTrigger();
    if (a.clk) clk[KIE_CLK_WAITED] = clk[KIE_CLK_STAGED] = kie_gtime();
    if (a.pf_bytes[0] | a.pf_bytes[1] | a.pf_bytes[2]) att_prefetch(a, blockIdx.x, blockIdx.y, threadIdx.x);
    return true;
  };
  if (a.bulk)
    att_smem_item<HD, AS_THREADS, true>(a, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, as_smem, ATT_SMEM_KEYS(HD),
                                        hs, SyncBlock(), wait);
  else
    att_smem_item<HD, AS_THREADS>(a, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, as_smem, ATT_SMEM_KEYS(HD), hs,
                                  SyncBlock(), wait);
  /* a block without work returns before its wait: no marks */
  if (a.clk && clk[KIE_CLK_WAITED]) {
    clk[KIE_CLK_END] = kie_gtime();
    kie_clock_marks(a.clk, clk);
  }
}

template <int HD>
cudaError_t launch_hd(const AttnArgs &a, int T, cudaStream_t st, int pdl) {
  const dim3 grid((unsigned)(a.heads1 ? a.nh : a.nh / a.g * a.hgroups), (unsigned)a.nsplit, (unsigned)T);
  return kcclLaunch(k_attention_smem<HD>, grid, dim3(AS_THREADS), SmemShape<HD, AS_THREADS>::bytes(ATT_SMEM_KEYS(HD)), st,
                    pdl, a);
}

}  // namespace

cudaError_t kie_launch_attention_smem(const AttnArgs &a, int T, cudaStream_t st, int pdl) {
  if (a.kcap < 1 || a.kcap > ATT_SMEM_KEYS(a.hd) || a.ksplit < 1 || a.ksplit > a.kcap) return cudaErrorInvalidValue;
  return kie_with_hd(a.hd, cudaErrorInvalidValue, [&](auto h) { return launch_hd<decltype(h)::value>(a, T, st, pdl); });
}

cudaError_t kie_attention_smem_attributes(void) {
  cudaError_t e = cudaSuccess;
  auto set = [&](auto h) {
    constexpr int HD = decltype(h)::value;
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(k_attention_smem<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               (int)SmemShape<HD, AS_THREADS>::bytes(ATT_SMEM_KEYS(HD)));
  };
  set(std::integral_constant<int, 16>());
  set(std::integral_constant<int, 32>());
  set(std::integral_constant<int, 64>());
  set(std::integral_constant<int, 128>());
  set(std::integral_constant<int, 256>());
  return e;
}
