/* mono_host.cu - the monokernel's host side: its stage table (built by the same
 * walk as the per-sublayer path), the sizes of its weight ring and grid, and
 * its launch (the kernel is mono.cu). */
#include <vector>

#include "forward_walk.h"

namespace kie_host {

/* The monokernel's stage table: the same ops with the same arguments; with
 * lanes, beside it the links: which stage's partial sum the lanes add up, and
 * which of those sums each stage adds (its adds, each the sum last reduced into
 * that buffer: with d + 1 buffers in rotation, S_j's buffer is not written
 * again before S_j's consumer, sublayer j + 1 + d, has run). */
struct MonoBuilder {
  kie_engine *e;
  std::vector<MonoStage> st;
  std::vector<MonoLink> links;
  std::vector<std::pair<const float *, int>> reduced; /* a sum buffer, the stage whose sum it holds */
  int slot = 0, xbytes = 0;
  int gemv(GemvArgs &a, int epi) {
    MonoStage m;
    memset(&m, 0, sizeof m);
    m.kind = MONO_GEMV;
    m.epi = epi;
    m.segs = a.segs = gemv_segs(e, a);
    m.upt = GEMV_WARPS / m.segs;
    m.g = a;
    slot = std::max(slot, m.upt * 4 * a.ld); /* upt units of two bf16 rows */
    xbytes = std::max(xbytes, 4 * a.ld);
    st.push_back(m);
    MonoLink l;
    memset(&l, 0, sizeof l);
    for (int j = 0; e->s.tp_size > 1 && j < a.nadd; j++) {
      int k = -1;
      for (const auto &r : reduced)
        if (r.first == a.adds[j]) k = r.second;
      if (k < 0) return fail(KIE_E_STATE, "monokernel: stage %zu adds a sum no stage wrote", st.size() - 1);
      l.need[l.nneed++] = k;
    }
    links.push_back(l);
    return KIE_OK;
  }
  int attention(AttnArgs &a) {
    MonoStage m;
    memset(&m, 0, sizeof m);
    m.kind = e->mono_attn == 2 ? MONO_ATTN_SMEM : MONO_ATTN;
    m.at = a; /* the shared-memory attention's keys and splits: mono_prepare, once it knows what fits */
    st.push_back(m);
    MonoLink l;
    memset(&l, 0, sizeof l);
    links.push_back(l);
    return KIE_OK;
  }
  /* The lanes' sum of S, written by the GEMV just added. */
  int sum(float *S, int) {
    const int k = (int)st.size() - 1;
    links[(size_t)k].sum = S;
    for (auto &r : reduced)
      if (r.first == S) {
        r.second = k;
        return KIE_OK;
      }
    reduced.push_back({S, k});
    return KIE_OK;
  }
  /* The graph path's join of a split-phase sum: here the stage that adds the sum waits for it (gemv). */
  int wait(int) { return KIE_OK; }
};

/* kie_shape.mono_ll: which GEMV stages stage their input from the LL words of the stage before
 * them, and which stages still publish a count.  Stage k reads words when stage k - 1 writes
 * all of its input (the o or down projection's residual rows, gate/up's product, or with
 * but with mono_ll 3 the attention's heads: the o stage's input; with mono_ll 4 and 6 not gate/up's
 * product, the down stage's input, twice its floats' bytes as words for every block to read), that
 * input is its plain x or the residual alone (one token, nothing to add, nothing to write,
 * short enough for the norm to hold in registers), and, when k adds the residual itself (an
 * o or down projection), the rows it adds were written by the same block: the last stage to
 * write them has k's row count, so the grid splits its units the same way.  Everything else
 * stage k reads from other blocks was ordered before a count of an earlier stage that some
 * block on the way to k waited for.  With mono_ll 5 and 6 the attention stage also reads the
 * QKV stage's q, k and v rows as words (its rows of earlier steps are older than the kernel).
 * A stage whose successor reads its words publishes no
 * count: nothing waits for it, and the release it costs sat on the block's path into the
 * next stage. */
static int mono_ll_plan(kie_engine *e, std::vector<MonoStage> &st) {
  for (auto &m : st) m.signal = 1;
  e->mono_ll_n = 0;
  if (!e->mono_ll) return KIE_OK;
  const size_t cap = mono_ll_words(e);
  size_t at = 0;
  const int ll = e->s.mono_ll;
  const bool att_in = ll == 5 || ll == 6, att_out = ll != 3, down_in = ll != 4 && ll != 6;
  /* stage p writes `words` LL words that stage c reads, and publishes no count */
  auto link = [&](MonoStage &p, MonoStage &c, size_t words) {
    if (at + words > cap) return fail(KIE_E_STATE, "monokernel: LL words past their %zu reserved", cap);
    p.ll_out = e->mono_ll + at;
    c.ll_in = p.ll_out;
    p.signal = 0;
    at += words;
    e->mono_ll_n++;
    return KIE_OK;
  };
  for (size_t k = 1; k < st.size(); k++) {
    MonoStage &p = st[k - 1], &c = st[k];
    if (c.kind == MONO_ATTN_SMEM && att_in && p.kind == MONO_GEMV && p.epi == EPI_QKV && p.g.T == 1 &&
        c.at.ksplit <= c.at.kcap && (long long)c.at.nsplit * c.at.kcap >= c.at.max_seq) {
      /* every split's keys in one chunk of shared memory, so that this step's row is read once,
       * from its words (attention_smem.cuh reads the keys past a first chunk from the cache) */
      TRY(link(p, c, round_up((size_t)p.g.rows, 8)));
      continue;
    }
    if (c.kind != MONO_GEMV || c.g.T != 1) continue;
    int count;
    const float *out;
    if (p.kind == MONO_GEMV && (p.epi == EPI_RESID || (p.epi == EPI_SWIGLU && down_in))) {
      count = p.epi == EPI_SWIGLU ? p.g.cols : p.g.rows;
      out = p.g.out;
    } else if (p.kind == MONO_ATTN_SMEM && att_out) { /* one token: the heads' rows from 0 */
      count = p.at.nh * p.at.hd;
      out = p.at.out;
    } else {
      continue;
    }
    const bool plain = c.g.x && c.g.x == out;
    const bool normed = !c.g.x && c.g.r_in == out && c.g.nadd == 0 && !c.g.r_out && c.g.ld / 4 <= MONO_LL_NORM_VEC4;
    if (!(plain || normed) || c.g.in > count) continue;
    if (c.epi == EPI_RESID) {
      long j = (long)k - 1;
      while (j >= 0 && !(st[(size_t)j].kind == MONO_GEMV && st[(size_t)j].g.out == c.g.r_in)) j--;
      if (j < 0 || st[(size_t)j].epi != EPI_RESID || st[(size_t)j].g.rows != c.g.rows) continue;
    }
    TRY(link(p, c, round_up((size_t)std::max(count, c.g.ld), 8)));
  }
  return KIE_OK;
}

/* Builds and uploads the stage table and sizes the weight ring (once). */
int mono_prepare(kie_engine *e) {
  if (e->mono_ready) return KIE_OK;
  MonoBuilder b{e, {}, {}, {}};
  TRY(walk_forward(e, 1, true, b, e->s.mono_residual != 2));
  if ((int)b.st.size() != e->mono_n) return fail(KIE_E_STATE, "monokernel: %zu stages, %d planned", b.st.size(), e->mono_n);
  const int tp = e->s.tp_size;
  int optin = 0;
  CU(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, e->device));
  const int hd = e->s.head_dim;
  const size_t slot = round_up((size_t)b.slot, 128);
  size_t static_smem = 0;
  CU(kie_mono_static_smem(e->s.head_dim, tp, &static_smem));
  /* The kernel's static shared memory, counted as 4 KB at least (the tp = 1
   * kernel's ring keeps the size it was measured with), and the mbarriers. */
  const size_t reserve = std::max<size_t>(4096, static_smem) + 256;
  /* The activations' region: a GEMV's staged x, or the attention's.  The
   * shared-memory attention holds att_keys keys, or by default the most (a multiple of
   * 16) that leave the weight ring three slots: on the 2b shape (H100) 192 keys and 3
   * slots were 513 tokens/s at a context of 128 against 486 with 64 keys and 5, and no
   * slower at 1,024: the ring's depth matters less than the combine longer keys spare. */
  auto x_region = [&](int cap) {
    return round_up(std::max((size_t)b.xbytes, kie_mono_attention_smem(hd, cap)), 128);
  };
  auto ring_slots = [&](size_t xu) {
    const long room = (long)optin - (long)xu - (long)reserve;
    return room > 0 ? (int)std::min<long>(8, room / (long)slot) : 0;
  };
  int cap = 0;
  if (e->mono_attn == 2) {
    if (e->s.att_keys > 0) {
      cap = e->s.att_keys;
    } else {
      cap = std::min(16, ATT_SMEM_KEYS(hd));
      for (int c = ATT_SMEM_KEYS(hd); c > 16; c -= 16)
        if (ring_slots(x_region(c)) >= 3) {
          cap = c;
          break;
        }
    }
  }
  const size_t xu = x_region(cap);
  const int fit = ring_slots(xu), nslots = e->s.mono_slots > 0 ? std::min(fit, e->s.mono_slots) : fit;
  if (nslots < 2)
    return fail(KIE_E_ARG, "the monokernel's weight ring needs two slots of %zu bytes beside %zu bytes of "
                "activations%s, and a block has %d bytes of shared memory: use the graph kernel for this shape%s",
                slot, xu, cap ? " (its attention's keys)" : "", optin,
                e->s.att_keys > 0 && cap ? ", or fewer att_keys" : "");
  e->mono_slot = (int)slot;
  e->mono_nslots = nslots;
  e->mono_xbytes = (int)xu;
  e->mono_smem = 256 + (size_t)nslots * slot + xu;
  int per_sm = 0;
  CU(kie_mono_prepare(e->s.head_dim, tp, e->mono_smem, &per_sm));
  if (per_sm < 1) return fail(KIE_E_CUDA, "the monokernel (%zu bytes of shared memory) does not fit an SM", e->mono_smem);
  /* A block per SM; lanes sharing the GPU (MPS) split its SMs, less a few: a
   * lane's blocks wait for the other lanes' inside the step, so every lane's
   * grid must be resident at once, and the kernels a late lane runs before
   * its step must find an SM. */
  int grid = e->sms;
  /* The caller's count comes from how many GPUs a lane sees; KCCL knows when
   * every lane is on this one (its pull mode), which that count misses when
   * the lanes pick one GPU among several: grids of every SM then could never
   * be resident together, and each lane's step would wait on the other's. */
  int lanes = e->s.lanes_per_device;
  if (tp > 1 && e->dc.pull) lanes = std::max(lanes, tp);
  if (e->s.mono_blocks > 0) grid = std::min(e->s.mono_blocks, e->sms);
  else if (lanes > 1) grid = std::max(1, (e->sms - MONO_FREE_SMS) / lanes);
  /* The lanes' sum of a sublayer (hid_pad floats, T = 1) in slices of at most
   * MONO_RED_FLOATS (more, up to KCCL's 8 KB, only past KCCL_DEV_MAX_BLOCKS
   * slices), a multiple of 4 floats each, one reducer block per slice. */
  int nred = 0, red_per = 0;
  if (tp > 1) {
    const int n = e->hid_pad;
    nred = std::min(KCCL_DEV_MAX_BLOCKS, (n + MONO_RED_FLOATS - 1) / MONO_RED_FLOATS);
    red_per = (int)round_up((size_t)((n + nred - 1) / nred), 4);
    nred = (n + red_per - 1) / red_per;
    if (nred > grid)
      return fail(KIE_E_ARG, "the monokernel's %d blocks are fewer than the %d that sum the lanes' sublayer sums",
                  grid, nred);
    CU(cudaMemcpyAsync(e->mono_links, b.links.data(), b.links.size() * sizeof(MonoLink), cudaMemcpyHostToDevice,
                       e->stream));
  }
  if (cap) {
    /* The graph kernel's keys a split and splits, the splits at most a block each a group:
     * one item a block, its rows of earlier steps all copied before its wait (a longer split
     * walks the rest after it).  The partial results' buffer holds the graph path's splits. */
    for (auto &m : b.st)
      if (m.kind == MONO_ATTN_SMEM) {
        m.at = smem_attention_args(e, m.at, cap);
        const int groups = m.at.nh / m.at.g * m.at.hgroups;
        m.at.nsplit = std::min({m.at.nsplit, std::max(1, grid / groups), std::max(e->nsplit, e->nsplit_smem)});
        e->mono_att_split = m.at.ksplit;
        e->mono_att_splits = m.at.nsplit;
      }
  }
  TRY(mono_ll_plan(e, b.st)); /* after the attention's arguments: its words need its splits in one chunk each */
  e->mono_att_keys = cap;
  e->mono_grid = grid;
  e->mono_nred = nred;
  e->mono_red_per = red_per;
  CU(cudaMemcpyAsync(e->mono_stages, b.st.data(), b.st.size() * sizeof(MonoStage), cudaMemcpyHostToDevice, e->stream));
  CU(cudaStreamSynchronize(e->stream));
  e->mono_ready = 1;
  return KIE_OK;
}

/* One decode step as the monokernel (the greedy pick inside it), then the
 * sampler or the advance when the mode asks for them. */
int enqueue_mono(kie_engine *e, int mode) {
  TRY(mono_prepare(e));
  MonoArgs m;
  memset(&m, 0, sizeof m);
  m.stages = e->mono_stages;
  m.nstages = mode == KIE_MODE_ADVANCE ? e->mono_n - 1 : e->mono_n;
  m.sync = e->mono_sync;
  m.cnt = e->mono_cnt;
  m.pick = mode == KIE_MODE_GREEDY;
  m.cand = e->cand;
  m.c = commit_of(e, 1);
  m.ring = e->ring_d;
  m.slot_bytes = e->mono_slot;
  m.nslots = e->mono_nslots;
  m.subs = MONO_SUBS_MAX;
  m.prefetch = e->s.mono_prefetch >= 0 ? e->s.mono_prefetch : 0;
  m.sync_release = e->s.mono_sync != 1; /* auto: release, the faster (bench/RESULTS.md) */
  m.stage_ahead = e->s.mono_ahead != 2;  /* auto: ahead; the kernel ignores it with several lanes */
  m.l2_first = e->s.l2_evict_first == 1; /* auto: off, slower for the ring's copies (bench/RESULTS.md) */
  m.ring_off = 256;
  m.x_off = 256 + e->mono_nslots * e->mono_slot;
  m.att_cap = e->mono_att_keys;
  m.timeout_ns = (e->s.mono_wait_ms ? e->s.mono_wait_ms : 2000) * 1000000LL;
  m.marks = e->mono_marks;
  m.tp = e->s.tp_size;
  if (m.tp > 1) {
    /* Any wait of the step may be waiting on a peer (through the reducers'
     * KCCL calls, which the stage after theirs needs): it gives the peer
     * KCCL's own bound first, so that a slow peer is what KCCL says it is
     * (its timeout, its dead or aborted peer), as on the graph path. */
    m.timeout_ns += (long long)e->dc.timeout_ns;
    m.links = e->mono_links;
    m.rcnt = e->mono_cnt + e->mono_n;
    m.nred = e->mono_nred;
    m.red_per = e->mono_red_per;
    m.sum_count = e->hid_pad;
    m.dc = e->dc;
  }
  CU(kie_launch_mono(m, e->s.head_dim, e->mono_grid, e->mono_smem, e->stream));
  return mode == KIE_MODE_GREEDY ? KIE_OK : enqueue_pick(e, 1, mode);
}

}  // namespace kie_host
