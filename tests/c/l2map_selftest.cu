/* The flag replicas' analysis (kgpu_l2_analyze, kccl_native/src/gpu/gpu_l2map.cu) on
 * made-up latencies, on the host.  Built with the library file and run by
 * tests/test_gpu_api.py:
 *   nvcc -std=c++17 -Ikccl_native/include -Ikccl_native/src tests/c/l2map_selftest.cu \
 *        kccl_native/src/gpu/gpu_l2map.cu -o l2map_selftest && ./l2map_selftest [MATRIX]
 * MATRIX: uint16 cycles [KGPU_SM_MAP][KGPU_L2_CANDIDATES] (the test makes one from the
 * H200's bench/results/gpu/l2_poll.json); prints the analysis of it instead. */
#include <stdio.h>

#include <vector>

#include "gpu/kgpu.h"

/* The two core functions gpu_l2map.cu calls, without the rest of the core. */
extern "C" kcclResult_t kccl_err(kcclResult_t code, const char *fmt, ...) { (void)fmt; return code; }
extern "C" void kccl_log(int level, const char *fmt, ...) { (void)level; (void)fmt; }

static unsigned rng = 12345;
static double noise(double sd) { /* roughly normal: sum of 4 uniforms */
  double u = 0;
  for (int k = 0; k < 4; k++) {
    rng = rng * 1103515245u + 12345u;
    u += ((rng >> 8) & 0xffff) / 65536.0 - 0.5;
  }
  return u * sd * 1.73;
}

/* SMs 0..nsm-1 (group as on the H200: SM ids 40-87 and 106-123 in one); line l near
 * group (near_of(l)); cycles per load near / far, plus noise. */
static void make(std::vector<uint16_t> &cyc, int nsm, double near_c, double far_c, double sd, int (*near_of)(int)) {
  cyc.assign((size_t)KGPU_SM_MAP * KGPU_L2_CANDIDATES, 0xffff);
  for (int s = 0; s < nsm; s++) {
    const int gs = (s >= 40 && s < 88) || (s >= 106 && s < 124);
    for (int l = 0; l < KGPU_L2_CANDIDATES; l++) {
      const int nl = near_of(l);
      const double c = (nl < 0 ? (near_c + far_c) / 2 : nl == gs ? near_c : far_c) + noise(sd);
      cyc[(size_t)s * KGPU_L2_CANDIDATES + l] = (uint16_t)(c * KGPU_L2_CHAIN);
    }
  }
}
static int split_half(int l) { return (int)(((uint32_t)l * 2654435761u) >> 31); }
static int flat(int) { return -1; }
static int mostly0(int l) { return l % 10 == 0 ? 1 : 0; }

static int fails = 0, passes = 0;
static void expect(bool ok, const char *what) {
  printf("%s %s\n", ok ? "ok  " : "FAIL", what);
  fails += !ok;
  passes += ok;
}

int main(int argc, char **argv) {
  std::vector<uint16_t> cyc;
  kgpu_l2_split sp;
  const double thr = KGPU_L2_GAP_NS * 1.98; /* cycles at 1.98 GHz */
  if (argc > 1) { /* a matrix from a file: prints code, group sizes, lines near each, the SM map */
    cyc.assign((size_t)KGPU_SM_MAP * KGPU_L2_CANDIDATES, 0xffff);
    FILE *f = fopen(argv[1], "rb");
    if (!f || fread(cyc.data(), sizeof(uint16_t), cyc.size(), f) != cyc.size()) return 2;
    fclose(f);
    kgpu_l2_analyze(cyc.data(), KGPU_L2_CHAIN, thr, &sp);
    printf("%d %d %d %d %d\n", sp.code, sp.size[0], sp.size[1], sp.near[0], sp.near[1]);
    for (int s = 0; s < KGPU_SM_MAP; s++) printf("%d%c", sp.map[s] == 0xff ? -1 : sp.map[s], s + 1 < KGPU_SM_MAP ? ' ' : '\n');
    printf("%s\n", sp.why);
    return 0;
  }
  /* H200-like: near 276, far 306 cycles (139 vs 154 ns), per-chain noise 10 cycles. */
  make(cyc, 132, 276, 306, 10, split_half);
  kgpu_l2_analyze(cyc.data(), KGPU_L2_CHAIN, thr, &sp);
  printf("     %s\n", sp.why);
  expect(sp.code == KGPU_REP_OK && sp.size[0] == 66 && sp.size[1] == 66, "two groups of 66");
  bool map_ok = true, tab_ok = true;
  for (int s = 0; s < 132; s++) {
    const int gs = (s >= 40 && s < 88) || (s >= 106 && s < 124);
    map_ok &= sp.map[s] == (gs ? sp.map[40] : sp.map[0]) && sp.map[0] != sp.map[40];
  }
  std::vector<int> used(KGPU_L2_POOL_LINES, 0);
  for (int b = 0; b < KGPU_TS_MAX_BLOCKS; b++)
    for (int st = 0; st < 2; st++)
      for (int c = 0; c < 2; c++) {
        const int line = sp.tab[b][st][c], cand = line / 8;
        tab_ok &= kgpu_l2_pool_line(cand) == line && used[line]++ == 0;
        /* copy c must be near the group whose label is c (the label of SM 0's group is map[0]) */
        const int truth_group_of_cand = split_half(cand);       /* 0: near SMs outside 40-87/106-123 */
        const int label = truth_group_of_cand == 0 ? sp.map[0] : sp.map[40];
        tab_ok &= label == c;
      }
  expect(map_ok, "SM map matches the made-up groups");
  expect(tab_ok, "every flag line distinct, a pool line, near its copy's group");
  expect(sp.map[200] == 0xff, "unmeasured SM ids map to 0xff");
  /* A few SMs without a block: still two groups, their entries 0xff. */
  make(cyc, 132, 276, 306, 10, split_half);
  for (int l = 0; l < KGPU_L2_CANDIDATES; l++) cyc[(size_t)7 * KGPU_L2_CANDIDATES + l] = 0xffff;
  cyc[(size_t)50 * KGPU_L2_CANDIDATES + 3] = 0xffff;
  kgpu_l2_analyze(cyc.data(), KGPU_L2_CHAIN, thr, &sp);
  expect(sp.code == KGPU_REP_OK && sp.measured == 130 && sp.map[7] == 0xff && sp.map[50] == 0xff,
         "SMs with a partial row are left out");
  /* Per-SM offsets (some SMs slower at every line) do not move SMs between groups. */
  make(cyc, 132, 276, 306, 10, split_half);
  for (int s = 0; s < 132; s += 3)
    for (int l = 0; l < KGPU_L2_CANDIDATES; l++) cyc[(size_t)s * KGPU_L2_CANDIDATES + l] += 25 * KGPU_L2_CHAIN;
  kgpu_l2_analyze(cyc.data(), KGPU_L2_CHAIN, thr, &sp);
  expect(sp.code == KGPU_REP_OK && sp.size[0] == 66 && sp.size[1] == 66 && sp.map[3] == sp.map[0] &&
         sp.map[42] == sp.map[40], "SMs 25 cycles slower everywhere stay in their group");
  /* One L2 (no partitions): refused. */
  make(cyc, 132, 290, 290, 10, flat);
  kgpu_l2_analyze(cyc.data(), KGPU_L2_CHAIN, thr, &sp);
  printf("     %s\n", sp.why);
  expect(sp.code == KGPU_REP_FEW_LINES || sp.code == KGPU_REP_ONE_GROUP, "flat latencies: no replicas");
  /* Nearly every line near one group: too few for the other copy. */
  make(cyc, 132, 276, 306, 10, mostly0);
  kgpu_l2_analyze(cyc.data(), KGPU_L2_CHAIN, thr, &sp);
  printf("     %s\n", sp.why);
  expect(sp.code == KGPU_REP_FEW_LINES, "lines near one group only: no replicas");
  /* One SM. */
  make(cyc, 1, 276, 306, 10, split_half);
  kgpu_l2_analyze(cyc.data(), KGPU_L2_CHAIN, thr, &sp);
  expect(sp.code == KGPU_REP_FEW_SMS, "one SM: no replicas");
  /* A smaller gap (8 ns = 16 cycles) with twice the noise still splits. */
  make(cyc, 132, 276, 292, 20, split_half);
  kgpu_l2_analyze(cyc.data(), KGPU_L2_CHAIN, thr, &sp);
  printf("     %s\n", sp.why);
  expect(sp.code == KGPU_REP_OK && sp.size[0] == 66, "8 ns gap, 20-cycle noise: two groups");
  printf("%d passed, %d failed\n", passes, fails);
  return fails ? 1 : 0;
}
