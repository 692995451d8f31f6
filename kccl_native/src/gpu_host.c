/* gpu_host.c - the host side of a GPU communicator.
 *
 * The host transport does the bootstrap: every rank's shared-memory segment
 * carries its GPU export (CUDA IPC handle, PCI id), so a GPU communicator is a
 * host communicator plus mapped device buffers.  This file
 * - exchanges the exports and maps the peers (gpu_api.h does the CUDA part),
 * - runs a watcher thread that turns a peer's death, abort or close into the
 *   host-mapped stop word that waiting kernels poll (a kernel cannot see a
 *   process die), sleeping in poll() on the peers' pidfds between looks,
 * - checks arguments and dispatches each collective to its kernel,
 * - turns a failure recorded by a kernel into the communicator's sticky error. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define WATCH_MS 2 /* the watcher's look at the peers' states; pidfds wake it at once */

/* Waits until every peer's gpu_state >= want, or a peer is gone, or time runs out. */
static kcclResult_t wait_gpu_state(struct kcclComm *c, uint32_t want) {
  const int bound_ms = c->cfg.init_timeout_ms; /* part of joining the communicator */
  int64_t deadline = bound_ms > 0 ? kccl_now_ns() + (int64_t)bound_ms * 1000000 : INT64_MAX;
  long backoff = 10;
  for (;;) {
    int missing = -1;
    for (int p = 0; p < c->nranks && missing < 0; p++)
      if (atomic_load_explicit(&c->hdr[p]->gpu_state, memory_order_acquire) < want) missing = p;
    if (missing < 0) return kcclSuccess;
    char why[400];
    int failed;
    kcclResult_t r = kccl_peers_gone(c, why, sizeof why, &failed);
    if (r != kcclSuccess) return kccl_err(r, "GPU setup: %s", why);
    if (failed >= 0)
      return kccl_err(kcclRemoteError, "GPU setup: rank %d failed: %.200s", failed, c->hdr[failed]->error_text);
    if (kccl_now_ns() > deadline)
      return kccl_err(kcclTimeout, "GPU setup: rank %d waited %d ms (KCCL_INIT_TIMEOUT_MS) for rank %d to %s its "
                      "GPU buffer", c->rank, bound_ms, missing, want == 1 ? "export" : "map every peer's");
    kccl_sleep_us(backoff);
    if (backoff < 1000) backoff *= 2;
  }
}

static void *watch(void *arg) {
  struct kcclComm *c = arg;
  struct kccl_gpu_host *gh = c->gpu;
  struct pollfd pfd[KCCL_MAX_RANKS + 1];
  int n = 0;
  pfd[n].fd = gh->efd;
  pfd[n++].events = POLLIN;
  for (int p = 0; p < c->nranks; p++)
    if (p != c->rank && c->pidfd[p] >= 0) {
      pfd[n].fd = c->pidfd[p];
      pfd[n++].events = POLLIN;
    }
  for (;;) {
    int rc = poll(pfd, (nfds_t)n, WATCH_MS);
    if (rc > 0 && pfd[0].revents) return NULL; /* our own destroy / abort */
    int why = KCCL_STOP_NONE, who = -1;
    for (int p = 0; p < c->nranks && !why; p++) {
      if (p == c->rank) continue;
      uint32_t s = atomic_load_explicit(&c->hdr[p]->state, memory_order_acquire);
      if (s == SEG_ABORTED) why = KCCL_STOP_ABORTED;
      else if (s == SEG_CLOSED) why = KCCL_STOP_CLOSED;
      else if (s == SEG_FAILED) why = KCCL_STOP_FAILED;
      if (why) who = p;
    }
    if (!why) {
      char text[300];
      int failed;
      if (kccl_peers_gone(c, text, sizeof text, &failed) != kcclSuccess) {
        why = KCCL_STOP_DEAD;
        for (int p = 0; p < c->nranks; p++)
          if (p != c->rank && !kccl_pid_alive(c->pid[p], c->hdr[p]->starttime)) who = p;
        if (who < 0) why = KCCL_STOP_NONE; /* raced with a state change: look again */
      }
    }
    if (why) {
      gh->status->stop_peer = who;
      __atomic_thread_fence(__ATOMIC_SEQ_CST);
      gh->status->stop = why;
      __atomic_thread_fence(__ATOMIC_SEQ_CST);
      return NULL;
    }
  }
}

kcclResult_t kccl_gpu_init(struct kcclComm *c) {
  if (!kgpu_built())
    return kccl_err(kcclInvalidUsage, "device=%d asked for, but this KCCL was built without CUDA (install "
                    "where nvcc and a GPU driver are, or with KCCL_CUDA=1)", c->cfg.device);
  struct kccl_gpu_host *gh = calloc(1, sizeof *gh);
  if (!gh) return kccl_err(kcclSystemError, "out of memory");
  gh->efd = -1;
  c->gpu = gh;
  /* The launch sizes are kgpu_connect's, once it has every rank's export. */
  kgpu_shape shape = {.nranks = c->nranks, .rank = c->rank, .cfg = c->cfg};
  kccl_seg_header *me = c->hdr[c->rank];
  kcclResult_t r = kgpu_create(c->cfg.device, &shape, &gh->kg, &me->gpu, &gh->status);
  if (r == kcclSuccess) {
    atomic_store_explicit(&me->gpu_state, 1, memory_order_release);
    r = wait_gpu_state(c, 1);
  }
  if (r == kcclSuccess) {
    kgpu_export *all = malloc((size_t)c->nranks * sizeof *all);
    if (!all) {
      r = kccl_err(kcclSystemError, "out of memory");
    } else {
      for (int p = 0; p < c->nranks; p++) memcpy(&all[p], &c->hdr[p]->gpu, sizeof *all);
      r = kgpu_connect(gh->kg, all);
      free(all);
    }
  }
  if (r == kcclSuccess) {
    atomic_store_explicit(&me->gpu_state, 2, memory_order_release);
    r = wait_gpu_state(c, 2);
  }
  if (r == kcclSuccess) {
    gh->efd = eventfd(0, EFD_CLOEXEC);
    if (gh->efd < 0 || pthread_create(&gh->watcher, NULL, watch, c) != 0)
      r = kccl_err(kcclSystemError, "GPU setup: cannot start the watcher thread: %s", strerror(errno));
    else
      gh->watching = 1;
  }
  if (r != kcclSuccess) {
    /* Tell the peers (they may be waiting in wait_gpu_state) before cleaning up. */
    kccl_seg_mark_failed(c);
    kccl_gpu_release(c, 1);
  }
  return r;
}

void kccl_gpu_quiesce(struct kcclComm *c, int aborting) {
  if (c->gpu && c->gpu->kg && !aborting) kgpu_sync(c->gpu->kg); /* our kernels are done with the peers */
}

static void stop_watcher(struct kccl_gpu_host *gh) {
  if (gh->watching) {
    uint64_t one = 1;
    if (write(gh->efd, &one, sizeof one) < 0) { /* cannot happen for an eventfd */ }
    pthread_join(gh->watcher, NULL);
    gh->watching = 0;
  }
  if (gh->efd >= 0) close(gh->efd);
  gh->efd = -1;
}

/* Destroy: every peer must be done with this rank's buffer before it is
 * freed (they read it in two-shot and gather), so wait (bounded) for each to
 * close, abort or die.  Abort: leave at once; the buffer stays allocated. */
void kccl_gpu_release(struct kcclComm *c, int aborting) {
  struct kccl_gpu_host *gh = c->gpu;
  if (!gh) return;
  int free_own = !aborting;
  if (!aborting && gh->kg) {
    int64_t deadline = kccl_now_ns() + (int64_t)(c->cfg.timeout_ms > 0 ? c->cfg.timeout_ms : 10000) * 1000000;
    long backoff = 10;
    for (int p = 0; p < c->nranks; p++) {
      if (p == c->rank) continue;
      for (;;) {
        uint32_t s = atomic_load_explicit(&c->hdr[p]->state, memory_order_acquire);
        if (s != SEG_READY || !kccl_pid_alive(c->pid[p], c->hdr[p]->starttime)) break;
        if (kccl_now_ns() > deadline) {
          kccl_log(1, "destroy: rank %d still open after the timeout; keeping this rank's GPU buffer", p);
          free_own = 0;
          break;
        }
        kccl_sleep_us(backoff);
        if (backoff < 2000) backoff *= 2;
      }
    }
  }
  stop_watcher(gh);
  kgpu_destroy(gh->kg, free_own);
  free(gh);
  c->gpu = NULL;
}

static const char *stop_word(int why) {
  switch (why) {
    case KCCL_STOP_DEAD: return "died";
    case KCCL_STOP_ABORTED: return "aborted";
    case KCCL_STOP_CLOSED: return "closed its communicator";
    case KCCL_STOP_FAILED: return "failed";
    default: return "stopped";
  }
}

/* Called before every GPU collective (a host-memory read, no CUDA call): a
 * failure a kernel recorded, or a peer the watcher saw go, breaks the
 * communicator now. */
kcclResult_t kccl_gpu_enter(struct kcclComm *c) {
  kcclGpuStatus *s = c->gpu->status;
  if (__builtin_expect(!s->code && !s->stop, 1)) return kcclSuccess;
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (s->code) {
    switch (s->what) {
      case KCCL_GPU_MISMATCH: {
        char peer_bytes[40] = ""; /* the one-shot knows only the peer's signature */
        if (s->bytes_peer != KCCL_GPU_BYTES_UNKNOWN)
          snprintf(peer_bytes, sizeof peer_bytes, ", %u bytes per block", s->bytes_peer);
        return kccl_comm_fail(c, kcclRemoteError,
                              "collective mismatch on GPU: rank %d's call (signature %08x, %u bytes per block) "
                              "differs from rank %d's (signature %08x%s)",
                              c->rank, s->sig_mine, s->bytes_mine, s->peer, s->sig_peer, peer_bytes);
      }
      case KCCL_GPU_TIMEOUT: {
        char where[160]; /* which wait, and how far the peer got, for diagnosis */
        if (s->stage < 0) snprintf(where, sizeof where, "block %d of %d, one-shot", s->block, s->grid);
        else
          snprintf(where, sizeof where, "block %d of %d, chunked flag %d; that rank's block %d is at step %u, "
                   "%u of its %d blocks have begun step %u", s->block, s->grid, s->stage + 1, s->block,
                   s->bytes_peer, s->bytes_mine, s->grid, s->epoch);
        return kccl_comm_fail(c, kcclTimeout,
                              "a kernel of rank %d waited %d ms for rank %d (pid %d) at step %u (KCCL_TIMEOUT_MS; "
                              "%s); is it alive, and calling the same collectives?",
                              c->rank, c->cfg.timeout_ms, s->peer, s->peer >= 0 ? (int)c->pid[s->peer] : -1,
                              s->epoch, where);
      }
      case KCCL_GPU_CANCELLED:
        return kccl_comm_fail(c, kcclRemoteError,
                              "a kernel of rank %d (block %d) cancelled its device-API call while waiting for rank "
                              "%d at step %u (its own wait gave up); the ranks' calls no longer pair up",
                              c->rank, s->block, s->peer, s->epoch);
      default:
        break;
    }
  }
  int who = s->stop_peer;
  if (s->stop && who >= 0 && who < c->nranks) {
    if (s->stop == KCCL_STOP_FAILED)
      return kccl_comm_fail(c, kcclRemoteError, "rank %d (pid %d) failed: %.200s", who, (int)c->pid[who],
                            c->hdr[who]->error_text);
    return kccl_comm_fail(c, kcclRemoteError, "rank %d (pid %d) %s (seen by rank %d's GPU watcher)", who,
                          (int)c->pid[who], stop_word(s->stop), c->rank);
  }
  return kccl_comm_fail(c, kcclRemoteError, "a kernel of rank %d gave up waiting for rank %d", c->rank, s->peer);
}

static size_t dtype_bytes(int dtype, size_t count) { return count * kccl_dtype_size((kcclDataType_t)dtype); }

kcclResult_t kccl_gpu_collective(struct kcclComm *c, int coll, const void *send, void *recv, size_t count,
                                 int dtype, int op, int root, void *stream, uint32_t sig) {
  struct kgpu *g = c->gpu->kg;
  kcclResult_t r;
  const size_t n = (size_t)c->nranks, bytes = dtype_bytes(dtype, count);
  switch (coll) {
    case COLL_ALLREDUCE: {
      if (bytes && ((r = kgpu_check_ptr(g, send, bytes, "sendbuff")) || (r = kgpu_check_ptr(g, recv, bytes, "recvbuff"))))
        return r;
      /* The LL inboxes hold 256 KB per sender, and the one-shot kernel runs at most
       * as many blocks as fit on the GPU beside the peers': larger messages go
       * two-shot even in auto (every rank computes the same cap). */
      const size_t ll_cap = kgpu_oneshot_max_bytes(g);
      size_t cross = c->cfg.gpu_oneshot_max_bytes < ll_cap ? c->cfg.gpu_oneshot_max_bytes : ll_cap;
      int twoshot = kccl_allreduce_algo(&c->cfg, bytes, cross) == kcclAlgoTwoShot;
      if (!twoshot && bytes > ll_cap)
        return kccl_err(kcclInvalidArgument, "KCCL_ALGO=oneshot on this GPU communicator takes at most %zu bytes, "
                        "got %zu", ll_cap, bytes);
      return kgpu_allreduce(g, send, recv, count, dtype, op, twoshot, sig, stream);
    }
    case COLL_ALLGATHER:
      if (bytes && ((r = kgpu_check_ptr(g, send, bytes, "sendbuff")) ||
                    (r = kgpu_check_ptr(g, recv, bytes * n, "recvbuff"))))
        return r;
      return kgpu_gather(g, send, recv, bytes, -1, sig, stream);
    case COLL_BROADCAST:
      if (bytes && (r = kgpu_check_ptr(g, recv, bytes, "recvbuff"))) return r;
      if (bytes && c->rank == root && (r = kgpu_check_ptr(g, send, bytes, "sendbuff"))) return r;
      return kgpu_gather(g, send, recv, bytes, root, sig, stream);
    case COLL_REDUCESCATTER:
      if (bytes && ((r = kgpu_check_ptr(g, send, bytes * n, "sendbuff")) ||
                    (r = kgpu_check_ptr(g, recv, bytes, "recvbuff"))))
        return r;
      return kgpu_reduce_scatter(g, send, recv, count, dtype, op, sig, stream);
    case COLL_BARRIER:
      return kgpu_gather(g, NULL, NULL, 0, -1, sig, stream);
    default:
      return kccl_err(kcclInternalError, "unknown collective %d", coll);
  }
}

static kcclResult_t gpu_enter(struct kcclComm *c, void *stream) {
  (void)stream; /* any stream of the communicator's device */
  return kccl_gpu_enter(c);
}

static kcclResult_t gpu_run(struct kcclComm *c, const kccl_call *a) {
  return kccl_gpu_collective(c, a->coll, a->send, a->recv, a->count, a->dtype, a->op, a->root, a->stream, a->sig);
}

const struct kccl_transport kccl_gpu_transport = {gpu_enter, gpu_run};

/* ------------------------------------------------------------ public API -- */

static kcclResult_t gpu_comm(kcclComm_t comm, struct kgpu **g) {
  if (kccl_comm_valid(comm) && !comm->gpu)
    return kccl_err(kcclInvalidUsage, "this is a host communicator (created with device=-1)");
  kcclResult_t r = kccl_comm_check(comm);
  if (r == kcclSuccess) r = kccl_gpu_enter(comm);
  if (r != kcclSuccess) return r;
  *g = comm->gpu->kg;
  return kcclSuccess;
}

kcclResult_t kcclGetGpuSupport(int *built, int *devices) {
  if (!built || !devices) return kccl_err(kcclInvalidArgument, "NULL argument");
  *built = kgpu_built();
  *devices = 0;
  if (*built) kgpu_device_count(devices);
  return kcclSuccess;
}

kcclResult_t kcclCommCuDevice(const kcclComm_t comm, int *device) {
  if (!kccl_comm_valid(comm) || !device)
    return kccl_err(kcclInvalidArgument, "invalid communicator or NULL device");
  *device = comm->gpu ? comm->cfg.device : -1;
  return kcclSuccess;
}

kcclResult_t kcclCommGpuFlagReplicas(const kcclComm_t comm, int *state, char *note, size_t noteBytes) {
  if (!kccl_comm_valid(comm) || !state)
    return kccl_err(kcclInvalidArgument, "invalid communicator or NULL state");
  if (!comm->gpu)
    return kccl_err(kcclInvalidUsage, "this is a host communicator (created with device=-1): flag replicas are a "
                    "GPU communicator's");
  kgpu_flag_replicas(comm->gpu->kg, state, note, noteBytes);
  return kcclSuccess;
}

kcclResult_t kcclCommGetDevComm(kcclComm_t comm, void *devComm, size_t bytes) {
  struct kgpu *g = NULL;
  kcclResult_t r = gpu_comm(comm, &g);
  if (r != kcclSuccess) return r;
  if (!devComm) return kccl_err(kcclInvalidArgument, "devComm is NULL");
  return kgpu_get_devcomm(g, devComm, bytes);
}
