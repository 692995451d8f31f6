// bench_cuda.h - what the standalone CUDA benchmarks in bench/gpu share.
#ifndef KCCL_BENCH_CUDA_H_
#define KCCL_BENCH_CUDA_H_
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

// A failed CUDA call ends the benchmark with the call and the error.
#define CHECK(x)                                                                                 \
  do {                                                                                           \
    cudaError_t e_ = (x);                                                                        \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

// The GPU's global nanosecond timer (the same clock on every SM).
__device__ __forceinline__ unsigned long long gtimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif
