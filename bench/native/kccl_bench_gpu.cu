/* kccl_bench_gpu.cu - the GPU half of the benchmarks: kernels that call the
 * device API as a user kernel would (a self-test, its group form's self-test
 * shaped as KIE's monokernel calls it, and a latency chain), the chain with
 * the device header's phase trace, the flag-hop floor and a
 * residency probe.  The last two need words every rank can reach: this file
 * allocates them itself and shares them over CUDA IPC, with handles passed
 * through kcclAllGather, so the library keeps nothing for them. */
#include <string.h>

#include "kccl_bench.h"
#include "kccl_device.cuh"

#define KB_CUDA(call)                                                                                      \
  do {                                                                                                     \
    cudaError_t e_ = (call);                                                                               \
    if (e_ != cudaSuccess)                                                                                 \
      return kb_fail(kcclUnhandledCudaError, "%s failed: %s (%s:%d)", #call, cudaGetErrorString(e_), __FILE__, \
                     __LINE__);                                                                            \
  } while (0)

static kcclDevComm devcomm(const struct kb_gpu *g) {
  kcclDevComm dc;
  static_assert(sizeof dc == KCCL_DEV_COMM_BYTES, "kcclDevComm and KCCL_DEV_COMM_BYTES disagree");
  memcpy(&dc, g->dc, sizeof dc);
  return dc;
}

/* This block's share [lo, hi) of count elements, in even slices. */
__device__ static inline void block_slice(int count, int *lo, int *hi) {
  const int per = (count + gridDim.x - 1) / gridDim.x;
  *lo = blockIdx.x * per < count ? blockIdx.x * per : count;
  *hi = *lo + per < count ? *lo + per : count;
}

/* Iteration k: every element of this block's slice becomes in[i] + k (in the
 * data type) in out row k, which is then all-reduced in place and left for
 * the host to check. */
template <int MAXR>
__global__ void __launch_bounds__(KCCL_LL_THREADS) k_selftest(kcclDevComm dc, const char *in, char *out, int count,
                                                              int dt, int op, int iters) {
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

/* A dependent chain: each call averages the previous result, which keeps the
 * values bounded over thousands of calls.  TRACE: the same chain through the
 * device header's traced copy, block 0 filling `trace`. */
template <int MAXR, bool TRACE>
__global__ void __launch_bounds__(KCCL_LL_THREADS) k_chain(kcclDevComm dc, char *buf, int count, int dt, int iters,
                                                           long long *trace) {
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

/* Ranks 0 and 1 bounce a counter through words[2] of each rank's scratch.
 * mode 0: release / acquire at system scope, pushed into the peer's memory (as
 * the chunked kernels do); 1: volatile, pushed; 2: relaxed at GPU scope, pushed;
 * 3: volatile, pulled (each rank writes its own word and polls the peer's).
 * One thread each; the wait is bounded by the communicator's timeout. */
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

__global__ void k_flag_hop(kcclDevComm dc, uint64_t *own, uint64_t *peer, int iters, int mode) {
  const int me = dc.rank, other = 1 - me;
  /* push: write the peer's word [other], poll own word [me]; pull: write own
   * word [me], poll the peer's word [other]. */
  uint64_t *dst = mode == 3 ? own + me : peer + other;
  const uint64_t *src = mode == 3 ? peer + other : own + me;
  volatile int never = 0;
  for (int i = 1; i <= iters; i++) {
    const uint64_t v = (uint64_t)i;
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
 * then waits (bounded) until all have.  When the GPU cannot hold every rank's
 * blocks at once, the resident ones see fewer arrivals than the target and
 * give up at the deadline; the most any block saw is how many were resident
 * together.  __launch_bounds__(256, 3) and KB_PROBE_LIVE floats kept live
 * across the wait give it about the collective kernels' footprint (~80
 * registers: 3 blocks per SM by the occupancy calculator). */
#define KB_PROBE_LIVE 48
__global__ void __launch_bounds__(256, 3) k_residency(int *counter, int target, uint64_t timeout_ns, int *seen,
                                                      float seed, int *sm_out) {
  float keep[KB_PROBE_LIVE];
#pragma unroll
  for (int i = 0; i < KB_PROBE_LIVE; i++) keep[i] = seed * (float)(kgpu_clock64() ^ i); /* not recomputable later */
  if (threadIdx.x == 0) {
    sm_out[blockIdx.x] = (int)kgpu_smid();
    int v = atomicAdd_system(counter, 1) + 1;
    const uint64_t deadline = kgpu_time_ns() + timeout_ns;
    while (v < target && kgpu_time_ns() < deadline) {
      kgpu_pause();
      v = *(volatile int *)counter;
    }
    atomicMax(seen, v > target ? target : v);
  }
  __syncthreads();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < KB_PROBE_LIVE; i++) s += keep[i] * keep[(i + 1) % KB_PROBE_LIVE];
  if (s == 1234.5f) seen[1] = 1; /* never in practice: keeps `keep` live, so the registers stay allocated */
}

/* The probe's "foreign" kernels: what an application might launch on its stream
 * just before a collective.  One block; k_foreign takes dynamic shared memory
 * (40 KB asks the SM for a larger carveout than the collective kernels use). */
__global__ void k_foreign(int *out) {
  extern __shared__ int s_buf[];
  s_buf[threadIdx.x] = (int)threadIdx.x;
  __syncthreads();
  if (threadIdx.x == 0) out[0] = s_buf[blockDim.x - 1];
}
__global__ void k_foreign_plain(int *out) {
  if (threadIdx.x == 0) out[0] = (int)blockDim.x;
}

/* kcclDevAllReduceGroup's self-test, shaped as the monokernel calls it: blocks
 * of KB_GROUP_THREADS callers and one bystander warp that never calls KCCL,
 * the grid's last `reducers` blocks reducing on slots counted from the end
 * (block gridDim.x - 1 - s on slot s: no slot is its block's index), several
 * calls in a row, the callers meeting at their named barrier between calls
 * too, the cancel word always passed.  Each call's input is small integers
 * (kb_group_value), exact in every data type and in any sum of up to
 * KB_GROUP_MAX_RANKS of them, so the result is checked on the device to the
 * bit; bytes just past the data are checked untouched. */
#define KB_GROUP_THREADS KCCL_LL_THREADS
#define KB_GROUP_BLOCK (KB_GROUP_THREADS + 32)
#define KB_GROUP_GUARD_BYTES 64
#define KB_GROUP_REGION (KB_GROUP_MAX_BYTES + KB_GROUP_GUARD_BYTES)
#define KB_GROUP_GUARD ((char)0xa5)
#define KB_GROUP_MARK 0x6b620000u
static_assert(KB_GROUP_MAX_BYTES == KCCL_LL_MAX_BYTES, "kccl_bench.h's KB_GROUP_MAX_BYTES is the device API's limit");
static_assert(KB_GROUP_MAX_SLOTS == KCCL_DEV_MAX_BLOCKS, "kccl_bench.h's KB_GROUP_MAX_SLOTS is the device API's");
static_assert(KB_GROUP_MAX_RANKS <= KCCL_GPU_MAX_RANKS, "KB_GROUP_MAX_RANKS: a copy the device API has");

/* In -7..7: any sum of KB_GROUP_MAX_RANKS of them is an integer bfloat16 holds exactly. */
__device__ static inline float kb_group_value(int rank, int slot, int call, int i) {
  return (float)((rank * 7 + slot * 5 + call * 3 + i * 11) % 15 - 7);
}

/* Call c's count: every third call a smaller one, so that a slot sees calls of
 * other sizes (and signatures) in turn. */
__device__ static inline int kb_group_count(int count, int call) { return call % 3 == 2 ? count / 3 + 1 : count; }

__device__ static inline uint32_t kb_group_encode(int dt, float x) {
  if (dt == kcclFloat32) return __float_as_uint(x);
  if (dt == kcclBfloat16) return kccl_detail::f32_to_bf16(x);
  return __half_as_ushort(__float2half_rn(x));
}

__device__ static inline void kb_group_put(char *p, int dt, int i, float x) {
  if (dt == kcclFloat32) ((uint32_t *)p)[i] = kb_group_encode(dt, x);
  else ((uint16_t *)p)[i] = (uint16_t)kb_group_encode(dt, x);
}

__device__ static inline uint32_t kb_group_bits(const char *p, int dt, int i) {
  return dt == kcclFloat32 ? ((const uint32_t *)p)[i] : ((const uint16_t *)p)[i];
}

/* The callers' own barrier, as the monokernel's consumers meet between calls. */
__device__ static inline void kb_group_bar(int barrier) {
  asm volatile("barrier.sync %0, %1;" ::"r"(barrier), "r"(KB_GROUP_THREADS) : "memory");
}

/* The bystander warp: keeps busy with work of its own until its block's
 * callers are done, never at their barrier.  A bound (the communicator's
 * timeout and a second) ends the wait if a call needed this warp, which is
 * then counted.  The one that cancels (block 0's, cancel 1) stores the cancel
 * word cancel_after_ns after its start, as the monokernel's producer sets the
 * abort flag, and waits for that moment even when its own block has no call. */
__device__ static void kb_group_bystander(const kcclDevComm &dc, const volatile int *s_done, unsigned *cancel,
                                          bool cancels, uint64_t cancel_after_ns, int *res, unsigned *marks) {
  const int lane = (int)threadIdx.x - KB_GROUP_THREADS;
  const uint64_t t0 = kgpu_time_ns();
  const uint64_t limit = (dc.timeout_ns ? dc.timeout_ns : 60000000000ull) + 1000000000ull;
  uint32_t work = 2166136261u ^ (uint32_t)lane;
  bool cancel_pending = cancels;
  for (;;) {
    const uint64_t t = kgpu_time_ns() - t0;
    if (cancel_pending && t >= cancel_after_ns) {
      if (lane == 0) {
        *(volatile unsigned *)cancel = 1u;
        __threadfence();
      }
      cancel_pending = false;
    }
    if (*s_done && !cancel_pending) break;
    if (t > limit) {
      if (lane == 0) atomicAdd(&res[KB_GROUP_BYSTANDER], 1);
      break;
    }
    work = (work ^ (uint32_t)t) * 16777619u;
    kgpu_pause();
  }
  for (int d = 16; d; d >>= 1) work ^= __shfl_xor_sync(0xffffffffu, work, d);
  if (lane == 0) {
    marks[blockIdx.x] = KB_GROUP_MARK ^ blockIdx.x;
    marks[gridDim.x + blockIdx.x] = work; /* its work's result, kept (not checked) */
  }
}

/* cancel 0: every rank calls, results checked.  1 and 2: rank 1 never calls;
 * the others' calls must end through the cancel word, set while they wait
 * (1: by block 0's bystander) or before the launch (2: by the host). */
template <int MAXR>
__global__ void __launch_bounds__(KB_GROUP_BLOCK) k_group_selftest(kcclDevComm dc, int dt, int op, int count,
                                                                   int calls, int reducers, int barrier, char *gdata,
                                                                   unsigned *cancel, int cancel_mode,
                                                                   uint64_t cancel_after_ns, int *res,
                                                                   unsigned *marks) {
  __shared__ __align__(16) char s_data[KB_GROUP_REGION];
  __shared__ volatile int s_done;
  const int tid = (int)threadIdx.x, slot = (int)gridDim.x - 1 - (int)blockIdx.x;
  if (tid == 0) s_done = 0;
  __syncthreads(); /* the last time the whole block meets */
  if (tid >= KB_GROUP_THREADS) {
    kb_group_bystander(dc, &s_done, cancel, cancel_mode == 1 && blockIdx.x == 0, cancel_after_ns, res, marks);
    return;
  }
  const bool calls_here = slot < reducers && !(cancel_mode && dc.rank == 1);
  char *data = gdata ? gdata + (size_t)slot * KB_GROUP_REGION : s_data;
  const int es = dt == kcclFloat32 ? 4 : 2;
  for (int c = 0; calls_here && c < calls; c++) {
    const int n = kb_group_count(count, c);
    const int o = op >= 0 ? op : (c & 1) ? (int)kcclMax : (int)kcclSum;
    const int nb = n * es;
    for (int i = tid; i < n; i += KB_GROUP_THREADS) kb_group_put(data, dt, i, kb_group_value(dc.rank, slot, c, i));
    for (int b = nb + tid; b < nb + KB_GROUP_GUARD_BYTES; b += KB_GROUP_THREADS) data[b] = KB_GROUP_GUARD;
    kb_group_bar(barrier);
    const kcclDevGroup g = {slot, barrier, KB_GROUP_THREADS, cancel};
    const kcclResult_t rc = kcclDevAllReduceGroup<MAXR>(dc, g, data, n, (kcclDataType_t)dt, (kcclRedOp_t)o);
    if (rc != kcclSuccess) { /* the same for every caller: the call ends at its barrier */
      if (tid == 0) {
        atomicAdd(&res[KB_GROUP_CALL_ERRS], 1);
        atomicCAS(&res[KB_GROUP_FIRST_CODE], 0, (int)rc);
      }
      break;
    }
    if (tid == 0) atomicAdd(&res[KB_GROUP_CALLS_OK], 1);
    for (int i = tid; i < n; i += KB_GROUP_THREADS) {
      float want = kb_group_value(0, slot, c, i);
      for (int r = 1; r < dc.nranks; r++) {
        const float v = kb_group_value(r, slot, c, i);
        want = o == kcclMax ? fmaxf(want, v) : want + v;
      }
      const uint32_t got = kb_group_bits(data, dt, i), w = kb_group_encode(dt, want);
      if (got != w) {
        atomicAdd(&res[KB_GROUP_WRONG], 1);
        if (atomicCAS(&res[KB_GROUP_CLAIM], 0, 1) == 0) {
          res[KB_GROUP_BAD_SLOT] = slot;
          res[KB_GROUP_BAD_CALL] = c;
          res[KB_GROUP_BAD_INDEX] = i;
          res[KB_GROUP_BAD_GOT] = (int)got;
          res[KB_GROUP_BAD_WANT] = (int)w;
        }
      }
    }
    for (int b = nb + tid; b < nb + KB_GROUP_GUARD_BYTES; b += KB_GROUP_THREADS)
      if (data[b] != KB_GROUP_GUARD) atomicAdd(&res[KB_GROUP_GUARD], 1);
    kb_group_bar(barrier); /* the next call's inputs overwrite what this one checked */
  }
  if (tid == 0) s_done = 1;
}

/* Loads every kernel of this file once per process, before the first launch:
 * under lazy module loading a first launch loads its module then, which can
 * wait for the device while a collective kernel of this rank waits for peers.
 * The kernels that wait for peers ask for the largest shared-memory carveout,
 * as kccl_device.cuh asks of a user's persistent kernel; the probe keeps the
 * driver's choice unless told otherwise. */
extern "C" kcclResult_t kbg_load(int device) {
  static int loaded = 0;
  KB_CUDA(cudaSetDevice(device));
  if (loaded) return kcclSuccess;
  const void *const waiting[] = {(const void *)k_selftest<8>, (const void *)k_selftest<KCCL_GPU_MAX_RANKS>,
                                 (const void *)k_chain<8, false>, (const void *)k_chain<KCCL_GPU_MAX_RANKS, false>,
                                 (const void *)k_chain<8, true>, (const void *)k_chain<KCCL_GPU_MAX_RANKS, true>,
                                 (const void *)k_flag_hop, (const void *)k_group_selftest<KB_GROUP_MAX_RANKS>};
  const void *const others[] = {(const void *)k_foreign, (const void *)k_foreign_plain, (const void *)k_residency};
  cudaFuncAttributes fa;
  for (const void *fn : waiting) {
    KB_CUDA(cudaFuncGetAttributes(&fa, fn));
    KB_CUDA(cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  }
  for (const void *fn : others) KB_CUDA(cudaFuncGetAttributes(&fa, fn));
  loaded = 1;
  return kcclSuccess;
}

extern "C" kcclResult_t kbg_sync(int device) {
  KB_CUDA(cudaSetDevice(device));
  KB_CUDA(cudaDeviceSynchronize());
  return kcclSuccess;
}

extern "C" kcclResult_t kbg_check_ptr(int device, const void *p, size_t bytes, const char *what) {
  cudaPointerAttributes a;
  if (!p) return kb_fail(kcclInvalidArgument, "%s is NULL", what);
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess || a.type != cudaMemoryTypeDevice) {
    cudaGetLastError();
    return kb_fail(kcclInvalidArgument, "%s (%p, %zu bytes) is not device memory", what, p, bytes);
  }
  if (a.device != device)
    return kb_fail(kcclInvalidArgument, "%s is on device %d, the communicator on %d", what, a.device, device);
  return kcclSuccess;
}

static kcclResult_t launch_error(const char *what) {
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? kcclSuccess : kb_fail(kcclUnhandledCudaError, "%s launch: %s", what, cudaGetErrorString(e));
}

static kcclResult_t devapi_args(size_t count, int dtype, int blocks) {
  if (dtype != kcclFloat32 && dtype != kcclFloat16 && dtype != kcclBfloat16)
    return kb_fail(kcclInvalidArgument, "the device API takes float32, float16 or bfloat16");
  if (blocks < 1 || blocks > KCCL_DEV_MAX_BLOCKS)
    return kb_fail(kcclInvalidArgument, "blocks=%d: 1..%d", blocks, KCCL_DEV_MAX_BLOCKS);
  const size_t es = dtype == kcclFloat32 ? 4 : 2;
  if ((count + blocks - 1) / blocks * es > KCCL_LL_MAX_BYTES)
    return kb_fail(kcclInvalidArgument, "count=%zu over %d blocks exceeds %d bytes per block", count, blocks,
                   KCCL_LL_MAX_BYTES);
  return kcclSuccess;
}

extern "C" kcclResult_t kbg_selftest(const struct kb_gpu *g, const void *in, void *out, size_t count, int dtype,
                                     int op, int iters, int blocks, void *stream) {
  kcclResult_t r = devapi_args(count, dtype, blocks);
  if (r != kcclSuccess) return r;
  /* Both copies: <= 8 ranks (what a kernel that knows its size would use) and the general one. */
  auto kern = g->nranks <= 8 ? k_selftest<8> : k_selftest<KCCL_GPU_MAX_RANKS>;
  kern<<<blocks, KCCL_LL_THREADS, 0, (cudaStream_t)stream>>>(devcomm(g), (const char *)in, (char *)out, (int)count,
                                                             dtype, op, iters);
  if ((r = launch_error("device-API self-test")) != kcclSuccess) return r;
  return kbg_sync(g->device);
}

static kcclResult_t elapsed_ms(cudaEvent_t e0, cudaEvent_t e1, double *ms) {
  float f = 0;
  KB_CUDA(cudaEventSynchronize(e1));
  KB_CUDA(cudaEventElapsedTime(&f, e0, e1));
  *ms = f;
  return kcclSuccess;
}

extern "C" kcclResult_t kbg_chain(const struct kb_gpu *g, void *buf, size_t count, int dtype, int iters, int blocks,
                                  double *us_per_call) {
  kcclResult_t r = devapi_args(count, dtype, blocks);
  if (r != kcclSuccess) return r;
  cudaEvent_t e0, e1;
  KB_CUDA(cudaEventCreate(&e0));
  KB_CUDA(cudaEventCreate(&e1));
  /* Two launches, a short and a long one, timed apart: their difference leaves
   * the launch and the ranks' start skew out of the per-call figure. */
  double ms_short = 0, ms_long = 0;
  const int short_iters = iters / 10 > 0 ? iters / 10 : 1;
  auto kern = g->nranks <= 8 ? k_chain<8, false> : k_chain<KCCL_GPU_MAX_RANKS, false>;
  for (int pass = 0; pass < 2 && r == kcclSuccess; pass++) {
    cudaEventRecord(e0, 0);
    kern<<<blocks, KCCL_LL_THREADS>>>(devcomm(g), (char *)buf, (int)count, dtype,
                                      pass ? iters + short_iters : short_iters, nullptr);
    cudaEventRecord(e1, 0);
    if ((r = launch_error("device-API chain")) == kcclSuccess) r = elapsed_ms(e0, e1, pass ? &ms_long : &ms_short);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  if (r == kcclSuccess) *us_per_call = (ms_long - ms_short) * 1000.0 / iters;
  return r;
}

extern "C" kcclResult_t kbg_phases(const struct kb_gpu *g, void *buf, size_t count, int dtype, int iters, int blocks,
                                   double phases[4]) {
  static_assert(KCCL_LL_TRACE_SLOTS == 4, "phases[] has one entry per trace slot");
  kcclResult_t r = devapi_args(count, dtype, blocks);
  if (r != kcclSuccess) return r;
  int khz = 0;
  KB_CUDA(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, g->device));
  long long *tr = NULL, host[KCCL_LL_TRACE_SLOTS] = {0};
  KB_CUDA(cudaMalloc((void **)&tr, sizeof host));
  cudaError_t e = cudaMemset(tr, 0, sizeof host);
  if (e == cudaSuccess) {
    auto kern = g->nranks <= 8 ? k_chain<8, true> : k_chain<KCCL_GPU_MAX_RANKS, true>;
    kern<<<blocks, KCCL_LL_THREADS>>>(devcomm(g), (char *)buf, (int)count, dtype, iters, tr);
    r = launch_error("device-API trace");
    if (r == kcclSuccess) e = cudaMemcpy(host, tr, sizeof host, cudaMemcpyDefault); /* waits for the kernel */
  }
  cudaFree(tr);
  if (r != kcclSuccess) return r;
  if (e != cudaSuccess) return kb_fail(kcclUnhandledCudaError, "device-API trace: %s", cudaGetErrorString(e));
  /* clock64 counts SM cycles; the nominal clock converts them (boost may differ a little). */
  for (int i = 0; i < KCCL_LL_TRACE_SLOTS; i++)
    phases[i] = i < 3 ? (double)host[i] / iters / (khz * 1e-3) : (double)host[i] / iters;
  return kcclSuccess;
}

/* Words every rank reaches: each rank allocates `bytes` (zeroed) and shares it
 * over CUDA IPC, the handles gathered with kcclAllGather.  The gather is also
 * the start line: no rank goes on before every rank zeroed its words. */
/* A whole 2 MiB (the driver's allocation granularity), so that the IPC handle
 * names an allocation of its own rather than a piece of a shared one. */
#define KB_SCRATCH_BYTES (2u << 20)
struct scratch {
  char *own;
  char *peer[KCCL_GPU_MAX_RANKS]; /* own included */
  int nranks, rank;
};

static void scratch_close(struct scratch *s) {
  for (int r = 0; r < s->nranks; r++)
    if (r != s->rank && s->peer[r]) cudaIpcCloseMemHandle(s->peer[r]);
  if (s->own) cudaFree(s->own);
  memset(s, 0, sizeof *s);
}

static kcclResult_t scratch_open(const struct kb_gpu *g, struct scratch *s) {
  memset(s, 0, sizeof *s);
  s->nranks = g->nranks;
  s->rank = g->rank;
  const size_t hb = sizeof(cudaIpcMemHandle_t);
  char *stage = NULL;
  cudaIpcMemHandle_t handles[KCCL_GPU_MAX_RANKS];
  KB_CUDA(cudaMalloc((void **)&s->own, KB_SCRATCH_BYTES));
  s->peer[g->rank] = s->own;
  cudaError_t e = cudaMemset(s->own, 0, KB_SCRATCH_BYTES);
  if (e == cudaSuccess) e = cudaIpcGetMemHandle(&handles[g->rank], s->own);
  if (e == cudaSuccess) e = cudaMalloc((void **)&stage, hb * (1 + (size_t)g->nranks));
  if (e == cudaSuccess) e = cudaMemcpy(stage, &handles[g->rank], hb, cudaMemcpyHostToDevice);
  kcclResult_t r = kcclSuccess;
  if (e == cudaSuccess) {
    r = kcclAllGather(stage, stage + hb, hb, kcclUint8, g->comm, NULL);
    if (r != kcclSuccess) r = kb_lib(r);
    else if ((e = cudaMemcpy(handles, stage + hb, hb * g->nranks, cudaMemcpyDeviceToHost)) == cudaSuccess)
      for (int p = 0; p < g->nranks && e == cudaSuccess; p++)
        if (p != g->rank) e = cudaIpcOpenMemHandle((void **)&s->peer[p], handles[p], cudaIpcMemLazyEnablePeerAccess);
  }
  if (stage) cudaFree(stage);
  if (r == kcclSuccess && e != cudaSuccess)
    r = kb_fail(kcclUnhandledCudaError, "benchmark scratch: %s", cudaGetErrorString(e));
  if (r != kcclSuccess) scratch_close(s);
  return r;
}

/* Every rank waits here until all are done with each other's scratch, then lets
 * go of its mappings and its words. */
static kcclResult_t scratch_done(const struct kb_gpu *g, struct scratch *s, kcclResult_t r) {
  kcclResult_t b = kcclBarrier(g->comm, NULL);
  if (b != kcclSuccess && r == kcclSuccess) r = kb_lib(b);
  cudaDeviceSynchronize();
  scratch_close(s);
  return r;
}

extern "C" kcclResult_t kbg_flag_hop(const struct kb_gpu *g, int iters, int mode, double *us_per_hop) {
  *us_per_hop = 0;
  struct scratch s;
  kcclResult_t r = scratch_open(g, &s);
  if (r != kcclSuccess) return r;
  if (g->rank <= 1) { /* only ranks 0 and 1 take part */
    cudaEvent_t e0, e1;
    if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess)
      return scratch_done(g, &s, kb_fail(kcclUnhandledCudaError, "flag hop: cudaEventCreate failed"));
    double ms = 0;
    cudaEventRecord(e0, 0);
    k_flag_hop<<<1, 1>>>(devcomm(g), (uint64_t *)s.own, (uint64_t *)s.peer[1 - g->rank], iters, mode);
    cudaEventRecord(e1, 0);
    r = launch_error("flag hop");
    if (r == kcclSuccess) r = elapsed_ms(e0, e1, &ms);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    if (r == kcclSuccess) *us_per_hop = ms * 1000.0 / (2.0 * iters);
  }
  return scratch_done(g, &s, r);
}

extern "C" kcclResult_t kbg_residency(const struct kb_gpu *g, int blocks, int timeout_ms, int foreign, int carveout,
                                      int out[4], int *sm_out) {
  KB_CUDA(cudaFuncSetAttribute(k_residency, cudaFuncAttributePreferredSharedMemoryCarveout, carveout));
  cudaFuncAttributes fa;
  int per_sm = 0;
  KB_CUDA(cudaFuncGetAttributes(&fa, k_residency));
  KB_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_residency, 256, 0));
  int *seen = NULL, host[2] = {0, 0};
  /* seen[0..1], then the foreign kernel's word, then one SM id per block */
  KB_CUDA(cudaMalloc((void **)&seen, sizeof(int) * (3 + (size_t)blocks)));
  struct scratch s;
  kcclResult_t r = scratch_open(g, &s);
  if (r != kcclSuccess) {
    cudaFree(seen);
    return r;
  }
  const int target = blocks * g->nranks;
  cudaError_t e = cudaMemset(seen, 0, sizeof host);
  if (e == cudaSuccess) {
    if (foreign == 1) k_foreign_plain<<<1, 128>>>(seen + 2);
    if (foreign == 2) k_foreign<<<1, 128, 40 * 1024>>>(seen + 2);
    k_residency<<<blocks, 256>>>((int *)s.peer[0], target, (uint64_t)timeout_ms * 1000000ull, seen,
                                  1.0f + (float)blocks, seen + 3);
    r = launch_error("residency probe");
    if (r == kcclSuccess) e = cudaMemcpy(host, seen, sizeof host, cudaMemcpyDefault); /* waits for it */
    if (r == kcclSuccess && e == cudaSuccess && sm_out)
      e = cudaMemcpy(sm_out, seen + 3, sizeof(int) * (size_t)blocks, cudaMemcpyDefault);
  }
  cudaFree(seen);
  if (r == kcclSuccess && e != cudaSuccess)
    r = kb_fail(kcclUnhandledCudaError, "residency probe: %s", cudaGetErrorString(e));
  r = scratch_done(g, &s, r);
  if (r != kcclSuccess) return r;
  out[0] = host[0]; /* arrivals the best-placed block saw */
  out[1] = target;
  out[2] = fa.numRegs;
  out[3] = per_sm;
  return kcclSuccess;
}

extern "C" kcclResult_t kbg_group_selftest(const struct kb_gpu *g, int dtype, int op, int count, int calls,
                                           int blocks, int reducers, int barrier, int global_data, int cancel,
                                           int cancel_after_us, int *out, double *ms) {
  /* One allocation: the results, the cancel word, two marks per block, then
   * each reducer's data region (global_data). */
  const size_t res_off = 0, cancel_off = 256, marks_off = 512;
  const size_t data_off = marks_off + 2 * sizeof(unsigned) * KB_GROUP_MAX_BLOCKS;
  const size_t bytes = data_off + (global_data ? (size_t)reducers * KB_GROUP_REGION : 0);
  static_assert(KB_GROUP_OUT * sizeof(int) <= 256, "the results fit before the cancel word");
  char *mem = NULL;
  KB_CUDA(cudaMalloc((void **)&mem, bytes));
  int res[KB_GROUP_OUT];
  unsigned marks[KB_GROUP_MAX_BLOCKS];
  kcclResult_t r = kcclSuccess;
  cudaEvent_t e0 = NULL, e1 = NULL;
  cudaError_t e = cudaMemset(mem, 0, bytes);
  if (e == cudaSuccess && cancel == 2) {
    const unsigned one = 1;
    e = cudaMemcpy(mem + cancel_off, &one, sizeof one, cudaMemcpyHostToDevice);
  }
  if (e == cudaSuccess) e = cudaEventCreate(&e0);
  if (e == cudaSuccess) e = cudaEventCreate(&e1);
  if (e == cudaSuccess) {
    cudaEventRecord(e0, 0);
    k_group_selftest<KB_GROUP_MAX_RANKS><<<blocks, KB_GROUP_BLOCK>>>(
        devcomm(g), dtype, op, count, calls, reducers, barrier, global_data ? mem + data_off : nullptr,
        (unsigned *)(mem + cancel_off), cancel, (uint64_t)cancel_after_us * 1000ull, (int *)(mem + res_off),
        (unsigned *)(mem + marks_off));
    cudaEventRecord(e1, 0);
    r = launch_error("device-API group self-test");
    if (r == kcclSuccess) r = elapsed_ms(e0, e1, ms);
    if (r == kcclSuccess) e = cudaMemcpy(res, mem + res_off, sizeof res, cudaMemcpyDeviceToHost);
    if (r == kcclSuccess && e == cudaSuccess)
      e = cudaMemcpy(marks, mem + marks_off, sizeof(unsigned) * (size_t)blocks, cudaMemcpyDeviceToHost);
  }
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  cudaFree(mem);
  if (r != kcclSuccess) return r;
  if (e != cudaSuccess) return kb_fail(kcclUnhandledCudaError, "device-API group self-test: %s", cudaGetErrorString(e));
  for (int b = 0; b < blocks; b++)
    if (marks[b] != (KB_GROUP_MARK ^ (unsigned)b)) res[KB_GROUP_BYSTANDER]++;
  if (!res[KB_GROUP_CLAIM])
    for (int i = KB_GROUP_BAD_SLOT; i <= KB_GROUP_BAD_WANT; i++) res[i] = -1;
  memcpy(out, res, sizeof res);
  return kcclSuccess;
}
