// sm_share.cu - whether an SM's share of HBM is a property of the SM: the question behind
// the monokernel's stage spread.
//
// Every GEMV stage of the monokernel splits its weight rows equally over the blocks, one a
// SM, and the next stage waits for the slowest block: its stage clock finds the blocks of
// one stage ending 2-3 us apart a layer while their units differ by 0.35 us
// (bench/RESULTS.md).  If some SMs are slower every time (their place on the chip's
// crossbar, a GPC with more SMs sharing its port), a split weighted by each SM's speed,
// measured once, removes that part of the spread; if it is noise, nothing known before the
// step does.  This measures both.
//
// One block an SM (its dynamic shared memory leaves no room for a second), one warp; lane 0
// streams its share of a stage's bytes into a ring of shared memory with bulk copies of
// 32 KB, `slots` in flight, as the monokernel's producer does, after every block has
// arrived at a grid-wide start line.  A share is a number of 8 KB units (the monokernel's
// 2 rows of 2,048 bf16), taken by the SM that runs the block (%smid), so that a weighted
// split follows the SM whatever block index it gets.
//
// For each stage size (the 2b shape's o, QKV, down and gate/up bytes): `reps` launches with
// the equal split (the monokernel's: SM i of n takes units [i U / n, (i + 1) U / n)), from
// which each SM's speed (bytes / its time) and how well one half of the launches predicts
// the other (Pearson over SMs of their mean times); then `reps` pairs of launches,
// alternating the equal split and one weighted by those speeds (largest remainder).  A
// launch's makespan is its last block's end less its first block's start.  Each launch reads
// a region of the 2 GB source past the last one's, so that L2 holds none of it.
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -I../../kie_engine/gpu/csrc -o sm_share sm_share.cu
// Run:   ./sm_share [reps=40] [slots=3]   (bench/gpu/kie_run.sh smshare; JSON to $OUT/sm_share_<KB in flight>kb.json)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

#include "bench_cuda.h"
#include "bulk_copy.cuh"

using namespace kie;

namespace {

constexpr unsigned UNIT = 8u << 10;  // a unit of work: 2 rows of 2,048 bf16
constexpr unsigned COPY = 32u << 10; // a ring slot (the monokernel's)
constexpr int MAX_SLOTS = 4;
constexpr int MAX_SM = 256;          // %smid below this (checked)
constexpr size_t SRC = 2ull << 30;

struct Args {
  const char *src;
  const int *u0, *u1;      // [MAX_SM] units of the SM with that id
  int slots;
  unsigned *arrived;       // the start line: every block adds one, then waits for target
  unsigned target;
  unsigned long long *t0, *t1;  // [grid] the block's start and end
  int *smid;               // [grid]
  int *bad;                // set when the start line or a copy outlives its bound
};

__device__ __forceinline__ int my_smid() {
  int s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

__global__ void __launch_bounds__(32, 1) k_share(const Args a) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) uint64_t bars[MAX_SLOTS];
  if (threadIdx.x != 0) return;
  const int sm = my_smid(), b = blockIdx.x;
  a.smid[b] = sm;
  if (sm >= MAX_SM) {
    atomicExch(a.bad, 3);
    return;
  }
  for (int s = 0; s < a.slots; s++) mbar_init(&bars[s], 1);
  mbar_init_fence();
  const unsigned long long bound = 200000000ull;  // 200 ms: every wait here is bounded
  atomicAdd(a.arrived, 1u);
  const unsigned long long tw = gtimer();
  while ((int)(*(volatile unsigned *)a.arrived - a.target) < 0)
    if (gtimer() - tw > bound) {
      atomicExch(a.bad, 1);
      break;
    }
  const uint64_t pol = l2_stream_policy(1);
  const char *p = a.src + (size_t)a.u0[sm] * UNIT;
  const size_t total = (size_t)(a.u1[sm] - a.u0[sm]) * UNIT;
  const unsigned long long t0 = gtimer();
  size_t issued = 0;
  unsigned parity = 0, pending = 0;
  for (int s = 0; s < a.slots && issued < total; s++) {
    const unsigned n = (unsigned)(total - issued < COPY ? total - issued : COPY);
    mbar_expect_tx(&bars[s], n);
    bulk_copy(ring + (size_t)s * COPY, p + issued, n, &bars[s], pol);
    issued += n;
    pending |= 1u << s;
  }
  while (pending)
    for (int s = 0; s < a.slots; s++) {
      if (!((pending >> s) & 1u)) continue;
      while (!mbar_done(&bars[s], (parity >> s) & 1u))
        if (gtimer() - t0 > bound) {
          atomicExch(a.bad, 2);
          break;
        }
      parity ^= 1u << s;
      pending &= ~(1u << s);
      if (issued < total) {
        const unsigned n = (unsigned)(total - issued < COPY ? total - issued : COPY);
        mbar_expect_tx(&bars[s], n);
        bulk_copy(ring + (size_t)s * COPY, p + issued, n, &bars[s], pol);
        issued += n;
        pending |= 1u << s;
      }
    }
  a.t0[b] = t0;
  a.t1[b] = gtimer();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double pearson(const std::vector<double> &x, const std::vector<double> &y) {
  const size_t n = x.size();
  const double mx = std::accumulate(x.begin(), x.end(), 0.0) / n, my = std::accumulate(y.begin(), y.end(), 0.0) / n;
  double sxy = 0, sxx = 0, syy = 0;
  for (size_t i = 0; i < n; i++) sxy += (x[i] - mx) * (y[i] - my), sxx += (x[i] - mx) * (x[i] - mx), syy += (y[i] - my) * (y[i] - my);
  return sxx > 0 && syy > 0 ? sxy / std::sqrt(sxx * syy) : 0.0;
}

struct Run {
  double makespan_us, mean_us;  // last end - first start; a block's mean time
  std::vector<double> us;       // [MAX_SM] each SM's time (-1: no block there)
};

struct Bench {
  int grid;
  Args a;
  int *u0d, *u1d;
  unsigned launches = 0;
  size_t cursor = 0;
  cudaLaunchConfig_t cfg = {};
  std::vector<int> sms;  // the SM ids seen (sorted)

  // One launch of a split (units per SM id); returns each SM's time.
  Run launch(const std::vector<int> &units) {
    std::vector<int> u0(MAX_SM, 0), u1(MAX_SM, 0);
    size_t total = 0;
    for (int s = 0; s < MAX_SM; s++) total += units[s];
    if (cursor + total * UNIT > SRC) cursor = 0;
    size_t at = cursor / UNIT;
    for (int s = 0; s < MAX_SM; s++) u0[s] = (int)at, at += units[s], u1[s] = (int)at;
    cursor += total * UNIT;
    CHECK(cudaMemcpy(u0d, u0.data(), MAX_SM * sizeof(int), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(u1d, u1.data(), MAX_SM * sizeof(int), cudaMemcpyHostToDevice));
    a.target = (++launches) * (unsigned)grid;
    CHECK(cudaLaunchKernelEx(&cfg, k_share, a));
    CHECK(cudaDeviceSynchronize());
    std::vector<unsigned long long> t0(grid), t1(grid);
    std::vector<int> sm(grid);
    int bad = 0;
    CHECK(cudaMemcpy(t0.data(), a.t0, grid * 8, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(t1.data(), a.t1, grid * 8, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(sm.data(), a.smid, grid * sizeof(int), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(&bad, a.bad, sizeof(int), cudaMemcpyDeviceToHost));
    if (bad) {
      std::fprintf(stderr, "sm_share: %s\n", bad == 1 ? "the start line timed out" : bad == 2 ? "a copy timed out" : "an SM id past 255");
      std::exit(1);
    }
    Run r{0, 0, std::vector<double>(MAX_SM, -1.0)};
    unsigned long long first = ~0ull, last = 0;
    for (int b = 0; b < grid; b++) {
      first = std::min(first, t0[b]);
      last = std::max(last, t1[b]);
      r.us[sm[b]] = (double)(t1[b] - t0[b]) / 1e3;
      r.mean_us += r.us[sm[b]] / grid;
    }
    r.makespan_us = (double)(last - first) / 1e3;
    if (sms.empty()) {
      sms = sm;
      std::sort(sms.begin(), sms.end());
      if (std::unique(sms.begin(), sms.end()) != sms.end()) {
        std::fprintf(stderr, "sm_share: two blocks on one SM\n");
        std::exit(1);
      }
    }
    return r;
  }

  // The monokernel's equal split of U units over the SMs, in SM id order.
  std::vector<int> equal(int U) const {
    std::vector<int> u(MAX_SM, 0);
    for (int i = 0; i < grid; i++) u[sms[i]] = (int)((long long)(i + 1) * U / grid - (long long)i * U / grid);
    return u;
  }

  // U units in proportion to `speed` (per SM id), largest remainder first.
  std::vector<int> weighted(int U, const std::vector<double> &speed) const {
    std::vector<int> u(MAX_SM, 0);
    double sum = 0;
    for (int s : sms) sum += speed[s];
    std::vector<std::pair<double, int>> rest;
    int given = 0;
    for (int s : sms) {
      const double want = U * speed[s] / sum;
      u[s] = (int)std::floor(want);
      given += u[s];
      rest.push_back({want - u[s], s});
    }
    std::sort(rest.rbegin(), rest.rend());
    for (int i = 0; given < U; i++, given++) u[rest[i].second]++;
    return u;
  }
};

}  // namespace

int main(int argc, char **argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 40, slots = argc > 2 ? std::atoi(argv[2]) : 3;
  if (reps < 4 || slots < 1 || slots > MAX_SLOTS) {
    std::fprintf(stderr, "usage: sm_share [reps>=4] [slots 1..%d]\n", MAX_SLOTS);
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  Bench B;
  B.grid = prop.multiProcessorCount;
  const size_t smem = std::max<size_t>(160u << 10, (size_t)slots * COPY);
  CHECK(cudaFuncSetAttribute(k_share, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_share, 32, smem));
  if (per_sm != 1) {
    std::fprintf(stderr, "sm_share: %d blocks an SM, want 1\n", per_sm);
    return 1;
  }
  B.cfg.gridDim = dim3(B.grid);
  B.cfg.blockDim = dim3(32);
  B.cfg.dynamicSmemBytes = smem;
  char *src;
  CHECK(cudaMalloc(&src, SRC));
  CHECK(cudaMemset(src, 1, SRC));
  CHECK(cudaMalloc(&B.u0d, MAX_SM * sizeof(int)));
  CHECK(cudaMalloc(&B.u1d, MAX_SM * sizeof(int)));
  B.a.src = src;
  B.a.u0 = B.u0d;
  B.a.u1 = B.u1d;
  B.a.slots = slots;
  CHECK(cudaMalloc(&B.a.arrived, sizeof(unsigned)));
  CHECK(cudaMemset(B.a.arrived, 0, sizeof(unsigned)));
  CHECK(cudaMalloc(&B.a.t0, B.grid * 8));
  CHECK(cudaMalloc(&B.a.t1, B.grid * 8));
  CHECK(cudaMalloc(&B.a.smid, B.grid * sizeof(int)));
  CHECK(cudaMalloc(&B.a.bad, sizeof(int)));
  CHECK(cudaMemset(B.a.bad, 0, sizeof(int)));

  // the 2b shape's stages: o, QKV, down, gate/up (bytes / 8 KB units)
  const struct { const char *name; int units; } stages[] = {{"o", 1024}, {"qkv", 2048}, {"down", 4096}, {"gate_up", 8192}};
  {  // the SM ids, and a few launches to wake the card
    std::vector<int> one(MAX_SM, 64);
    for (int i = 0; i < 5; i++) B.launch(one);
  }
  std::printf("# %s, %d SMs (ids %d .. %d), %d KB in flight a block, %d launches a split\n", prop.name, B.grid,
              B.sms.front(), B.sms.back(), slots * (COPY >> 10), reps);
  std::printf("%-8s %6s | %-36s | %-34s | %s\n", "stage", "MB", "equal split: makespan med, block mean, spread",
              "halves' correlation, systematic part", "weighted: makespan med (equal's in the same pairs)");
  std::string json = "{\"gpu\": \"" + std::string(prop.name) + "\", \"sms\": " + std::to_string(B.grid) +
                     ", \"kb_in_flight\": " + std::to_string(slots * (COPY >> 10)) + ", \"reps\": " +
                     std::to_string(reps) + ", \"stages\": [";
  for (size_t si = 0; si < sizeof stages / sizeof stages[0]; si++) {
    const int U = stages[si].units;
    std::vector<Run> eq;
    for (int r = 0; r < reps; r++) eq.push_back(B.launch(B.equal(U)));
    std::vector<double> even(MAX_SM, 0), odd(MAX_SM, 0), all(MAX_SM, 0), ms, spread, mean;
    for (int r = 0; r < reps; r++) {
      double lo = 1e30, hi = 0;
      for (int s : B.sms) {
        (r % 2 ? odd : even)[s] += eq[r].us[s] / (reps / 2);
        all[s] += eq[r].us[s] / reps;
        lo = std::min(lo, eq[r].us[s]), hi = std::max(hi, eq[r].us[s]);
      }
      ms.push_back(eq[r].makespan_us);
      mean.push_back(eq[r].mean_us);
      spread.push_back(hi - lo);
    }
    std::vector<double> ev, od, speed(MAX_SM, 0);
    const std::vector<int> eqs = B.equal(U);
    double sys_max = 0, sys_mean = 0;
    for (int s : B.sms) {
      ev.push_back(even[s]);
      od.push_back(odd[s]);
      speed[s] = eqs[s] / all[s];  // units per us
      sys_max = std::max(sys_max, all[s]);
      sys_mean += all[s] / B.grid;
    }
    const double corr = pearson(ev, od);
    std::vector<double> msw, mse;
    const std::vector<int> w = B.weighted(U, speed);
    for (int r = 0; r < reps; r++) {
      msw.push_back(B.launch(w).makespan_us);
      mse.push_back(B.launch(eqs).makespan_us);
    }
    const double mb = (double)U * UNIT / 1e6;
    std::printf("%-8s %6.1f | %8.2f us %8.2f us %8.2f us    | r = %5.2f, mean SM's max - mean %5.2f us | %8.2f us (%8.2f us)\n",
                stages[si].name, mb, median(ms), median(mean), median(spread), corr, sys_max - sys_mean, median(msw),
                median(mse));
    char row[512];
    std::snprintf(row, sizeof row,
                  "%s{\"stage\": \"%s\", \"mb\": %.2f, \"equal_makespan_us\": %.3f, \"equal_block_mean_us\": %.3f, "
                  "\"equal_spread_us\": %.3f, \"halves_pearson\": %.3f, \"systematic_max_minus_mean_us\": %.3f, "
                  "\"weighted_makespan_us\": %.3f, \"equal_paired_makespan_us\": %.3f, \"per_sm_mean_us\": {",
                  si ? ", " : "", stages[si].name, mb, median(ms), median(mean), median(spread), corr,
                  sys_max - sys_mean, median(msw), median(mse));
    json += row;
    for (size_t i = 0; i < B.sms.size(); i++) {
      std::snprintf(row, sizeof row, "%s\"%d\": %.3f", i ? ", " : "", B.sms[i], all[B.sms[i]]);
      json += row;
    }
    json += "}}";
  }
  json += "]}\n";
  if (const char *out = std::getenv("OUT")) {
    const std::string path = std::string(out) + "/sm_share_" + std::to_string(slots * (COPY >> 10)) + "kb.json";
    if (FILE *f = std::fopen(path.c_str(), "w")) {
      std::fputs(json.c_str(), f);
      std::fclose(f);
      std::printf("wrote %s\n", path.c_str());
    }
  }
  CHECK(cudaFree(src));
  return 0;
}
