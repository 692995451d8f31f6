/* shm.c - the segments: create this rank's, map every peer's, unlink the names.
 *
 * Name of rank r's segment: /kccl-<token as 32 hex digits>-<r>, mode 0600.
 * Once every rank has mapped every segment the names are unlinked, so from then
 * on a crash of any or all ranks leaves nothing in /dev/shm (the kernel frees
 * the memory with the last mapping).  Only the short window during init can
 * leave a name behind (every rank SIGKILLed before the unlink): survivors
 * unlink a dead peer's name, and every init and get_unique_id sweeps names
 * whose creating process is gone. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define SHM_PREFIX "kccl-"

static void seg_name(char *out, size_t n, const uint8_t token[16], int rank) {
  char hex[33];
  for (int i = 0; i < 16; i++) snprintf(hex + 2 * i, 3, "%02x", token[i]);
  snprintf(out, n, "/" SHM_PREFIX "%s-%d", hex, rank);
}

/* Unlinks /dev/shm/kccl-* names of this user whose creator is gone. */
void kccl_shm_sweep_stale(void) {
  DIR *d = opendir("/dev/shm");
  if (!d) return;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (strncmp(e->d_name, SHM_PREFIX, strlen(SHM_PREFIX)) != 0) continue;
    char name[300];
    snprintf(name, sizeof name, "/%s", e->d_name);
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd < 0) continue;
    struct stat sb;
    int stale = 0;
    if (fstat(fd, &sb) == 0 && sb.st_uid == geteuid()) {
      if ((size_t)sb.st_size >= sizeof(kccl_seg_header)) {
        kccl_seg_header *h = mmap(NULL, sizeof *h, PROT_READ, MAP_SHARED, fd, 0);
        if (h != MAP_FAILED) {
          if (h->magic == KCCL_SEG_MAGIC)
            stale = !kccl_pid_alive((pid_t)h->pid, h->starttime);
          else /* never initialised: stale once clearly abandoned */
            stale = time(NULL) - sb.st_mtime > 60;
          munmap(h, sizeof *h);
        }
      } else {
        stale = time(NULL) - sb.st_mtime > 60;
      }
    }
    close(fd);
    if (stale) {
      shm_unlink(name);
      kccl_log(2, "removed stale segment %s", name);
    }
  }
  closedir(d);
}

/* What this rank's peers compare: its transport and every setting (the table's
 * `equal` rule says which ones must match). */
static void own_settings(const kcclConfig_t *cfg, kccl_seg_header *h) {
  h->gpu_transport = cfg->device >= 0;
  for (int i = 0; i < KCCL_NSETTINGS; i++) h->settings[i] = kccl_setting_get(cfg, i);
}

static const char *transport_text(int64_t gpu) { return gpu ? "a GPU (device=N)" : "the host transport"; }

static kcclResult_t create_own(struct kcclComm *c) {
  const char *name = c->names[c->rank];
  int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    if (errno == EEXIST)
      return kccl_err(kcclInvalidUsage,
                      "rank %d of this unique id is already initialised (a unique id serves one "
                      "communicator, and each rank joins once)", c->rank);
    return kccl_err(kcclSystemError, "shm_open(%s): %s", name, strerror(errno));
  }
  if (ftruncate(fd, (off_t)c->seg_bytes) != 0) {
    int e = errno;
    close(fd);
    shm_unlink(name);
    return kccl_err(kcclSystemError, "ftruncate(%s, %zu): %s (is /dev/shm large enough? see KCCL_BUFFER_BYTES)",
                    name, c->seg_bytes, strerror(e));
  }
  /* Every page up to the point-to-point area is populated now (first touch by this rank,
   * and no fault inside a collective); the area's pages come when a pair first uses them. */
  void *p = mmap(NULL, c->seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p != MAP_FAILED && mmap(p, c->p2p_off, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd, 0) ==
                             MAP_FAILED) {
    int e = errno;
    munmap(p, c->seg_bytes);
    p = MAP_FAILED;
    errno = e;
  }
  int e = errno;
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name);
    return kccl_err(kcclSystemError, "mmap of %zu bytes: %s", c->seg_bytes, strerror(e));
  }
  c->base[c->rank] = p;
  c->map_bytes[c->rank] = c->seg_bytes;
  kccl_seg_header *h = c->hdr[c->rank] = p;
  h->version = KCCL_VERSION_CODE;
  h->nranks = (uint32_t)c->nranks;
  h->rank = (uint32_t)c->rank;
  h->pid = (uint32_t)getpid();
  h->starttime = kccl_proc_starttime(getpid());
  memcpy(h->token, c->token, 16);
  h->seg_bytes = c->seg_bytes;
  h->slot_bytes = c->slot_bytes;
  own_settings(&c->cfg, h);
  kccl_replicas_own(c); /* placement fields; replica pages bound while only this rank maps them */
  atomic_store_explicit(&h->state, SEG_READY, memory_order_relaxed);
  __atomic_store_n(&h->magic, KCCL_SEG_MAGIC, __ATOMIC_RELEASE); /* header complete */
  c->pid[c->rank] = getpid();
  return kcclSuccess;
}

static int peer_dead(struct kcclComm *c, int p) {
  return c->hdr[p] && !kccl_pid_alive(c->pid[p], c->hdr[p]->starttime);
}

/* With every rank's header at hand: the transport, then the first setting (in table
 * order) that must be equal and on which some rank differs from rank 0, at the lowest
 * such rank.  A KCCL_EQUAL_GPU setting counts only between two GPU ranks.  Every rank
 * sees the same headers, so every rank returns the same error text. */
static kcclResult_t check_agreement(struct kcclComm *c) {
  const kccl_seg_header *h0 = c->hdr[0];
  for (int r = 1; r < c->nranks; r++)
    if (c->hdr[r]->gpu_transport != h0->gpu_transport)
      return kccl_err(kcclInvalidUsage, "unequal settings: rank 0 has %s, rank %d has %s; the transport must be "
                      "equal on all ranks (set it alike everywhere, or nowhere)", transport_text(h0->gpu_transport),
                      r, transport_text(c->hdr[r]->gpu_transport));
  for (int i = 0; i < KCCL_NSETTINGS; i++) {
    const kccl_setting *s = &kccl_settings[i];
    if (s->equal == KCCL_EQUAL_NO || (s->equal == KCCL_EQUAL_GPU && !h0->gpu_transport)) continue;
    for (int r = 1; r < c->nranks; r++) {
      if (c->hdr[r]->settings[i] == h0->settings[i]) continue;
      return kccl_err(kcclInvalidUsage, "unequal settings: rank 0 has %s=%lld, rank %d has %s=%lld; %s must be "
                      "equal on all ranks (set it alike everywhere, or nowhere)", s->var,
                      (long long)h0->settings[i], r, s->var, (long long)c->hdr[r]->settings[i], s->var);
    }
  }
  for (int r = 1; r < c->nranks; r++) {
    kcclResult_t res = kccl_replicas_check_rank(c, r);
    if (res != kcclSuccess) return res;
  }
  for (int r = 1; r < c->nranks; r++) /* the settings above decide the size; this is a last guard */
    if (c->hdr[r]->seg_bytes != c->hdr[0]->seg_bytes)
      return kccl_err(kcclInvalidUsage, "rank 0 uses %llu-byte segments, rank %d %llu: every rank must use the "
                      "same KCCL_BUFFER_BYTES and KCCL_MAX_OUTSTANDING", (unsigned long long)c->hdr[0]->seg_bytes,
                      r, (unsigned long long)c->hdr[r]->seg_bytes);
  return kcclSuccess;
}

/* Maps peer p's segment at the size its creator gave it, waiting for it to appear and
 * its header to be complete; then counts this rank in the peer's `attached`. */
static kcclResult_t map_peer(struct kcclComm *c, int p, int64_t deadline) {
  long backoff = 20;
  int fd = -1;
  for (;;) {
    fd = shm_open(c->names[p], O_RDWR | O_CLOEXEC, 0);
    if (fd >= 0) break;
    if (errno != ENOENT) return kccl_err(kcclSystemError, "shm_open(%s): %s", c->names[p], strerror(errno));
    if (kccl_now_ns() > deadline)
      return kccl_err(kcclTimeout,
                      "rank %d: rank %d did not join within KCCL_INIT_TIMEOUT_MS=%d (all ranks must run on "
                      "one host and use the same unique id)", c->rank, p, c->cfg.init_timeout_ms);
    kccl_sleep_us(backoff);
    if (backoff < 2000) backoff *= 2;
  }
  struct stat sb;
  for (;;) { /* the creator ftruncates right after creating */
    if (fstat(fd, &sb) != 0) { close(fd); return kccl_err(kcclSystemError, "fstat: %s", strerror(errno)); }
    if ((size_t)sb.st_size >= sizeof(kccl_seg_header)) break;
    if (kccl_now_ns() > deadline) { close(fd); return kccl_err(kcclTimeout, "rank %d's segment was never sized", p); }
    kccl_sleep_us(50);
  }
  void *m = mmap(NULL, (size_t)sb.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  close(fd);
  if (m == MAP_FAILED) return kccl_err(kcclSystemError, "mmap peer %d: %s", p, strerror(e));
  c->base[p] = m;
  c->map_bytes[p] = (size_t)sb.st_size;
  kccl_seg_header *h = m;
  while (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != KCCL_SEG_MAGIC) {
    if (kccl_now_ns() > deadline) return kccl_err(kcclTimeout, "rank %d's segment header never completed", p);
    kccl_sleep_us(50);
  }
  /* Every later access to this segment trusts seg_bytes (check_agreement makes it equal on
   * all ranks); a file smaller than that, or not this user's, was not made by a rank of
   * this communicator (a forged id naming a planted file) and would fault on first use. */
  if ((uint64_t)sb.st_size < h->seg_bytes || sb.st_uid != geteuid())
    return kccl_err(kcclInvalidUsage, "rank %d's segment %s is not a KCCL segment of this communicator "
                    "(%lld bytes, owner uid %d; its header claims %llu bytes)", p, c->names[p],
                    (long long)sb.st_size, (int)sb.st_uid, (unsigned long long)h->seg_bytes);
  c->hdr[p] = h;
  c->pid[p] = (pid_t)h->pid;
  if (h->version != KCCL_VERSION_CODE)
    return kccl_err(kcclInvalidUsage, "rank %d runs KCCL version %u, rank %d version %d", p,
                    h->version, c->rank, KCCL_VERSION_CODE);
  atomic_fetch_add_explicit(&h->attached, 1, memory_order_seq_cst);
  if (h->nranks != (uint32_t)c->nranks || h->rank != (uint32_t)p)
    return kccl_err(kcclInvalidUsage, "rank %d joined with nranks=%u, rank %d with nranks=%d", p,
                    h->nranks, c->rank, c->nranks);
#ifdef SYS_pidfd_open
  c->pidfd[p] = (int)syscall(SYS_pidfd_open, c->pid[p], 0);
#endif
  return kcclSuccess;
}

/* Before a rank that refused the settings takes its name away: every peer still alive has
 * mapped it (so has read the same headers and refuses alike), or the deadline passed. */
static void wait_attached(struct kcclComm *c, int64_t deadline) {
  long backoff = 10;
  for (;;) {
    int dead = 0;
    for (int p = 0; p < c->nranks; p++)
      if (p != c->rank && peer_dead(c, p)) dead++;
    uint32_t seen = atomic_load_explicit(&c->hdr[c->rank]->attached, memory_order_acquire);
    if ((int)seen + dead >= c->nranks - 1 || kccl_now_ns() > deadline) return;
    kccl_sleep_us(backoff);
    if (backoff < 1000) backoff *= 2;
  }
}

kcclResult_t kccl_shm_connect(struct kcclComm *c) {
  for (int r = 0; r < c->nranks; r++) {
    c->names[r] = malloc(64);
    if (!c->names[r]) return kccl_err(kcclSystemError, "out of memory");
    seg_name(c->names[r], 64, c->token, r);
  }
  kcclResult_t res = create_own(c);
  if (res != kcclSuccess) return res;

  const int bound_ms = c->cfg.init_timeout_ms;
  int64_t deadline = bound_ms > 0 ? kccl_now_ns() + (int64_t)bound_ms * 1000000 : INT64_MAX;
  for (int p = 0; p < c->nranks && res == kcclSuccess; p++)
    if (p != c->rank) res = map_peer(c, p, deadline);
  int refused = 0;
  if (res == kcclSuccess) refused = (res = check_agreement(c)) != kcclSuccess;

  if (res == kcclSuccess) {
    atomic_store_explicit(&c->hdr[c->rank]->mapped, 1, memory_order_seq_cst);
    /* Wait until every peer has mapped every segment (ours included). */
    long backoff = 10;
    for (int p = 0; p < c->nranks && res == kcclSuccess; p++) {
      while (p != c->rank && !atomic_load_explicit(&c->hdr[p]->mapped, memory_order_acquire)) {
        /* A peer sets `mapped` before it can close, fail or exit: once one of
         * those is seen, `mapped` is read again before init gives up. */
        int dead = peer_dead(c, p);
        uint32_t st = atomic_load(&c->hdr[p]->state);
        if (dead || st != SEG_READY) {
          if (atomic_load_explicit(&c->hdr[p]->mapped, memory_order_seq_cst)) break;
          res = st == SEG_FAILED && !dead && c->hdr[p]->error_text[0]
                    ? kccl_err(kcclRemoteError, "rank %d failed during init: %.200s", p, c->hdr[p]->error_text)
                    : kccl_err(kcclRemoteError, "rank %d (pid %d) %s during init", p, (int)c->pid[p],
                               dead ? "died" : "failed");
          break;
        }
        if (kccl_now_ns() > deadline) {
          res = kccl_err(kcclTimeout, "rank %d never finished mapping its peers (KCCL_INIT_TIMEOUT_MS=%d)", p,
                         bound_ms);
          break;
        }
        kccl_sleep_us(backoff);
        if (backoff < 1000) backoff *= 2;
      }
    }
  }
  if (res == kcclSuccess) {
    shm_unlink(c->names[c->rank]);
    kccl_replicas_setup(c);
    return kcclSuccess;
  }
  /* Failure: our name goes (after a refusal, once the peers have read our header), and so
   * do the names of peers that are dead. */
  kccl_seg_mark_failed(c);
  if (refused) wait_attached(c, deadline);
  shm_unlink(c->names[c->rank]);
  for (int p = 0; p < c->nranks; p++)
    if (p != c->rank && peer_dead(c, p)) shm_unlink(c->names[p]);
  return res;
}

void kccl_seg_mark_failed(struct kcclComm *c) {
  kccl_seg_header *h = c->hdr[c->rank];
  snprintf(h->error_text, sizeof h->error_text, "%.255s", kcclGetLastError(NULL));
  atomic_store_explicit(&h->state, SEG_FAILED, memory_order_seq_cst);
}

void kccl_shm_release(struct kcclComm *c) {
  for (int r = 0; r < c->nranks; r++) {
    if (c->base && c->base[r]) munmap(c->base[r], c->map_bytes[r]);
    if (c->pidfd && c->pidfd[r] >= 0) close(c->pidfd[r]);
    if (c->names) free(c->names[r]);
  }
  free(c->names);
  free(c->base);
  free(c->hdr);
  free(c->map_bytes);
  free(c->pid);
  free(c->pidfd);
  kccl_replicas_free(c);
}
