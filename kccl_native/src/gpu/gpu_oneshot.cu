/* gpu_oneshot.cu - the library's one-shot all-reduce kernels.
 *
 * The LL protocol of kccl_device.cuh (channel 0), one block per <= 8 KB
 * slice: each rank pushes its slice into every peer's inbox and reduces what
 * arrives in its own.  No flag, no barrier.  The launcher (gpu_launch.cu)
 * picks a kernel from kgpu_oneshot_kernels. */
#include "kernels.h"

using namespace kccl_detail;

/* MAXR: 8 for communicators of up to 8 ranks (fewer registers, so more blocks
 * fit on an SM beside the peers' and the next call's), else KCCL_GPU_MAX_RANKS.
 * One kernel per (MAXR, data type, operation): the body stays small (see
 * ll_block); kcclAvg runs the kcclSum kernel with avg set. */
template <int MAXR, int DT, int OP>
__global__ void __launch_bounds__(KCCL_LL_THREADS) k_oneshot(kcclDevComm dc, const char *in, char *out,
                                                             size_t nbytes, uint32_t per_block, int avg,
                                                             uint32_t sig) {
  kgpu_pdl_wait();    /* everything below may read what the previous kernel wrote */
  kgpu_pdl_trigger(); /* after the wait: see kgpu_pdl_trigger */
  const size_t off = (size_t)blockIdx.x * per_block;
  const uint32_t nb = (uint32_t)(nbytes - off < per_block ? nbytes - off : per_block);
  ll_block<MAXR, DT, OP, false>(dc, blockIdx.x, in + off, out + off, nb, avg != 0, sig, nullptr);
}

/* [MAXR 2 / 8 / 16][bf16, f16, f32][sum, prod, max, min].  2 ranks get their own
 * kernels: peer loops run to MAXR with a run-time rank count, which costs ~0.7 us
 * per call at 2 ranks in the 8-rank kernel (bench/gpu/ll_ladder.cu). */
#define KCCL_ONESHOT_OPS(M, D) {k_oneshot<M, D, kcclSum>, k_oneshot<M, D, kcclProd>, k_oneshot<M, D, kcclMax>, \
                                k_oneshot<M, D, kcclMin>}
#define KCCL_ONESHOT_TYPES(M) {KCCL_ONESHOT_OPS(M, kcclBfloat16), KCCL_ONESHOT_OPS(M, kcclFloat16), \
                               KCCL_ONESHOT_OPS(M, kcclFloat32)}
extern const kgpu_oneshot_fn kgpu_oneshot_kernels[3][3][4] = {KCCL_ONESHOT_TYPES(2), KCCL_ONESHOT_TYPES(8),
                                                              KCCL_ONESHOT_TYPES(KCCL_GPU_MAX_RANKS)};
#undef KCCL_ONESHOT_TYPES
#undef KCCL_ONESHOT_OPS
