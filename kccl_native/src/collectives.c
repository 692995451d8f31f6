/* collectives.c - the public collectives: the checks every call starts with,
 * written once, then the communicator's transport (host.c or gpu_host.c).
 * The split-phase all-reduce (nonblocking.c) uses the same checks. */
#include "internal.h"

/* [a, a+an) and [b, b+bn) overlap? */
static int overlap(const void *a, size_t an, const void *b, size_t bn) {
  const char *x = a, *y = b;
  return an && bn && x < y + bn && y < x + an;
}

kcclResult_t kccl_enter(struct kcclComm *c, int coll, size_t count, int dtype, int op, int root,
                        void *stream, uint32_t *sig) {
  kcclResult_t r = kccl_comm_check(c);
  if (r == kcclSuccess) r = c->tp->enter(c, stream);
  if (r != kcclSuccess) return r;
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

kcclResult_t kccl_check_buffers(const struct kcclComm *c, const kccl_call *a) {
  const size_t bytes = a->count * kccl_dtype_size((kcclDataType_t)a->dtype);
  const char *send = a->send, *recv = a->recv;
  switch (a->coll) {
    case COLL_ALLREDUCE:
    case COLL_ALLREDUCE_NB:
      if (a->count && (!send || !recv)) return kccl_err(kcclInvalidArgument, "NULL buffer with count=%zu", a->count);
      if (send != recv && overlap(send, bytes, recv, bytes))
        return kccl_err(kcclInvalidArgument, "send and recv buffers partly overlap (in place needs send == recv)");
      return kcclSuccess;
    case COLL_ALLGATHER:
      if (a->count && (!send || !recv)) return kccl_err(kcclInvalidArgument, "NULL buffer with count=%zu", a->count);
      if (send != recv + (size_t)c->rank * bytes && overlap(send, bytes, recv, bytes * (size_t)c->nranks))
        return kccl_err(kcclInvalidArgument, "send overlaps recv (in place needs send == recv + rank*count)");
      return kcclSuccess;
    case COLL_REDUCESCATTER:
      if (a->count && (!send || !recv)) return kccl_err(kcclInvalidArgument, "NULL buffer with count=%zu", a->count);
      if (recv != send + (size_t)c->rank * bytes && overlap(send, bytes * (size_t)c->nranks, recv, bytes))
        return kccl_err(kcclInvalidArgument, "recv overlaps send (in place needs recv == send + rank*count)");
      return kcclSuccess;
    case COLL_BROADCAST: {
      const int am_root = c->rank == a->root;
      if (a->count && (!recv || (am_root && !send)))
        return kccl_err(kcclInvalidArgument, "NULL buffer with count=%zu", a->count);
      if (am_root && send != recv && overlap(send, bytes, recv, bytes))
        return kccl_err(kcclInvalidArgument, "send and recv buffers partly overlap (in place needs send == recv)");
      return kcclSuccess;
    }
    default:
      return kcclSuccess;
  }
}

/* Every blocking collective: the shared checks, then the transport. */
static kcclResult_t collective(struct kcclComm *c, kccl_call *a) {
  kcclResult_t r = kccl_enter(c, a->coll, a->count, a->dtype, a->op, a->root, a->stream, &a->sig);
  if (r == kcclSuccess) r = kccl_check_buffers(c, a);
  if (r == kcclSuccess) r = c->tp->run(c, a);
  if (kccl_comm_valid(c)) c->long_wait = 0; /* the hint is for one collective (run or refused) */
  return r;
}

kcclResult_t kcclAllReduce(const void *sendbuff, void *recvbuff, size_t count, kcclDataType_t dt,
                           kcclRedOp_t op, kcclComm_t c, void *stream) {
  kccl_call a = {COLL_ALLREDUCE, sendbuff, recvbuff, count, dt, op, 0, stream, 0};
  return collective(c, &a);
}

kcclResult_t kcclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, kcclDataType_t dt,
                           kcclComm_t c, void *stream) {
  kccl_call a = {COLL_ALLGATHER, sendbuff, recvbuff, sendcount, dt, 0, 0, stream, 0};
  return collective(c, &a);
}

kcclResult_t kcclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, kcclDataType_t dt,
                               kcclRedOp_t op, kcclComm_t c, void *stream) {
  kccl_call a = {COLL_REDUCESCATTER, sendbuff, recvbuff, recvcount, dt, op, 0, stream, 0};
  return collective(c, &a);
}

kcclResult_t kcclBroadcast(const void *sendbuff, void *recvbuff, size_t count, kcclDataType_t dt, int root,
                           kcclComm_t c, void *stream) {
  kccl_call a = {COLL_BROADCAST, sendbuff, recvbuff, count, dt, 0, root, stream, 0};
  return collective(c, &a);
}

kcclResult_t kcclBarrier(kcclComm_t c, void *stream) {
  kccl_call a = {COLL_BARRIER, NULL, NULL, 0, 0, 0, 0, stream, 0};
  return collective(c, &a);
}
