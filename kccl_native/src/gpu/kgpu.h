/* kgpu.h - one rank's GPU state, shared by the CUDA files (not installed).
 *
 * The files of src/gpu/ in layers, lowest first: each calls only files listed
 * before it (tests/test_boundaries.py reads this list).
 *   1. kgpu.h          this rank's state, inline helpers
 *      kernels.h       the kernels' arguments, as their launchers see them
 *      chunked_copy.cuh   the chunked kernels' loads, stores and range copy
 *      chunked_flags.cuh  the chunked kernels' flags: signal and wait
 *   2. gpu_oneshot.cu  the one-shot all-reduce kernels
 *      gpu_twoshot.cu  the two-shot all-reduce and reduce-scatter kernel
 *      gpu_gather.cu   the all-gather and broadcast kernel
 *   3. gpu_l2map.cu    per-L2-partition flag replicas: calibration, agreement
 *   4. gpu_launch.cu   launch configuration and launchers, kernel preload, occupancy
 *   5. gpu_runtime.cu  the exported buffer, mapping the peers, pointer checks,
 *                      the device handle: gpu_api.h's life cycle */
#ifndef KCCL_KGPU_H_
#define KCCL_KGPU_H_
#include "../gpu_api.h"
#include "kccl_device.cuh"

#define KGPU_TS_MAX_BLOCKS KCCL_GPU_MAX_BLOCKS /* blocks of the two-shot / gather kernels, at most */
#define KGPU_ALIGN 256
#define KGPU_LINE 128          /* one flag line: the 16 per-source slots of one (stage, block) */

/* Per-L2-partition flag replicas (KCCL_GPU_FLAG_REPLICAS, gpu_l2map.cu).  The pool
 * spans 1 MiB so its candidates cover many address bits (which partition owns a
 * line is a hash of the physical address); candidate i is one line of the eight
 * lines [8i, 8i+8), the low bits varied by a multiplicative hash of i. */
#define KGPU_L2_CANDIDATES 1024
#define KGPU_L2_POOL_LINES (8 * KGPU_L2_CANDIDATES)
#define KGPU_FREE_SMS 4        /* SMs the collective kernels of all ranks of a GPU but one leave free
                                  (gpu_runtime.cu) */
#define KGPU_SM_MAP 256        /* SM ids the SM -> group map covers (more: copy 0) */
#define KGPU_L2_NEED (2 * KGPU_TS_MAX_BLOCKS) /* lines near each group the flags need */

__host__ __device__ static inline int kgpu_l2_pool_line(int i) {
  return 8 * i + (int)(((uint32_t)i * 2654435761u) >> 29);
}

/* Layout of every rank's exported buffer (offsets are the same on every rank). */
struct kgpu_layout {
  size_t ll[KCCL_CHANNELS]; /* LL inboxes */
  size_t epochs;            /* uint32 [KCCL_CHANNELS][KCCL_DEV_MAX_BLOCKS] */
  size_t steps;             /* uint32 [KGPU_TS_MAX_BLOCKS]: step counter per two-shot / gather block */
  size_t fail;              /* int: claimed by the first failing block */
  size_t flags;             /* uint64 [2 stages][KGPU_TS_MAX_BLOCKS][KCCL_GPU_MAX_RANKS], pushed by senders */
  /* Flag replicas (sizes 0 unless asked for): */
  size_t l2pool;            /* KGPU_L2_POOL_LINES lines: the replicas' flag lines are chosen from these */
  size_t l2tab;             /* uint16 [KGPU_TS_MAX_BLOCKS][2 stages][2 copies]: pool line of each flag line
                               (copy c near SM group c); a block's four in one 8-byte word */
  size_t l2map;             /* uint8 [KGPU_SM_MAP]: SM id -> group (0, 1; 0xff: not measured), then
                               uint32: 1 when this rank's calibration found two groups */
  size_t in, out;           /* two-shot scratch: inputs, reduced segments */
  size_t g[2];              /* gather halves */
  size_t total;
};

struct kgpu {
  int device;
  kgpu_shape shape;
  kgpu_layout lay;
  char *buf;
  char *peer[KCCL_GPU_MAX_RANKS];
  kcclGpuStatus *status_h, *status_d;
  kcclDevComm dc[KCCL_CHANNELS];
  const void *ok_ptr[8];
  size_t ok_len[8];
  int ok_next;
  int ll_prev_grid;         /* blocks of the last one-shot launch, while a PDL successor may overlap it
                               (0 after a chunked launch: those never trigger their successor) */
  int rep_self;             /* KGPU_REP_* of this rank's calibration */
  int rep_on;               /* every rank calibrated: the chunked kernels use the replicas */
  int one_gpu;              /* every rank runs on this GPU: the chunked flags order at GPU scope */
  char rep_cal[320];        /* this rank's calibration, in words */
  char rep_note[420];       /* what kgpu_flag_replicas reports */
  void *side;               /* kgpuStream_t of the split-phase all-reduces */
  void *split_fork[KGPU_SPLIT_SLOTS], *split_done[KGPU_SPLIT_SLOTS]; /* kgpuEvent_t per outstanding slot */
};

#define KGPU_CHECK(call)                                                                              \
  do {                                                                                                \
    kgpuError_t e_ = (call);                                                                          \
    if (e_ != kgpuSuccess)                                                                            \
      return kccl_err(kcclUnhandledCudaError, "%s failed: %s (%s:%d)", #call, kgpuGetErrorString(e_), \
                      __FILE__, __LINE__);                                                            \
  } while (0)

/* Blocks per multiprocessor of the chunked kernels (the smaller of two-shot's
 * and gather's) for blocks of 1 .. KCCL_GPU_MAX_CHUNK_THREADS / 32 warps
 * (ts_per_sm[w - 1]), and of the one-shot kernel used for nranks (gpu_launch.cu). */
kgpuError_t kgpu_kernel_occupancy(int nranks, int8_t *ts_per_sm, int *ll_per_sm);
/* Loads the library's kernels at init (lazy loading: see gpu_launch.cu). */
/* carveout: the shared-memory carveout in percent for the kernels that wait
 * for peers (KCCL_GPU_CARVEOUT; -1: the driver's choice; why: gpu_launch.cu).
 * A function attribute, so per process: the last communicator's setting holds. */
kgpuError_t kgpu_preload_kernels(int carveout);
/* One kernel of those lists: getting its attributes loads it; one that waits
 * for peers also gets the carveout. */
static inline kgpuError_t kgpu_load_kernel(const void *fn) {
  kgpuFuncAttributes fa;
  return kgpuFuncGetAttributes(&fa, fn);
}
static inline kgpuError_t kgpu_load_waiting_kernel(const void *fn, int carveout) {
  kgpuError_t e = kgpu_load_kernel(fn);
  return e != kgpuSuccess ? e : kgpuFuncSetCarveout(fn, carveout);
}

/* gpu_l2map.cu.  Times every candidate line from every SM and fills this rank's
 * l2tab / l2map (g->rep_self, g->rep_cal say how it went); an error only when
 * a CUDA call fails. */
kcclResult_t kgpu_l2_calibrate(struct kgpu *g);
/* At connect: replicas are used only when every rank's calibration succeeded (sets g->rep_on). */
void kgpu_l2_agree(struct kgpu *g, const kgpu_export *peers);
#define KGPU_L2_CHAIN 16     /* dependent loads timed per candidate and pass */
/* A line is near a group when the groups' mean acquire-load latencies differ by
 * more than this.  The H200 (bench/results/gpu/l2_poll.json, ld.acquire.sys):
 * the gap is 14.4-18.6 ns on every one of 64 addresses (near ~139 ns, far
 * ~154-159 ns) with a per-SM spread of 3-6 ns, so the mean of 66 SMs is good to
 * ~1 ns: half the smallest gap seen is many noise widths above zero (no line of
 * a GPU without partitions passes) and far below every real gap. */
#define KGPU_L2_GAP_NS 7.0
/* The analysis, host only (tests/c/l2map_selftest.cu runs it on made-up
 * latencies).  cyc: cycles of `chain` dependent loads, [KGPU_SM_MAP][KGPU_L2_CANDIDATES],
 * 0xffff = not measured. */
struct kgpu_l2_split {
  int code;                 /* KGPU_REP_* */
  int measured;             /* SMs with a full row */
  int size[2];              /* SMs per group */
  int near[2], neither;     /* candidate lines near group 0 / 1 / neither */
  double gap;               /* median |group 1 - group 0| cycles per load over the lines near one */
  uint8_t map[KGPU_SM_MAP];
  uint16_t tab[KGPU_TS_MAX_BLOCKS][2][2];
  char why[160];
};
void kgpu_l2_analyze(const uint16_t *cyc, int chain, double threshold_cycles, struct kgpu_l2_split *out);
#endif
