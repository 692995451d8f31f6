// poll_stream.cu - how long a signal between two SMs takes while the others stream
// HBM into shared-memory rings, as the monokernel's blocks do between its stages.
//
// The monokernel's stage boundary is a release reduction on a counter in L2 by the last
// block of a stage and relaxed polls of it by the others; its stage clock says a waiting
// block sees the count 2-3 us after the last block ends, and sooner with a shallower ring
// (bench/RESULTS.md).  This separates what that time depends on: whether the polling SM
// itself has bulk copies in flight, or only the others; and how a signal through another
// cluster block's shared memory (distributed shared memory, no L2 round trip) compares.
//
// One block per SM (its dynamic shared memory leaves no room for a second), clusters of 2.
// Warp 0's lane 0 streams: it keeps `slots` bulk copies of 32 KB in flight from its own
// 16 MB region (cp.async.bulk into a ring counted by mbarriers, each slot issued again as
// it lands) until the run's time is up.  Warp 1's lane 0 of blocks 0 and 1 (one cluster)
// runs the test once the streams have run `warm` ms:
//   chain    block 0: a chain of dependent relaxed loads of one L2 line (a load's round trip)
//   global   blocks 0 and 1 ping-pong through two counters in global memory, each side
//            adding with red.release.gpu and polling with ld.relaxed.gpu (the monokernel's
//            protocol); one-way time = round trip / 2, a sample the mean of 8 round trips
//   dsmem    the same ping-pong through a word in the other block's shared memory
//            (st.release.cluster to it, ld.acquire.cluster polls of one's own)
//   ll       the same ping-pong through 8-byte words in global memory that carry their own
//            flag (a value and its step in one st.relaxed.gpu.v2, polled with ld.relaxed.gpu.v2
//            until the step is there): no release, no fence, as a protocol whose data words say
//            themselves that they are ready would signal
//   dsll     the same through an 8-byte word in the other block's shared memory (st.relaxed.cluster,
//            ld.relaxed.cluster polls of one's own)
//   fence    block 0: fence.acq_rel.gpu alone, one after another (what a release costs its thread)
// Streams: none; "others" (every block but 0 and 1); "all" (0 and 1 too, beside their test).
// Every wait is bounded by the run's time; a test that runs out of it is reported.
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -I../../kie_engine/gpu/csrc -o poll_stream poll_stream.cu
// Run:   ./poll_stream [samples=300] [run_ms=60] [warm_ms=4]   (bench/gpu/kie_run.sh pollstream)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_cuda.h"
#include "bulk_copy.cuh"
#include "stage_count.cuh"

using namespace kie;

namespace {

constexpr unsigned SLOT = 32u << 10;       // bytes of a ring slot (the monokernel's)
constexpr int MAX_SLOTS = 4;
constexpr size_t REGION = 16ull << 20;     // bytes each block streams, cyclically (well past L2 in all)
constexpr size_t SMEM = 160u << 10;        // at least this much: one block an SM
constexpr int THREADS = 64;
constexpr unsigned RT = 8;                 // round trips a ping-pong sample

enum Test { CHAIN = 0, GLOBAL = 1, DSMEM = 2, LL = 3, DSLL = 4, FENCE = 5 };
enum Streams { NONE = 0, OTHERS = 1, ALL = 2 };

struct Args {
  const char *src;
  int slots;      // copies in flight per streaming block (0: nobody streams)
  int streams;    // Streams
  int test;       // Test
  int iters;     // samples
  unsigned long long run_ns, warm_ns;
  unsigned long long *line;   // CHAIN: a line holding its own address
  unsigned *ping, *pong;      // GLOBAL: a counter each; LL: an 8-byte word each
  unsigned long long *bytes;  // [grid] bytes each block streamed
  unsigned long long *span;   // [grid] ns each block streamed
  float *ns;                  // [iters] the test's times (CHAIN: a load; FENCE: a fence; else a round trip)
  int *timed_out;             // set when a bounded wait ran out of time
};

/* One slot of the ring: its bytes counted on its mbarrier, its lines in L2 under policy pol
 * (the monokernel's ring copies: the same helpers, bulk_copy.cuh). */
__device__ __forceinline__ void issue(unsigned char *dst, const char *src, uint64_t *bar, uint64_t pol) {
  mbar_expect_tx(bar, SLOT);
  bulk_copy(dst, src, SLOT, bar, pol);
}

__device__ __forceinline__ unsigned long long ld_chain(const unsigned long long *p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned ld_own(const unsigned *p) {
  unsigned v;
  asm volatile("ld.acquire.cluster.shared::cta.u32 %0, [%1];" : "=r"(v) : "r"(smem_u32(p)) : "memory");
  return v;
}
/* The address of this block's shared variable p in cluster block `rank`'s shared memory. */
__device__ __forceinline__ uint32_t peer_addr(const void *p, unsigned rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(p)), "r"(rank));
  return remote;
}
__device__ __forceinline__ void st_peer(unsigned *own_word, unsigned rank, unsigned v) {
  asm volatile("st.release.cluster.shared::cluster.u32 [%0], %1;" ::"r"(peer_addr(own_word, rank)), "r"(v) : "memory");
}
/* LL: a value and its flag in one 8-byte word, written and read whole */
__device__ __forceinline__ void st_ll(unsigned *p, unsigned value, unsigned flag) {
  asm volatile("st.relaxed.gpu.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(value), "r"(flag) : "memory");
}
__device__ __forceinline__ bool ll_seen(const unsigned *p, unsigned flag) {
  unsigned v, f;
  asm volatile("ld.relaxed.gpu.global.v2.u32 {%0, %1}, [%2];" : "=r"(v), "=r"(f) : "l"(p) : "memory");
  return f == flag && v == ~flag;
}
__device__ __forceinline__ void st_peer_ll(unsigned long long *own_word, unsigned rank, unsigned value, unsigned flag) {
  asm volatile("st.relaxed.cluster.shared::cluster.v2.u32 [%0], {%1, %2};" ::"r"(peer_addr(own_word, rank)), "r"(value),
               "r"(flag)
               : "memory");
}
__device__ __forceinline__ bool own_ll_seen(const unsigned long long *p, unsigned flag) {
  unsigned v, f;
  asm volatile("ld.relaxed.cluster.shared::cta.v2.u32 {%0, %1}, [%2];" : "=r"(v), "=r"(f) : "r"(smem_u32(p)) : "memory");
  return f == flag && v == ~flag;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__global__ void __launch_bounds__(THREADS, 1) k_poll_stream(const Args a) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) uint64_t bars[MAX_SLOTS];
  __shared__ unsigned word;  // DSMEM: what the other block of the cluster writes
  __shared__ unsigned long long ll_word;  // DSLL: the same, a value and its flag
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, b = blockIdx.x;
  const bool tester = b < 2, streams = a.slots > 0 && (a.streams == ALL || (a.streams == OTHERS && !tester));
  if (threadIdx.x == 0) {
    word = 0;
    ll_word = 0;
    for (int s = 0; s < a.slots; s++) mbar_init(&bars[s], 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (a.test == DSMEM || a.test == DSLL) cluster_sync();  // the peer's word is initialized before anyone writes it
  const unsigned long long t0 = gtimer();
  auto over = [&] { return gtimer() - t0 > a.run_ns; };

  if (warp == 0 && lane == 0 && streams) {
    const uint64_t pol = l2_stream_policy(0);
    const char *base = a.src + (size_t)b * REGION;
    size_t off = 0;
    unsigned long long bytes = 0;
    unsigned parity = 0, pending = 0;  // bit s: the phase slot s waits for next; its copy in flight
    for (int s = 0; s < a.slots; s++, off += SLOT) {
      issue(ring + (size_t)s * SLOT, base + off, &bars[s], pol);
      pending |= 1u << s;
    }
    /* Each slot is issued again as it lands until the time is up; then the ring drains, so
     * that no copy into this block's shared memory is in flight when it exits. */
    while (pending)
      for (int s = 0; s < a.slots; s++) {
        if (!((pending >> s) & 1u)) continue;
        while (!mbar_done(&bars[s], (parity >> s) & 1u))
          if (gtimer() - t0 > a.run_ns + 50000000ull) {  // a copy that never lands: say so
            atomicExch(a.timed_out, 1);
            break;
          }
        parity ^= 1u << s;
        pending &= ~(1u << s);
        bytes += SLOT;
        if (over() || *(volatile int *)a.timed_out) continue;
        if (off + SLOT > REGION) off = 0;
        issue(ring + (size_t)s * SLOT, base + off, &bars[s], pol);
        pending |= 1u << s;
        off += SLOT;
      }
    a.bytes[b] = bytes;
    a.span[b] = gtimer() - t0;
  }

  if (warp == 1 && lane == 0 && tester) {
    while (gtimer() - t0 < a.warm_ns) {
    }
    const bool first = b == 0;
    if (a.test == CHAIN && first) {
      const unsigned long long *q = a.line;
      for (int i = 0; i < a.iters && !over(); i++) {
        const unsigned long long t = gtimer();
        for (int k = 0; k < 16; k++) q = reinterpret_cast<const unsigned long long *>(ld_chain(q));
        a.ns[i] = (float)(gtimer() - t) / 16.f;
      }
      if (q != a.line) atomicExch(a.timed_out, 2);  // the chain must come back to its line
    } else if (a.test == FENCE && first) {
      for (int i = 0; i < a.iters && !over(); i++) {
        const unsigned long long t = gtimer();
        for (int k = 0; k < 16; k++) asm volatile("fence.acq_rel.gpu;" ::: "memory");
        a.ns[i] = (float)(gtimer() - t) / 16.f;
      }
    } else if (a.test == GLOBAL || a.test == DSMEM || a.test == LL || a.test == DSLL) {
      /* A sample is RT round trips (the global timer's steps are too coarse for one). */
      unsigned *mine = first ? a.ping : a.pong, *theirs = first ? a.pong : a.ping;
      unsigned rank;
      asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
      auto send = [&](unsigned i) {
        if (a.test == GLOBAL) red_release(mine, 1u);
        else if (a.test == LL) st_ll(mine, ~i, i);
        else if (a.test == DSLL) st_peer_ll(&ll_word, rank ^ 1u, ~i, i);
        else st_peer(&word, rank ^ 1u, i);
      };
      auto seen = [&](unsigned i) {
        if (a.test == LL) return ll_seen(theirs, i);
        if (a.test == DSLL) return own_ll_seen(&ll_word, i);
        return (int)((a.test == GLOBAL ? ld_relaxed(theirs) : ld_own(&word)) - i) >= 0;
      };
      const unsigned n = (unsigned)a.iters * RT;
      unsigned long long tg = gtimer();
      for (unsigned i = 1; i <= n; i++) {
        if (first) send(i);
        bool late = false;
        while (!seen(i))
          if (over()) {
            late = true;
            break;
          }
        if (late) {
          atomicExch(a.timed_out, 1);
          break;
        }
        if (!first) send(i);
        if (first && i % RT == 0) {
          const unsigned long long now = gtimer();
          a.ns[i / RT - 1] = (float)(now - tg) / (float)RT;
          tg = now;
        }
      }
    }
  }
  __syncwarp();
  __syncthreads();
  if (a.test == DSMEM || a.test == DSLL) cluster_sync();  // neither block leaves while the other may still write its word
}

float pct(std::vector<float> v, double q) {
  if (v.empty()) return -1.f;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, (size_t)(q * (double)(v.size() - 1) + 0.5))];
}

}  // namespace

int main(int argc, char **argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 300;
  const double run_ms = argc > 2 ? std::atof(argv[2]) : 60.0, warm_ms = argc > 3 ? std::atof(argv[3]) : 4.0;
  if (iters < 1 || run_ms <= warm_ms || warm_ms < 0) {
    std::fprintf(stderr, "usage: poll_stream [samples>=1] [run_ms > warm_ms] [warm_ms>=0]\n");
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const size_t smem = std::max(SMEM, (size_t)MAX_SLOTS * SLOT);
  CHECK(cudaFuncSetAttribute(k_poll_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 2;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = smem;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cfg.gridDim = dim3(prop.multiProcessorCount & ~1);
  int clusters = 0;
  CHECK(cudaOccupancyMaxActiveClusters(&clusters, k_poll_stream, &cfg));
  const int grid = std::min(prop.multiProcessorCount & ~1, 2 * clusters);  // every block resident at once
  cfg.gridDim = dim3(grid);

  char *src;
  unsigned long long *line, *bytes, *span;
  unsigned *flags;
  float *ns;
  int *timed_out;
  CHECK(cudaMalloc(&src, (size_t)grid * REGION));
  CHECK(cudaMemset(src, 1, (size_t)grid * REGION));
  CHECK(cudaMalloc(&line, 256));
  CHECK(cudaMemcpy(line, &line, sizeof line, cudaMemcpyHostToDevice));  // the line holds its own address
  CHECK(cudaMalloc(&flags, 256));
  CHECK(cudaMalloc(&bytes, grid * sizeof(unsigned long long)));
  CHECK(cudaMalloc(&span, grid * sizeof(unsigned long long)));
  CHECK(cudaMalloc(&ns, iters * sizeof(float)));
  CHECK(cudaMalloc(&timed_out, sizeof(int)));
  std::printf("# %s, %d SMs, grid %d (clusters of 2), %d samples, %.0f ms a run, the tests starting after %.0f ms\n",
              prop.name, prop.multiProcessorCount, grid, iters, run_ms, warm_ms);
  std::printf("%-7s %-7s %5s %10s %10s %10s %10s  %s\n", "test", "streams", "KB", "p10 ns", "median ns", "p90 ns",
              "HBM GB/s", "(chain: a load; fence: one; global, dsmem, ll, dsll: one way, half a round trip)");
  const char *tests[] = {"chain", "global", "dsmem", "ll", "dsll", "fence"}, *modes[] = {"none", "others", "all"};
  std::string json = "{\"gpu\": \"" + std::string(prop.name) + "\", \"grid\": " + std::to_string(grid) +
                     ", \"iters\": " + std::to_string(iters) + ", \"rows\": [";
  bool firstrow = true;
  for (int test = CHAIN; test <= FENCE; test++)
    for (int mode = NONE; mode <= ALL; mode++)
      for (int slots = mode == NONE ? 0 : 1; slots <= (mode == NONE ? 0 : MAX_SLOTS); slots++) {
        CHECK(cudaMemset(flags, 0, 256));
        CHECK(cudaMemset(bytes, 0, grid * sizeof(unsigned long long)));
        CHECK(cudaMemset(span, 0, grid * sizeof(unsigned long long)));
        CHECK(cudaMemset(ns, 0, iters * sizeof(float)));
        CHECK(cudaMemset(timed_out, 0, sizeof(int)));
        Args a = {src, slots, mode, test, iters, (unsigned long long)(run_ms * 1e6), (unsigned long long)(warm_ms * 1e6),
                  line, flags, flags + 32, bytes, span, ns, timed_out};
        CHECK(cudaLaunchKernelEx(&cfg, k_poll_stream, a));
        CHECK(cudaDeviceSynchronize());
        std::vector<float> t(iters);
        std::vector<unsigned long long> by(grid), sp(grid);
        int bad = 0;
        CHECK(cudaMemcpy(t.data(), ns, iters * sizeof(float), cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(by.data(), bytes, grid * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(sp.data(), span, grid * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(&bad, timed_out, sizeof(int), cudaMemcpyDeviceToHost));
        t.erase(std::remove_if(t.begin(), t.end(), [](float x) { return x <= 0.f; }), t.end());
        if (test != CHAIN && test != FENCE)
          for (float &x : t) x *= 0.5f;
        unsigned long long total = 0, longest = 0;
        for (int i = 0; i < grid; i++) total += by[i], longest = std::max(longest, sp[i]);
        const double gbps = longest ? (double)total / (double)longest : 0.0;
        const float p10 = pct(t, 0.1), p50 = pct(t, 0.5), p90 = pct(t, 0.9);
        std::printf("%-7s %-7s %5u %10.0f %10.0f %10.0f %10.0f  %zu samples%s\n", tests[test], modes[mode],
                    slots * (SLOT >> 10), p10, p50, p90, gbps, t.size(),
                    bad == 1 ? ", TIMED OUT" : bad == 2 ? ", CHAIN BROKEN" : "");
        char row[320];
        std::snprintf(row, sizeof row,
                      "%s{\"test\": \"%s\", \"streams\": \"%s\", \"kb_in_flight\": %u, \"p10_ns\": %.1f, "
                      "\"median_ns\": %.1f, \"p90_ns\": %.1f, \"hbm_GBps\": %.1f, \"samples\": %zu, \"timed_out\": %s}",
                      firstrow ? "" : ", ", tests[test], modes[mode], slots * (SLOT >> 10), p10, p50, p90, gbps,
                      t.size(), bad ? "true" : "false");
        json += row;
        firstrow = false;
      }
  json += "]}\n";
  if (const char *out = std::getenv("OUT")) {
    const std::string path = std::string(out) + "/poll_stream.json";
    if (FILE *f = std::fopen(path.c_str(), "w")) {
      std::fputs(json.c_str(), f);
      std::fclose(f);
      std::printf("wrote %s\n", path.c_str());
    }
  }
  CHECK(cudaFree(src));
  CHECK(cudaFree(line));
  CHECK(cudaFree(flags));
  CHECK(cudaFree(bytes));
  CHECK(cudaFree(span));
  CHECK(cudaFree(ns));
  CHECK(cudaFree(timed_out));
  return 0;
}
