/* host.c - the host transport: all-reduce (one-shot and two-shot), all-gather,
 * reduce-scatter, broadcast and barrier over the mapped segments.
 *
 * Every collective is a sequence of steps.  In step s each rank writes its
 * part into its slot of buffer set s % nsets, publishes flag = s << 32 | sig, and
 * waits for every peer's flag of step s before it leaves the step: a rank in
 * step s+1 therefore knows every peer has left step s-1, whose set it reuses.
 * `sig` hashes the call's arguments, so a peer that called something else is
 * noticed at the first step, before any data is combined.
 *
 * The calls arrive checked (collectives.c): known types and ops, buffers given
 * and overlapping only in place. */
#include <string.h>

#include "internal.h"
#include "replicas.h"

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

/* Publishes this rank's flag for step s in slot A of set s%2. */
static inline uint32_t begin_step(struct kcclComm *c, uint8_t **mine) {
  uint32_t s = ++c->step;
  c->hdr[c->rank]->call.seq = s;
  *mine = kccl_slot(c, c->rank, s % c->nsets, 0);
  return s;
}

/* Starts a step with `bytes` of src in this rank's slot A, published; returns the step. */
static inline uint32_t publish_chunk(struct kcclComm *c, const void *src, size_t bytes, uint32_t sig) {
  uint8_t *mine;
  uint32_t s = begin_step(c, &mine);
  kccl_slot_fill(c, kccl_data(mine), src, bytes);
  kccl_publish_slot(c, s % c->nsets, 0, bytes, s, sig);
  return s;
}

/* Waits for every peer's flag of step s; `bytes` is what each peer published (the
 * root, if root >= 0, published root_bytes): it says whether a replica carries it. */
static kcclResult_t wait_all(struct kcclComm *c, uint32_t s, uint32_t sig, int which, size_t bytes, int root,
                             size_t root_bytes) {
  for (int p = 0; p < c->nranks; p++) {
    if (p == c->rank) continue;
    size_t b = p == root ? root_bytes : bytes;
    kcclResult_t r = kccl_wait_flag(c, p, kccl_peer_flag(c, p, s % c->nsets, which, b), s, sig);
    if (r != kcclSuccess) return r;
  }
  return kcclSuccess;
}

static kcclResult_t allreduce_oneshot(struct kcclComm *c, const char *send, char *recv, size_t count,
                                      size_t es, kcclDataType_t dt, kcclRedOp_t op, uint32_t sig) {
  const void *in[KCCL_MAX_RANKS];
  const size_t chunk = c->chunk_bytes / es;
  size_t off = 0;
  do {
    size_t n = min_sz(chunk, count - off);
    uint32_t s = publish_chunk(c, send + off * es, n * es, sig);
    kcclResult_t r = wait_all(c, s, sig, 0, n * es, -1, 0);
    if (r != kcclSuccess) return r;
    /* own data from the slot too: safe in place */
    for (int p = 0; p < c->nranks; p++) in[p] = kccl_peer_data(c, p, s % c->nsets, 0, n * es);
    kccl_reduce(recv + off * es, in, c->nranks, n, dt, op, c->nranks);
    off += n;
  } while (off < count);
  return kcclSuccess;
}

/* This rank's share [lo, hi) of an n-element chunk, in 64-byte multiples. */
static void share(size_t n, size_t es, int nranks, int r, size_t *lo, size_t *hi) {
  size_t per_line = KCCL_LINE / es;
  size_t part = (n + (size_t)nranks - 1) / (size_t)nranks;
  part = (part + per_line - 1) / per_line * per_line;
  *lo = min_sz(n, (size_t)r * part);
  *hi = min_sz(n, *lo + part);
}

/* Reduce-scatter then all-gather inside each piece: slot A carries the parts of the
 * input the peers reduce, slot B each rank's reduced share.  A rank's own share goes from
 * its send buffer straight into the reduction and is never copied into its slot: that
 * saves a copy of 1/nranks of the message and keeps slot A's hole out of the caches.  In
 * place this is safe: the own share of `send` is read only by the reduction, before the
 * result overwrites it, and the other shares are copied out before any peer's result
 * lands there. */
static kcclResult_t allreduce_twoshot(struct kcclComm *c, const char *send, char *recv, size_t count,
                                      size_t es, kcclDataType_t dt, kcclRedOp_t op, uint32_t sig) {
  const void *in[KCCL_MAX_RANKS];
  const size_t chunk = c->chunk_bytes / es;
  size_t off = 0;
  do {
    size_t n = min_sz(chunk, count - off), lo, hi;
    share(n, es, c->nranks, c->rank, &lo, &hi);
    uint8_t *mine;
    uint32_t s = begin_step(c, &mine);
    const uint32_t set = s % c->nsets;
    kccl_slot_fill(c, kccl_data(mine), send + off * es, lo * es);
    kccl_slot_fill(c, kccl_data(mine) + hi * es, send + (off + hi) * es, (n - hi) * es);
    kccl_publish_slot(c, set, 0, n * es, s, sig);
    kcclResult_t r = wait_all(c, s, sig, 0, n * es, -1, 0);
    if (r != kcclSuccess) return r;
    for (int p = 0; p < c->nranks; p++)
      in[p] = p == c->rank ? (const void *)(send + (off + lo) * es)
                           : (const void *)(kccl_peer_data(c, p, set, 0, n * es) + lo * es);
    kccl_slot_reduce(c, kccl_data(kccl_slot(c, c->rank, set, 1)), recv + (off + lo) * es, in, c->nranks, hi - lo,
                     dt, op);
    kccl_publish_slot(c, set, 1, (hi - lo) * es, s, sig);
    for (int i = 1; i < c->nranks; i++) { /* start with the next rank: spreads the readers */
      int p = (c->rank + i) % c->nranks;
      share(n, es, c->nranks, p, &lo, &hi);
      if ((r = kccl_wait_flag(c, p, kccl_peer_flag(c, p, set, 1, (hi - lo) * es), s, sig)) != kcclSuccess) return r;
      memcpy(recv + (off + lo) * es, kccl_peer_data(c, p, set, 1, (hi - lo) * es), (hi - lo) * es);
    }
    off += n;
  } while (off < count);
  return kcclSuccess;
}

static kcclResult_t allreduce(struct kcclComm *c, const kccl_call *a) {
  const void *sendbuff = a->send;
  void *recvbuff = a->recv;
  const size_t count = a->count;
  const kcclDataType_t dt = (kcclDataType_t)a->dtype;
  const kcclRedOp_t op = (kcclRedOp_t)a->op;
  uint32_t sig = a->sig;
  size_t es = kccl_dtype_size(dt), bytes = count * es;
  if (c->nranks == 1) {
    const void *in[1] = {sendbuff};
    if (sendbuff != recvbuff || op == kcclAvg) kccl_reduce(recvbuff, in, 1, count, dt, op, 1);
    return kcclSuccess;
  }
  int algo = kccl_allreduce_algo(&c->cfg, bytes, c->cfg.oneshot_max_bytes);
  if (algo == kcclAlgoTwoShot) {
    c->hdr[c->rank]->call.coll = COLL_ALLREDUCE_2SHOT;
    sig = kccl_signature(COLL_ALLREDUCE_2SHOT, count, dt, op, 0);
  }
  return algo == kcclAlgoOneShot ? allreduce_oneshot(c, sendbuff, recvbuff, count, es, dt, op, sig)
                                 : allreduce_twoshot(c, sendbuff, recvbuff, count, es, dt, op, sig);
}

static kcclResult_t allgather(struct kcclComm *c, const kccl_call *a) {
  const size_t sendcount = a->count, es = kccl_dtype_size((kcclDataType_t)a->dtype), bytes = sendcount * es;
  const uint32_t sig = a->sig;
  const char *send = a->send;
  char *recv = a->recv;
  char *myout = recv + (size_t)c->rank * bytes;
  int inplace = send == myout;
  if (c->nranks == 1) {
    if (!inplace && bytes) memcpy(recv, send, bytes);
    return kcclSuccess;
  }
  const size_t chunk = c->chunk_bytes / es;
  size_t off = 0;
  do {
    size_t n = min_sz(chunk, sendcount - off);
    uint32_t s = publish_chunk(c, send + off * es, n * es, sig);
    /* Every peer's signature is checked before recv is touched. */
    kcclResult_t r = wait_all(c, s, sig, 0, n * es, -1, 0);
    if (r != kcclSuccess) return r;
    if (!inplace) memcpy(myout + off * es, send + off * es, n * es);
    for (int i = 1; i < c->nranks; i++) {
      int p = (c->rank + i) % c->nranks;
      memcpy(recv + (size_t)p * bytes + off * es, kccl_peer_data(c, p, s % c->nsets, 0, n * es), n * es);
    }
    off += n;
  } while (off < sendcount);
  return kcclSuccess;
}

static kcclResult_t reduce_scatter(struct kcclComm *c, const kccl_call *a) {
  const size_t recvcount = a->count, es = kccl_dtype_size((kcclDataType_t)a->dtype), bytes = recvcount * es;
  const kcclDataType_t dt = (kcclDataType_t)a->dtype;
  const kcclRedOp_t op = (kcclRedOp_t)a->op;
  const uint32_t sig = a->sig;
  const char *send = a->send;
  char *recv = a->recv;
  int inplace = recv == send + (size_t)c->rank * bytes;
  const void *in[KCCL_MAX_RANKS];
  if (c->nranks == 1) {
    in[0] = send;
    if (!inplace || op == kcclAvg) kccl_reduce(recv, in, 1, recvcount, dt, op, 1);
    return kcclSuccess;
  }
  const size_t chunk = c->chunk_bytes / es / (size_t)c->nranks;
  size_t off = 0;
  do {
    size_t n = min_sz(chunk, recvcount - off);
    uint8_t *mine;
    uint32_t s = begin_step(c, &mine);
    for (int q = 0; q < c->nranks; q++)
      kccl_slot_fill(c, kccl_data(mine) + (size_t)q * n * es, send + ((size_t)q * recvcount + off) * es, n * es);
    kccl_publish_slot(c, s % c->nsets, 0, (size_t)c->nranks * n * es, s, sig);
    kcclResult_t r = wait_all(c, s, sig, 0, (size_t)c->nranks * n * es, -1, 0);
    if (r != kcclSuccess) return r;
    for (int p = 0; p < c->nranks; p++)
      in[p] = kccl_peer_data(c, p, s % c->nsets, 0, (size_t)c->nranks * n * es) + (size_t)c->rank * n * es;
    kccl_reduce(recv + off * es, in, c->nranks, n, dt, op, c->nranks);
    off += n;
  } while (off < recvcount);
  return kcclSuccess;
}

static kcclResult_t broadcast(struct kcclComm *c, const kccl_call *a) {
  const size_t count = a->count, es = kccl_dtype_size((kcclDataType_t)a->dtype), bytes = count * es;
  const int root = a->root;
  const uint32_t sig = a->sig;
  const char *send = a->send;
  char *recv = a->recv;
  const int am_root = c->rank == root;
  if (c->nranks == 1) {
    if (send != recv && bytes) memcpy(recv, send, bytes);
    return kcclSuccess;
  }
  const size_t chunk = c->chunk_bytes / es;
  size_t off = 0;
  do {
    size_t n = min_sz(chunk, count - off);
    uint8_t *mine;
    uint32_t s = begin_step(c, &mine);
    if (am_root) kccl_slot_fill(c, kccl_data(mine), send + off * es, n * es);
    kccl_publish_slot(c, s % c->nsets, 0, am_root ? n * es : 0, s, sig); /* non-roots: "arrived" */
    kcclResult_t r = wait_all(c, s, sig, 0, 0, root, n * es);
    if (r != kcclSuccess) return r;
    if (am_root && send != recv) memcpy(recv + off * es, send + off * es, n * es);
    if (!am_root) memcpy(recv + off * es, kccl_peer_data(c, root, s % c->nsets, 0, n * es), n * es);
    off += n;
  } while (off < count);
  return kcclSuccess;
}

static kcclResult_t barrier(struct kcclComm *c, const kccl_call *a) {
  if (c->nranks == 1) return kcclSuccess;
  uint8_t *mine;
  uint32_t s = begin_step(c, &mine);
  kccl_publish_slot(c, s % c->nsets, 0, 0, s, a->sig);
  return wait_all(c, s, a->sig, 0, 0, -1, 0);
}

static kcclResult_t host_enter(struct kcclComm *c, void *stream) {
  (void)c;
  if (stream) return kccl_err(kcclInvalidArgument, "the host transport takes stream=NULL");
  return kcclSuccess;
}

static kcclResult_t host_run(struct kcclComm *c, const kccl_call *a) {
  switch (a->coll) {
    case COLL_ALLREDUCE: return allreduce(c, a);
    case COLL_ALLGATHER: return allgather(c, a);
    case COLL_REDUCESCATTER: return reduce_scatter(c, a);
    case COLL_BROADCAST: return broadcast(c, a);
    case COLL_BARRIER: return barrier(c, a);
    default: return kccl_err(kcclInternalError, "unknown collective %d", a->coll);
  }
}

const struct kccl_transport kccl_host_transport = {host_enter, host_run};
