// ll_ladder.cu - what the parts of KCCL's LL all-reduce body cost, one process.
//
// R "ranks" are R groups of B blocks of one grid on one GPU (the same L2 as R
// MPS clients, without MPS or IPC), each with its own kcclDevComm whose
// peer_base[] point into one allocation.  Each block runs a dependent chain of
// in-place 8 KB (per rank) bf16 all-reduces of its 8 KB / B slice and reports
// us per call.  Variants, from the bare exchange up to the library's code:
//   0 bare: epoch in a register, load -> push to every peer -> poll -> combine -> store
//   1 bare + a block barrier at the end of each call
//   2 bare + thread 0 reads / advances the epoch in memory + start barrier + end barrier
//   3 kccl_detail::ll_allreduce_block<8>   (the library's: signature check and bounded waits)
//   4 kccl_detail::ll_allreduce_block<16>
//   5 the library's body for bf16 max, 8 ranks at most, called directly (no dtype / op dispatch)
//   6 variant 2 + the header line (thread 0 pushes it, thread p checks peer p's)
//   7 variant 6 + the library's bounded wait (keep_waiting between poll rounds)
//   8 variant 7 with the peer loops run to 8 and the rank count known only at run time
//   100 + F: the feature rungs (see feat)
//   and variants 3 and 5 again with the library's pull mode (dc.pull = 1), in one hop and in
//   two (dc.ll_hops = 2: reduce-scatter, then all-gather; kccl_device.cuh "Two hops")
//   Each at 256, 128, 64 and 32 threads per block (one 8-byte datum per thread: 4-32 blocks).
//   200 + M: (session 13) no LL lines: plain data behind one flag per block (M 0) or per
//           warp (M 1), see flagx
//   ll_ladder [iters=2000] [ranks (0: 2, 4, 8)] [threads (0: all four)] [lib | flag]
//   (one config: for ncu; lib: only the library's rungs, push and pull, one hop and two;
//   flag: the flag rungs beside the bare exchange and the library's pull body)
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -Ikccl_native/include -o ll_ladder ll_ladder.cu
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench_cuda.h"
#include "kccl_device.cuh"

using namespace kccl_detail;

static const size_t LL_BYTES = (size_t)KCCL_LL_SETS * 8 * KCCL_DEV_MAX_BLOCKS * KCCL_LL_REGION_BYTES;
static const size_t MISC = 64 * 1024; // epochs, fail word, status, data
static const size_t RANK_BYTES = LL_BYTES + MISC;
static const size_t OFF_EPOCHS = LL_BYTES, OFF_FAIL = LL_BYTES + 1024, OFF_STATUS = LL_BYTES + 2048,
                    OFF_DATA = LL_BYTES + 4096;
static const int DATA_BYTES = 8192;

// The header rungs' line: the last line of a region, which the ladder's data
// (one line per thread, at most 256) never uses.  (The library has no header
// line since session 8: the signature rides in each data line's flag word.)
__device__ static inline uint32_t *lad_hdr(uint32_t *region) {
  return ll_line(region, KCCL_LL_THREADS * KCCL_LL_MAX_LPT - 1);
}

// F_SIG rungs: poll rounds that saw a line whose first flag word was this call's epoch and whose
// second was not e ^ sig.  Every rank calls with the same signature, so each is a 16-byte line read
// half old, half new (the library's mismatch check waits 64 rounds before it trusts such a line).
__device__ unsigned long long g_odd_rounds;

struct Ranks {
  kcclDevComm dc[8];
};

// Every rung's combine: line `tid` of ranks 0..n-1 (this rank's w0, w1; the peers' in got[p].x
// and .z) reduced with bf16 max in rank order and stored in place.
template <int MAXR>
__device__ static __forceinline__ void lad_reduce_store(const uint4 *got, int me, int n, uint32_t w0, uint32_t w1,
                                                        char *data, int tid, uint32_t nbytes) {
  float acc[4], v[4];
#pragma unroll
  for (int p = 0; p < MAXR; p++) {
    if (p < n) {
      decode(p == me ? w0 : got[p].x, p == me ? w1 : got[p].z, kcclBfloat16, v);
#pragma unroll
      for (int j = 0; j < 4; j++) acc[j] = p == 0 ? v[j] : combine(acc[j], v[j], kcclMax);
    }
  }
  encode(acc, kcclBfloat16, &w0, &w1);
  store8(data, (size_t)tid * 8, nbytes, w0, w1);
}

// The bare exchange: one 8-byte datum per thread (lines <= blockDim.x).  MAXR: the
// peer loops run to MAXR with a run-time rank count (as the library's do); V as above.
template <int R, int MAXR, int V>
__device__ static inline bool bare(const kcclDevComm &dc, int block, char *data, uint32_t nbytes, uint32_t &e,
                                   int *hung) {
  __shared__ uint32_t s_e;
  __shared__ volatile int s_fail;
  const int tid = threadIdx.x, me = dc.rank, n = MAXR == R ? R : dc.nranks;
  const uint32_t lines = nbytes / 8, sig = 0x1234u;
  uint32_t w0 = 0, w1 = 0;
  if (tid < lines) load8(data, (size_t)tid * 8, nbytes, &w0, &w1);
  if (V >= 2) {
    uint32_t *ep = dc.epochs + block;
    if (tid == 0) {
      const uint32_t nx = kgpu_ld_volatile_u32(ep) + 1;
      *ep = nx;
      s_e = nx;
      s_fail = 0;
    }
    __syncthreads();
    e = s_e;
  } else {
    e++;
  }
  const uint32_t set = e % KCCL_LL_SETS;
  uint32_t hpend = V >= 6 && tid < n && tid != me ? 1u << tid : 0;
  if (V >= 6 && tid == 0) {
#pragma unroll
    for (int p = 0; p < MAXR; p++)
      if (p < n && p != me) kgpu_st_weak_v4(lad_hdr(ll_region(dc, p, set, me, block)), sig, e, nbytes, e);
  }
  if (tid >= lines && !hpend) {
    if (V >= 1) __syncthreads();
    return true;
  }
  if (tid < lines) {
#pragma unroll
    for (int p = 0; p < MAXR; p++)
      if (p < n && p != me) kgpu_st_weak_v4(ll_line(ll_region(dc, p, set, me, block), tid), w0, e, w1, e);
  }
  uint4 got[MAXR];
  uint32_t pending = tid < lines ? ((1u << n) - 1) & ~(1u << me) : 0;
  Waiter w = waiter(dc);
  for (uint32_t polls = 0; pending | hpend; polls++) {
    uint4 hdr;
    if (V >= 6 && hpend) kgpu_ld_weak_v4(lad_hdr(ll_region(dc, me, set, tid, block)), &hdr.x, &hdr.y, &hdr.z, &hdr.w);
#pragma unroll
    for (int p = 0; p < MAXR; p++)
      if (pending & (1u << p))
        kgpu_ld_weak_v4(ll_line(ll_region(dc, me, set, p, block), tid), &got[p].x, &got[p].y, &got[p].z, &got[p].w);
#pragma unroll
    for (int p = 0; p < MAXR; p++)
      if ((pending & (1u << p)) && got[p].y == e && got[p].w == e) pending &= ~(1u << p);
    if (V >= 6 && hpend && hdr.y == e && hdr.w == e) {
      hpend = 0;
      if (hdr.x != sig || hdr.z != nbytes) *hung = 3;
    }
    if (!(pending | hpend)) break;
    if (V >= 7 && keep_waiting(dc, w, &s_fail)) { *hung = 4; return false; }
    if (polls > (1u << 24)) { *hung = 1; return false; } /* a bug here: the run's timeout ends it */
  }
  if (tid < lines) lad_reduce_store<MAXR>(got, me, n, w0, w1, data, tid, nbytes);
  if (V >= 1) __syncthreads();
  return true;
}

// Feature rungs (session 5), all on top of variant 2 (epoch in memory, 2 barriers):
//   F_PULL: the sender writes each line once, into its own buffer's slot, and
//           readers poll the sender's copy (one GPU: one L2, so pull costs what push does
//           per load, with 1 store per line instead of R-1)
//   F_SENT: after a first full round, poll only the lowest pending peer per round, and
//           all pending peers again once it has come (1 load per round while waiting)
//   F_SLEEP: __nanosleep(64) after a round that found something missing
//   F_HDR:  the header line pushed (thread 0) and polled by threads 0..R-1 (variant 6)
//   F_HDRW: as F_HDR, but polled by the last warp's lanes instead of warp 0's
//   F_HSTORE: the header pushed, not polled (the store's cost alone)
//   F_HFULL: (with F_HDR) the header looked at only in full rounds (see F_SENT)
//   F_HAFTER: (with F_HDR) the header looked at only once the thread's lines have all come
//   F_SIG:  (session 8) no header: lines carry {data, e, data, e ^ sig}, and a peer whose line has
//           e in its first word but not e ^ sig in its second is polled every round (the library's
//           mismatch check, without the verdict)
//   F_BOUND: the library's bounded wait (keep_waiting) between poll rounds
enum { F_PULL = 1, F_SENT = 2, F_SLEEP = 4, F_HDR = 8, F_HDRW = 16, F_HSTORE = 32, F_HFULL = 64, F_HAFTER = 128,
       F_SIG = 256, F_BOUND = 512 };
template <int R, int F>
__device__ static inline bool feat(const kcclDevComm &dc, int block, char *data, uint32_t nbytes, int *hung) {
  __shared__ uint32_t s_e;
  const int tid = threadIdx.x, me = dc.rank, nt = blockDim.x;
  const uint32_t lines = nbytes / 8, sig = 0x1234u;
  uint32_t w0 = 0, w1 = 0;
  if (tid < lines) load8(data, (size_t)tid * 8, nbytes, &w0, &w1);
  uint32_t *ep = dc.epochs + block;
  if (tid == 0) {
    const uint32_t nx = kgpu_ld_volatile_u32(ep) + 1;
    *ep = nx;
    s_e = nx;
  }
  __syncthreads();
  const uint32_t e = s_e, set = e % KCCL_LL_SETS, ew = (F & F_SIG) ? e ^ sig : e;
  __shared__ volatile int s_fail;
  if (tid == 0) s_fail = 0;
  const int htid = (F & F_HDRW) ? tid - (nt - 32) : tid; /* which peer's header this thread checks */
  uint32_t hpend = (F & (F_HDR | F_HDRW)) && htid >= 0 && htid < R && htid != me ? 1u << htid : 0;
  if ((F & (F_HDR | F_HDRW | F_HSTORE)) && tid == 0) {
    if (F & F_PULL) {
      kgpu_st_weak_v4(lad_hdr(ll_region(dc, me, set, me, block)), sig, e, nbytes, e);
    } else {
#pragma unroll
      for (int p = 0; p < R; p++)
        if (p != me) kgpu_st_weak_v4(lad_hdr(ll_region(dc, p, set, me, block)), sig, e, nbytes, e);
    }
  }
  if (tid < lines) {
    if (F & F_PULL) {
      kgpu_st_weak_v4(ll_line(ll_region(dc, me, set, me, block), tid), w0, e, w1, ew);
    } else {
#pragma unroll
      for (int p = 0; p < R; p++)
        if (p != me) kgpu_st_weak_v4(ll_line(ll_region(dc, p, set, me, block), tid), w0, e, w1, ew);
    }
  }
  uint4 got[R];
  uint32_t pending = tid < lines ? ((1u << R) - 1) & ~(1u << me) : 0, odd = 0;
  bool full = true;
  Waiter wt = waiter(dc);
  for (uint32_t polls = 0; pending | hpend; polls++) {
    uint4 hdr;
    const bool hlook = hpend && (!(F & F_HFULL) || full) && (!(F & F_HAFTER) || !pending);
    uint32_t *hsrc = lad_hdr((F & F_PULL) ? ll_region(dc, htid, set, htid, block) : ll_region(dc, me, set, htid, block));
    if (hlook) kgpu_ld_weak_v4(hsrc, &hdr.x, &hdr.y, &hdr.z, &hdr.w);
    const uint32_t look = (F & F_SENT) && !full ? (pending & (0u - pending)) | odd : pending;
#pragma unroll
    for (int p = 0; p < R; p++)
      if (look & (1u << p)) {
        uint32_t *src = (F & F_PULL) ? ll_line(ll_region(dc, p, set, p, block), tid)
                                     : ll_line(ll_region(dc, me, set, p, block), tid);
        kgpu_ld_weak_v4(src, &got[p].x, &got[p].y, &got[p].z, &got[p].w);
      }
    uint32_t came = 0, o = 0;
#pragma unroll
    for (int p = 0; p < R; p++)
      if (look & (1u << p)) {
        came |= (got[p].y == e && got[p].w == ew) ? 1u << p : 0u;
        if (F & F_SIG) o |= (got[p].y == e && got[p].w != ew) ? 1u << p : 0u;
      }
    odd = o;
    if ((F & F_SIG) && o) atomicAdd(&g_odd_rounds, 1ull);
    pending &= ~came;
    full = came != 0;
    if (hlook && hdr.y == e && hdr.w == e) {
      hpend = 0;
      if (hdr.x != sig || hdr.z != nbytes) *hung = 3;
    }
    if (!(pending | hpend)) break;
    if (F & F_SLEEP) __nanosleep(64);
    if ((F & F_BOUND) && keep_waiting(dc, wt, &s_fail)) { *hung = 4; return false; }
    if (polls > (1u << 24)) { *hung = 1; return false; }
  }
  if (tid < lines) lad_reduce_store<R>(got, me, R, w0, w1, data, tid, nbytes);
  __syncthreads();
  return true;
}

// Flag rungs (session 13).  The LL rungs' cost grows with the ranks (8 KB per rank, one
// process: about 0.7 us at 2 ranks, 2 us at 8): every thread polls a 16-byte line of every
// rank each round, 8 x 8 x 1024 line reads per round at 8 ranks, most of them to lines that
// 7 other readers poll too.  Here the data travels as plain 8-byte words (half the bytes of
// an LL line) behind one 64-bit flag per (sender, block) (M 0) or per (sender, block, warp)
// (M 1): the writer stores its words, a barrier, then one thread fences (acq_rel, GPU
// scope: every rank shares this GPU) and stores the flag; lane p of the reader polls
// sender p's flag with an acquire load, a barrier, then every thread reads its word of
// each rank past L1 (.cg) once.  Two more hops than LL on the critical path (the fence's
// round trip, the data read after the flag), but R flag polls per reader block or warp
// per round instead of R lines per thread.  No end barrier: a sender overwrites set s
// only after every rank's flag of the next two calls, each published after that rank's
// reads of this one.  Measured on the H200 (bench/RESULTS.md, the flag-per-block exchange): slower than the LL
// exchange with an end barrier at 2, 4 and 8 ranks (8 ranks: 2.5 us against 1.6-2.1).  Kept as a
// rung, not used by the library.
__device__ static inline uint64_t *flag_word(const kcclDevComm &dc, int owner, uint32_t set, int block, int unit) {
  return (uint64_t *)((char *)ll_region(dc, owner, set, owner, block) + 8192 + unit * 128);
}
template <int R, int M>
__device__ static inline bool flagx(const kcclDevComm &dc, int block, char *data, uint32_t nbytes, uint32_t &e,
                                    int *hung) {
  const int tid = threadIdx.x, me = dc.rank, lane = tid & 31;
  const int who = M == 0 ? tid : lane;       /* 0: the publisher; p < R: polls sender p */
  const int unit = M == 0 ? 0 : tid >> 5;    /* whose flag: the block's or the warp's */
  const uint32_t lines = nbytes / 8;
  __shared__ volatile int s_hung;
  if (tid == 0) s_hung = 0;
  e++;
  const uint32_t set = e % KCCL_LL_SETS;
  const uint64_t val = (uint64_t)0x1234u << 32 | e;
  uint32_t w0 = 0, w1 = 0;
  if (tid < lines) {
    load8(data, (size_t)tid * 8, nbytes, &w0, &w1);
    uint32_t *mine = (uint32_t *)ll_region(dc, me, set, me, block) + 2 * tid;
    asm volatile("st.global.cg.v2.u32 [%0], {%1,%2};" ::"l"(mine), "r"(w0), "r"(w1) : "memory");
  }
  if (M == 0) __syncthreads(); else __syncwarp();
  if (who == 0) {
    kgpu_fence_gpu();
    kgpu_st_relaxed_gpu_u64(flag_word(dc, me, set, block, unit), val);
  }
  if (who < R && who != me) {
    const uint64_t *f = flag_word(dc, who, set, block, unit);
    for (uint32_t polls = 0; kgpu_ld_acquire_gpu_u64(f) != val; polls++)
      if (polls > (1u << 24)) { *hung = 1; s_hung = 1; break; }
  }
  if (M == 0) __syncthreads(); else __syncwarp();
  if (s_hung) return false; /* shared: no extra round trip on the path */
  if (tid < lines) {
    uint4 got[R]; /* a peer's two data words in .x and .z, as an LL line's */
#pragma unroll
    for (int p = 0; p < R; p++)
      if (p != me) {
        const uint32_t *src = (const uint32_t *)ll_region(dc, p, set, p, block) + 2 * tid;
        asm volatile("ld.global.cg.v2.u32 {%0,%1}, [%2];" : "=r"(got[p].x), "=r"(got[p].z) : "l"(src) : "memory");
      }
    lad_reduce_store<R>(got, me, R, w0, w1, data, tid, nbytes);
  }
  return true;
}

template <int R, int V>
__global__ void __launch_bounds__(256) k_ladder(Ranks rk, int B, int iters, uint32_t e0, double *us, int *hung) {
  const int r = blockIdx.x / B, b = blockIdx.x % B;
  const kcclDevComm &dc = rk.dc[r];
  const uint32_t per = DATA_BYTES / B;
  char *data = dc.peer_base[r] + OFF_DATA + (size_t)b * per;
  uint32_t e = e0;
  const unsigned long long t0 = gtimer();
  for (int it = 0; it < iters; it++) {
    if (V >= 200) {
      if (!flagx<R, V - 200>(dc, b, data, per, e, hung)) break;
    } else if (V >= 100) {
      if (!feat<R, V - 100>(dc, b, data, per, hung)) break;
    } else if (V <= 2 || V >= 6) {
      if (!bare<R, V == 8 ? 8 : R, V>(dc, b, data, per, e, hung)) break;
    } else {
      kcclResult_t rc =
          V == 3 ? ll_allreduce_block<8>(dc, b, data, data, per, kcclBfloat16, kcclMax, 0x1234u)
          : V == 4 ? ll_allreduce_block<16>(dc, b, data, data, per, kcclBfloat16, kcclMax, 0x1234u)
                   : ll_block<8, kcclBfloat16, kcclMax, false>(dc, b, data, data, per, false, 0x1234u, nullptr);
      if (rc != kcclSuccess) { *hung = 2; break; }
    }
  }
  const unsigned long long t1 = gtimer();
  if (threadIdx.x == 0) us[blockIdx.x] = (t1 - t0) * 1e-3 / iters;
}

template <int R, int V>
static double run(Ranks rk, int B, int T, int iters, uint32_t &e0, double *d_us, int *d_hung) {
  k_ladder<R, V><<<R * B, T>>>(rk, B, iters, e0, d_us, d_hung);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  e0 += iters;
  int hung;
  CHECK(cudaMemcpy(&hung, d_hung, sizeof hung, cudaMemcpyDeviceToHost));
  if (hung) { std::printf("  (variant %d: hung / failed: %d)\n", V, hung); return -1; }
  std::vector<double> us(R * B);
  CHECK(cudaMemcpy(us.data(), d_us, sizeof(double) * R * B, cudaMemcpyDeviceToHost));
  return *std::max_element(us.begin(), us.end());
}

// The library's body (variant 3) with push / pull and one / two hops: us per call, in that order.
template <int R>
static void lib_rungs(Ranks &rk, int B, int T, int iters, uint32_t &e, double *d_us, int *d_hung, double out[4]) {
  for (int k = 0; k < 4; k++) {
    for (int r = 0; r < R; r++) {
      rk.dc[r].pull = k & 1;
      rk.dc[r].ll_hops = k & 2 ? 2 : 1;
    }
    out[k] = run<R, 3>(rk, B, T, iters, e, d_us, d_hung);
  }
  for (int r = 0; r < R; r++) {
    rk.dc[r].pull = 0;
    rk.dc[r].ll_hops = 1;
  }
}

template <int R>
static void ladder(char *base, int iters, int only_threads, bool lib_only, bool flag_only) {
  Ranks rk;
  CHECK(cudaMemset(base, 0, RANK_BYTES * R));
  for (int r = 0; r < R; r++) {
    kcclDevComm &dc = rk.dc[r];
    std::memset(&dc, 0, sizeof dc);
    dc.rank = r;
    dc.nranks = R;
    dc.ll_hops = 1;
    dc.channel = 0;
    dc.timeout_ns = 5000000000ull;
    for (int p = 0; p < R; p++) dc.peer_base[p] = base + (size_t)p * RANK_BYTES;
    dc.ll_off[0] = dc.ll_off[1] = 0;
    dc.epochs = (uint32_t *)(base + (size_t)r * RANK_BYTES + OFF_EPOCHS);
    dc.fail_owner = (int *)(base + (size_t)r * RANK_BYTES + OFF_FAIL);
    dc.status = (kcclGpuStatus *)(base + (size_t)r * RANK_BYTES + OFF_STATUS);
  }
  double *d_us;
  int *d_hung;
  CHECK(cudaMalloc(&d_us, sizeof(double) * 8 * KCCL_DEV_MAX_BLOCKS));
  CHECK(cudaMalloc(&d_hung, sizeof(int)));
  CHECK(cudaMemset(d_hung, 0, sizeof(int)));
  for (int T : {256, 128, 64, 32}) {
    if (only_threads && T != only_threads) continue;
    const int B = DATA_BYTES / 8 / T; /* one 8-byte datum per thread */
    // Variants 0-1 keep the epoch in a register, 2-4 in memory: separate epoch ranges, so
    // no inbox line of one run can pass for a line of the next (each run starts 10^6 on).
    uint32_t ereg = 1000000;
    CHECK(cudaMemset(base, 0, RANK_BYTES * R));
    double lib[4];
    if (lib_only) {
      uint32_t e = 0;
      for (int round = 0; round < 3; round++) { /* three times: the spread shows the noise */
        lib_rungs<R>(rk, B, T, iters, e, d_us, d_hung, lib);
        std::printf("R=%d ranks, %2d blocks/rank x %3d threads, ll_allreduce_block<8> (round %d): push %.3f | "
                    "pull %.3f | push 2 hops %.3f | pull 2 hops %.3f  us per call\n",
                    R, B, T, round, lib[0], lib[1], lib[2], lib[3]);
      }
      continue;
    }
    if (flag_only) {
      for (int round = 0; round < 3; round++) { /* three times: the spread shows the noise */
        uint32_t e = 2000000 + 1000000 * round, d = 0;
        CHECK(cudaMemset(base, 0, RANK_BYTES * R));
        const double b0 = run<R, 0>(rk, B, T, iters, e, d_us, d_hung);
        e += 1000000;
        const double b1 = run<R, 1>(rk, B, T, iters, e, d_us, d_hung);
        e += 1000000;
        const double f0 = run<R, 200>(rk, B, T, iters, e, d_us, d_hung);
        e += 1000000;
        const double f1 = run<R, 201>(rk, B, T, iters, e, d_us, d_hung);
        CHECK(cudaMemset(base, 0, RANK_BYTES * R));
        for (int r = 0; r < R; r++) rk.dc[r].pull = 1;
        const double lp = run<R, 3>(rk, B, T, iters, d, d_us, d_hung);
        for (int r = 0; r < R; r++) rk.dc[r].pull = 0;
        std::printf("R=%d ranks, %2d blocks/rank x %3d threads (round %d): LL bare %.3f | LL bare+end barrier %.3f | "
                    "flag per block %.3f | flag per warp %.3f | library pull <8> %.3f  us per call\n",
                    R, B, T, round, b0, b1, f0, f1, lp);
      }
      continue;
    }
    double v[9];
    v[0] = run<R, 0>(rk, B, T, iters, ereg, d_us, d_hung);
    ereg += 1000000;
    v[1] = run<R, 1>(rk, B, T, iters, ereg, d_us, d_hung);
    CHECK(cudaMemset(base, 0, RANK_BYTES * R));  // epochs in memory restart at 0
    uint32_t dummy = 0;
    v[2] = run<R, 2>(rk, B, T, iters, dummy, d_us, d_hung);
    v[3] = run<R, 3>(rk, B, T, iters, dummy, d_us, d_hung);
    v[4] = run<R, 4>(rk, B, T, iters, dummy, d_us, d_hung);
    v[5] = run<R, 5>(rk, B, T, iters, dummy, d_us, d_hung);
    v[6] = run<R, 6>(rk, B, T, iters, dummy, d_us, d_hung);
    v[7] = run<R, 7>(rk, B, T, iters, dummy, d_us, d_hung);
    v[8] = run<R, 8>(rk, B, T, iters, dummy, d_us, d_hung);
    double lib_pull[2];
    for (int r = 0; r < R; r++) rk.dc[r].pull = 1; /* the library's pull mode (dc.pull) */
    lib_pull[0] = run<R, 3>(rk, B, T, iters, dummy, d_us, d_hung);
    lib_pull[1] = run<R, 5>(rk, B, T, iters, dummy, d_us, d_hung);
    for (int r = 0; r < R; r++) rk.dc[r].pull = 0;
    lib_rungs<R>(rk, B, T, iters, dummy, d_us, d_hung, lib);
    {
      double f[17];
      f[0] = run<R, 100>(rk, B, T, iters, dummy, d_us, d_hung);
      f[1] = run<R, 100 + F_HSTORE>(rk, B, T, iters, dummy, d_us, d_hung);
      f[2] = run<R, 100 + F_HDR>(rk, B, T, iters, dummy, d_us, d_hung);
      f[3] = run<R, 100 + F_HDRW>(rk, B, T, iters, dummy, d_us, d_hung);
      f[4] = run<R, 100 + F_PULL>(rk, B, T, iters, dummy, d_us, d_hung);
      f[5] = run<R, 100 + F_SENT>(rk, B, T, iters, dummy, d_us, d_hung);
      f[6] = run<R, 100 + (F_PULL | F_SENT)>(rk, B, T, iters, dummy, d_us, d_hung);
      f[7] = run<R, 100 + F_SLEEP>(rk, B, T, iters, dummy, d_us, d_hung);
      f[8] = run<R, 100 + (F_PULL | F_SLEEP)>(rk, B, T, iters, dummy, d_us, d_hung);
      f[9] = run<R, 100 + (F_PULL | F_SENT | F_HDR)>(rk, B, T, iters, dummy, d_us, d_hung);
      f[10] = run<R, 100 + (F_PULL | F_SENT | F_HDRW)>(rk, B, T, iters, dummy, d_us, d_hung);
      f[11] = run<R, 100 + (F_PULL | F_SENT | F_HSTORE)>(rk, B, T, iters, dummy, d_us, d_hung);
      f[12] = run<R, 100 + (F_PULL | F_SENT | F_HDR | F_HFULL)>(rk, B, T, iters, dummy, d_us, d_hung);
      f[13] = run<R, 100 + (F_PULL | F_SENT | F_HDR | F_HAFTER)>(rk, B, T, iters, dummy, d_us, d_hung);
      f[14] = run<R, 100 + (F_PULL | F_SENT | F_HDRW | F_HFULL)>(rk, B, T, iters, dummy, d_us, d_hung);
      const unsigned long long zero = 0;
      CHECK(cudaMemcpyToSymbol(g_odd_rounds, &zero, sizeof zero));
      f[15] = run<R, 100 + (F_PULL | F_SENT | F_SIG)>(rk, B, T, iters, dummy, d_us, d_hung);
      f[16] = run<R, 100 + (F_PULL | F_SENT | F_SIG | F_BOUND)>(rk, B, T, iters, dummy, d_us, d_hung);
      unsigned long long odd_rounds = 0;
      CHECK(cudaMemcpyFromSymbol(&odd_rounds, g_odd_rounds, sizeof odd_rounds));
      std::printf("R=%d ranks, %2d blocks/rank x %3d threads: torn lines (first word new, second old) seen in "
                  "%llu poll rounds over the two sig rungs (2 x %d calls x %d lines per rank)\n",
                  R, B, T, odd_rounds, iters, DATA_BYTES / 8);
      std::printf("R=%d ranks, %2d blocks/rank x %3d threads, feature rungs (us per call):", R, B, T);
      const char *names[] = {"v2", "+hdr store", "+hdr", "+hdr last warp", "pull", "sentinel", "pull+sent",
                             "sleep", "pull+sleep", "pull+sent+hdr", "pull+sent+hdr last warp",
                             "pull+sent+hdr store", "pull+sent+hdr full rounds", "pull+sent+hdr after lines",
                             "pull+sent+hdr last warp full rounds", "pull+sent+sig", "pull+sent+sig+bounded"};
      for (int i = 0; i < 17; i++) std::printf(" %s %.3f%s", names[i], f[i], i < 16 ? " |" : "\n");
    }
    std::printf("R=%d ranks, %2d blocks/rank x %3d threads: bare %.3f | +end barrier %.3f | +epoch in memory, "
                "2 barriers %.3f | +header %.3f | +bounded wait %.3f | +loops to 8 %.3f | ll_allreduce_block<8> %.3f | <16> %.3f "
                "| <8> bf16/max body %.3f | pull: <8> %.3f, <8> bf16/max body %.3f | two hops: push <8> %.3f, "
                "pull <8> %.3f  us per call\n",
                R, B, T, v[0], v[1], v[2], v[6], v[7], v[8], v[3], v[4], v[5], lib_pull[0], lib_pull[1], lib[2],
                lib[3]);
  }
  CHECK(cudaFree(d_us));
  CHECK(cudaFree(d_hung));
}

int main(int argc, char **argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 2000;
  char *base;
  CHECK(cudaMalloc(&base, RANK_BYTES * 8));
  std::printf("ll_ladder: %d dependent calls per run, max over blocks of us per call\n", iters);
  const int ranks = argc > 2 ? std::atoi(argv[2]) : 0, threads = argc > 3 ? std::atoi(argv[3]) : 0;
  const bool lib_only = argc > 4 && std::strcmp(argv[4], "lib") == 0;
  const bool flag_only = argc > 4 && std::strcmp(argv[4], "flag") == 0;
  if (!ranks || ranks == 2) ladder<2>(base, iters, threads, lib_only, flag_only);
  if (!ranks || ranks == 4) ladder<4>(base, iters, threads, lib_only, flag_only);
  if (!ranks || ranks == 8) ladder<8>(base, iters, threads, lib_only, flag_only);
  CHECK(cudaFree(base));
  return 0;
}
