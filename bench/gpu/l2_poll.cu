// l2_poll.cu - does an H100/H200 SM poll some flag addresses faster than others
// (its near L2 partition) and which SMs share a partition?
//
// One block per SM (blocks claim SMs through %smid; extra blocks exit).  The SMs
// take turns (a ticket, so one SM measures at a time and the others only sleep):
// for each of K flag addresses spread over a 64 MiB buffer, the SM runs a chain of
// dependent loads of a line that holds its own address (so each load waits for the
// previous one), R times, in each load mode, and records the median ns per load.
// Load modes, because a polled flag is read with one of them and the L2 may keep a
// near copy of a far line for plain loads:
//   volatile   ld.volatile.global  (what a `volatile` poll compiles to)
//   acquire    ld.acquire.sys.global (cross-GPU flags: must reach the point of coherence)
//   atomic     atom.global.or.b64 with 0 (always resolved at the line's home L2 slice)
// The host then splits the SMs in two groups (2-means on each SM's latency row minus
// the per-address median), says how far apart the groups are per address, and which
// addresses are near which group.  Prints a compact table; writes $OUT/l2_poll.json.
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o l2_poll l2_poll.cu
// Run:   ./l2_poll [K=64] [loads=256] [reps=5]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_cuda.h"

static const int MODES = 3;
static const char *MODE_NAMES[MODES] = {"volatile", "acquire", "atomic"};
static const size_t SPAN = 64ull << 20;  // addresses spread over 64 MiB (> L2: many pages, both partitions)

__device__ __forceinline__ unsigned smid() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
template <int MODE>
__device__ __forceinline__ unsigned long long load(const unsigned long long *p) {
  unsigned long long v;
  if (MODE == 0)
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  else if (MODE == 1)
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  else
    asm volatile("atom.global.or.b64 %0, [%1], 0;" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// ns per load of a chain of `loads` dependent loads starting at p (the line holds its own address).
template <int MODE>
__device__ double chase(const unsigned long long *p, int loads, unsigned long long *sink) {
  const unsigned long long *q = p;
  for (int i = 0; i < 8; i++) q = (const unsigned long long *)load<MODE>(q);  // warm: line in L2
  unsigned long long t0 = gtimer();
  for (int i = 0; i < loads; i++) q = (const unsigned long long *)load<MODE>(q);
  unsigned long long t1 = gtimer();
  *sink += (unsigned long long)q;  // keeps the chain
  return double(t1 - t0) / loads;
}

struct Ctl {
  unsigned claimed[1024];  // smid -> 1 once a block owns it
  unsigned tickets;        // claim order
  volatile unsigned turn;  // the ticket now measuring
  unsigned long long sink;
};

__global__ void measure(Ctl *ctl, const unsigned long long *const *addrs, int K, int loads, int reps, float *out,
                        int *sm_of_ticket) {
  if (threadIdx.x != 0) return;
  unsigned s = smid();
  if (s >= 1024 || atomicCAS(&ctl->claimed[s], 0u, 1u) != 0u) return;  // another block has this SM
  unsigned t = atomicAdd(&ctl->tickets, 1u);
  sm_of_ticket[t] = (int)s;
  while (ctl->turn != t) __nanosleep(2000);  // sleep: keep the L2 quiet for the SM measuring
  unsigned long long sink = 0;
  double v[64];
  for (int m = 0; m < MODES; m++)
    for (int a = 0; a < K; a++) {
      int n = reps < 64 ? reps : 64;
      for (int r = 0; r < n; r++)
        v[r] = m == 0 ? chase<0>(addrs[a], loads, &sink) : m == 1 ? chase<1>(addrs[a], loads, &sink)
                                                                  : chase<2>(addrs[a], loads, &sink);
      for (int i = 1; i < n; i++)  // median of the reps (insertion sort, n is small)
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
          double x = v[j]; v[j] = v[j - 1]; v[j - 1] = x;
        }
      out[((size_t)t * MODES + m) * K + a] = (float)v[n / 2];
    }
  atomicAdd(&ctl->sink, sink);
  __threadfence();
  ctl->turn = t + 1;
}

__global__ void init_lines(unsigned long long *const *addrs, int K) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < K) *addrs[i] = (unsigned long long)addrs[i];
}

// ---- host analysis --------------------------------------------------------------------------

static double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x.empty() ? 0 : x[x.size() / 2];
}

struct Split {
  std::vector<int> group;        // per SM (ticket order): 0 or 1
  std::vector<double> mean[2];   // per address: mean latency of each group
  std::vector<double> sd[2];
  int size[2] = {0, 0};
  int significant = 0;           // addresses whose group means differ by > 3 pooled sd
  double near_far_ns = 0;        // mean |difference| over significant addresses
};

static Split two_means(const std::vector<std::vector<double>> &lat) {  // lat[sm][addr]
  const int S = (int)lat.size(), K = S ? (int)lat[0].size() : 0;
  Split sp;
  sp.group.assign(S, 0);
  if (S < 2 || K == 0) return sp;
  std::vector<std::vector<double>> z(S, std::vector<double>(K));
  for (int a = 0; a < K; a++) {
    std::vector<double> col(S);
    for (int s = 0; s < S; s++) col[s] = lat[s][a];
    double m = median(col);
    for (int s = 0; s < S; s++) z[s][a] = lat[s][a] - m;
  }
  auto dist = [&](const std::vector<double> &x, const std::vector<double> &y) {
    double d = 0;
    for (int a = 0; a < K; a++) d += (x[a] - y[a]) * (x[a] - y[a]);
    return d;
  };
  int i0 = 0, i1 = 0;  // seeds: the SM farthest from SM 0, then the one farthest from that
  for (int s = 0; s < S; s++) if (dist(z[s], z[0]) > dist(z[i0], z[0])) i0 = s;
  for (int s = 0; s < S; s++) if (dist(z[s], z[i0]) > dist(z[i1], z[i0])) i1 = s;
  std::vector<double> c[2] = {z[i0], z[i1]};
  for (int it = 0; it < 50; it++) {
    bool moved = false;
    for (int s = 0; s < S; s++) {
      int g = dist(z[s], c[1]) < dist(z[s], c[0]) ? 1 : 0;
      moved |= g != sp.group[s];
      sp.group[s] = g;
    }
    for (int g = 0; g < 2; g++) {
      std::vector<double> acc(K, 0.0);
      int n = 0;
      for (int s = 0; s < S; s++)
        if (sp.group[s] == g) { n++; for (int a = 0; a < K; a++) acc[a] += z[s][a]; }
      if (n) for (int a = 0; a < K; a++) c[g][a] = acc[a] / n;
    }
    if (!moved && it) break;
  }
  for (int g = 0; g < 2; g++) {
    sp.size[g] = (int)std::count(sp.group.begin(), sp.group.end(), g);
    sp.mean[g].assign(K, 0);
    sp.sd[g].assign(K, 0);
    for (int a = 0; a < K; a++) {
      double m = 0, v = 0;
      int n = 0;
      for (int s = 0; s < S; s++) if (sp.group[s] == g) { m += lat[s][a]; n++; }
      m = n ? m / n : 0;
      for (int s = 0; s < S; s++) if (sp.group[s] == g) v += (lat[s][a] - m) * (lat[s][a] - m);
      sp.mean[g][a] = m;
      sp.sd[g][a] = n > 1 ? std::sqrt(v / (n - 1)) : 0;
    }
  }
  double sum = 0;
  for (int a = 0; a < K; a++) {
    double d = std::fabs(sp.mean[0][a] - sp.mean[1][a]);
    double pooled = std::sqrt((sp.sd[0][a] * sp.sd[0][a] + sp.sd[1][a] * sp.sd[1][a]) / 2) + 1e-9;
    if (sp.size[0] > 1 && sp.size[1] > 1 && d > 3 * pooled) { sp.significant++; sum += d; }
  }
  sp.near_far_ns = sp.significant ? sum / sp.significant : 0;
  return sp;
}

#ifdef L2POLL_SELFTEST
// Host-only check of the analysis (no GPU): 132 SMs, 66 near partition A; each address
// near A or B; near 200 ns, far 260 ns, plus noise.  nvcc -DL2POLL_SELFTEST ... && ./a.out
int main() {
  const int S = 132, K = 64;
  std::vector<std::vector<double>> lat(S, std::vector<double>(K));
  unsigned r = 1;
  for (int s = 0; s < S; s++)
    for (int a = 0; a < K; a++) {
      r = r * 1103515245u + 12345u;
      bool near = ((s * 7 % S) < 66) == (a % 3 != 0);
      lat[s][a] = (near ? 200 : 260) + (r >> 16) % 10;
    }
  Split sp = two_means(lat);
  std::printf("sizes %d/%d significant %d/%d near_far %.1f\n", sp.size[0], sp.size[1], sp.significant, K,
              sp.near_far_ns);
  for (auto &row : lat) for (auto &x : row) x = 230 + (r = r * 1103515245u + 12345u, (r >> 16) % 10);
  sp = two_means(lat);
  std::printf("flat: sizes %d/%d significant %d/%d\n", sp.size[0], sp.size[1], sp.significant, K);
  return 0;
}
#else
int main(int argc, char **argv) {
  int K = argc > 1 ? std::atoi(argv[1]) : 64;
  int loads = argc > 2 ? std::atoi(argv[2]) : 256;
  int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  if (K < 2 || K > 256 || loads < 16 || reps < 1 || reps > 64) {
    std::fprintf(stderr, "usage: %s [K 2..256] [loads >= 16] [reps 1..64]\n", argv[0]);
    return 2;
  }
  int dev = 0, nsm = 0, clock_khz = 0, l2 = 0;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  CHECK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev));
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  std::printf("device: %s, %d SMs, L2 %d MiB; %d addresses over %zu MiB, %d dependent loads x %d reps per "
              "address and mode\n", prop.name, nsm, l2 >> 20, K, SPAN >> 20, loads, reps);

  unsigned char *buf;
  CHECK(cudaMalloc(&buf, SPAN));
  std::vector<unsigned long long *> h_addrs(K);
  std::vector<size_t> offs(K);
  for (int a = 0; a < K; a++) {  // spread over the span; vary the low bits too (slice hashes use them)
    offs[a] = (SPAN / K) * a + (size_t)(a % 16) * 128;
    h_addrs[a] = (unsigned long long *)(buf + offs[a]);
  }
  unsigned long long **d_addrs;
  CHECK(cudaMalloc(&d_addrs, K * sizeof(void *)));
  CHECK(cudaMemcpy(d_addrs, h_addrs.data(), K * sizeof(void *), cudaMemcpyHostToDevice));
  init_lines<<<(K + 63) / 64, 64>>>(d_addrs, K);
  Ctl *ctl;
  CHECK(cudaMalloc(&ctl, sizeof(Ctl)));
  CHECK(cudaMemset(ctl, 0, sizeof(Ctl)));
  float *d_out;
  int *d_sm;
  CHECK(cudaMalloc(&d_out, sizeof(float) * nsm * MODES * K));
  CHECK(cudaMalloc(&d_sm, sizeof(int) * nsm));
  CHECK(cudaMemset(d_sm, 0xff, sizeof(int) * nsm));
  // 4 blocks per SM so that every SM gets one; all are resident at once (tiny blocks),
  // so the ticket order cannot deadlock.
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  CHECK(cudaEventRecord(e0));
  measure<<<4 * nsm, 32>>>(ctl, d_addrs, K, loads, reps, d_out, d_sm);
  CHECK(cudaGetLastError());
  CHECK(cudaEventRecord(e1));
  CHECK(cudaDeviceSynchronize());
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  unsigned got = 0;
  CHECK(cudaMemcpy(&got, &ctl->tickets, sizeof got, cudaMemcpyDeviceToHost));
  std::vector<float> out((size_t)nsm * MODES * K);
  std::vector<int> sm_of(nsm);
  CHECK(cudaMemcpy(out.data(), d_out, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(sm_of.data(), d_sm, nsm * sizeof(int), cudaMemcpyDeviceToHost));
  int S = (int)std::min<unsigned>(got, (unsigned)nsm);
  std::printf("measured %d of %d SMs in %.1f s\n", S, nsm, ms / 1e3);

  // order by SM id
  std::vector<int> order(S);
  for (int i = 0; i < S; i++) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int x, int y) { return sm_of[x] < sm_of[y]; });

  std::string json = "{\"device\": \"" + std::string(prop.name) + "\", \"sms\": " + std::to_string(nsm) +
                     ", \"l2_bytes\": " + std::to_string(l2) + ", \"loads\": " + std::to_string(loads) +
                     ", \"reps\": " + std::to_string(reps) + ", \"offsets\": [";
  for (int a = 0; a < K; a++) json += (a ? "," : "") + std::to_string(offs[a]);
  json += "], \"modes\": {";
  for (int m = 0; m < MODES; m++) {
    std::vector<std::vector<double>> lat(S, std::vector<double>(K));
    for (int i = 0; i < S; i++)
      for (int a = 0; a < K; a++) lat[i][a] = out[((size_t)order[i] * MODES + m) * K + a];
    Split sp = two_means(lat);
    bool two = sp.significant >= K / 4 && std::min(sp.size[0], sp.size[1]) >= S / 10;
    std::printf("\n== mode %s: median ns per load; per SM: group, mean over the addresses near group 0 / near "
                "group 1, and per address n (near: faster than the address's median) or f ==\n", MODE_NAMES[m]);
    std::printf("  sm grp  g0-near  g1-near  addresses\n");
    std::vector<int> near_g(K);  // which group is faster at each address
    for (int a = 0; a < K; a++) near_g[a] = sp.mean[1][a] < sp.mean[0][a] ? 1 : 0;
    for (int i = 0; i < S; i++) {
      double s0 = 0, s1 = 0;
      int n0 = 0, n1 = 0;
      std::string marks;
      std::vector<double> col(S);
      for (int a = 0; a < K; a++) {
        for (int j = 0; j < S; j++) col[j] = lat[j][a];
        marks += lat[i][a] < median(col) ? 'n' : 'f';
        if (near_g[a] == 0) { s0 += lat[i][a]; n0++; } else { s1 += lat[i][a]; n1++; }
      }
      std::printf("%4d %3d %8.1f %8.1f  %s\n", sm_of[order[i]], sp.group[i], n0 ? s0 / n0 : 0.0,
                  n1 ? s1 / n1 : 0.0, marks.c_str());
    }
    std::printf("summary %s: %s; group sizes %d / %d; %d of %d addresses differ by > 3 sd between the groups; "
                "near/far difference %.1f ns (mean over those addresses); addresses near group 0: %d, group 1: %d\n",
                MODE_NAMES[m], two ? "TWO GROUPS" : "no clear split", sp.size[0], sp.size[1], sp.significant, K,
                sp.near_far_ns, (int)std::count(near_g.begin(), near_g.end(), 0),
                (int)std::count(near_g.begin(), near_g.end(), 1));
    json += std::string(m ? "," : "") + "\"" + MODE_NAMES[m] + "\": {\"two_groups\": " + (two ? "true" : "false") +
            ", \"group_sizes\": [" + std::to_string(sp.size[0]) + "," + std::to_string(sp.size[1]) +
            "], \"significant_addresses\": " + std::to_string(sp.significant) +
            ", \"near_far_ns\": " + std::to_string(sp.near_far_ns) + ", \"near_group_of_address\": [";
    for (int a = 0; a < K; a++) json += (a ? "," : "") + std::to_string(near_g[a]);
    json += "], \"sm\": [";
    for (int i = 0; i < S; i++) {
      json += (i ? ",{" : "{") + std::string("\"smid\": ") + std::to_string(sm_of[order[i]]) +
              ", \"group\": " + std::to_string(sp.group[i]) + ", \"ns\": [";
      for (int a = 0; a < K; a++) {
        char b[32];
        std::snprintf(b, sizeof b, "%s%.2f", a ? "," : "", lat[i][a]);
        json += b;
      }
      json += "]}";
    }
    json += "]}";
  }
  json += "}, \"seconds\": " + std::to_string(ms / 1e3) + ", \"clock_khz\": " + std::to_string(clock_khz) + "}\n";
  const char *outdir = std::getenv("OUT");
  if (outdir && *outdir) {
    std::string path = std::string(outdir) + "/l2_poll.json";
    FILE *f = std::fopen(path.c_str(), "w");
    if (f) { std::fputs(json.c_str(), f); std::fclose(f); std::printf("\nwrote %s\n", path.c_str()); }
    else std::fprintf(stderr, "cannot write %s\n", path.c_str());
  }
  return 0;
}
#endif
