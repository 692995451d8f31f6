/* gpu_launch.cu - launching the library's kernels: how many blocks and
 * threads each call gets, the arguments it takes from the communicator, and
 * loading every kernel at init (kernels.h lists them). */
#include "kernels.h"

static unsigned ts_grid(const kgpu *g) { return (unsigned)g->shape.ts_blocks; }

/* The chunked kernels launch without PDL: with it, the 8-rank two-shot
 * benchmark under MPS timed out at the first eager call after a graph capture
 * (cause unknown), and their calls are long enough that PDL gains little. */
#define KGPU_CHUNKED_PDL 0

/* The arguments both chunked kernels take. */
static void chunked_args(const kgpu *g, Chunked *a, const void *send, void *recv, uint32_t sig) {
  a->dc = g->dc[0];
  a->off_flags = g->lay.flags;
  a->off_steps = g->lay.steps;
  a->send = (const char *)send;
  a->recv = (char *)recv;
  a->sig = sig;
  a->rep.off_pool = g->lay.l2pool;
  a->rep.off_tab = g->lay.l2tab;
  a->rep.off_map = g->lay.l2map;
  a->rep.on = g->rep_on;
  a->rep.gpu_scope = g->one_gpu;
}

/* Why the kernels that wait for their peers ask for the largest
 * shared-memory carveout (KCCL_GPU_CARVEOUT, default 100; kgpu_preload_kernels).
 * An SM's L1 / shared-memory split is set for the blocks it holds; a kernel
 * that wants a larger shared part than an SM is set to cannot start there
 * while those blocks run.  A late rank's own kernel before a collective
 * (torch's, say) would then find no SM while its peers' blocks wait on all of
 * them, and everyone times out (bench/gpu/residency.py --foreign 2).  With the
 * largest shared part asked for, other kernels' shared memory fits beside
 * these blocks; these kernels read remote data past L1 and need little of it. */

/* Loads every kernel of the library now.  With lazy loading (CUDA's default
 * since 12.2) a kernel's code is loaded at its first launch, and the CUDA
 * programming guide warns that a load may need a context synchronization, so
 * kernels that wait for each other can deadlock.  Here a rank's first launch
 * would wait while its peers' kernels spin waiting for it (until
 * KCCL_TIMEOUT_MS).  Getting a kernel's attributes loads it. */
kgpuError_t kgpu_preload_kernels(int carveout) {
  kgpuError_t e;
  for (int m = 0; m < 3; m++)
    for (int t = 0; t < 3; t++)
      for (int o = 0; o < 4; o++)
        if ((e = kgpu_load_waiting_kernel((const void *)kgpu_oneshot_kernels[m][t][o], carveout)) != kgpuSuccess)
          return e;
  if ((e = kgpu_load_waiting_kernel((const void *)k_twoshot, carveout)) != kgpuSuccess) return e;
  return kgpu_load_waiting_kernel((const void *)k_gather, carveout);
}

kgpuError_t kgpu_kernel_occupancy(int nranks, int8_t *ts_per_sm, int *ll_per_sm) {
  int a = 0, b = 0, c = 0;
  kgpuError_t e;
  for (int w = 1; w <= KCCL_GPU_MAX_CHUNK_THREADS / 32; w++) {
    if ((e = kgpuOccupancyMaxActiveBlocksPerMultiprocessor(&a, k_twoshot, 32 * w, 0)) != kgpuSuccess ||
        (e = kgpuOccupancyMaxActiveBlocksPerMultiprocessor(&b, k_gather, 32 * w, 0)) != kgpuSuccess)
      return e;
    a = a < b ? a : b;
    ts_per_sm[w - 1] = (int8_t)(a > 127 ? 127 : a);
  }
  if ((e = kgpuOccupancyMaxActiveBlocksPerMultiprocessor(&c, kgpu_oneshot_kernel(nranks, kcclFloat32, kcclSum),
                                                         KCCL_LL_THREADS, 0)) != kgpuSuccess)
    return e;
  *ll_per_sm = c;
  return kgpuSuccess;
}

static kcclResult_t launched(kgpuError_t e, const char *what) {
  if (e != kgpuSuccess) kgpuGetLastError();
  else if ((e = kgpuGetLastError()) == kgpuSuccess) return kcclSuccess;
  return kccl_err(kcclUnhandledCudaError, "launching the %s kernel: %s", what, kgpuGetErrorString(e));
}

extern "C" size_t kgpu_oneshot_max_bytes(struct kgpu *g) {
  return (size_t)g->shape.ll_blocks * KCCL_LL_MAX_BYTES;
}

/* A chunked kernel, on the grid kgpu_connect sized.  It never triggers its
 * successor early, so no one-shot grid can overlap it (ll_prev_grid 0). */
template <typename Args>
static kcclResult_t launch_chunked(kgpu *g, void (*kernel)(Args), const Args &a, kgpuStream_t st,
                                   const char *what) {
  g->ll_prev_grid = 0;
  return launched(kgpu_launch(kernel, ts_grid(g), (unsigned)g->shape.ts_threads, st, KGPU_CHUNKED_PDL, a), what);
}

/* count: elements (per rank for reduce-scatter); chunk_elems: scratch capacity in elements. */
static kcclResult_t launch_twoshot(kgpu *g, const void *send, void *recv, size_t count, size_t chunk_elems,
                                   int dtype, int op, int scatter, uint32_t sig, kgpuStream_t st, const char *what) {
  TwoShot a;
  chunked_args(g, &a, send, recv, sig);
  a.off_in = g->lay.in;
  a.off_out = g->lay.out;
  a.count = count;
  a.chunk_elems = chunk_elems;
  a.dt = dtype;
  a.op = op;
  a.es = dtype == kcclFloat32 ? 4 : 2;
  a.scatter = scatter;
  return launch_chunked(g, k_twoshot, a, st, what);
}

extern "C" kcclResult_t kgpu_allreduce(struct kgpu *g, const void *send, void *recv, size_t count, int dtype,
                                       int op, int twoshot, uint32_t sig, void *stream) {
  if (dtype != kcclFloat32 && dtype != kcclFloat16 && dtype != kcclBfloat16)
    return kccl_err(kcclInvalidArgument, "the GPU all-reduce takes float32, float16 or bfloat16 (dtype %d)", dtype);
  if (count == 0) return kcclSuccess;
  const size_t es = dtype == kcclFloat32 ? 4 : 2, nbytes = count * es;
  kgpuStream_t st = (kgpuStream_t)stream;
  if (!twoshot && nbytes <= kgpu_oneshot_max_bytes(g)) {
    /* One line per thread (KCCL_GPU_LL_THREADS x 8 bytes per block) until the
     * blocks run out, then more lines per thread.  256 by default: 128 was
     * slower across processes at 8 KB, and slower from 64 KB on, where the
     * blocks run out and each thread carries more lines. */
    const unsigned threads = (unsigned)g->shape.cfg.gpu_ll_threads;
    size_t blocks = (nbytes + threads * 8 - 1) / (threads * 8);
    if (blocks > (size_t)g->shape.ll_blocks) blocks = (size_t)g->shape.ll_blocks;
    size_t per = (nbytes + blocks - 1) / blocks;
    per = (per + 7) / 8 * 8;
    blocks = (nbytes + per - 1) / per;
    /* With PDL this kernel may be resident while the previous one-shot call
     * still runs (it triggers at once): both grids must fit the budget
     * (gpu_runtime.cu), else this one launches plainly, after it. */
    const int pdl = g->shape.cfg.gpu_pdl && (int)blocks + g->ll_prev_grid <= g->shape.ll_room;
    kgpuError_t e = kgpu_launch(kgpu_oneshot_kernel(g->shape.nranks, dtype, op), (unsigned)blocks, threads, st,
                                pdl, g->dc[0], (const char *)send, (char *)recv, nbytes, (uint32_t)per,
                                op == kcclAvg ? 1 : 0, sig);
    g->ll_prev_grid = (int)blocks;
    return launched(e, "one-shot all-reduce");
  }
  /* Whole 16-element units per rank segment. */
  const size_t unit = 16 * (size_t)g->shape.nranks;
  return launch_twoshot(g, send, recv, count, g->shape.cfg.gpu_buffer_bytes / es / unit * unit, dtype, op, 0, sig, st,
                        "two-shot all-reduce");
}

extern "C" kcclResult_t kgpu_reduce_scatter(struct kgpu *g, const void *send, void *recv, size_t recvcount,
                                            int dtype, int op, uint32_t sig, void *stream) {
  if (dtype != kcclFloat32 && dtype != kcclFloat16 && dtype != kcclBfloat16)
    return kccl_err(kcclInvalidArgument, "the GPU reduce-scatter takes float32, float16 or bfloat16 (dtype %d)",
                    dtype);
  if (recvcount == 0) return kcclSuccess;
  const size_t es = dtype == kcclFloat32 ? 4 : 2;
  return launch_twoshot(g, send, recv, recvcount, g->shape.cfg.gpu_buffer_bytes / es, dtype, op, 1, sig,
                        (kgpuStream_t)stream, "reduce-scatter");
}

extern "C" kcclResult_t kgpu_gather(struct kgpu *g, const void *send, void *recv, size_t bytes, int root,
                                    uint32_t sig, void *stream) {
  Gather a;
  chunked_args(g, &a, send, recv, sig);
  a.off_g0 = g->lay.g[0];
  a.off_g1 = g->lay.g[1];
  a.bytes = bytes;
  a.chunk_bytes = g->shape.cfg.gpu_buffer_bytes / 16 * 16;
  a.root = root;
  return launch_chunked(g, k_gather, a, (kgpuStream_t)stream, root < 0 ? "all-gather" : "broadcast");
}
