/* nonblocking.c - split-phase one-shot all-reduce: kcclAllReduceStart / Wait / Test.
 *
 * Start takes the next step s, copies the input into this rank's slot A of set
 * s % nsets and publishes the flag, exactly as the first half of a blocking
 * one-shot step; Wait does the second half (wait for every peer's flag of s,
 * reduce every slot in rank order into recv).  Steps are shared with the
 * blocking collectives, so peers agree on step numbers whatever mix of calls
 * they make, and a peer calling something else is caught by the signature.
 *
 * Completion is in start order (a FIFO ring in the communicator): the set
 * count argument in internal.h needs "completed s-D before starting s", which
 * an out-of-order completion would break. */
#include <string.h>

#include "internal.h"
#include "replicas.h"

static kccl_nb_op *oldest(struct kcclComm *c) { return &c->nb[c->nb_head]; }

static void pop(struct kcclComm *c) {
  c->nb_head = (c->nb_head + 1) % KCCL_MAX_OUTSTANDING;
  c->nb_count--;
}

/* What every start checks: buffers, overlap (as the blocking all-reduce), room for one more. */
static kcclResult_t start_checks(struct kcclComm *c, const void *sendbuff, void *recvbuff, size_t count, int dt) {
  kccl_call a = {COLL_ALLREDUCE_NB, sendbuff, recvbuff, count, dt, 0, 0, NULL, 0};
  kcclResult_t r = kccl_check_buffers(c, &a);
  if (r != kcclSuccess) return r;
  if (c->nb_count >= (uint32_t)c->cfg.max_outstanding)
    return kccl_err(kcclInvalidUsage, "%u all_reduce_start operations are already outstanding, the most "
                    "KCCL_MAX_OUTSTANDING=%d allows: wait for the oldest first", c->nb_count,
                    c->cfg.max_outstanding);
  return kcclSuccess;
}

/* The ring entry of the next start (counted once the start succeeds). */
static kccl_nb_op *next_op(struct kcclComm *c, uint32_t sig, void *recvbuff, size_t count, int dt, int op) {
  kccl_nb_op *o = &c->nb[(c->nb_head + c->nb_count) % KCCL_MAX_OUTSTANDING];
  memset(o, 0, sizeof *o);
  o->ticket = c->nb_issued + 1;
  o->sig = sig;
  o->recv = recvbuff;
  o->count = count;
  o->dtype = dt;
  o->op = op;
  return o;
}

kcclResult_t kcclAllReduceStart(const void *sendbuff, void *recvbuff, size_t count, kcclDataType_t dt,
                                kcclRedOp_t op, kcclComm_t c, uint64_t *request) {
  if (!request) return kccl_err(kcclInvalidArgument, "request is NULL");
  *request = 0;
  uint32_t sig = 0;
  kcclResult_t r = kccl_enter(c, COLL_ALLREDUCE_NB, count, dt, op, 0, NULL, &sig);
  if (r != kcclSuccess) return r;
  if (c->gpu)
    return kccl_err(kcclInvalidUsage, "a GPU communicator's split-phase all-reduce is stream-ordered: use "
                    "kcclAllReduceStartStream");
  const size_t bytes = count * kccl_dtype_size(dt);
  if ((r = start_checks(c, sendbuff, recvbuff, count, dt)) != kcclSuccess) return r;
  if (bytes > c->slot_bytes)
    return kccl_err(kcclInvalidArgument, "all_reduce_start takes at most KCCL_BUFFER_BYTES = %zu bytes, got %zu "
                    "(use the blocking all_reduce for larger messages)", c->slot_bytes, bytes);
  kccl_nb_op *o = next_op(c, sig, recvbuff, count, dt, op);
  if (c->nranks == 1) { /* nothing to wait for: the result is ready now */
    const void *in[1] = {sendbuff};
    if (sendbuff != recvbuff || op == kcclAvg) kccl_reduce(recvbuff, in, 1, count, dt, op, 1);
  } else {
    uint32_t s = ++c->step;
    c->hdr[c->rank]->call.seq = s;
    uint8_t *mine = kccl_slot(c, c->rank, s % c->nsets, 0);
    if (bytes) kccl_slot_fill(c, kccl_data(mine), sendbuff, bytes);
    kccl_publish_slot(c, s % c->nsets, 0, bytes, s, sig); /* and its replicas (topology placement) */
    o->step = s;
  }
  c->nb_issued = o->ticket;
  c->nb_count++;
  *request = o->ticket;
  return kcclSuccess;
}

/* Reduces the oldest operation once every peer's flag is there; with block = 0
 * it returns kcclInProgress instead of waiting for a flag that is not set yet. */
static kcclResult_t complete_oldest(struct kcclComm *c, int block) {
  kccl_nb_op *o = oldest(c);
  if (c->nranks > 1) {
    const void *in[KCCL_MAX_RANKS];
    const uint32_t set = o->step % c->nsets;
    const size_t bytes = o->count * kccl_dtype_size((kcclDataType_t)o->dtype);
    for (int p = 0; p < c->nranks; p++) {
      in[p] = kccl_peer_data(c, p, set, 0, bytes); /* a replica in this rank's domain, if any */
      if (p == c->rank) continue;
      _Atomic uint64_t *flag = kccl_peer_flag(c, p, set, 0, bytes);
      if (!block && (uint32_t)(atomic_load_explicit(flag, memory_order_acquire) >> 32) != o->step)
        return kcclInProgress;
      /* Returns at once when the flag is set (and checks its signature). */
      kcclResult_t r = kccl_wait_flag(c, p, flag, o->step, o->sig);
      if (r != kcclSuccess) return r;
    }
    kccl_reduce(o->recv, in, c->nranks, o->count, (kcclDataType_t)o->dtype, (kcclRedOp_t)o->op, c->nranks);
  }
  pop(c);
  return kcclSuccess;
}

/* Request checks shared by Wait and Test; *pending: whether it is still outstanding. */
static kcclResult_t check_request(struct kcclComm *c, uint64_t request, int *pending) {
  kcclResult_t r = kccl_comm_check(c);
  if (r != kcclSuccess) return r;
  if (request == 0 || request > c->nb_issued)
    return kccl_err(kcclInvalidArgument, "request %llu was not returned by kcclAllReduceStart on this communicator",
                    (unsigned long long)request);
  *pending = c->nb_count && request >= oldest(c)->ticket;
  return kcclSuccess;
}

static kcclResult_t host_only(struct kcclComm *c, const char *what) {
  if (kccl_comm_valid(c) && c->gpu)
    return kccl_err(kcclInvalidUsage, "%s is the host transport's; a GPU communicator waits on a stream "
                    "(kcclAllReduceWaitStream)", what);
  return kcclSuccess;
}

kcclResult_t kcclAllReduceWait(kcclComm_t c, uint64_t request) {
  int pending = 0;
  kcclResult_t r = host_only(c, "kcclAllReduceWait");
  if (r == kcclSuccess) r = check_request(c, request, &pending);
  while (r == kcclSuccess && pending) {
    if ((r = complete_oldest(c, 1)) == kcclSuccess) pending = c->nb_count && request >= oldest(c)->ticket;
  }
  return r;
}

kcclResult_t kcclAllReduceTest(kcclComm_t c, uint64_t request, int *done) {
  if (!done) return kccl_err(kcclInvalidArgument, "done is NULL");
  *done = 0;
  int pending = 0;
  kcclResult_t r = host_only(c, "kcclAllReduceTest");
  if (r == kcclSuccess) r = check_request(c, request, &pending);
  while (r == kcclSuccess && pending) {
    r = complete_oldest(c, 0);
    if (r == kcclInProgress) {
      /* Not there yet: report a peer that will never deliver, rather than let a
       * polling caller spin forever; the flag is re-read after a bad verdict
       * because a peer may publish and then exit. */
      int64_t now = kccl_now_ns();
      if (now < c->nb_next_check) return kcclSuccess;
      c->nb_next_check = now + 1000000;
      char why[480];
      kccl_nb_op *o = oldest(c);
      kcclResult_t bad = kccl_peer_problem(c, o->step, o->sig, why, sizeof why);
      if (bad == kcclSuccess) return kcclSuccess;
      if ((r = complete_oldest(c, 0)) == kcclInProgress) return kccl_comm_fail(c, bad, "%s", why);
    }
    if (r == kcclSuccess) pending = c->nb_count && request >= oldest(c)->ticket;
  }
  if (r == kcclSuccess) *done = 1;
  return r;
}

/* ----------------------------------------------------- GPU: stream-ordered --
 *
 * A GPU communicator's split phase lives on streams, not on the host: Start
 * forks the communicator's side stream off `stream`, enqueues the ordinary GPU
 * all-reduce there and records slot ticket % KCCL_MAX_OUTSTANDING's done event;
 * Wait makes `stream` wait for that event.  Nothing blocks the host, so both
 * can be captured in a CUDA graph, where they become a branch that joins the
 * main chain where Wait was called.  The side stream runs the collectives in
 * start order, so the one-shot kernels never overlap each other (their epochs
 * are per communicator) and waiting for one also orders every older one.  The
 * signature is the blocking all-reduce's: a peer may mix the two forms. */
_Static_assert(KCCL_MAX_OUTSTANDING == KGPU_SPLIT_SLOTS, "one event pair per outstanding GPU split op");

kcclResult_t kcclAllReduceStartStream(const void *sendbuff, void *recvbuff, size_t count, kcclDataType_t dt,
                                      kcclRedOp_t op, kcclComm_t c, void *stream, uint64_t *request) {
  if (!request) return kccl_err(kcclInvalidArgument, "request is NULL");
  *request = 0;
  if (kccl_comm_valid(c) && !c->gpu) {
    if (stream) return kccl_err(kcclInvalidArgument, "the host transport takes stream=NULL");
    return kcclAllReduceStart(sendbuff, recvbuff, count, dt, op, c, request);
  }
  uint32_t sig = 0;
  kcclResult_t r = kccl_enter(c, COLL_ALLREDUCE_NB, count, dt, op, 0, stream, &sig);
  if (r != kcclSuccess) return r;
  if ((r = start_checks(c, sendbuff, recvbuff, count, dt)) != kcclSuccess) return r;
  const uint64_t ticket = c->nb_issued + 1;
  const int slot = (int)(ticket % KCCL_MAX_OUTSTANDING);
  void *side = NULL;
  if ((r = kgpu_split_fork(c->gpu->kg, slot, stream, &side)) != kcclSuccess) return r;
  sig = kccl_signature(COLL_ALLREDUCE, count, dt, op, 0);
  r = kccl_gpu_collective(c, COLL_ALLREDUCE, sendbuff, recvbuff, count, dt, op, 0, side, sig);
  /* The done event is recorded even after a refused launch, so the side stream's
   * fork is always joined where the caller waits (a capture must not end with an
   * unjoined branch); the request is handed out only on success. */
  kcclResult_t r2 = kgpu_split_done(c->gpu->kg, slot);
  if (r == kcclSuccess) r = r2;
  if (r != kcclSuccess) {
    kgpu_split_join(c->gpu->kg, slot, stream);
    return r;
  }
  kccl_nb_op *o = next_op(c, sig, recvbuff, count, dt, op);
  c->nb_issued = o->ticket;
  c->nb_count++;
  *request = o->ticket;
  return kcclSuccess;
}

kcclResult_t kcclAllReduceWaitStream(kcclComm_t c, uint64_t request, void *stream) {
  if (kccl_comm_valid(c) && !c->gpu) {
    if (stream) return kccl_err(kcclInvalidArgument, "the host transport takes stream=NULL");
    return kcclAllReduceWait(c, request);
  }
  int pending = 0;
  kcclResult_t r = check_request(c, request, &pending);
  if (r != kcclSuccess || !pending) return r;
  if ((r = kccl_gpu_enter(c)) != kcclSuccess) return r;
  if ((r = kgpu_split_join(c->gpu->kg, (int)(request % KCCL_MAX_OUTSTANDING), stream)) != kcclSuccess) return r;
  while (c->nb_count && oldest(c)->ticket <= request) pop(c);
  return kcclSuccess;
}
