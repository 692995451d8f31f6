/* pick.cu - the end of a step: the token picked on the device and committed
 * (kie_commit: the next step's input, the host ring, position and step).
 *
 *   k_finalize  greedy: the best of the lanes' candidates (value, id), first lane on ties
 *   k_sample    temperature, top-k, top-p and a seeded draw over the whole vocabulary
 *   k_advance   no pick: a prompt chunk that is not the last one
 *
 * Every lane runs the same pick on the same logits and gets the same token,
 * so the sampler must be deterministic: masses are integers (2^-40 units of
 * the largest probability, summed exactly in any order), selections are radix
 * passes over integer counts, and the draw comes from a hash of (seed, step). */
#include <math.h>

#include "kie_kernels.h"

namespace {

__global__ void k_finalize(const FinalArgs a) {
  kcclDevPdlWait();
  kcclDevPdlTrigger();
  if (threadIdx.x == 0) kie_finalize_pick(a.cand, a.tp, a.c);
}

__global__ void k_advance(const Commit c) {
  kcclDevPdlWait();
  kcclDevPdlTrigger();
  if (threadIdx.x == 0) c.st->pos += c.T;
}

#define SAMP_THREADS 1024
#define SAMP_WARPS (SAMP_THREADS / 32)
#define MASS_ONE 1099511627776.0 /* 2^40 */

__device__ __forceinline__ unsigned okey(float v) {
  const unsigned u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float okey_value(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

struct Reduce {
  unsigned long long u64[SAMP_WARPS];
  unsigned u32[SAMP_WARPS];
};

__device__ unsigned long long block_sum_u64(unsigned long long v, Reduce &r) {
  for (int off = 16; off; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) r.u64[threadIdx.x >> 5] = v;
  __syncthreads();
  unsigned long long s = 0;
  for (int w = 0; w < SAMP_WARPS; w++) s += r.u64[w];
  return s;
}

__device__ unsigned block_max_u32(unsigned v, Reduce &r) {
  for (int off = 16; off; off >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) r.u32[threadIdx.x >> 5] = v;
  __syncthreads();
  unsigned m = 0;
  for (int w = 0; w < SAMP_WARPS; w++) m = max(m, r.u32[w]);
  return m;
}

/* Exclusive prefix over threads in thread order. */
__device__ unsigned long long block_scan_u64(unsigned long long v, Reduce &r) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long x = v;
  for (int off = 1; off < 32; off <<= 1) {
    const unsigned long long y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  __syncthreads();
  if (lane == 31) r.u64[warp] = x;
  __syncthreads();
  unsigned long long before = 0;
  for (int w = 0; w < warp; w++) before += r.u64[w];
  return before + x - v;
}

/* NaN logits below the maximum get no mass (a NaN maximum is refused before). */
__device__ __forceinline__ unsigned long long mass_of(float l, float lmax, float inv_t) {
  const float e = expf((l - lmax) * inv_t);
  return e > 0.f ? (unsigned long long)llrint((double)e * MASS_ONE) : 0ull;
}

__device__ __forceinline__ unsigned long long mix64(unsigned long long x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

struct Select {
  unsigned long long hist[256];
  unsigned prefix;
  unsigned long long rem;
};

/* Radix selection from the largest key down, 8 bits a pass, among the keys >= lo:
 * the key t at which the running weight (a count, or with MASS the elements' masses)
 * first reaches `need`.  Returns t; *left: the weight the elements equal to t must
 * still give.  Integer sums, so every lane selects the same key. */
template <bool MASS>
__device__ unsigned radix_select(const float *L, int i0, int i1, unsigned lo, unsigned long long need, float lmax,
                                 float inv_t, Select &sel, unsigned long long *left) {
  unsigned prefix = 0, mask = 0;
  unsigned long long rem = need;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += SAMP_THREADS) sel.hist[b] = 0;
    __syncthreads();
    for (int i = i0; i < i1; i++) {
      const unsigned k = okey(L[i]);
      if (k >= lo && (k & mask) == prefix)
        atomicAdd(&sel.hist[(k >> shift) & 255u], MASS ? mass_of(L[i], lmax, inv_t) : 1ull);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long cum = 0;
      int b = 255;
      for (; b > 0; b--) {
        if (cum + sel.hist[b] >= rem) break;
        cum += sel.hist[b];
      }
      sel.prefix = prefix | ((unsigned)b << shift);
      sel.rem = rem - cum;
    }
    __syncthreads();
    prefix = sel.prefix;
    rem = sel.rem;
    mask |= 255u << shift;
  }
  *left = rem;
  return prefix;
}

__global__ void __launch_bounds__(SAMP_THREADS) k_sample(const SampleArgs a) {
  __shared__ Reduce red;
  __shared__ Select sel;
  __shared__ int picked;
  kcclDevPdlWait();
  kcclDevPdlTrigger();

  const int tid = threadIdx.x, V = a.V;
  const float *L = a.logits;
  const float inv_t = a.p->inv_temp;
  const int per = (V + SAMP_THREADS - 1) / SAMP_THREADS;
  const int i0 = min(V, tid * per), i1 = min(V, i0 + per);

  unsigned km = 0;
  for (int i = i0; i < i1; i++) km = max(km, okey(L[i]));
  km = block_max_u32(km, red);
  const float lmax = okey_value(km);
  if (isnan(lmax) || isinf(lmax)) {
    if (tid == 0) {
      kie_set_error(a.c.ring, KIE_DERR_NAN, a.c.st->step);
      kie_commit(a.c, 0);
    }
    return;
  }

  /* Top-k: the k-th largest key (tk) and how many of the elements equal to it are
   * kept (lowest ids first).  Without top-k every element is kept. */
  const int top_k = a.p->top_k;
  unsigned tk = 0, tie_k = 0xffffffffu;
  if (top_k > 0 && top_k < V) {
    unsigned long long left = 0;
    tk = radix_select<false>(L, i0, i1, 0u, (unsigned long long)top_k, lmax, inv_t, sel, &left);
    tie_k = (unsigned)left;
  }

  /* Mass above tk, and the mass of one element at tk. */
  unsigned long long gt = 0;
  unsigned eq = 0;
  for (int i = i0; i < i1; i++) {
    const unsigned k = okey(L[i]);
    if (k > tk) gt += mass_of(L[i], lmax, inv_t);
    else if (k == tk) eq++;
  }
  const unsigned long long mass_gt_k = block_sum_u64(gt, red);
  const unsigned long long count_eq_k = block_sum_u64(eq, red);
  const unsigned long long m_tk = mass_of(okey_value(tk), lmax, inv_t);
  const unsigned long long ties_k = tie_k == 0xffffffffu ? count_eq_k : (unsigned long long)tie_k;
  const unsigned long long z_k = mass_gt_k + ties_k * m_tk;

  /* Top-p: the smallest prefix (largest first, lowest ids first among equals) of
   * the top-k set whose mass reaches top_p of the set's. */
  unsigned t = tk;
  unsigned long long ties = ties_k;
  const float top_p = a.p->top_p;
  if (top_p < 1.f) {
    unsigned long long target = (unsigned long long)ceil((double)top_p * (double)z_k);
    if (target < 1) target = 1;
    if (mass_gt_k >= target) { /* the cut lies above tk: select by mass among keys > tk */
      unsigned long long rem = 0;
      t = radix_select<true>(L, i0, i1, tk + 1, target, lmax, inv_t, sel, &rem);
      const unsigned long long m_t = mass_of(okey_value(t), lmax, inv_t);
      ties = m_t ? (rem + m_t - 1) / m_t : 1;
    } else {                   /* the cut is among the elements equal to tk */
      const unsigned long long rem = target - mass_gt_k;
      const unsigned long long need = m_tk ? (rem + m_tk - 1) / m_tk : ties_k;
      ties = need < ties_k ? need : ties_k;
    }
  }

  /* The draw: u in [0, 1) from (seed, step), then the kept element whose
   * cumulative mass (in id order) first passes u * total. */
  const unsigned long long m_t = mass_of(okey_value(t), lmax, inv_t);
  unsigned long long my_gt = 0, my_eq = 0;
  for (int i = i0; i < i1; i++) {
    const unsigned k = okey(L[i]);
    if (k > t) my_gt += mass_of(L[i], lmax, inv_t);
    else if (k == t) my_eq++;
  }
  const unsigned long long eq_before = block_scan_u64(my_eq, red);
  const unsigned long long my_ties = eq_before >= ties ? 0 : min(my_eq, ties - eq_before);
  const unsigned long long my_mass = my_gt + my_ties * m_t;
  const unsigned long long mass_before = block_scan_u64(my_mass, red);
  const unsigned long long total = block_sum_u64(my_mass, red);
  const int step = a.c.st->step;
  const double u = (double)(mix64(a.p->seed ^ mix64((unsigned long long)step)) >> 11) * (1.0 / 9007199254740992.0);
  unsigned long long r = (unsigned long long)(u * (double)total);
  if (r >= total) r = total - 1;
  if (tid == 0) picked = -1;
  __syncthreads();
  if (my_mass && r >= mass_before && r < mass_before + my_mass) {
    unsigned long long cum = mass_before, seen = eq_before;
    for (int i = i0; i < i1; i++) {
      const unsigned k = okey(L[i]);
      unsigned long long w = 0;
      if (k > t) w = mass_of(L[i], lmax, inv_t);
      else if (k == t && seen++ < ties) w = m_t;
      if (r < cum + w) {
        picked = i;
        break;
      }
      cum += w;
    }
  }
  __syncthreads();
  if (tid == 0) {
    if (picked < 0) { /* cannot happen with total > 0; keep the argmax rather than a wild id */
      kie_set_error(a.c.ring, KIE_DERR_TOKEN, step);
      picked = 0;
    }
    kie_commit(a.c, picked);
  }
}

}  // namespace

cudaError_t kie_launch_finalize(const FinalArgs &a, cudaStream_t st, int pdl) {
  return kcclLaunch(k_finalize, dim3(1), dim3(32), 0, st, pdl, a);
}

cudaError_t kie_launch_advance(const Commit &c, cudaStream_t st, int pdl) {
  return kcclLaunch(k_advance, dim3(1), dim3(32), 0, st, pdl, c);
}

cudaError_t kie_launch_sample(const SampleArgs &a, cudaStream_t st, int pdl) {
  return kcclLaunch(k_sample, dim3(1), dim3(SAMP_THREADS), 0, st, pdl, a);
}
