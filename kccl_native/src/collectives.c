/* collectives.c - all-reduce (one-shot and two-shot), all-gather,
 * reduce-scatter, broadcast and barrier over the mapped segments.
 *
 * Every collective is a sequence of steps.  In step s each rank writes its
 * part into its slot of buffer set s % nsets, publishes flag = s << 32 | sig, and
 * waits for every peer's flag of step s before it leaves the step: a rank in
 * step s+1 therefore knows every peer has left step s-1, whose set it reuses.
 * `sig` hashes the call's arguments, so a peer that called something else is
 * noticed at the first step, before any data is combined. */
#include <string.h>
#include <time.h>

#include "internal.h"
#include "replicas.h"

uint32_t kccl_signature(int coll, size_t count, int dtype, int op, int root) {
  uint64_t h = (uint64_t)count * 0x9e3779b97f4a7c15ull;
  h ^= ((uint64_t)coll << 48) ^ ((uint64_t)(uint32_t)dtype << 40) ^ ((uint64_t)(uint32_t)op << 32) ^
       (uint64_t)(uint32_t)root;
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 29;
  return (uint32_t)h ^ (uint32_t)(h >> 32);
}

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

/* [a, a+an) and [b, b+bn) overlap? */
static int overlap(const void *a, size_t an, const void *b, size_t bn) {
  const char *x = a, *y = b;
  return an && bn && x < y + bn && y < x + an;
}

/* Checks shared by every collective; returns the call signature in *sig. */
static kcclResult_t enter(struct kcclComm *c, int coll, size_t count, int dtype, int op, int root,
                          void *stream, uint32_t *sig) {
  if (!c || c->magic != KCCL_COMM_MAGIC) return kccl_err(kcclInvalidArgument, "invalid communicator");
  if (c->error != kcclSuccess)
    return kccl_err(kcclInvalidUsage, "communicator is unusable after an earlier error (%s); create a new one",
                    c->hdr[c->rank]->error_text);
  if (c->gpu) {
    kcclResult_t r = kccl_gpu_enter(c);
    if (r != kcclSuccess) return r;
  } else if (stream) {
    return kccl_err(kcclInvalidArgument, "the host transport takes stream=NULL");
  }
  /* A blocking step would wait for peers that are still inside older split-phase steps
   * and reuse sets those may still read (nonblocking.c). */
  if (coll != COLL_ALLREDUCE_NB && c->nb_count)
    return kccl_err(kcclInvalidUsage, "%s called while %u all_reduce_start operation(s) are outstanding: "
                    "wait for them first", kccl_coll_name(coll), c->nb_count);
  if (dtype < 0 || dtype >= kcclNumTypes) return kccl_err(kcclInvalidArgument, "unknown data type %d", dtype);
  if (op < 0 || op >= kcclNumOps) return kccl_err(kcclInvalidArgument, "unknown reduction op %d", op);
  if (root < 0 || root >= c->nranks)
    return kccl_err(kcclInvalidArgument, "root=%d out of range for %d ranks", root, c->nranks);
  if (count > ((size_t)1 << 56) / 8) return kccl_err(kcclInvalidArgument, "count=%zu is too large", count);
  kccl_call_desc *d = &c->hdr[c->rank]->call;
  d->coll = (uint32_t)coll;
  d->dtype = (uint32_t)dtype;
  d->op = (uint32_t)op;
  d->root = (uint32_t)root;
  d->count = count; /* d->seq is set by each step (begin_step) */
  *sig = kccl_signature(coll, count, dtype, op, root);
  return kcclSuccess;
}

kcclResult_t kccl_enter(struct kcclComm *c, int coll, size_t count, int dtype, int op, int root,
                        void *stream, uint32_t *sig) {
  return enter(c, coll, count, dtype, op, root, stream, sig);
}

/* Publishes this rank's flag for step s in slot A of set s%2. */
static inline uint32_t begin_step(struct kcclComm *c, uint8_t **mine) {
  uint32_t s = ++c->step;
  c->hdr[c->rank]->call.seq = s;
  *mine = kccl_slot(c, c->rank, s % c->nsets, 0);
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
  const size_t chunk = c->slot_bytes / es;
  size_t off = 0;
  do {
    size_t n = min_sz(chunk, count - off);
    uint8_t *mine;
    uint32_t s = begin_step(c, &mine);
    memcpy(kccl_data(mine), send + off * es, n * es);
    kccl_publish_slot(c, s % c->nsets, 0, n * es, s, sig);
    for (int p = 0; p < c->nranks; p++) {
      if (p != c->rank) {
        kcclResult_t r = kccl_wait_flag(c, p, kccl_peer_flag(c, p, s % c->nsets, 0, n * es), s, sig);
        if (r != kcclSuccess) return r;
      }
      in[p] = kccl_peer_data(c, p, s % c->nsets, 0, n * es); /* own data from the slot too: safe in place */
    }
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

/* Reduce-scatter then all-gather inside each chunk: slot A carries the inputs,
 * slot B each rank's reduced share. */
static kcclResult_t allreduce_twoshot(struct kcclComm *c, const char *send, char *recv, size_t count,
                                      size_t es, kcclDataType_t dt, kcclRedOp_t op, uint32_t sig) {
  const void *in[KCCL_MAX_RANKS];
  const size_t chunk = c->slot_bytes / es;
  size_t off = 0;
  do {
    size_t n = min_sz(chunk, count - off), lo, hi;
    uint8_t *mine;
    uint32_t s = begin_step(c, &mine);
    const uint32_t set = s % c->nsets;
    memcpy(kccl_data(mine), send + off * es, n * es);
    kccl_publish_slot(c, set, 0, n * es, s, sig);
    kcclResult_t r = wait_all(c, s, sig, 0, n * es, -1, 0);
    if (r != kcclSuccess) return r;
    share(n, es, c->nranks, c->rank, &lo, &hi);
    for (int p = 0; p < c->nranks; p++) in[p] = kccl_peer_data(c, p, set, 0, n * es) + lo * es;
    uint8_t *myb = kccl_slot(c, c->rank, set, 1);
    kccl_reduce(kccl_data(myb), in, c->nranks, hi - lo, dt, op, c->nranks);
    kccl_publish_slot(c, set, 1, (hi - lo) * es, s, sig);
    memcpy(recv + (off + lo) * es, kccl_data(myb), (hi - lo) * es);
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

kcclResult_t kcclAllReduce(const void *sendbuff, void *recvbuff, size_t count, kcclDataType_t dt,
                           kcclRedOp_t op, kcclComm_t c, void *stream) {
  uint32_t sig = 0;
  kcclResult_t r = enter(c, COLL_ALLREDUCE, count, dt, op, 0, stream, &sig);
  if (r != kcclSuccess) return r;
  size_t es = kccl_dtype_size(dt), bytes = count * es;
  if (count && (!sendbuff || !recvbuff)) return kccl_err(kcclInvalidArgument, "NULL buffer with count=%zu", count);
  if (sendbuff != recvbuff && overlap(sendbuff, bytes, recvbuff, bytes))
    return kccl_err(kcclInvalidArgument, "send and recv buffers partly overlap (in place needs send == recv)");
  if (c->gpu) return kccl_gpu_collective(c, COLL_ALLREDUCE, sendbuff, recvbuff, count, dt, op, 0, stream, sig);
  if (c->nranks == 1) {
    const void *in[1] = {sendbuff};
    if (sendbuff != recvbuff || op == kcclAvg) kccl_reduce(recvbuff, in, 1, count, dt, op, 1);
    return kcclSuccess;
  }
  int algo = c->cfg.algo;
  if (algo == kcclAlgoAuto) algo = bytes <= c->cfg.oneshot_max_bytes ? kcclAlgoOneShot : kcclAlgoTwoShot;
  if (algo == kcclAlgoTwoShot) {
    c->hdr[c->rank]->call.coll = COLL_ALLREDUCE_2SHOT;
    sig = kccl_signature(COLL_ALLREDUCE_2SHOT, count, dt, op, 0);
  }
  return algo == kcclAlgoOneShot ? allreduce_oneshot(c, sendbuff, recvbuff, count, es, dt, op, sig)
                                 : allreduce_twoshot(c, sendbuff, recvbuff, count, es, dt, op, sig);
}

kcclResult_t kcclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, kcclDataType_t dt,
                           kcclComm_t c, void *stream) {
  uint32_t sig = 0;
  kcclResult_t r = enter(c, COLL_ALLGATHER, sendcount, dt, 0, 0, stream, &sig);
  if (r != kcclSuccess) return r;
  const size_t es = kccl_dtype_size(dt), bytes = sendcount * es;
  const char *send = sendbuff;
  char *recv = recvbuff;
  if (sendcount && (!send || !recv)) return kccl_err(kcclInvalidArgument, "NULL buffer with count=%zu", sendcount);
  char *myout = recv + (size_t)c->rank * bytes;
  int inplace = send == myout;
  if (!inplace && overlap(send, bytes, recv, bytes * (size_t)c->nranks))
    return kccl_err(kcclInvalidArgument, "send overlaps recv (in place needs send == recv + rank*count)");
  if (c->gpu) return kccl_gpu_collective(c, COLL_ALLGATHER, send, recv, sendcount, dt, 0, 0, stream, sig);
  if (c->nranks == 1) {
    if (!inplace && bytes) memcpy(recv, send, bytes);
    return kcclSuccess;
  }
  const size_t chunk = c->slot_bytes / es;
  size_t off = 0;
  do {
    size_t n = min_sz(chunk, sendcount - off);
    uint8_t *mine;
    uint32_t s = begin_step(c, &mine);
    memcpy(kccl_data(mine), send + off * es, n * es);
    kccl_publish_slot(c, s % c->nsets, 0, n * es, s, sig);
    /* Every peer's signature is checked before recv is touched. */
    if ((r = wait_all(c, s, sig, 0, n * es, -1, 0)) != kcclSuccess) return r;
    if (!inplace) memcpy(myout + off * es, send + off * es, n * es);
    for (int i = 1; i < c->nranks; i++) {
      int p = (c->rank + i) % c->nranks;
      memcpy(recv + (size_t)p * bytes + off * es, kccl_peer_data(c, p, s % c->nsets, 0, n * es), n * es);
    }
    off += n;
  } while (off < sendcount);
  return kcclSuccess;
}

kcclResult_t kcclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, kcclDataType_t dt,
                               kcclRedOp_t op, kcclComm_t c, void *stream) {
  uint32_t sig = 0;
  kcclResult_t r = enter(c, COLL_REDUCESCATTER, recvcount, dt, op, 0, stream, &sig);
  if (r != kcclSuccess) return r;
  const size_t es = kccl_dtype_size(dt), bytes = recvcount * es;
  const char *send = sendbuff;
  char *recv = recvbuff;
  if (recvcount && (!send || !recv)) return kccl_err(kcclInvalidArgument, "NULL buffer with count=%zu", recvcount);
  int inplace = recv == send + (size_t)c->rank * bytes;
  if (!inplace && overlap(send, bytes * (size_t)c->nranks, recv, bytes))
    return kccl_err(kcclInvalidArgument, "recv overlaps send (in place needs recv == send + rank*count)");
  if (c->gpu) return kccl_gpu_collective(c, COLL_REDUCESCATTER, send, recv, recvcount, dt, op, 0, stream, sig);
  const void *in[KCCL_MAX_RANKS];
  if (c->nranks == 1) {
    in[0] = send;
    if (!inplace || op == kcclAvg) kccl_reduce(recv, in, 1, recvcount, dt, op, 1);
    return kcclSuccess;
  }
  const size_t chunk = c->slot_bytes / es / (size_t)c->nranks;
  size_t off = 0;
  do {
    size_t n = min_sz(chunk, recvcount - off);
    uint8_t *mine;
    uint32_t s = begin_step(c, &mine);
    for (int q = 0; q < c->nranks; q++)
      memcpy(kccl_data(mine) + (size_t)q * n * es, send + ((size_t)q * recvcount + off) * es, n * es);
    kccl_publish_slot(c, s % c->nsets, 0, (size_t)c->nranks * n * es, s, sig);
    if ((r = wait_all(c, s, sig, 0, (size_t)c->nranks * n * es, -1, 0)) != kcclSuccess) return r;
    for (int p = 0; p < c->nranks; p++)
      in[p] = kccl_peer_data(c, p, s % c->nsets, 0, (size_t)c->nranks * n * es) + (size_t)c->rank * n * es;
    kccl_reduce(recv + off * es, in, c->nranks, n, dt, op, c->nranks);
    off += n;
  } while (off < recvcount);
  return kcclSuccess;
}

kcclResult_t kcclBroadcast(const void *sendbuff, void *recvbuff, size_t count, kcclDataType_t dt, int root,
                           kcclComm_t c, void *stream) {
  uint32_t sig = 0;
  kcclResult_t r = enter(c, COLL_BROADCAST, count, dt, 0, root, stream, &sig);
  if (r != kcclSuccess) return r;
  const size_t es = kccl_dtype_size(dt), bytes = count * es;
  const char *send = sendbuff;
  char *recv = recvbuff;
  const int am_root = c->rank == root;
  if (count && (!recv || (am_root && !send)))
    return kccl_err(kcclInvalidArgument, "NULL buffer with count=%zu", count);
  if (am_root && send != recv && overlap(send, bytes, recv, bytes))
    return kccl_err(kcclInvalidArgument, "send and recv buffers partly overlap (in place needs send == recv)");
  if (c->gpu) return kccl_gpu_collective(c, COLL_BROADCAST, send, recv, count, dt, 0, root, stream, sig);
  if (c->nranks == 1) {
    if (send != recv && bytes) memcpy(recv, send, bytes);
    return kcclSuccess;
  }
  const size_t chunk = c->slot_bytes / es;
  size_t off = 0;
  do {
    size_t n = min_sz(chunk, count - off);
    uint8_t *mine;
    uint32_t s = begin_step(c, &mine);
    if (am_root) memcpy(kccl_data(mine), send + off * es, n * es);
    kccl_publish_slot(c, s % c->nsets, 0, am_root ? n * es : 0, s, sig); /* non-roots: "arrived" */
    if ((r = wait_all(c, s, sig, 0, 0, root, n * es)) != kcclSuccess) return r;
    if (am_root && send != recv) memcpy(recv + off * es, send + off * es, n * es);
    if (!am_root) memcpy(recv + off * es, kccl_peer_data(c, root, s % c->nsets, 0, n * es), n * es);
    off += n;
  } while (off < count);
  return kcclSuccess;
}

kcclResult_t kcclBarrier(kcclComm_t c, void *stream) {
  uint32_t sig = 0;
  kcclResult_t r = enter(c, COLL_BARRIER, 0, 0, 0, 0, stream, &sig);
  if (r == kcclSuccess && c->gpu) return kccl_gpu_collective(c, COLL_BARRIER, NULL, NULL, 0, 0, 0, 0, stream, sig);
  if (r != kcclSuccess || c->nranks == 1) return r;
  uint8_t *mine;
  uint32_t s = begin_step(c, &mine);
  kccl_publish_slot(c, s % c->nsets, 0, 0, s, sig);
  return wait_all(c, s, sig, 0, 0, -1, 0);
}
