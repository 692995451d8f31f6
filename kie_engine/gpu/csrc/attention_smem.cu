/* attention_smem.cu - the graph path's decode attention: a block per (KV head group or
 * query head, split, token) holds its keys' rows of K and V in shared memory
 * (attention_smem.cuh, which says how and why); with AttnArgs.blocks, that many blocks
 * take the step's items in turn.
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

/* CLK (the step clock, a.clk): the block's marks, kept until its end since a block without
 * work returns before its wait and must mark nothing; a kernel of its own, like the GEMV's,
 * so that the default carries none of it.  Its STAGED mark is thread 0's first chunk's scores
 * and softmax done (what the attention does with its input once it is in shared memory); its
 * LOADED mark that input (rows and queries) in shared memory, its SUMMED mark its values done. */
template <int HD, bool CLK, bool WARM>
__global__ void __launch_bounds__(AS_THREADS, 1) k_attention_smem(const AttnArgs a) {
  extern __shared__ __align__(16) unsigned char as_smem[];
  __shared__ AttSmemHeads hs;
  unsigned long long clk[KIE_CLK_MARKS] = {};
  unsigned long long *item_clk[3] = {&clk[KIE_CLK_STAGED], &clk[KIE_CLK_SUMMED], &clk[KIE_CLK_LOADED]};
  if (CLK) clk[KIE_CLK_START] = kie_gtime();
  auto wait = [&] {
    kcclDevPdlWait();
    kcclDevPdlTrigger();
    if (CLK && !clk[KIE_CLK_WAITED]) clk[KIE_CLK_WAITED] = kie_gtime();
    return true;
  };
  if (a.blocks == 0) {
    att_smem_item<HD, AS_THREADS, WARM>(a, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, as_smem, ATT_SMEM_KEYS(HD),
                                        hs, SyncBlock(), wait, CLK ? item_clk : nullptr);
  } else {
    /* The step's items only (the monokernel's order: a query head each while the context fits
     * one item, else (group, split)), item i on block i, i + gridDim.x, ...: no block is launched
     * for splits past the context, which a grid of item slots ends at once every step. */
    const int t = blockIdx.z, groups = a.nh / a.g * a.hgroups;
    const int ns = att_smem_splits(a, *a.pos + t + 1);
    const bool per_head = ns == 1 && a.heads1;
    const int items = per_head ? a.nh : groups * ns;
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
      int bx = it, split = 0;
      if (!per_head) { /* the group's first query head under heads1, as the grid of item slots has it */
        const int grp = it % groups;
        split = it / groups;
        bx = a.heads1 ? grp / a.hgroups * a.g + grp % a.hgroups * a.gper : grp;
      }
      if (it != (int)blockIdx.x) __syncthreads(); /* the last item is done with the shared memory */
      att_smem_item<HD, AS_THREADS, WARM>(a, bx, split, t, threadIdx.x, as_smem, ATT_SMEM_KEYS(HD), hs, SyncBlock(),
                                          wait, CLK && it == (int)blockIdx.x ? item_clk : nullptr);
    }
  }
  if (CLK && clk[KIE_CLK_WAITED]) {
    clk[KIE_CLK_END] = kie_gtime();
    kie_clock_marks(a.clk, clk);
  }
}

template <int HD>
cudaError_t launch_hd(const AttnArgs &a, int T, cudaStream_t st, int pdl) {
  const dim3 grid = a.blocks > 0 ? dim3((unsigned)a.blocks, 1u, (unsigned)T)
                                 : dim3((unsigned)(a.heads1 ? a.nh : a.nh / a.g * a.hgroups), (unsigned)a.nsplit,
                                        (unsigned)T);
  const size_t smem = SmemShape<HD, AS_THREADS>::bytes(ATT_SMEM_KEYS(HD));
  if (a.warm)
    return a.clk ? kcclLaunch(k_attention_smem<HD, true, true>, grid, dim3(AS_THREADS), smem, st, pdl, a)
                 : kcclLaunch(k_attention_smem<HD, false, true>, grid, dim3(AS_THREADS), smem, st, pdl, a);
  return a.clk ? kcclLaunch(k_attention_smem<HD, true, false>, grid, dim3(AS_THREADS), smem, st, pdl, a)
               : kcclLaunch(k_attention_smem<HD, false, false>, grid, dim3(AS_THREADS), smem, st, pdl, a);
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
    const int smem = (int)SmemShape<HD, AS_THREADS>::bytes(ATT_SMEM_KEYS(HD));
    const cudaFuncAttribute at = cudaFuncAttributeMaxDynamicSharedMemorySize;
    if (e == cudaSuccess) e = cudaFuncSetAttribute(k_attention_smem<HD, false, false>, at, smem);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(k_attention_smem<HD, true, false>, at, smem);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(k_attention_smem<HD, false, true>, at, smem);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(k_attention_smem<HD, true, true>, at, smem);
  };
  set(std::integral_constant<int, 16>());
  set(std::integral_constant<int, 32>());
  set(std::integral_constant<int, 64>());
  set(std::integral_constant<int, 128>());
  set(std::integral_constant<int, 256>());
  return e;
}
