/* gpu_bench.cu - kernels that exercise the device-side API (a self-test and
 * a latency benchmark inside one persistent kernel), the flag-hop floor and a
 * residency probe.  They use only kccl_device.cuh's public surface, as a user
 * kernel would, except the phase trace (its internal TRACE copy). */
#include "kgpu.h"

/* This block's share [lo, hi) of count elements, in even slices. */
__device__ static inline void block_slice(int count, int *lo, int *hi) {
  const int per = (count + gridDim.x - 1) / gridDim.x;
  *lo = blockIdx.x * per < count ? blockIdx.x * per : count;
  *hi = *lo + per < count ? *lo + per : count;
}

/* Iteration k: every element of this block's slice becomes in[i] + k (in
 * the data type), is all-reduced in place inside out row k, and stays there
 * for the host to check. */
template <int MAXR>
__global__ void __launch_bounds__(KCCL_LL_THREADS) k_dev_selftest(kcclDevComm dc, const char *in, char *out,
                                                                  int count, int dt, int op, int iters) {
  const int es = dt == kcclFloat32 ? 4 : 2;
  int lo, hi;
  block_slice(count, &lo, &hi);
  for (int k = 0; k < iters; k++) {
    char *row = out + (size_t)k * count * es;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      float x;
      if (dt == kcclFloat32) x = ((const float *)in)[i];
      else if (dt == kcclBfloat16) x = kccl_detail::bf16_to_f32(((const uint16_t *)in)[i]);
      else x = __half2float(((const __half *)in)[i]);
      x += (float)k;
      if (dt == kcclFloat32) ((float *)row)[i] = x;
      else if (dt == kcclBfloat16) ((uint16_t *)row)[i] = (uint16_t)kccl_detail::f32_to_bf16(x);
      else ((__half *)row)[i] = __float2half_rn(x);
    }
    __syncthreads();
    if (kcclDevAllReduce<MAXR>(dc, row + (size_t)lo * es, hi - lo, (kcclDataType_t)dt, (kcclRedOp_t)op) != kcclSuccess)
      return;
  }
}

/* A dependent chain: each call averages the previous result (the average
 * keeps values bounded over thousands of calls).  TRACE: the same chain with
 * block 0's phase trace (kccl_device.cuh's internal TRACE copy); otherwise the
 * public kcclDevAllReduce, as a user kernel calls it. */
template <int MAXR, bool TRACE>
__global__ void __launch_bounds__(KCCL_LL_THREADS) k_dev_chain(kcclDevComm dc, char *buf, int count, int dt,
                                                               int iters, long long *trace) {
  const int es = dt == kcclFloat32 ? 4 : 2;
  int lo, hi;
  block_slice(count, &lo, &hi);
  char *mine = buf + (size_t)lo * es;
  for (int k = 0; k < iters; k++) {
    const kcclResult_t r =
        TRACE ? kccl_detail::dev_allreduce<MAXR, true>(dc, mine, hi - lo, (kcclDataType_t)dt, kcclAvg, trace)
              : kcclDevAllReduce<MAXR>(dc, mine, hi - lo, (kcclDataType_t)dt, kcclAvg);
    if (r != kcclSuccess) return;
  }
}

/* Ranks 0 and 1 bounce a counter.  mode 0: release / acquire at system scope,
 * pushed into the peer's memory (what the chunked kernels do); 1: volatile, pushed;
 * 2: relaxed at GPU scope, pushed; 3: volatile, pulled (each rank writes its own
 * word and polls the peer's).  One thread each; bounded like every KCCL wait. */
__device__ static inline void hop_store(uint64_t *p, uint64_t v, int mode) {
  if (mode == 0) kgpu_st_release_sys_u64(p, v);
  else if (mode == 2) kgpu_st_relaxed_gpu_u64(p, v);
  else kgpu_st_volatile_u64(p, v);
}
__device__ static inline uint64_t hop_load(const uint64_t *p, int mode) {
  if (mode == 0) return kgpu_ld_acquire_sys_u64(p);
  if (mode == 2) return kgpu_ld_relaxed_gpu_u64(p);
  return kgpu_ld_volatile_u64(p);
}

__global__ void k_flag_hop(kcclDevComm dc, size_t hop_off, uint64_t base, int iters, int mode) {
  const int me = dc.rank, other = 1 - me;
  uint64_t *own = (uint64_t *)(dc.peer_base[me] + hop_off);
  uint64_t *peer = (uint64_t *)(dc.peer_base[other] + hop_off);
  /* push: write into the peer's word [other], poll own word [me];
   * pull: write own word [me], poll the peer's word [other]. */
  uint64_t *dst = mode == 3 ? own + me : peer + other;
  const uint64_t *src = mode == 3 ? peer + other : own + me;
  volatile int never = 0;
  for (int i = 1; i <= iters; i++) {
    const uint64_t v = base + (uint64_t)i;
    if (me == 0) hop_store(dst, v, mode);
    kccl_detail::Waiter w = kccl_detail::waiter(dc);
    while (hop_load(src, mode) < v)
      if (kccl_detail::keep_waiting(dc, w, &never)) {
        kccl_detail::record_failure(dc, KCCL_GPU_TIMEOUT, kcclTimeout, other, 0, 0, (uint32_t)v, 0, 0);
        return;
      }
    if (me == 1) hop_store(dst, v, mode);
  }
}

/* Residency probe: every block of every rank adds one to rank 0's counter,
 * then waits (bounded) until all have.  If the GPU cannot hold every rank's
 * blocks at once, the ones that are resident see fewer arrivals than the
 * target and give up at the deadline; the most any block saw is how many were
 * resident together.  __launch_bounds__(256, 3) and KGPU_PROBE_LIVE floats kept
 * live across the wait give it about the collective kernels' footprint (~80
 * registers: 3 blocks per SM by the occupancy calculator). */
#define KGPU_PROBE_LIVE 48
__global__ void __launch_bounds__(256, 3) k_residency(int *counter, long long target, uint64_t timeout_ns,
                                                      int *seen, float seed, int *sm_out) {
  float keep[KGPU_PROBE_LIVE];
#pragma unroll
  for (int i = 0; i < KGPU_PROBE_LIVE; i++) keep[i] = seed * (float)(kgpu_clock64() ^ i); /* not recomputable later */
  if (threadIdx.x == 0) {
    sm_out[blockIdx.x] = (int)kgpu_smid();
    long long v = (long long)atomicAdd_system(counter, 1) + 1;
    const uint64_t deadline = kgpu_time_ns() + timeout_ns;
    while (v < target && kgpu_time_ns() < deadline) {
      kgpu_pause();
      v = *(volatile int *)counter;
    }
    atomicMax(seen, (int)(v > target ? target : v));
  }
  __syncthreads();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < KGPU_PROBE_LIVE; i++) s += keep[i] * keep[(i + 1) % KGPU_PROBE_LIVE];
  if (s == 1234.5f) seen[1] = 1; /* never in practice: keeps `keep` live, so the registers stay allocated */
}

/* The probe's "foreign" kernels: what an application might launch on its
 * stream just before a collective.  One block; `smem`: dynamic shared memory
 * (0, or 40 KB, which asks the SM for a larger shared-memory carveout than
 * the collective kernels use). */
__global__ void k_foreign(int *out) {
  extern __shared__ int s_buf[];
  s_buf[threadIdx.x] = (int)threadIdx.x;
  __syncthreads();
  if (threadIdx.x == 0) out[0] = s_buf[blockDim.x - 1];
}
__global__ void k_foreign_plain(int *out) {
  if (threadIdx.x == 0) out[0] = (int)blockDim.x;
}

/* The benchmark kernels that wait for a peer, loaded at init (see kgpu_preload_kernels). */
kgpuError_t kgpu_preload_bench_kernels(int carveout) {
  /* The kernels that wait for peers ask for the library's carveout (as a user's
   * persistent kernel should: kccl_device.cuh); the residency probe keeps the
   * driver's choice unless told otherwise. */
  const void *const waiting[] = {(const void *)k_dev_selftest<8>, (const void *)k_dev_selftest<KCCL_GPU_MAX_RANKS>,
                                 (const void *)k_dev_chain<8, false>,
                                 (const void *)k_dev_chain<KCCL_GPU_MAX_RANKS, false>,
                                 (const void *)k_dev_chain<8, true>, (const void *)k_dev_chain<KCCL_GPU_MAX_RANKS, true>,
                                 (const void *)k_flag_hop};
  const void *const others[] = {(const void *)k_foreign, (const void *)k_foreign_plain, (const void *)k_residency};
  kgpuError_t e;
  for (const void *fn : waiting)
    if ((e = kgpu_load_waiting_kernel(fn, carveout)) != kgpuSuccess) return e;
  for (const void *fn : others)
    if ((e = kgpu_load_kernel(fn)) != kgpuSuccess) return e;
  return kgpuSuccess;
}

extern "C" kcclResult_t kgpu_bench_residency(struct kgpu *g, int blocks, int timeout_ms, int foreign, int carveout,
                                             int out[4], int *sm_out) {
  /* blocks, timeout_ms, foreign and carveout: range-checked by kcclBenchResidency */
  KGPU_CHECK(kgpuSetDevice(g->device));
  KGPU_CHECK(kgpuFuncSetCarveout(k_residency, carveout)); /* -1: back to the driver's choice */
  kgpuFuncAttributes fa;
  int per_sm = 0;
  KGPU_CHECK(kgpuFuncGetAttributes(&fa, k_residency));
  KGPU_CHECK(kgpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_residency, 256, 0));
  int *seen = NULL, host[2] = {0, 0};
  /* seen[0..1], then the foreign kernel's word, then one SM id per block */
  KGPU_CHECK(kgpuMalloc((void **)&seen, sizeof(int) * (3 + (size_t)blocks)));
  const long long before = g->probe_base;
  g->probe_base += (long long)blocks * g->shape.nranks; /* every rank adds the same, seen or not */
  kgpuError_t e = kgpuMemset(seen, 0, sizeof host);
  kcclResult_t r = kcclSuccess;
  if (e == kgpuSuccess) {
    if (foreign == 1) k_foreign_plain<<<1, 128>>>(seen + 2);
    if (foreign == 2) k_foreign<<<1, 128, 40 * 1024>>>(seen + 2);
    k_residency<<<blocks, 256>>>((int *)(g->peer[0] + g->lay.probe), g->probe_base,
                                  (uint64_t)timeout_ms * 1000000ull, seen, 1.0f + (float)blocks, seen + 3);
    r = kgpu_launch_error("residency probe");
    if (r == kcclSuccess) e = kgpuMemcpy(host, seen, sizeof host, kgpuMemcpyDefault); /* waits for it */
    if (r == kcclSuccess && e == kgpuSuccess && sm_out)
      e = kgpuMemcpy(sm_out, seen + 3, sizeof(int) * (size_t)blocks, kgpuMemcpyDefault);
  }
  kgpuFree(seen);
  if (r != kcclSuccess) return r;
  if (e != kgpuSuccess) return kccl_err(kcclUnhandledCudaError, "residency probe: %s", kgpuGetErrorString(e));
  out[0] = (int)(host[0] - before); /* arrivals the best-placed block saw */
  out[1] = blocks * g->shape.nranks;
  out[2] = fa.numRegs;
  out[3] = per_sm;
  return kcclSuccess;
}

static kcclResult_t devapi_args(int count, int dtype, int blocks) {
  if (dtype != kcclFloat32 && dtype != kcclFloat16 && dtype != kcclBfloat16)
    return kccl_err(kcclInvalidArgument, "the device API takes float32, float16 or bfloat16");
  if (blocks < 1 || blocks > KCCL_DEV_MAX_BLOCKS)
    return kccl_err(kcclInvalidArgument, "blocks=%d: 1..%d", blocks, KCCL_DEV_MAX_BLOCKS);
  const int es = dtype == kcclFloat32 ? 4 : 2;
  if (count < 0 || (size_t)((count + blocks - 1) / blocks) * es > KCCL_LL_MAX_BYTES)
    return kccl_err(kcclInvalidArgument, "count=%d over %d blocks exceeds %d bytes per block", count, blocks,
                    KCCL_LL_MAX_BYTES);
  return kcclSuccess;
}

extern "C" kcclResult_t kgpu_dev_selftest(struct kgpu *g, const void *inputs, void *outputs, size_t count,
                                          int dtype, int op, int iters, int blocks, void *stream) {
  kcclResult_t r = devapi_args((int)count, dtype, blocks);
  if (r != kcclSuccess) return r;
  if (op < 0 || op >= kcclNumOps) return kccl_err(kcclInvalidArgument, "unknown op %d", op);
  /* Both copies: <= 8 ranks (what a kernel that knows its size would use) and the general one. */
  auto kern = g->shape.nranks <= 8 ? k_dev_selftest<8> : k_dev_selftest<KCCL_GPU_MAX_RANKS>;
  kern<<<blocks, KCCL_LL_THREADS, 0, (kgpuStream_t)stream>>>(g->dc[1], (const char *)inputs, (char *)outputs,
                                                             (int)count, dtype, op, iters);
  return kgpu_launch_error("device-API self-test");
}

static kcclResult_t timed(kgpuEvent_t e0, kgpuEvent_t e1, double *ms) {
  float f = 0;
  KGPU_CHECK(kgpuEventSynchronize(e1));
  KGPU_CHECK(kgpuEventElapsedTime(&f, e0, e1));
  *ms = f;
  return kcclSuccess;
}

extern "C" kcclResult_t kgpu_bench_dev(struct kgpu *g, void *buf, size_t count, int dtype, int iters, int blocks,
                                       double *us_per_call) {
  kcclResult_t r = devapi_args((int)count, dtype, blocks);
  if (r != kcclSuccess) return r;
  KGPU_CHECK(kgpuSetDevice(g->device));
  kgpuEvent_t e0, e1;
  KGPU_CHECK(kgpuEventCreate(&e0));
  KGPU_CHECK(kgpuEventCreate(&e1));
  /* Two launches timed together minus one: the kernel launch and the ranks'
   * start skew cancel out of the per-call figure. */
  double ms_short = 0, ms_long = 0;
  const int short_iters = iters / 10 > 0 ? iters / 10 : 1;
  for (int pass = 0; pass < 2 && r == kcclSuccess; pass++) {
    const int it = pass ? iters + short_iters : short_iters;
    kgpuEventRecord(e0, 0);
    auto kern = g->shape.nranks <= 8 ? k_dev_chain<8, false> : k_dev_chain<KCCL_GPU_MAX_RANKS, false>;
    kern<<<blocks, KCCL_LL_THREADS>>>(g->dc[1], (char *)buf, (int)count, dtype, it, nullptr);
    kgpuEventRecord(e1, 0);
    if ((r = kgpu_launch_error("device-API chain")) == kcclSuccess) r = timed(e0, e1, pass ? &ms_long : &ms_short);
  }
  kgpuEventDestroy(e0);
  kgpuEventDestroy(e1);
  if (r != kcclSuccess) return r;
  if (g->status_h->code) return (kcclResult_t)g->status_h->code;
  *us_per_call = (ms_long - ms_short) * 1000.0 / iters;
  return kcclSuccess;
}

extern "C" kcclResult_t kgpu_bench_dev_phases(struct kgpu *g, void *buf, size_t count, int dtype, int iters,
                                              int blocks, double phases[KCCL_LL_TRACE_SLOTS]) {
  kcclResult_t r = devapi_args((int)count, dtype, blocks);
  if (r != kcclSuccess) return r;
  KGPU_CHECK(kgpuSetDevice(g->device));
  int khz = 0;
  KGPU_CHECK(kgpuDeviceGetAttribute(&khz, kgpuDevAttrClockRate, g->device));
  long long *tr = NULL, host[KCCL_LL_TRACE_SLOTS] = {0};
  KGPU_CHECK(kgpuMalloc((void **)&tr, sizeof host));
  kgpuError_t e = kgpuMemset(tr, 0, sizeof host);
  if (e == kgpuSuccess) {
    auto kern = g->shape.nranks <= 8 ? k_dev_chain<8, true> : k_dev_chain<KCCL_GPU_MAX_RANKS, true>;
    kern<<<blocks, KCCL_LL_THREADS>>>(g->dc[1], (char *)buf, (int)count, dtype, iters, tr);
    r = kgpu_launch_error("device-API trace");
    if (r == kcclSuccess) e = kgpuMemcpy(host, tr, sizeof host, kgpuMemcpyDefault); /* waits for the kernel */
  }
  kgpuFree(tr);
  if (r != kcclSuccess) return r;
  if (e != kgpuSuccess) return kccl_err(kcclUnhandledCudaError, "device-API trace: %s", kgpuGetErrorString(e));
  if (g->status_h->code) return (kcclResult_t)g->status_h->code;
  /* clock64 counts SM cycles; the nominal clock converts them (boost may differ a little). */
  for (int i = 0; i < KCCL_LL_TRACE_SLOTS; i++)
    phases[i] = i < 3 ? (double)host[i] / iters / (khz * 1e-3) : (double)host[i] / iters;
  return kcclSuccess;
}

extern "C" kcclResult_t kgpu_bench_flag_hop(struct kgpu *g, int iters, int mode, double *us_per_hop) {
  if (mode < 0 || mode > 3) return kccl_err(kcclInvalidArgument, "flag-hop mode %d: 0..3", mode);
  if (g->shape.nranks < 2) return kccl_err(kcclInvalidUsage, "the flag-hop benchmark needs 2 ranks");
  *us_per_hop = 0;
  if (g->shape.rank > 1) return kcclSuccess; /* only ranks 0 and 1 take part */
  KGPU_CHECK(kgpuSetDevice(g->device));
  kgpuEvent_t e0, e1;
  KGPU_CHECK(kgpuEventCreate(&e0));
  KGPU_CHECK(kgpuEventCreate(&e1));
  kgpuEventRecord(e0, 0);
  k_flag_hop<<<1, 1>>>(g->dc[0], g->lay.hop, g->hop_base, iters, mode);
  kgpuEventRecord(e1, 0);
  g->hop_base += (uint64_t)iters;
  double ms = 0;
  kcclResult_t r = kgpu_launch_error("flag hop");
  if (r == kcclSuccess) r = timed(e0, e1, &ms);
  kgpuEventDestroy(e0);
  kgpuEventDestroy(e1);
  if (r != kcclSuccess) return r;
  if (g->status_h->code) return (kcclResult_t)g->status_h->code;
  *us_per_hop = ms * 1000.0 / (2.0 * iters);
  return kcclSuccess;
}
