/* replicas.c - placement of per-domain replicas: layout, NUMA binding and its
 * verification, the peers' agreement on the domains, and the replicated publish.
 *
 * Why non-temporal stores for remote replicas: an ordinary store leaves the
 * line modified in the writer's cache, so every reader of the replica would
 * still fetch it from the writer's domain, and the replica would only add the
 * writer's own fetch of it (more cross-domain transfers than one copy; see
 * topology/cost.py).  A full non-temporal write sends the line to the
 * replica's home memory and invalidates the readers' copies; they then refill
 * from their own node. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "replicas.h"

#define REP_DATA_MAX 16384 /* bytes of data a replica carries: the one-shot crossover's default
                             (topology/cost.py REPLICA_DATA_MAX mirrors it) */
#define MPOL_BIND_ 2       /* <linux/mempolicy.h> values, spelled out: the header is not always installed */
#define MPOL_MF_STRICT_ (1 << 0)
#define MPOL_MF_MOVE_ (1 << 1)

kcclResult_t kccl_replicas_alloc(struct kcclComm *c, const kcclPlacement_t *pl) {
  c->rep = NULL;
  if (!pl) return kcclSuccess;
  if (pl->size != sizeof *pl)
    return kccl_err(kcclInvalidArgument, "placement.size=%zu, expected %zu", pl->size, sizeof *pl);
  if (pl->ndomains < 0 || pl->ndomains > KCCL_MAX_DOMAINS)
    return kccl_err(kcclInvalidArgument, "placement.ndomains=%d: expected 0..%d", pl->ndomains, KCCL_MAX_DOMAINS);
  if (pl->ndomains <= 1) return kcclSuccess; /* one domain = one copy */
  if (pl->domain < -1 || pl->domain >= pl->ndomains)
    return kccl_err(kcclInvalidArgument, "placement.domain=%d out of range for %d domains", pl->domain,
                    pl->ndomains);
  for (int d = 0; d < pl->ndomains; d++)
    if (pl->numaNode[d] < -1 || pl->numaNode[d] >= 1024)
      return kccl_err(kcclInvalidArgument, "placement.numaNode[%d]=%d: expected -1..1023", d, pl->numaNode[d]);
  struct kccl_replicas *x = calloc(1, sizeof *x);
  if (!x || !(x->dom = calloc((size_t)c->nranks, sizeof *x->dom))) {
    free(x);
    return kccl_err(kcclSystemError, "out of memory");
  }
  x->ndomains = pl->ndomains;
  x->mydom = pl->domain;
  x->hash = pl->topoHash;
  memcpy(x->numa, pl->numaNode, sizeof x->numa);
  x->data_bytes = c->slot_bytes < REP_DATA_MAX ? c->slot_bytes : REP_DATA_MAX;
  snprintf(x->note, sizeof x->note, "not bound yet");
  c->rep = x;
  return kcclSuccess;
}

size_t kccl_replicas_layout(struct kcclComm *c, size_t area_off) {
  struct kccl_replicas *x = c->rep;
  if (!x) return 0;
  /* skewed like the main slots (4K aliasing); a block per domain, page aligned for mbind */
  x->stride = kccl_round_up(SLOT_DATA_OFF + x->data_bytes, KCCL_LINE) + 17 * KCCL_LINE;
  x->block_bytes = kccl_round_up((size_t)c->nsets * 2 * x->stride, KCCL_PAGE);
  x->area_off = area_off;
  return (size_t)x->ndomains * x->block_bytes;
}

/* Binds block d of the own segment to its domain's node and checks where its
 * pages are.  Returns 1 verified, 0 nothing checked, -1 failed (note says why). */
static int bind_block(struct kcclComm *c, int d, char *note, size_t n) {
  struct kccl_replicas *x = c->rep;
  int node = x->numa[d];
  if (node < 0) return 0;
  uint8_t *p = kccl_rep_slot(c, c->rank, d, 0, 0);
  unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {0};
  mask[node / (8 * sizeof(unsigned long))] = 1ul << (node % (8 * sizeof(unsigned long)));
  /* MOVE: the pages were populated by this rank (first touch, its own node); only
   * this process maps them yet, so they can move. */
  if (syscall(SYS_mbind, p, x->block_bytes, MPOL_BIND_, mask, 1024 + 1, MPOL_MF_MOVE_ | MPOL_MF_STRICT_) != 0) {
    snprintf(note, n, "mbind of domain %d's replica to node %d: %s", d, node, strerror(errno));
    return -1;
  }
  size_t npages = x->block_bytes / KCCL_PAGE;
  void *pages[64];
  int status[64];
  if (npages > 64) npages = 64;
  for (size_t i = 0; i < npages; i++) {
    pages[i] = p + i * KCCL_PAGE;
    ((volatile uint8_t *)pages[i])[0]; /* present, so move_pages reports a node */
  }
  if (syscall(SYS_move_pages, 0, (unsigned long)npages, pages, NULL, status, 0) != 0) {
    snprintf(note, n, "bound domain %d to node %d; move_pages cannot verify: %s", d, node, strerror(errno));
    return 0;
  }
  for (size_t i = 0; i < npages; i++)
    if (status[i] != node) {
      snprintf(note, n, "domain %d's replica page %zu is on node %d, not %d", d, i, status[i], node);
      return -1;
    }
  return 1;
}

void kccl_replicas_own(struct kcclComm *c) {
  kccl_seg_header *h = c->hdr[c->rank];
  struct kccl_replicas *x = c->rep;
  h->ndomains = x ? x->ndomains : 1;
  h->domain = x ? x->mydom : 0;
  h->topo_hash = x ? x->hash : 0;
  if (!x) return;
  int verified = 0, failed = 0, tried = 0;
  char note[192] = "";
  for (int d = 0; d < x->ndomains; d++) {
    if (d == x->mydom) continue; /* this rank's own domain reads the main slots */
    char why[192] = "";
    int r = bind_block(c, d, why, sizeof why);
    tried += x->numa[d] >= 0;
    verified += r == 1;
    if (r < 0 && !failed++) snprintf(note, sizeof note, "%s", why);
    if (r == 0 && why[0] && !note[0]) snprintf(note, sizeof note, "%s", why);
  }
  x->bound = failed ? -1 : (tried && verified == tried ? 1 : 0);
  if (x->bound == 1)
    snprintf(x->note, sizeof x->note, "%d replica blocks bound and verified with move_pages", verified);
  else if (!note[0])
    snprintf(x->note, sizeof x->note, "no NUMA node given: replicas placed by first touch");
  else
    snprintf(x->note, sizeof x->note, "%s", note);
  kccl_log(x->bound < 0 ? 1 : 2, "rank %d replicas: %s", c->rank, x->note);
}

/* Rank r's placement against rank 0's: every rank runs this for every r, so all of
 * them refuse a disagreement alike. */
kcclResult_t kccl_replicas_check_rank(struct kcclComm *c, int r) {
  const kccl_seg_header *h = c->hdr[r], *h0 = c->hdr[0];
  if (h->ndomains != h0->ndomains || h->topo_hash != h0->topo_hash)
    return kccl_err(kcclInvalidUsage,
                    "rank 0 sees %d topology domains (hash %016llx), rank %d sees %d (hash %016llx): every "
                    "rank must use the same topology (KCCL_TOPO, KCCL_TOPO_FILE)", (int)h0->ndomains,
                    (unsigned long long)h0->topo_hash, r, (int)h->ndomains, (unsigned long long)h->topo_hash);
  if (h->domain < -1 || h->domain >= h->ndomains)
    return kccl_err(kcclInvalidUsage, "rank %d claims domain %d of %d", r, (int)h->domain, (int)h->ndomains);
  return kcclSuccess;
}

void kccl_replicas_setup(struct kcclComm *c) {
  struct kccl_replicas *x = c->rep;
  if (!x) return;
  for (int r = 0; r < c->nranks; r++) x->dom[r] = c->hdr[r]->domain;
  x->ntargets = 0;
  for (int d = 0; d < x->ndomains; d++) {
    if (d == x->mydom) continue;
    for (int r = 0; r < c->nranks; r++)
      if (r != c->rank && x->dom[r] == d) {
        x->targets[x->ntargets++] = d;
        break;
      }
  }
  kccl_log(2, "rank %d: domain %d of %d, writes %d remote replicas", c->rank, x->mydom, x->ndomains, x->ntargets);
}

/* Copies n bytes (8-aligned dst and src, n rounded up to 8: slots have room) so
 * that the lines go to memory, not into this core's cache. */
/* -DKCCL_REPLICA_PLAIN_STORES: ordinary stores instead, to compare against. */
#if defined(__x86_64__) && !defined(KCCL_REPLICA_PLAIN_STORES)
#define KCCL_NT_PUSH 1
#endif

static void push_bytes(uint8_t *dst, const uint8_t *src, size_t n) {
#if KCCL_NT_PUSH
  for (size_t i = 0; i < n; i += 8) {
    long long v;
    memcpy(&v, src + i, 8);
    _mm_stream_si64((long long *)(dst + i), v);
  }
#else
  memcpy(dst, src, n);
#endif
}

void kccl_publish_replicated(struct kcclComm *c, uint32_t set, int which, size_t bytes, uint32_t seq,
                             uint32_t sig) {
  struct kccl_replicas *x = c->rep;
  uint8_t *main = kccl_slot(c, c->rank, set, which);
  uint64_t v = ((uint64_t)seq << 32) | sig;
  atomic_store_explicit(kccl_flag(main), v, memory_order_seq_cst); /* own domain's readers first */
  size_t n = (bytes + 7) / 8 * 8; /* kccl_publish_slot: bytes <= x->data_bytes */
  for (int i = 0; i < x->ntargets; i++) {
    uint8_t *rep = kccl_rep_slot(c, c->rank, x->targets[i], set, which);
    push_bytes(kccl_data(rep), kccl_data(main), n);
#if KCCL_NT_PUSH
    _mm_sfence(); /* the data is visible before the flag that announces it */
    _mm_stream_si64((long long *)kccl_flag(rep), (long long)v);
#else
    atomic_store_explicit(kccl_flag(rep), v, memory_order_release);
#endif
  }
  x->pushes += (uint64_t)x->ntargets;
  /* Store-load order between the flag stores and the sleepers check (wait.c's
   * register-then-recheck); mfence also drains the non-temporal stores. */
  atomic_thread_fence(memory_order_seq_cst);
#if defined(__x86_64__)
  _mm_mfence();
#endif
  if (atomic_load_explicit(&c->hdr[c->rank]->sleepers, memory_order_seq_cst)) {
    kccl_futex_wake(kccl_seq_word(kccl_flag(main)));
    for (int i = 0; i < x->ntargets; i++)
      kccl_futex_wake(kccl_seq_word(kccl_flag(kccl_rep_slot(c, c->rank, x->targets[i], set, which))));
  }
}

void kccl_replicas_wake_all(struct kcclComm *c) {
  struct kccl_replicas *x = c->rep;
  if (!x || !c->base || !c->base[c->rank]) return;
  for (int d = 0; d < x->ndomains; d++)
    for (uint32_t set = 0; set < c->nsets; set++)
      for (int which = 0; which < 2; which++) kccl_futex_wake(kccl_seq_word(kccl_flag(kccl_rep_slot(c, c->rank, d, set, which))));
}

void kccl_replicas_free(struct kcclComm *c) {
  if (!c->rep) return;
  free(c->rep->dom);
  free(c->rep);
  c->rep = NULL;
}

kcclResult_t kcclCommTopoInfo(kcclComm_t c, kcclTopoInfo_t *info) {
  if (!kccl_comm_valid(c) || !info)
    return kccl_err(kcclInvalidArgument, "invalid communicator or NULL info");
  memset(info, 0, sizeof *info);
  const struct kccl_replicas *x = c->rep;
  info->ndomains = x ? x->ndomains : 1;
  info->domain = x ? x->mydom : 0;
  info->replicas = x ? x->ntargets : 0;
  info->bound = x ? x->bound : 0;
  info->pushes = x ? x->pushes : 0;
  info->replicaReads = x ? x->reads : 0;
  snprintf(info->note, sizeof info->note, "%s", x ? x->note : "one copy: nothing to bind");
  return kcclSuccess;
}
