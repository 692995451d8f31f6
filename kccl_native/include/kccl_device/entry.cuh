/*
 * kccl_device/entry.cuh - the LL all-reduce entries: ll_allreduce_block (dtype and
 * op chosen at run time; the library's kernels) and dev_allreduce
 * (kcclDevAllReduce's body, and the benchmark's TRACE copies).
 *
 * Part of kccl_device.cuh, which defines kcclDevComm and the limits and
 * includes this file; include that header, not this one.
 */
#ifndef KCCL_DEVICE_ENTRY_CUH_
#define KCCL_DEVICE_ENTRY_CUH_

namespace kccl_detail {

/* The library's entry: dtype and op at run time, one compiled body each (only
 * the one that runs has to be fetched; a caller whose dt and op are constants
 * keeps only theirs).  kcclInvalidArgument for others.  grp: the calling
 * threads (groups.cuh), every thread of the block by default. */
template <int MAXR, bool TRACE = false, typename G = WholeBlock> /* MAXR: ranks this copy handles (<= KCCL_GPU_MAX_RANKS): the registers scale with it */
__device__ static __forceinline__ kcclResult_t ll_allreduce_block(const kcclDevComm &dc, int block, const char *in, char *out,
                                                         uint32_t nbytes, kcclDataType_t dt, kcclRedOp_t op,
                                                         uint32_t sig, long long *trace = nullptr, const G &grp = G()) {
  /* Two ranks get their own body: peer loops that run to MAXR with a run-time
   * rank count cost ~0.7 us per call at 2 ranks (bench/gpu/ll_ladder.cu). */
  if (MAXR > 2 && dc.nranks <= 2)
    return ll_allreduce_block<2, TRACE, G>(dc, block, in, out, nbytes, dt, op, sig, trace, grp);
  const bool avg = op == kcclAvg;
  const int o = avg ? (int)kcclSum : (int)op;
#define KCCL_LL_CASE(D, O) \
  if (dt == D && o == O) return ll_block<MAXR, D, O, TRACE, G>(dc, block, in, out, nbytes, avg, sig, trace, grp)
#define KCCL_LL_CASES(D) \
  KCCL_LL_CASE(D, kcclSum); KCCL_LL_CASE(D, kcclProd); KCCL_LL_CASE(D, kcclMax); KCCL_LL_CASE(D, kcclMin)
  KCCL_LL_CASES(kcclBfloat16);
  KCCL_LL_CASES(kcclFloat16);
  KCCL_LL_CASES(kcclFloat32);
#undef KCCL_LL_CASES
#undef KCCL_LL_CASE
  return kcclInvalidArgument;
}

/* kcclDevAllReduce's body (grp: WholeBlock) and kcclDevAllReduceGroup's
 * (NamedGroup); TRACE copies fill `trace` (see KCCL_LL_TRACE_SLOTS). */
template <int MaxRanks, bool TRACE, typename G = WholeBlock>
__device__ static __forceinline__ kcclResult_t dev_allreduce(const kcclDevComm &dc, void *data, int count, kcclDataType_t dt,
                                                    kcclRedOp_t op, long long *trace, const G &grp = G()) {
  static_assert(MaxRanks >= 1 && MaxRanks <= KCCL_GPU_MAX_RANKS, "MaxRanks: 1..KCCL_GPU_MAX_RANKS");
  const int es = dt == kcclFloat32 ? 4 : 2;
  const uint32_t nbytes = (uint32_t)count * es;
  if ((dt != kcclFloat32 && dt != kcclFloat16 && dt != kcclBfloat16) || op < 0 || op >= kcclNumOps ||
      count < 0 || nbytes > KCCL_LL_MAX_BYTES || !grp.valid() || dc.nranks > MaxRanks)
    return kcclInvalidArgument;
  /* The signature of a device call: kind 0x40 | dtype | op, and the size. */
  const uint32_t sig = 0x4b440000u ^ ((uint32_t)dt << 8) ^ (uint32_t)op ^ (nbytes * 2654435761u);
  return ll_allreduce_block<MaxRanks, TRACE, G>(dc, grp.slot(), (const char *)data, (char *)data, nbytes, dt, op,
                                                sig, trace, grp);
}

}  // namespace kccl_detail

#endif /* KCCL_DEVICE_ENTRY_CUH_ */
