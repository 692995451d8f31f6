/* gpu_l2map.cu - per-L2-partition flag replicas (KCCL_GPU_FLAG_REPLICAS=1).
 *
 * An H100/H200's L2 has two partitions; every address lives in one, and an SM
 * of the other group reaches it a little later (H200: 132 SMs in two groups of
 * 66, an acquire load ~16 ns slower from the far group).  With replicas
 * every flag line of the chunked kernels exists twice in the reader's buffer,
 * one copy near each SM group: a writer writes both, a reader polls the one near
 * the SM its block landed on.
 *
 * At init each rank calibrates its own buffer, before publishing its export:
 * - every candidate line of a 1 MiB pool holds its own address, so a chain of
 *   loads through it is a chain of dependent loads of that line;
 * - one thread per SM (the first block that lands on an SM claims it) times R
 *   such loads of every candidate with clock64, twice (the smaller count is
 *   kept: interference only ever adds), SMs starting at different candidates;
 * - the host splits the SMs into two groups by their near/far pattern, calls a
 *   line near a group when the groups' mean latencies differ by more than
 *   KGPU_L2_GAP_NS, and picks for every (stage, block) one line near each group.
 * A GPU without two clear groups (one L2, or the split is noise) keeps one copy.
 * Every rank must succeed for the replicas to be used (kgpu_l2_agree). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <vector>

#include "kgpu.h"

#define KGPU_L2_PASSES 2
#define KGPU_L2_BUDGET_NS 250000000ull /* the probe gives up after this (expected: ~5 ms) */

/* ---------------------------------------------------------------- device -- */

__global__ void k_l2_init(char *pool) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < KGPU_L2_CANDIDATES) {
    uint64_t *p = (uint64_t *)(pool + (size_t)kgpu_l2_pool_line(i) * KGPU_LINE);
    *p = (uint64_t)(uintptr_t)p;
  }
}

/* cyc[sm][candidate]: clock64 cycles of KGPU_L2_CHAIN dependent acquire loads
 * (the load the flag waits use), the smaller of the passes; left at 0xffff when
 * the SM got no block or the budget ran out during the first pass. */
__global__ void k_l2_probe(const char *pool, unsigned *claimed, uint16_t *cyc, unsigned long long *sink) {
  if (threadIdx.x != 0) return;
  const unsigned sm = kgpu_smid();
  if (sm >= KGPU_SM_MAP || atomicCAS(&claimed[sm], 0u, 1u) != 0u) return; /* this SM is measured by another block */
  const uint64_t t_end = kgpu_time_ns() + KGPU_L2_BUDGET_NS;
  /* Start points spread out, so the SMs do not all load one line at once. */
  const int start = (int)sm * (KGPU_L2_CANDIDATES / KGPU_SM_MAP);
  uint16_t *row = cyc + (size_t)sm * KGPU_L2_CANDIDATES;
  uint64_t acc = 0;
  for (int pass = 0; pass < KGPU_L2_PASSES; pass++) {
    for (int k = 0; k < KGPU_L2_CANDIDATES; k++) {
      const int i = (start + k) % KGPU_L2_CANDIDATES;
      const uint64_t *q = (const uint64_t *)(pool + (size_t)kgpu_l2_pool_line(i) * KGPU_LINE);
      /* Two loads first (the line into L2).  The clock reads wait for nothing, so
       * t0 is read as the second load issues and t1 as the last one issues: the
       * interval is KGPU_L2_CHAIN whole round trips of hits in L2. */
      q = (const uint64_t *)kgpu_ld_acquire_sys_u64(q);
      q = (const uint64_t *)kgpu_ld_acquire_sys_u64(q);
      const long long t0 = kgpu_clock64();
      for (int r = 0; r < KGPU_L2_CHAIN; r++) q = (const uint64_t *)kgpu_ld_acquire_sys_u64(q);
      const long long t1 = kgpu_clock64();
      acc += (uint64_t)(uintptr_t)q;
      const long long d = t1 - t0;
      const uint16_t c = (uint16_t)(d < 0 ? 0xfffe : d > 0xfffe ? 0xfffe : d);
      if (pass == 0 || c < row[i]) row[i] = c;
      if ((k & 63) == 63 && kgpu_time_ns() > t_end) {
        atomicAdd(sink, acc);
        return;
      }
    }
  }
  atomicAdd(sink, acc); /* keeps the chains */
}

/* ------------------------------------------------------------ host: analysis -- */

static double median_of(std::vector<double> &v) {
  if (v.empty()) return 0.0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

void kgpu_l2_analyze(const uint16_t *cyc, int chain, double thr, struct kgpu_l2_split *o) {
  const int L = KGPU_L2_CANDIDATES;
  memset(o, 0, sizeof *o);
  memset(o->map, 0xff, sizeof o->map);
  std::vector<int> sms; /* SMs with a full row */
  for (int s = 0; s < KGPU_SM_MAP; s++) {
    bool full = true;
    for (int l = 0; l < L && full; l++) full = cyc[(size_t)s * L + l] != 0xffff;
    if (full) sms.push_back(s);
  }
  const int S = (int)sms.size();
  o->measured = S;
  if (S < 2) {
    o->code = KGPU_REP_FEW_SMS;
    snprintf(o->why, sizeof o->why, "%d SM(s) measured, 2 needed", S);
    return;
  }
  /* lat[i][l]: cycles per load of SM sms[i]; z: minus the line's median over the
   * SMs, then minus the SM's own median (an SM slower at every line is not far
   * from any in particular). */
  std::vector<double> lat((size_t)S * L), z((size_t)S * L), col(S), row(L);
  for (int i = 0; i < S; i++)
    for (int l = 0; l < L; l++) lat[(size_t)i * L + l] = cyc[(size_t)sms[i] * L + l] / (double)chain;
  for (int l = 0; l < L; l++) {
    for (int i = 0; i < S; i++) col[i] = lat[(size_t)i * L + l];
    const double m = median_of(col);
    for (int i = 0; i < S; i++) z[(size_t)i * L + l] = lat[(size_t)i * L + l] - m;
  }
  for (int i = 0; i < S; i++) {
    for (int l = 0; l < L; l++) row[l] = z[(size_t)i * L + l];
    const double m = median_of(row);
    for (int l = 0; l < L; l++) z[(size_t)i * L + l] -= m;
  }
  /* Group 0 = SMs whose near/far pattern (below / above each line's median)
   * agrees with the first SM's on most lines; then two rounds that move each SM
   * to the group whose profile it matches (robust to a noisy first SM). */
  std::vector<int> grp(S);
  for (int i = 0; i < S; i++) {
    int agree = 0;
    for (int l = 0; l < L; l++) agree += (z[(size_t)i * L + l] < 0) == (z[l] < 0);
    grp[i] = 2 * agree > L ? 0 : 1;
  }
  std::vector<double> mean[2] = {std::vector<double>(L), std::vector<double>(L)};
  auto means = [&]() {
    int n[2] = {0, 0};
    for (int g = 0; g < 2; g++) std::fill(mean[g].begin(), mean[g].end(), 0.0);
    for (int i = 0; i < S; i++) {
      n[grp[i]]++;
      for (int l = 0; l < L; l++) mean[grp[i]][l] += lat[(size_t)i * L + l];
    }
    for (int g = 0; g < 2; g++)
      for (int l = 0; l < L; l++) mean[g][l] = n[g] ? mean[g][l] / n[g] : 0.0;
    o->size[0] = n[0];
    o->size[1] = n[1];
  };
  means();
  for (int round = 0; round < 2 && o->size[0] && o->size[1]; round++) {
    for (int i = 0; i < S; i++) {
      double score = 0; /* > 0: slow where group 1 is slow, i.e. like group 1 */
      for (int l = 0; l < L; l++) score += z[(size_t)i * L + l] * (mean[1][l] - mean[0][l]);
      grp[i] = score > 0 ? 1 : 0;
    }
    means();
  }
  const int min_group = S / 8 > 1 ? S / 8 : 1;
  if (o->size[0] < min_group || o->size[1] < min_group) {
    o->code = KGPU_REP_ONE_GROUP;
    snprintf(o->why, sizeof o->why, "the %d SMs do not split into two groups (%d / %d)", S, o->size[0], o->size[1]);
    return;
  }
  for (int i = 0; i < S; i++) o->map[sms[i]] = (uint8_t)grp[i];
  /* Lines: near group c when group c is faster by more than thr cycles per load. */
  std::vector<std::pair<double, int>> near[2];
  std::vector<double> gaps;
  for (int l = 0; l < L; l++) {
    const double gap = mean[1][l] - mean[0][l]; /* > 0: near group 0 */
    if (gap > thr) near[0].push_back({-gap, l});
    else if (-gap > thr) near[1].push_back({gap, l});
    else o->neither++;
    if (gap > thr || -gap > thr) gaps.push_back(gap < 0 ? -gap : gap);
  }
  o->near[0] = (int)near[0].size();
  o->near[1] = (int)near[1].size();
  o->gap = median_of(gaps);
  if (o->near[0] < KGPU_L2_NEED || o->near[1] < KGPU_L2_NEED) {
    o->code = KGPU_REP_FEW_LINES;
    snprintf(o->why, sizeof o->why, "SM groups %d / %d, but only %d / %d of %d lines are near one (gap > %.1f cycles), "
             "%d of each needed", o->size[0], o->size[1], o->near[0], o->near[1], L, thr, KGPU_L2_NEED);
    return;
  }
  /* The clearest lines first: flag line (stage, block) gets the k-th of each group. */
  for (int c = 0; c < 2; c++) {
    std::sort(near[c].begin(), near[c].end());
    for (int st = 0; st < 2; st++)
      for (int b = 0; b < KGPU_TS_MAX_BLOCKS; b++)
        o->tab[b][st][c] = (uint16_t)kgpu_l2_pool_line(near[c][st * KGPU_TS_MAX_BLOCKS + b].second);
  }
  o->code = KGPU_REP_OK;
  snprintf(o->why, sizeof o->why, "SM groups %d / %d (%d measured), lines near group 0 / 1 / neither: %d / %d / %d, "
           "median gap %.1f cycles per load", o->size[0], o->size[1], S, o->near[0], o->near[1], o->neither, o->gap);
}

/* ----------------------------------------------------------------- host -- */

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static const char *rep_words(int code) {
  switch (code) {
    case KGPU_REP_OK: return "two L2 groups found";
    case KGPU_REP_FEW_SMS: return "fewer than 2 SMs could be measured";
    case KGPU_REP_ONE_GROUP: return "the SMs do not split into two L2 groups";
    case KGPU_REP_FEW_LINES: return "too few lines are clearly near one L2 group";
    default: return "unknown";
  }
}

#define L2_CHECK(call)                                                                                  \
  do {                                                                                                  \
    kgpuError_t e_ = (call);                                                                            \
    if (e_ != kgpuSuccess) {                                                                            \
      r = kccl_err(kcclUnhandledCudaError, "flag-replica calibration: %s failed: %s", #call,            \
                   kgpuGetErrorString(e_));                                                             \
      goto done;                                                                                        \
    }                                                                                                   \
  } while (0)

kcclResult_t kgpu_l2_calibrate(struct kgpu *g) {
  const double t_start = now_ms();
  kcclResult_t r = kcclSuccess;
  int sms = 0, khz = 0;
  unsigned *claimed = NULL;
  uint16_t *cyc_d = NULL;
  unsigned long long *sink = NULL;
  struct kgpu_l2_split *sp = (struct kgpu_l2_split *)calloc(1, sizeof *sp);
  std::vector<uint16_t> cyc((size_t)KGPU_SM_MAP * KGPU_L2_CANDIDATES);
  const size_t cyc_bytes = cyc.size() * sizeof(uint16_t);
  char *pool = g->buf + g->lay.l2pool;
  uint8_t mapw[KGPU_SM_MAP + sizeof(uint32_t)];
  uint32_t valid;
  if (!sp) return kccl_err(kcclSystemError, "out of memory");
  L2_CHECK(kgpuDeviceGetAttribute(&sms, kgpuDevAttrMultiProcessorCount, g->device));
  L2_CHECK(kgpuDeviceGetAttribute(&khz, kgpuDevAttrClockRate, g->device));
  L2_CHECK(kgpuMalloc((void **)&claimed, KGPU_SM_MAP * sizeof(unsigned)));
  L2_CHECK(kgpuMalloc((void **)&cyc_d, cyc_bytes));
  L2_CHECK(kgpuMalloc((void **)&sink, sizeof *sink));
  L2_CHECK(kgpuMemset(claimed, 0, KGPU_SM_MAP * sizeof(unsigned)));
  L2_CHECK(kgpuMemset(cyc_d, 0xff, cyc_bytes));
  L2_CHECK(kgpu_launch(k_l2_init, (KGPU_L2_CANDIDATES + 255) / 256, 256, 0, 0, pool));
  /* Tiny blocks, 4 per SM, all resident at once: every SM gets one (under MPS
   * beside other ranks' work too, most likely; an SM without one maps to copy 0). */
  L2_CHECK(kgpu_launch(k_l2_probe, 4 * (unsigned)sms, 32, 0, 0, (const char *)pool, claimed, cyc_d, sink));
  L2_CHECK(kgpuDeviceSynchronize());
  L2_CHECK(kgpuMemcpy(cyc.data(), cyc_d, cyc_bytes, kgpuMemcpyDefault));
  {
    /* clock64 counts SM cycles: the threshold in ns at the rated clock. */
    const double thr = KGPU_L2_GAP_NS * (khz > 0 ? khz : 1500000) / 1e6;
    kgpu_l2_analyze(cyc.data(), KGPU_L2_CHAIN, thr, sp);
    const double ns_per_cycle = 1e6 / (khz > 0 ? khz : 1500000);
    g->rep_self = sp->code;
    memcpy(mapw, sp->map, KGPU_SM_MAP);
    valid = sp->code == KGPU_REP_OK;
    memcpy(mapw + KGPU_SM_MAP, &valid, sizeof valid);
    /* The pool's words held addresses: every flag starts at 0. */
    L2_CHECK(kgpuMemset(pool, 0, (size_t)KGPU_L2_POOL_LINES * KGPU_LINE));
    L2_CHECK(kgpuMemcpy(g->buf + g->lay.l2tab, sp->tab, sizeof sp->tab, kgpuMemcpyDefault));
    L2_CHECK(kgpuMemcpy(g->buf + g->lay.l2map, mapw, sizeof mapw, kgpuMemcpyDefault));
    snprintf(g->rep_cal, sizeof g->rep_cal, "%s: %s (%.1f ns gap; threshold %.1f cycles; %d SMs; %.1f ms)",
             rep_words(sp->code), sp->why, sp->gap * ns_per_cycle, thr, sms, now_ms() - t_start);
    kccl_log(sp->code == KGPU_REP_OK ? 2 : 1, "rank %d, GPU %d, flag replicas: %s", g->shape.rank, g->device,
             g->rep_cal);
  }
done:
  if (claimed) kgpuFree(claimed);
  if (cyc_d) kgpuFree(cyc_d);
  if (sink) kgpuFree(sink);
  free(sp);
  return r;
}

void kgpu_l2_agree(struct kgpu *g, const kgpu_export *peers) {
  const kgpu_shape *s = &g->shape;
  g->rep_on = 0;
  if (!s->cfg.gpu_flag_replicas) {
    snprintf(g->rep_note, sizeof g->rep_note, "not requested (KCCL_GPU_FLAG_REPLICAS=0)");
    return;
  }
  for (int p = 0; p < s->nranks; p++) {
    if (peers[p].flag_replicas == KGPU_REP_OK) continue;
    if (p == s->rank)
      snprintf(g->rep_note, sizeof g->rep_note, "requested but disabled: this rank's calibration: %s", g->rep_cal);
    else
      snprintf(g->rep_note, sizeof g->rep_note, "requested but disabled: rank %d's calibration: %s", p,
               rep_words(peers[p].flag_replicas));
    kccl_log(1, "rank %d: KCCL_GPU_FLAG_REPLICAS=1 but one copy per flag: %s", s->rank, g->rep_note);
    return;
  }
  g->rep_on = 1;
  snprintf(g->rep_note, sizeof g->rep_note, "in use on every rank; this rank: %s", g->rep_cal);
}

extern "C" void kgpu_flag_replicas(struct kgpu *g, int *state, char *note, size_t bytes) {
  *state = g->rep_on ? 1 : g->shape.cfg.gpu_flag_replicas ? -1 : 0;
  if (note && bytes) snprintf(note, bytes, "%s", g->rep_note);
}
