/* kernels.h - the library's collective kernels as their launchers see them:
 * the arguments each takes and how to name it (not installed).
 *
 *   gpu_oneshot.cu   one-shot all-reduce (LL protocol of kccl_device.cuh)
 *   gpu_twoshot.cu   two-shot all-reduce and reduce-scatter  } chunked through scratch,
 *   gpu_gather.cu    all-gather and broadcast                } flags in chunked_flags.cuh
 *   gpu_launch.cu    launch configuration, launchers, preload and occupancy */
#ifndef KCCL_GPU_KERNELS_H_
#define KCCL_GPU_KERNELS_H_
#include "kgpu.h"

/* ------------------------------------------------------------- one-shot ---- */

typedef void (*kgpu_oneshot_fn)(kcclDevComm, const char *, char *, size_t, uint32_t, int, uint32_t);

/* [MAXR 2 / 8 / 16][bf16, f16, f32][sum, prod, max, min] (gpu_oneshot.cu). */
extern const kgpu_oneshot_fn kgpu_oneshot_kernels[3][3][4];

static inline kgpu_oneshot_fn kgpu_oneshot_kernel(int nranks, int dtype, int op) {
  const int t = dtype == kcclBfloat16 ? 0 : dtype == kcclFloat16 ? 1 : 2;
  return kgpu_oneshot_kernels[nranks <= 2 ? 0 : nranks <= 8 ? 1 : 2][t][op == kcclAvg ? kcclSum : op];
}

/* ------------------------------------------------------------- chunked ---- */

/* How the flags are reached.  Flag replicas: where the tables are (the same
 * offsets in every rank's buffer) and whether to use them (on); the flags
 * region is used as without replicas.  gpu_scope: every rank runs on
 * this GPU, so signals and waits order at GPU scope, not system scope (a
 * system-scope fence also waits for the writes to be visible beyond the GPU,
 * which costs the 64 MB call a few percent). */
struct Replicas {
  size_t off_pool, off_tab, off_map;
  int on;
  int gpu_scope;
};

/* What both chunked kernels take: the handle, where the flags and the step
 * counters are, the user's buffers, the call's signature, the flag replicas. */
struct Chunked {
  kcclDevComm dc;
  size_t off_flags, off_steps;
  const char *send;
  char *recv;
  uint32_t sig;
  Replicas rep;
};

struct TwoShot : Chunked {
  size_t off_in, off_out;
  size_t count;       /* all-reduce: elements; reduce-scatter: elements per rank */
  size_t chunk_elems; /* scratch capacity in elements */
  int dt, op, es, scatter;
};

struct Gather : Chunked {
  size_t off_g0, off_g1;
  size_t bytes;       /* per rank */
  size_t chunk_bytes;
  int root;           /* < 0: all-gather */
};

/* Launched with shape.ts_threads threads and shape.ts_blocks blocks. */
__global__ void k_twoshot(TwoShot a);
__global__ void k_gather(Gather a);

#endif
