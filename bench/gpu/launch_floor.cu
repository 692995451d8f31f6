// launch_floor.cu - two floors under KCCL's GPU latency on one GPU under MPS.
//
// 1. launch: what one kernel node of a dependent chain costs inside a CUDA graph
//    when N processes (MPS clients) run such chains at the same time.  Every
//    all-reduce call is one kernel per rank, and the ranks are coupled each call,
//    so if the GPU's front end takes grid launches of all clients one after the
//    other, a call on N ranks cannot cost less than N launches.
//      launch_floor launch <start_unix_ms> <kernels K> <pdl 0|1> <blocks (0: empty kernel)> <seconds>
//    Start N copies with the same start time; each waits for it, then replays a
//    graph of K kernels and one of K/4 in turns until <seconds> have passed and
//    prints the median of (t(K) - t(K/4)) / (3K/4): us per kernel, the graph launch
//    cancelled.  blocks > 0: each kernel copies 8 KB (bf16 all-reduce size) from
//    the previous kernel's output with 256-thread blocks (after griddepcontrol.wait
//    with PDL), so the chain is data-dependent as KCCL's is.
// 2. mem: how long one dependent load takes from an SM, by where the line is:
//    lines spread over 1 page, over many 2 MiB pages (TLB reach), in 8 separate
//    allocations (as peers' buffers are), and a line this thread has just stored
//    (read-after-write, as the LL kernel reads its input back).
//      launch_floor mem
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o launch_floor launch_floor.cu
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "bench_cuda.h"

// ------------------------------------------------------------------ launch --

__global__ void k_empty() {}

__global__ void k_copy8k(const uint4 *in, uint4 *out, int pdl) {
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 512) {  // 512 x 16 B = 8 KB
    uint4 v = in[i];
    v.x += 1;
    out[i] = v;
  }
}

static cudaGraphExec_t capture(cudaStream_t st, int K, int pdl, int blocks, uint4 *a, uint4 *b) {
  cudaGraph_t g;
  CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int k = 0; k < K; k++) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.blockDim = dim3(blocks ? 256 : 32);
    cfg.gridDim = dim3(blocks ? blocks : 1);
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    if (blocks)
      CHECK(cudaLaunchKernelEx(&cfg, k_copy8k, (const uint4 *)((k & 1) ? b : a), (k & 1) ? a : b, pdl));
    else
      CHECK(cudaLaunchKernelEx(&cfg, k_empty));
  }
  CHECK(cudaStreamEndCapture(st, &g));
  cudaGraphExec_t ex;
  CHECK(cudaGraphInstantiate(&ex, g, 0));
  CHECK(cudaGraphDestroy(g));
  return ex;
}

static int run_launch(long long start_ms, int K, int pdl, int blocks, double seconds) {
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  uint4 *a, *b;
  CHECK(cudaMalloc(&a, 8192));
  CHECK(cudaMalloc(&b, 8192));
  CHECK(cudaMemset(a, 0, 8192));
  cudaGraphExec_t big = capture(st, K, pdl, blocks, a, b), small = capture(st, K / 4, pdl, blocks, a, b);
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (int w = 0; w < 3; w++) CHECK(cudaGraphLaunch(big, st));
  CHECK(cudaStreamSynchronize(st));
  using clk = std::chrono::system_clock;
  while (std::chrono::duration_cast<std::chrono::milliseconds>(clk::now().time_since_epoch()).count() < start_ms)
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  std::vector<double> per;
  auto t_end = clk::now() + std::chrono::microseconds((long long)(seconds * 1e6));
  while (clk::now() < t_end) {
    float tb, ts;
    CHECK(cudaEventRecord(e0, st));
    CHECK(cudaGraphLaunch(big, st));
    CHECK(cudaEventRecord(e1, st));
    CHECK(cudaEventSynchronize(e1));
    CHECK(cudaEventElapsedTime(&tb, e0, e1));
    CHECK(cudaEventRecord(e0, st));
    CHECK(cudaGraphLaunch(small, st));
    CHECK(cudaEventRecord(e1, st));
    CHECK(cudaEventSynchronize(e1));
    CHECK(cudaEventElapsedTime(&ts, e0, e1));
    per.push_back((tb - ts) * 1e3 / (0.75 * K));
  }
  std::sort(per.begin(), per.end());
  std::printf("launch K=%d pdl=%d blocks=%d: %.3f us per kernel (median of %zu, p10 %.3f, p90 %.3f)\n", K, pdl,
              blocks, per[per.size() / 2], per.size(), per[per.size() / 10], per[per.size() * 9 / 10]);
  return 0;
}

// --------------------------------------------------------------------- mem --

__device__ __forceinline__ unsigned long long ld_cg(const unsigned long long *p) {
  unsigned long long v;
  asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_cg(unsigned long long *p, unsigned long long v) {
  asm volatile("st.global.cg.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// One thread: a chain of `loads` dependent loads through a ring of lines (each holds the next one's address).
__global__ void k_chase(const unsigned long long *start, int loads, double *ns, unsigned long long *sink) {
  const unsigned long long *q = start;
  for (int i = 0; i < 64; i++) q = (const unsigned long long *)ld_cg(q);  // warm the ring (L2, TLB)
  unsigned long long t0 = gtimer();
  for (int i = 0; i < loads; i++) q = (const unsigned long long *)ld_cg(q);
  unsigned long long t1 = gtimer();
  *ns = double(t1 - t0) / loads;
  *sink = (unsigned long long)q;
}

// One thread: store a line, then load it back, the stored value depending on the load before.
__global__ void k_raw(unsigned long long *p, int loops, double *ns) {
  unsigned long long v = 1;
  for (int i = 0; i < 16; i++) { st_cg(p, v); v = ld_cg(p) + 1; }
  unsigned long long t0 = gtimer();
  for (int i = 0; i < loops; i++) { st_cg(p, v); v = ld_cg(p) + 1; }
  unsigned long long t1 = gtimer();
  *ns = double(t1 - t0) / loops;
  p[1] = v;
}

// Links the lines at `addr` into a ring, in the given order.
static void ring(const std::vector<unsigned long long *> &addr) {
  for (size_t i = 0; i < addr.size(); i++) {
    unsigned long long next = (unsigned long long)addr[(i + 1) % addr.size()];
    CHECK(cudaMemcpy(addr[i], &next, 8, cudaMemcpyHostToDevice));
  }
}

static double chase(const std::vector<unsigned long long *> &addr, double *d_ns, unsigned long long *d_sink) {
  ring(addr);
  std::vector<double> r;
  for (int rep = 0; rep < 5; rep++) {
    k_chase<<<1, 1>>>(addr[0], 4096, d_ns, d_sink);
    CHECK(cudaGetLastError());
    double ns;
    CHECK(cudaMemcpy(&ns, d_ns, 8, cudaMemcpyDeviceToHost));
    r.push_back(ns);
  }
  std::sort(r.begin(), r.end());
  return r[2];
}

static int run_mem() {
  double *d_ns;
  unsigned long long *d_sink;
  CHECK(cudaMalloc(&d_ns, 8));
  CHECK(cudaMalloc(&d_sink, 8));
  const size_t PAGE = 2u << 20, SPAN = 512u << 20;
  char *big;
  CHECK(cudaMalloc(&big, SPAN));
  std::printf("mem: ns per dependent ld.global.cg.u64 (one thread, median of 5 x 4096 loads)\n");
  for (int lines : {8, 64}) {
    std::vector<unsigned long long *> a;
    for (int i = 0; i < lines; i++) a.push_back((unsigned long long *)(big + (size_t)i * 4096 + (i % 8) * 128));
    std::printf("  %3d lines within %zu KB (few pages)              : %7.1f\n", lines, (size_t)lines * 4, chase(a, d_ns, d_sink));
  }
  for (int pages : {4, 8, 16, 32, 64, 128, 255}) {
    std::vector<unsigned long long *> a;
    for (int i = 0; i < pages; i++) a.push_back((unsigned long long *)(big + (size_t)i * PAGE + (i % 16) * 128));
    std::printf("  %3d lines, one per 2 MiB page (%3d MiB)          : %7.1f\n", pages, pages * 2, chase(a, d_ns, d_sink));
  }
  // Eight separate allocations (a rank's view of its peers' buffers), 3 lines in each.
  std::vector<char *> bufs(8);
  for (auto &b : bufs) CHECK(cudaMalloc(&b, 64u << 20));
  {
    std::vector<unsigned long long *> a;
    for (int l = 0; l < 3; l++)
      for (int i = 0; i < 8; i++) a.push_back((unsigned long long *)(bufs[i] + (size_t)l * (16u << 20) + i * 256));
    std::printf("  24 lines in 8 allocations x 3 pages               : %7.1f\n", chase(a, d_ns, d_sink));
  }
  {
    std::vector<double> r;
    for (int rep = 0; rep < 5; rep++) {
      k_raw<<<1, 1>>>((unsigned long long *)big, 4096, d_ns);
      double ns;
      CHECK(cudaMemcpy(&ns, d_ns, 8, cudaMemcpyDeviceToHost));
      r.push_back(ns);
    }
    std::sort(r.begin(), r.end());
    std::printf("  store then load of the same line (read-after-write): %7.1f\n", r[2]);
  }
  for (auto b : bufs) CHECK(cudaFree(b));
  CHECK(cudaFree(big));
  return 0;
}

int main(int argc, char **argv) {
  if (argc >= 2 && std::string(argv[1]) == "mem") return run_mem();
  if (argc >= 7 && std::string(argv[1]) == "launch")
    return run_launch(std::atoll(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]),
                      std::atof(argv[6]));
  std::fprintf(stderr, "usage: launch_floor mem | launch <start_unix_ms> <K> <pdl> <blocks> <seconds>\n");
  return 2;
}
