/* gpu_gather.cu - the all-gather and the broadcast: one kernel, chunked
 * through two alternating gather halves of each rank's scratch (flags and
 * reuse: chunked_flags.cuh).  Each publishing rank (every rank, or the root)
 * copies block b's portion of its chunk into its half, raises its flag, and
 * the readers copy that portion out of every publisher's half. */
#include "chunked_copy.cuh"
#include "chunked_flags.cuh"

__global__ void __launch_bounds__(KCCL_GPU_MAX_CHUNK_THREADS, 1) k_gather(Gather a) {
  kgpu_pdl_wait();
  /* No kgpu_pdl_trigger: a successor launched with PDL (a one-shot call) then
   * starts only when this kernel ends, so at most one chunked kernel per rank
   * is resident and the block counts of kgpu_connect hold. */
  __shared__ uint32_t s_step;
  __shared__ volatile int s_fail;
  const kcclDevComm &dc = a.dc;
  const int n = dc.nranks, me = dc.rank, G = gridDim.x, b = blockIdx.x;
  if (threadIdx.x == 0) s_fail = 0;
  const bool bcast = a.root >= 0;
  const bool publish = !bcast || me == a.root;
  const RepLines rl = rep_lines(dc, a.rep);
  /* Block b's portion of every chunk comes from the first (largest) one: see TsLayout (gpu_twoshot.cu). */
  const size_t cb0 = a.bytes < a.chunk_bytes ? a.bytes : a.chunk_bytes;
  const size_t P = ((cb0 + G - 1) / G + 15) / 16 * 16;
  for (size_t o = 0; o < a.bytes || (o == 0 && a.bytes == 0);) {
    const size_t cb = a.bytes - o < a.chunk_bytes ? a.bytes - o : a.chunk_bytes;
    const size_t lo = (size_t)b * P < cb ? (size_t)b * P : cb, hi = lo + P < cb ? lo + P : cb;
    const uint32_t step = next_step(dc, a.off_steps, &s_step);
    const size_t half = (step & 1) ? a.off_g1 : a.off_g0;
    const uint64_t val = ((uint64_t)a.sig << 32) | step;
    char *my_recv = a.recv + (bcast ? 0 : (size_t)me * a.bytes);

    if (publish && lo < hi) copy_range(dc.peer_base[me] + half - o, a.send, o + lo, o + hi, false);
    signal_peers(dc, a.off_flags, a.rep, rl, 0, val);
    if (!wait_peers(dc, a.off_flags, a.off_steps, a.rep, rl, 0, step, a.sig, bcast && me != a.root ? a.root : -1,
                    &s_fail))
      break;
    if (lo < hi) {
      if (!bcast) {
        for (int p = 0; p < n; p++) {
          if (p == me) continue;
          copy_range(a.recv + (size_t)p * a.bytes + o, dc.peer_base[p] + half, lo, hi, true);
        }
        if (a.send != my_recv) copy_range(my_recv, a.send, o + lo, o + hi, false);
      } else if (me != a.root) {
        copy_range(a.recv + o, dc.peer_base[a.root] + half, lo, hi, true);
      } else if (a.send != a.recv) {
        copy_range(a.recv, a.send, o + lo, o + hi, false);
      }
    }
    __syncthreads();
    if (a.bytes == 0) break;
    o += cb;
  }
}
