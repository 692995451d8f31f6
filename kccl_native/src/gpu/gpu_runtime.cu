/* gpu_runtime.cu - the CUDA side of a GPU communicator: the exported buffer,
 * mapping the peers' buffers, pointer checks, the device handle. */
#include <stdlib.h>
#include <string.h>

#include "kgpu.h"

static_assert(sizeof(kcclDevComm) == KCCL_DEV_COMM_BYTES, "kccl.h's KCCL_DEV_COMM_BYTES is out of date");

static size_t align_up(size_t x) { return (x + KGPU_ALIGN - 1) / KGPU_ALIGN * KGPU_ALIGN; }

static kgpu_layout make_layout(const kgpu_shape *s) {
  kgpu_layout l;
  size_t at = 0;
  const size_t ll_bytes = (size_t)KCCL_LL_SETS * s->nranks * KCCL_DEV_MAX_BLOCKS * KCCL_LL_REGION_BYTES;
  for (int c = 0; c < KCCL_CHANNELS; c++) {
    l.ll[c] = at;
    at = align_up(at + ll_bytes);
  }
  l.epochs = at;
  at = align_up(at + sizeof(uint32_t) * KCCL_CHANNELS * KCCL_DEV_MAX_BLOCKS);
  l.steps = at;
  at = align_up(at + sizeof(uint32_t) * KGPU_TS_MAX_BLOCKS);
  l.fail = at;
  at = align_up(at + sizeof(int));
  l.flags = at;
  at = align_up(at + sizeof(uint64_t) * 2 * KGPU_TS_MAX_BLOCKS * KCCL_GPU_MAX_RANKS);
  const int rep = s->cfg.gpu_flag_replicas != 0;
  l.l2pool = at;
  at = align_up(at + (rep ? (size_t)KGPU_L2_POOL_LINES * KGPU_LINE : 0));
  l.l2tab = at;
  at = align_up(at + (rep ? sizeof(uint16_t) * KGPU_TS_MAX_BLOCKS * 2 * 2 : 0));
  l.l2map = at;
  at = align_up(at + (rep ? KGPU_SM_MAP + sizeof(uint32_t) : 0));
  /* Scratch areas get one spare alignment unit: kernels read whole 16-byte
   * units past the end of a partial tail. */
  size_t area = align_up(s->cfg.gpu_buffer_bytes) + KGPU_ALIGN;
  l.in = at;
  at += area;
  l.out = at;
  at += area;
  l.g[0] = at;
  at += area;
  l.g[1] = at;
  at += area;
  l.total = at;
  return l;
}

extern "C" int kgpu_built(void) { return 1; }

static void split_free(kgpu *g) {
  for (int i = 0; i < KGPU_SPLIT_SLOTS; i++) {
    if (g->split_fork[i]) kgpuEventDestroy((kgpuEvent_t)g->split_fork[i]);
    if (g->split_done[i]) kgpuEventDestroy((kgpuEvent_t)g->split_done[i]);
    g->split_fork[i] = g->split_done[i] = NULL;
  }
  if (g->side) kgpuStreamDestroy((kgpuStream_t)g->side);
  g->side = NULL;
}

/* Split phase: slot i forks the side stream off `stream` (it runs after the work
 * enqueued there so far), and returns the side stream for the collective. Event
 * records and waits are captured like kernels, so this works inside a graph. */
extern "C" kcclResult_t kgpu_split_fork(struct kgpu *g, int slot, void *stream, void **side) {
  KGPU_CHECK(kgpuEventRecord((kgpuEvent_t)g->split_fork[slot], (kgpuStream_t)stream));
  KGPU_CHECK(kgpuStreamWaitEvent((kgpuStream_t)g->side, (kgpuEvent_t)g->split_fork[slot]));
  *side = g->side;
  return kcclSuccess;
}

/* Marks the end of slot i's collective on the side stream. */
extern "C" kcclResult_t kgpu_split_done(struct kgpu *g, int slot) {
  KGPU_CHECK(kgpuEventRecord((kgpuEvent_t)g->split_done[slot], (kgpuStream_t)g->side));
  return kcclSuccess;
}

/* Work enqueued on `stream` from now on runs after slot i's collective (and, the
 * side stream being in order, after every older one). */
extern "C" kcclResult_t kgpu_split_join(struct kgpu *g, int slot, void *stream) {
  KGPU_CHECK(kgpuStreamWaitEvent((kgpuStream_t)stream, (kgpuEvent_t)g->split_done[slot]));
  return kcclSuccess;
}

extern "C" kcclResult_t kgpu_device_count(int *n) {
  *n = 0;
  kgpuError_t e = kgpuGetDeviceCount(n);
  if (e != kgpuSuccess) { /* no driver or no device: not an error, just none */
    kgpuGetLastError();
    *n = 0;
  }
  return kcclSuccess;
}

extern "C" kcclResult_t kgpu_create(int device, const kgpu_shape *shape, struct kgpu **out, kgpu_export *exp,
                                    kcclGpuStatus **status) {
  *out = NULL;
  int ndev = 0;
  kgpu_device_count(&ndev);
  if (device < 0 || device >= ndev)
    return kccl_err(kcclInvalidArgument, "device=%d: this process sees %d CUDA device(s)", device, ndev);
  if (shape->nranks > KCCL_GPU_MAX_RANKS)
    return kccl_err(kcclInvalidArgument, "the GPU transport takes at most %d ranks, got %d", KCCL_GPU_MAX_RANKS,
                    shape->nranks);
  KGPU_CHECK(kgpuSetDevice(device));
  kgpu *g = (kgpu *)calloc(1, sizeof *g);
  if (!g) return kccl_err(kcclSystemError, "out of memory");
  g->device = device;
  g->shape = *shape;
  g->lay = make_layout(shape);
  kgpuError_t e = kgpuMalloc((void **)&g->buf, g->lay.total);
  if (e != kgpuSuccess) {
    free(g);
    return kccl_err(kcclUnhandledCudaError, "cudaMalloc of %zu bytes on device %d: %s", g->lay.total, device,
                    kgpuGetErrorString(e));
  }
  /* Zero: every flag and epoch starts at 0, and the first call uses 1. */
  if ((e = kgpuMemset(g->buf, 0, g->lay.total)) != kgpuSuccess ||
      (e = kgpuHostAlloc((void **)&g->status_h, sizeof(kcclGpuStatus), kgpuHostAllocMapped)) != kgpuSuccess) {
    kgpuFree(g->buf);
    free(g);
    return kccl_err(kcclUnhandledCudaError, "device %d setup: %s", device, kgpuGetErrorString(e));
  }
  memset((void *)g->status_h, 0, sizeof *g->status_h);
  /* The split-phase all-reduce's side stream and events, made here rather than at
   * the first kcclAllReduceStartStream: that call may come while the caller's
   * stream is being captured, when creating them could be refused. */
  e = kgpuStreamCreateWithFlags((kgpuStream_t *)&g->side, kgpuStreamNonBlocking);
  for (int i = 0; e == kgpuSuccess && i < KGPU_SPLIT_SLOTS; i++) {
    e = kgpuEventCreateWithFlags((kgpuEvent_t *)&g->split_fork[i], kgpuEventDisableTiming);
    if (e == kgpuSuccess) e = kgpuEventCreateWithFlags((kgpuEvent_t *)&g->split_done[i], kgpuEventDisableTiming);
  }
  if (e != kgpuSuccess) {
    split_free(g);
    kgpuFreeHost((void *)g->status_h);
    kgpuFree(g->buf);
    free(g);
    return kccl_err(kcclUnhandledCudaError, "device %d: side stream for split-phase all-reduces: %s", device,
                    kgpuGetErrorString(e));
  }
  exp->flag_replicas = KGPU_REP_OFF;
  if (shape->cfg.gpu_flag_replicas) {
    /* Before the export is published: a peer reads the tables once it has mapped this buffer. */
    kcclResult_t r = kgpu_l2_calibrate(g);
    if (r != kcclSuccess) {
      kgpuFreeHost((void *)g->status_h);
      kgpuFree(g->buf);
      free(g);
      return r;
    }
    exp->flag_replicas = g->rep_self;
  }
  if ((e = kgpuHostGetDevicePointer((void **)&g->status_d, (void *)g->status_h, 0)) != kgpuSuccess ||
      (e = kgpuIpcGetMemHandle((kgpuIpcMemHandle_t *)exp->ipc, g->buf)) != kgpuSuccess ||
      (e = kgpuDeviceGetPCIBusId(exp->pci, KGPU_PCI_BYTES, device)) != kgpuSuccess ||
      (e = kgpuDeviceGetAttribute(&exp->sms, kgpuDevAttrMultiProcessorCount, device)) != kgpuSuccess ||
      (e = kgpu_kernel_occupancy(shape->nranks, exp->ts_per_sm, &exp->ll_per_sm)) != kgpuSuccess ||
      (e = kgpu_preload_kernels(shape->cfg.gpu_carveout)) != kgpuSuccess) {
    kgpuFreeHost((void *)g->status_h);
    kgpuFree(g->buf);
    free(g);
    return kccl_err(kcclUnhandledCudaError, "device %d export: %s", device, kgpuGetErrorString(e));
  }
  exp->bytes = g->lay.total;
  *status = g->status_h;
  *out = g;
  return kcclSuccess;
}

/* Threads per block of the chunked kernels when KCCL_GPU_CHUNK_THREADS is 0.
 * Ranks sharing a GPU: 768, one block per SM at 80 registers.  The ranks'
 * blocks together are then one per usable SM, each with 24 warps: enough loads
 * in flight for HBM (64 MB bf16 on an H200 at 8 ranks x 16 blocks: 756 us
 * against 1319 with 256 threads).  One rank per GPU: 256 (not measured). */
static int chunk_threads_auto(int max_local) { return max_local > 1 ? 768 : 256; }

/* Maps every peer's buffer (this rank's own is g->buf). */
static kcclResult_t map_peers(kgpu *g, const kgpu_export *peers) {
  const kgpu_shape *s = &g->shape;
  for (int p = 0; p < s->nranks; p++) {
    if (p == s->rank) {
      g->peer[p] = g->buf;
      continue;
    }
    if (peers[p].bytes != g->lay.total)
      return kccl_err(kcclInvalidUsage, "rank %d's GPU buffer has %llu bytes, this rank's %zu: the ranks were "
                      "configured differently (KCCL_GPU_BUFFER_BYTES must be equal on all ranks)",
                      p, (unsigned long long)peers[p].bytes, g->lay.total);
    kgpuIpcMemHandle_t h;
    memcpy(&h, peers[p].ipc, sizeof h);
    kgpuError_t e = kgpuIpcOpenMemHandle((void **)&g->peer[p], h, kgpuIpcMemLazyEnablePeerAccess);
    if (e != kgpuSuccess) {
      g->peer[p] = NULL;
      return kccl_err(kcclUnhandledCudaError, "mapping rank %d's GPU buffer (GPU %s) on GPU %s: %s (peer access "
                      "between these GPUs may be unavailable)", p, peers[p].pci, peers[s->rank].pci,
                      kgpuGetErrorString(e));
    }
  }
  return kcclSuccess;
}

/* What the launch budget is computed from, the same on every rank (it comes
 * from the exports). */
struct gpu_room {
  int max_local; /* ranks on the most shared GPU */
  int min_sms;   /* multiprocessors of the smallest GPU */
  int ll_per_sm; /* one-shot blocks per multiprocessor, the least of any rank */
};

static gpu_room measure_room(const kgpu_shape *s, const kgpu_export *peers) {
  gpu_room r = {1, 1 << 30, 1 << 30};
  for (int p = 0; p < s->nranks; p++) {
    int local = 0;
    for (int q = 0; q < s->nranks; q++) local += !strncmp(peers[p].pci, peers[q].pci, KGPU_PCI_BYTES);
    if (local > r.max_local) r.max_local = local;
    if (peers[p].sms < r.min_sms) r.min_sms = peers[p].sms;
    if (peers[p].ll_per_sm < r.ll_per_sm) r.ll_per_sm = peers[p].ll_per_sm;
  }
  return r;
}

/* Every rank's kernels must be resident at once: a block waits for the same
 * block of every peer.  Two limits, both per GPU:
 * - Room: all ranks' blocks fit, each kernel counted with its own
 *   blocks-per-SM and kept to 3/4 of it (kernels of different register
 *   counts share SMs, where the per-kernel counts do not quite add up).
 * - A free SM: a rank that is late may have a kernel of its own (the
 *   application's, torch's) before the collective on its stream.  If the
 *   blocks its peers already have waiting sit on every SM, a kernel that
 *   needs a larger shared-memory carveout than those SMs are set to cannot
 *   start anywhere, the late rank never reaches the collective, and the
 *   peers wait until KCCL_TIMEOUT_MS (bench/gpu/residency.py shows it).
 *   The library's kernels ask for the largest carveout
 *   (kgpu_preload_kernels), which removes the shared-memory case, but a
 *   kernel that needs more registers or threads than an SM has left beside
 *   them would still wait.  So the blocks of all ranks of a GPU but one
 *   leave KGPU_FREE_SMS SMs free (the block scheduler spreads a grid over
 *   empty SMs first).
 * The one-shot kernel launches with PDL: the next call's kernel may be
 * resident beside it.  The launcher uses PDL only when both grids together
 * stay within this budget (kgpu_allreduce), so one call alone may use all
 * of it.  The chunked kernels launch without PDL and never trigger their
 * successor early, so at most one of them per rank is resident.
 * KCCL_GPU_BLOCKS overrides the chunked count.  Every rank computes the
 * same numbers from the same exports. */
static int free_sm_room(const gpu_room &r) {
  return r.max_local > 1 ? (r.min_sms - KGPU_FREE_SMS) / (r.max_local - 1) : 1 << 30;
}

/* The chunked kernels' shape: shape.ts_threads and shape.ts_blocks. */
static kcclResult_t chunked_grid(kgpu *g, const kgpu_export *peers, const gpu_room &r) {
  const kgpu_shape *s = &g->shape;
  const int max_local = r.max_local, min_sms = r.min_sms;
  int ts_per_sm = 1 << 30;
  const int threads = s->cfg.gpu_chunk_threads > 0 ? s->cfg.gpu_chunk_threads : chunk_threads_auto(max_local);
  for (int p = 0; p < s->nranks; p++)
    if (peers[p].ts_per_sm[threads / 32 - 1] < ts_per_sm) ts_per_sm = peers[p].ts_per_sm[threads / 32 - 1];
  if (ts_per_sm < 1)
    return kccl_err(kcclInvalidArgument, "a chunked kernel of %d threads per block does not fit on a "
                    "multiprocessor of every rank's GPU (KCCL_GPU_CHUNK_THREADS)", threads);
  g->shape.ts_threads = threads;
  /* Every rank's blocks resident at once on all but KGPU_FREE_SMS SMs' room. */
  int blocks = 2 * min_sms / max_local, cap = (min_sms - KGPU_FREE_SMS) * ts_per_sm / max_local;
  if (cap > free_sm_room(r)) cap = free_sm_room(r);
  if (blocks > cap) blocks = cap;
  /* Whole blocks per SM where the count is just past them: the ranks of a GPU
   * together run k blocks on each of the SMs they leave free, not k on most
   * and k + 1 on a few.  A block on a shared SM moves its portion more slowly,
   * and at every flag exchange block b of each rank waits for block b of all
   * the others.  A larger excess still pays for itself (on an H200, 4 ranks x
   * 42 blocks beat 4 x 32), so only an excess of at most a quarter of the
   * usable SMs is dropped. */
  if (max_local > 1 && min_sms > KGPU_FREE_SMS) { /* never more blocks than above */
    const int usable = min_sms - KGPU_FREE_SMS, per_sm = blocks * max_local / usable;
    if (per_sm >= 1 && 4 * (blocks * max_local - per_sm * usable) <= usable) blocks = per_sm * usable / max_local;
  }
  if (s->cfg.gpu_blocks > 0) blocks = s->cfg.gpu_blocks; /* the user's choice, equal on all ranks (check_agreement) */
  g->shape.ts_blocks = blocks < 1 ? 1 : blocks > KGPU_TS_MAX_BLOCKS ? KGPU_TS_MAX_BLOCKS : blocks;
  return kcclSuccess;
}

/* The one-shot kernel's budget: shape.ll_room (blocks of two successive calls
 * together, with PDL) and shape.ll_blocks (one call). */
static void oneshot_grid(kgpu *g, const gpu_room &r) {
  int cap = r.min_sms * r.ll_per_sm * 3 / (4 * r.max_local);
  if (cap > free_sm_room(r)) cap = free_sm_room(r);
  g->shape.ll_room = cap < 1 ? 1 : cap;
  g->shape.ll_blocks = g->shape.ll_room < KCCL_DEV_MAX_BLOCKS ? g->shape.ll_room : KCCL_DEV_MAX_BLOCKS;
}

/* The device handles of both channels (0: the library's kernels, 1: user
 * kernels through kcclCommGetDevComm). */
static void fill_devcomms(kgpu *g, int max_local) {
  const kgpu_shape *s = &g->shape;
  for (int c = 0; c < KCCL_CHANNELS; c++) {
    kcclDevComm *dc = &g->dc[c];
    memset(dc, 0, sizeof *dc);
    dc->rank = s->rank;
    dc->nranks = s->nranks;
    dc->channel = c;
    dc->pull = s->cfg.gpu_pull >= 0 ? s->cfg.gpu_pull : max_local == s->nranks; /* auto: pull when all share this GPU */
    /* KCCL_GPU_LL_HOPS=0: one hop.  Two hops save polls within one process,
     * but across processes each hop costs a cross-process round trip, and on
     * an H200 under MPS the second hop cost more than it saved (8 KB, 8 ranks).
     * Across GPUs: not measured. */
    dc->ll_hops = s->cfg.gpu_ll_hops ? s->cfg.gpu_ll_hops : 1;
    dc->timeout_ns = (uint64_t)s->cfg.timeout_ms * 1000000ull;
    for (int p = 0; p < s->nranks; p++) dc->peer_base[p] = g->peer[p];
    for (int k = 0; k < KCCL_CHANNELS; k++) dc->ll_off[k] = g->lay.ll[k];
    dc->epochs = (uint32_t *)(g->buf + g->lay.epochs);
    dc->fail_owner = (int *)(g->buf + g->lay.fail);
    dc->status = g->status_d;
  }
}

extern "C" kcclResult_t kgpu_connect(struct kgpu *g, const kgpu_export *peers) {
  KGPU_CHECK(kgpuSetDevice(g->device));
  /* The settings every rank must share (KCCL_GPU_* with KCCL_EQUAL_GPU in
   * kccl_settings.def) were compared before any GPU work (shm.c, check_agreement). */
  kcclResult_t r = map_peers(g, peers);
  if (r != kcclSuccess) return r;
  const gpu_room room = measure_room(&g->shape, peers);
  if ((r = chunked_grid(g, peers, room)) != kcclSuccess) return r;
  g->one_gpu = room.max_local == g->shape.nranks;
  kgpu_l2_agree(g, peers);
  oneshot_grid(g, room);
  fill_devcomms(g, room.max_local);
  return kcclSuccess;
}

extern "C" kcclResult_t kgpu_sync(struct kgpu *g) {
  KGPU_CHECK(kgpuSetDevice(g->device));
  KGPU_CHECK(kgpuDeviceSynchronize());
  return kcclSuccess;
}

extern "C" void kgpu_destroy(struct kgpu *g, int free_own) {
  if (!g) return;
  kgpuSetDevice(g->device);
  for (int p = 0; p < g->shape.nranks; p++)
    if (p != g->shape.rank && g->peer[p]) kgpuIpcCloseMemHandle(g->peer[p]);
  split_free(g);
  if (free_own) {
    kgpuFree(g->buf);
    kgpuFreeHost((void *)g->status_h);
  }
  /* Not freed after an abort: a peer's kernel may still be pushing into this
   * buffer (or reading the status); the process's exit releases both. */
  kgpuGetLastError();
  free(g);
}

extern "C" kcclResult_t kgpu_check_ptr(struct kgpu *g, const void *p, size_t bytes, const char *what) {
  for (int i = 0; i < 8; i++)
    if (g->ok_ptr[i] == p && g->ok_len[i] >= bytes) return kcclSuccess;
  kgpuPointerAttributes a;
  kgpuError_t e = kgpuPointerGetAttributes(&a, p);
  if (e != kgpuSuccess) {
    kgpuGetLastError();
    return kccl_err(kcclInvalidArgument, "%s=%p is not memory CUDA knows (%s): this communicator is on GPU %d and "
                    "takes device buffers", what, p, kgpuGetErrorString(e), g->device);
  }
  if (!KGPU_PTR_IS_DEVICE(a))
    return kccl_err(kcclInvalidArgument, "%s=%p is host memory: this communicator is on GPU %d and takes device "
                    "buffers", what, p, g->device);
  if (KGPU_PTR_DEVICE(a) != g->device)
    return kccl_err(kcclInvalidArgument, "%s=%p lives on GPU %d, but this communicator is on GPU %d", what, p,
                    KGPU_PTR_DEVICE(a), g->device);
  g->ok_ptr[g->ok_next] = p;
  g->ok_len[g->ok_next] = bytes;
  g->ok_next = (g->ok_next + 1) & 7;
  return kcclSuccess;
}

extern "C" kcclResult_t kgpu_get_devcomm(struct kgpu *g, void *out, size_t bytes) {
  if (bytes != sizeof(kcclDevComm))
    return kccl_err(kcclInvalidArgument, "devComm has %zu bytes, this library's kcclDevComm %zu: rebuild against "
                    "the installed kccl_device.cuh", bytes, sizeof(kcclDevComm));
  memcpy(out, &g->dc[1], sizeof(kcclDevComm));
  return kcclSuccess;
}
