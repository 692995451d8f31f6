/* replicas.h - per-domain replicas of flags and small-message slots: the
 * hot-path helpers the collectives call instead of touching slots directly.
 *
 * With replicas off (c->rep == NULL, one domain, KCCL_TOPO=off, or a C caller
 * that gave no placement) every helper is the old single-copy access.  With
 * replicas on, rank w's segment holds, after its main slots, one block per
 * domain d: a copy of each of w's slots (flag + up to rep->data_bytes of
 * data; larger payloads are not replicated), whose pages are bound to d's NUMA node.  A reader in domain d != w's
 * reads w's block d; a reader in w's domain (or a reader whose CPUs span
 * domains, domain -1) reads w's main slot. */
#ifndef KCCL_REPLICAS_H_
#define KCCL_REPLICAS_H_

#include "internal.h"

struct kccl_replicas {
  int ndomains, mydom;
  int *dom;                    /* each rank's domain (-1: spans several), from its header */
  int ntargets;                /* remote domains this rank pushes to ... */
  int targets[KCCL_MAX_DOMAINS]; /* ... (those holding a rank other than this one) */
  int numa[KCCL_MAX_DOMAINS];
  uint64_t hash;
  size_t data_bytes;           /* data a replica slot carries; larger payloads: flag only */
  size_t stride, block_bytes, area_off;
  int bound;
  char note[192];
  uint64_t pushes, reads;
};

/* Replica of slot (set, which) for domain d in rank r's segment. */
static inline uint8_t *kccl_rep_slot(struct kcclComm *c, int r, int d, uint32_t set, int which) {
  const struct kccl_replicas *x = c->rep;
  return c->base[r] + x->area_off + (size_t)d * x->block_bytes + ((size_t)set * 2 + (size_t)which) * x->stride;
}

static inline int kccl_reads_replica(const struct kcclComm *c, int p) {
  return c->rep && c->rep->mydom >= 0 && c->rep->dom[p] != c->rep->mydom;
}

/* The flag of peer p's slot (set, which) this rank polls, for a payload of `bytes`.  A
 * payload larger than a replica travels without replicas (flag included): the reader
 * fetches the writer's first line with the data anyway, so a flag replica would only
 * add a transfer (topology/cost.py). */
static inline _Atomic uint64_t *kccl_peer_flag(struct kcclComm *c, int p, uint32_t set, int which, size_t bytes) {
  if (__builtin_expect(kccl_reads_replica(c, p), 0) && bytes <= c->rep->data_bytes) {
    c->rep->reads++;
    return kccl_flag(kccl_rep_slot(c, p, c->rep->mydom, set, which));
  }
  return kccl_flag(kccl_slot(c, p, set, which));
}

/* Where this rank reads peer p's data of slot (set, which), for a payload of `bytes`. */
static inline uint8_t *kccl_peer_data(struct kcclComm *c, int p, uint32_t set, int which, size_t bytes) {
  if (__builtin_expect(kccl_reads_replica(c, p), 0) && bytes <= c->rep->data_bytes)
    return kccl_data(kccl_rep_slot(c, p, c->rep->mydom, set, which));
  return kccl_data(kccl_slot(c, p, set, which));
}

/* replicas.c: publish own slot (set, which), whose first `bytes` of data are written. */
void kccl_publish_replicated(struct kcclComm *c, uint32_t set, int which, size_t bytes, uint32_t seq, uint32_t sig);

#endif
