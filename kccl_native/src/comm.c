/* comm.c - communicator life cycle: unique id, init (with or without a placement), destroy, abort, queries. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

/* (token, rank) pairs this process has joined: a second join of the same rank
 * would otherwise go unnoticed once the segment names are unlinked. */
static pthread_mutex_t joined_lock = PTHREAD_MUTEX_INITIALIZER;
static struct joined { uint8_t token[16]; int rank; struct joined *next; } *joined;

static int already_joined(const uint8_t token[16], int rank) {
  pthread_mutex_lock(&joined_lock);
  int found = 0;
  for (struct joined *j = joined; j && !found; j = j->next) found = j->rank == rank && !memcmp(j->token, token, 16);
  pthread_mutex_unlock(&joined_lock);
  return found;
}

static void remember_join(const uint8_t token[16], int rank) {
  struct joined *j = malloc(sizeof *j);
  if (!j) return;
  memcpy(j->token, token, 16);
  j->rank = rank;
  pthread_mutex_lock(&joined_lock);
  j->next = joined;
  joined = j;
  pthread_mutex_unlock(&joined_lock);
}

static int allowed_cpus(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

/* Waiting phases.  With a core per rank, spinning is cheapest; with more ranks
 * than cores a spinning rank steals the core its peer needs, so spin briefly
 * and let the scheduler (yield, then futex sleep) hand the core over. */
kcclResult_t kcclGetUniqueId(kcclUniqueId *id) {
  kcclResult_t r = kccl_uid_make(id);
  if (r == kcclSuccess) kccl_shm_sweep_stale(); /* a good moment to clean up after earlier crashes */
  return r;
}

static void resolve_waits(struct kcclComm *c) {
  int over = c->nranks > c->ncpus;
  int spin = c->cfg.spin_us >= 0 ? c->cfg.spin_us : (over ? 0 : 100);
  int yield = c->cfg.yield_us >= 0 ? c->cfg.yield_us : (over ? 1000 : 2000);
  c->spin_ns = (int64_t)spin * 1000;
  c->yield_ns = (int64_t)yield * 1000;
}

/* Init with an optional placement (NULL: one copy of everything). */
static kcclResult_t comm_init(kcclComm_t *out, int nranks, kcclUniqueId id, int rank, const kcclConfig_t *config,
                             const kcclPlacement_t *placement) {
  if (!out) return kccl_err(kcclInvalidArgument, "comm is NULL");
  *out = NULL;
  if (nranks < 1 || nranks > KCCL_MAX_RANKS)
    return kccl_err(kcclInvalidArgument, "nranks=%d: expected 1..%d", nranks, KCCL_MAX_RANKS);
  if (rank < 0 || rank >= nranks)
    return kccl_err(kcclInvalidArgument, "rank=%d out of range for nranks=%d", rank, nranks);
  kcclConfig_t cfg;
  kcclResult_t r;
  if (config) {
    if (config->size != sizeof cfg)
      return kccl_err(kcclInvalidArgument, "config.size=%zu, expected %zu (initialise it with kcclConfigInit)",
                      config->size, sizeof cfg);
    cfg = *config;
  } else if ((r = kcclConfigInit(&cfg)) != kcclSuccess) {
    return r;
  }
  if (cfg.device < -1)
    return kccl_err(kcclInvalidArgument, "config.device=%d: -1 (host transport) or a CUDA device ordinal", cfg.device);
  if ((r = kccl_config_check(&cfg)) != kcclSuccess) return r;
  kccl_debug_level = cfg.debug;

  struct kcclComm *c = calloc(1, sizeof *c);
  if (!c) return kccl_err(kcclSystemError, "out of memory");
  if ((r = kccl_uid_parse(&id, c->token)) != kcclSuccess) { free(c); return r; }
  if (already_joined(c->token, rank)) {
    free(c);
    return kccl_err(kcclInvalidUsage, "rank %d of this unique id was already initialised by this process "
                    "(a unique id serves one communicator: get a new one)", rank);
  }
  c->magic = KCCL_COMM_MAGIC;
  c->nranks = nranks;
  c->rank = rank;
  c->cfg = cfg;
  c->tp = cfg.device >= 0 ? &kccl_gpu_transport : &kccl_host_transport;
  c->ncpus = allowed_cpus();
  resolve_waits(c);
  /* Reduce-scatter puts nranks blocks of at least one 8-byte element in a slot. */
  size_t slot = kccl_round_up(cfg.buffer_bytes, KCCL_LINE);
  if (slot < (size_t)nranks * KCCL_LINE) slot = (size_t)nranks * KCCL_LINE;
  c->slot_bytes = slot;
  size_t chunk = kccl_round_up(cfg.chunk_bytes, KCCL_LINE);
  if (chunk < (size_t)nranks * KCCL_LINE) chunk = (size_t)nranks * KCCL_LINE;
  c->chunk_bytes = chunk < slot ? chunk : slot;
  /* Slots are not page multiples apart: a kernel that loads from one slot and
   * stores to another (two-shot: A slots -> B slot) would otherwise hit 4K
   * aliasing between its load and store streams on x86. */
  c->slot_stride = kccl_round_up(SLOT_DATA_OFF + slot, KCCL_LINE) + 17 * KCCL_LINE;
  for (c->nsets = 2; c->nsets < 2u * (uint32_t)cfg.max_outstanding; c->nsets *= 2) {}
  c->seg_bytes = kccl_round_up(KCCL_PAGE + (size_t)c->nsets * 2 * c->slot_stride, KCCL_PAGE);
  if ((r = kccl_replicas_alloc(c, placement)) != kcclSuccess) { free(c); return r; }
  c->seg_bytes += kccl_replicas_layout(c, c->seg_bytes);
  c->p2p_off = c->seg_bytes;
  c->seg_bytes += kccl_p2p_layout(c);
  c->names = calloc((size_t)nranks, sizeof *c->names);
  c->base = calloc((size_t)nranks, sizeof *c->base);
  c->hdr = calloc((size_t)nranks, sizeof *c->hdr);
  c->map_bytes = calloc((size_t)nranks, sizeof *c->map_bytes);
  c->pid = calloc((size_t)nranks, sizeof *c->pid);
  c->pidfd = malloc((size_t)nranks * sizeof *c->pidfd);
  if (!c->names || !c->base || !c->hdr || !c->map_bytes || !c->pid || !c->pidfd) {
    kccl_shm_release(c);
    free(c);
    return kccl_err(kcclSystemError, "out of memory");
  }
  for (int i = 0; i < nranks; i++) c->pidfd[i] = -1;

  kccl_shm_sweep_stale();
  if ((r = kccl_shm_connect(c)) != kcclSuccess || (cfg.device >= 0 && (r = kccl_gpu_init(c)) != kcclSuccess) ||
      (r = kccl_p2p_init(c)) != kcclSuccess) {
    kccl_shm_release(c);
    free(c);
    return r;
  }
  remember_join(c->token, rank);
  kccl_log(2, "rank %d/%d ready: %zu-byte slots, spin %lld us, yield %lld us, %d cpus", rank, nranks,
           c->slot_bytes, (long long)(c->spin_ns / 1000), (long long)(c->yield_ns / 1000), c->ncpus);
  *out = c;
  return kcclSuccess;
}

kcclResult_t kcclCommInitRankConfig(kcclComm_t *out, int nranks, kcclUniqueId id, int rank,
                                    const kcclConfig_t *config) {
  return comm_init(out, nranks, id, rank, config, NULL);
}

kcclResult_t kcclCommInitRankPlacement(kcclComm_t *comm, int nranks, kcclUniqueId id, int rank,
                                       const kcclConfig_t *config, const kcclPlacement_t *placement) {
  if (!placement) return kccl_err(kcclInvalidArgument, "placement is NULL (use kcclCommInitRankConfig)");
  return comm_init(comm, nranks, id, rank, config, placement);
}

kcclResult_t kcclCommInitRank(kcclComm_t *comm, int nranks, kcclUniqueId id, int rank) {
  return kcclCommInitRankConfig(comm, nranks, id, rank, NULL);
}

static kcclResult_t finish(kcclComm_t c, uint32_t state) {
  if (!kccl_comm_valid(c)) return kccl_err(kcclInvalidArgument, "invalid communicator");
  kccl_gpu_quiesce(c, state == SEG_ABORTED);
  uint32_t cur = atomic_load(&c->hdr[c->rank]->state);
  if (cur == SEG_READY || state == SEG_ABORTED) atomic_store(&c->hdr[c->rank]->state, state);
  kccl_wake_all(c);
  kccl_gpu_release(c, state == SEG_ABORTED);
  kccl_p2p_free(c);
  kccl_shm_release(c);
  c->magic = 0;
  free(c);
  return kcclSuccess;
}

kcclResult_t kcclCommDestroy(kcclComm_t comm) { return finish(comm, SEG_CLOSED); }
kcclResult_t kcclCommAbort(kcclComm_t comm) { return finish(comm, SEG_ABORTED); }

kcclResult_t kcclCommExpectLongWait(kcclComm_t comm) {
  if (!kccl_comm_valid(comm)) return kccl_err(kcclInvalidArgument, "invalid communicator");
  comm->long_wait = 1;
  return kcclSuccess;
}

kcclResult_t kcclCommCount(const kcclComm_t comm, int *count) {
  if (!kccl_comm_valid(comm) || !count) return kccl_err(kcclInvalidArgument, "invalid communicator or NULL count");
  *count = comm->nranks;
  return kcclSuccess;
}

kcclResult_t kcclCommUserRank(const kcclComm_t comm, int *rank) {
  if (!kccl_comm_valid(comm) || !rank) return kccl_err(kcclInvalidArgument, "invalid communicator or NULL rank");
  *rank = comm->rank;
  return kcclSuccess;
}

kcclResult_t kcclCommGetAsyncError(kcclComm_t comm, kcclResult_t *asyncError) {
  if (!kccl_comm_valid(comm) || !asyncError) return kccl_err(kcclInvalidArgument, "invalid communicator or NULL asyncError");
  /* GPU: a failure a kernel recorded (or a peer the watcher saw go) counts now, as the next call would say. */
  if (comm->gpu && comm->error == kcclSuccess) kccl_gpu_enter(comm);
  *asyncError = comm->error;
  return kcclSuccess;
}
