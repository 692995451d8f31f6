/* p2p.c - point-to-point over the segments: kcclSend / kcclRecv, their split phase,
 * and the progress that moves every outstanding operation.
 *
 * Area (in every host segment, from c->p2p_off, page aligned):
 *   one line: this rank's doorbell {bell, sleeping} (see wait_request)
 *   one line per rank p: `taken`, how many pieces of p's stream to this rank it has read
 *   one ring per peer p (rank order, this rank left out): KCCL_P2P_BYTES in P2P_SLOTS
 *     slots, each a header line {flag, tag, first, message bytes, offset} and data.
 * The stream from w to p is a sequence of pieces numbered 1, 2, ... (32 bits,
 * wrapping); piece s lives in slot s % P2P_SLOTS of w's ring for p.  The sender
 * writes a piece only when p's `taken` for w is at least s - P2P_SLOTS (the slot
 * is free), fills the data and header, then publishes flag = s << 32 | piece bytes
 * (release).  The receiver reads the slot once the flag's high half is s
 * (acquire), copies the data out, then publishes taken = s.  So each slot has one
 * writer and one reader at a time and no step needs more than those two flags.
 *
 * Matching.  The first piece of a message carries its tag and byte count.  The
 * message at the head of w's stream goes to the oldest posted receive from w (or
 * from any source) with that tag.  When none matches, the message stays in the
 * ring (back-pressure, no memory) unless a receive from w or any source is
 * waiting behind it; then it is read into a private buffer ("unexpected"), where a
 * later receive for its tag finds it.  Messages from one sender are therefore
 * matched in the order they were sent, as MPI and gloo do. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define P2P_SLOTS 4

typedef struct {
  _Atomic uint64_t flag; /* piece << 32 | bytes of this piece */
  int32_t tag;
  uint32_t first;        /* 1 on a message's first piece */
  uint64_t msg_bytes;
  uint64_t offset;       /* of this piece in the message */
} p2p_slot_head;

typedef struct {
  _Atomic uint32_t bell;     /* bumped by a peer that published something for this rank while it slept */
  _Atomic uint32_t sleeping; /* 1 while this rank may be asleep on bell */
} p2p_doorbell;

typedef struct p2p_req {
  uint64_t id;
  int send;             /* 1 send, 0 receive */
  int peer;             /* a receive's is KCCL_ANY_SOURCE until matched, then the sender */
  int32_t tag;
  uint8_t *buf;
  size_t bytes, done;
  int queued;           /* send: published its first piece; receive: matched to a message */
  int complete;
  kcclResult_t error;
  struct p2p_req *next; /* in a peer's send queue or the posted-receive list */
  struct p2p_req *live; /* every request not yet reported by Wait / Test */
} p2p_req;

typedef struct unexpected {
  int32_t tag;
  size_t bytes, done;
  uint64_t order;       /* arrival order over all peers, for KCCL_ANY_SOURCE */
  uint8_t *data;
  struct unexpected *next;
} unexpected;

/* What the piece stream from a peer is delivering now: a message's pieces go to a matched
 * receive or to an unexpected buffer until `bytes` have arrived. */
typedef struct {
  p2p_req *req;
  unexpected *unx;
  size_t bytes, done;
} incoming;

typedef struct {
  p2p_req *head, *tail;
} req_queue;

struct kccl_p2p {
  size_t ring_bytes, stride, slot_data;
  size_t taken_off, rings_off; /* from p2p_off */
  uint32_t *sent;       /* per peer: last piece published to it */
  uint32_t *read;       /* per peer: last piece read from it */
  req_queue *sendq;     /* per peer, in start order */
  req_queue posted;     /* receives not yet matched, in start order */
  int *posted_for;      /* per peer: posted receives naming it */
  int posted_any;       /* posted receives from any source */
  incoming *in;         /* per peer */
  unexpected **unx;     /* per peer, arrival order */
  uint64_t arrivals;
  p2p_req *live;
  int outstanding;      /* started and not complete */
  uint64_t next_id;
};

static inline uint8_t *area(struct kcclComm *c, int r) { return c->base[r] + c->p2p_off; }
static inline p2p_doorbell *doorbell(struct kcclComm *c, int r) { return (p2p_doorbell *)area(c, r); }
/* How many pieces of `from`'s stream rank r has read (lives in r's segment). */
static inline _Atomic uint32_t *taken(struct kcclComm *c, int r, int from) {
  return (_Atomic uint32_t *)(area(c, r) + c->p2p->taken_off + (size_t)from * KCCL_LINE);
}
/* Slot of piece s in w's ring for p. */
static inline p2p_slot_head *slot(struct kcclComm *c, int w, int p, uint32_t s) {
  size_t ring = (size_t)(p < w ? p : p - 1);
  return (p2p_slot_head *)(area(c, w) + c->p2p->rings_off + ring * c->p2p->ring_bytes +
                           (size_t)(s % P2P_SLOTS) * c->p2p->stride);
}
static inline uint8_t *slot_data(p2p_slot_head *h) { return (uint8_t *)h + KCCL_LINE; }

size_t kccl_p2p_layout(struct kcclComm *c) {
  if (c->cfg.device >= 0) return 0;
  const size_t ring = kccl_round_up(c->cfg.p2p_bytes, (size_t)P2P_SLOTS * KCCL_LINE);
  const size_t head = kccl_round_up(KCCL_LINE + (size_t)c->nranks * KCCL_LINE, KCCL_PAGE);
  return head + (size_t)(c->nranks - 1) * ring;
}

kcclResult_t kccl_p2p_init(struct kcclComm *c) {
  if (c->cfg.device >= 0) return kcclSuccess;
  struct kccl_p2p *x = calloc(1, sizeof *x);
  const size_t n = (size_t)c->nranks;
  if (!x) return kccl_err(kcclSystemError, "out of memory");
  x->ring_bytes = kccl_round_up(c->cfg.p2p_bytes, (size_t)P2P_SLOTS * KCCL_LINE);
  x->stride = x->ring_bytes / P2P_SLOTS;
  x->slot_data = x->stride - KCCL_LINE;
  x->taken_off = KCCL_LINE;
  x->rings_off = kccl_round_up(KCCL_LINE + n * KCCL_LINE, KCCL_PAGE);
  x->sent = calloc(n, sizeof *x->sent);
  x->read = calloc(n, sizeof *x->read);
  x->sendq = calloc(n, sizeof *x->sendq);
  x->posted_for = calloc(n, sizeof *x->posted_for);
  x->in = calloc(n, sizeof *x->in);
  x->unx = calloc(n, sizeof *x->unx);
  c->p2p = x;
  if (!x->sent || !x->read || !x->sendq || !x->posted_for || !x->in || !x->unx) {
    kccl_p2p_free(c);
    return kccl_err(kcclSystemError, "out of memory");
  }
  return kcclSuccess;
}

void kccl_p2p_free(struct kcclComm *c) {
  struct kccl_p2p *x = c->p2p;
  if (!x) return;
  for (p2p_req *r = x->live, *next; r; r = next) {
    next = r->live;
    free(r);
  }
  for (int p = 0; x->unx && p < c->nranks; p++)
    for (unexpected *u = x->unx[p], *next; u; u = next) {
      next = u->next;
      free(u->data);
      free(u);
    }
  free(x->sent);
  free(x->read);
  free(x->sendq);
  free(x->posted_for);
  free(x->in);
  free(x->unx);
  free(x);
  c->p2p = NULL;
  c->idle_work = NULL;
}

/* -------------------------------------------------------------- moving pieces -- */

/* After publishing something peer p waits for: ring its doorbell if it may be asleep. */
static void ring_bell(struct kcclComm *c, int p) {
  p2p_doorbell *d = doorbell(c, p);
  if (atomic_load_explicit(&d->sleeping, memory_order_seq_cst)) {
    atomic_fetch_add_explicit(&d->bell, 1, memory_order_seq_cst);
    kccl_futex_wake((uint32_t *)&d->bell);
  }
}

static void finish(struct kcclComm *c, p2p_req *r) {
  r->complete = 1;
  c->p2p->outstanding--;
}

/* Publishes as many pieces of p's send queue as its ring has room for. */
static int push_sends(struct kcclComm *c, int p) {
  struct kccl_p2p *x = c->p2p;
  req_queue *q = &x->sendq[p];
  int moved = 0;
  uint32_t room_until = atomic_load_explicit(taken(c, p, c->rank), memory_order_acquire) + P2P_SLOTS;
  while (q->head) {
    p2p_req *r = q->head;
    while (!r->queued || r->done < r->bytes) {
      uint32_t s = x->sent[p] + 1;
      if ((int32_t)(s - room_until) > 0) return moved;
      p2p_slot_head *h = slot(c, c->rank, p, s);
      size_t n = r->bytes - r->done < x->slot_data ? r->bytes - r->done : x->slot_data;
      if (n) memcpy(slot_data(h), r->buf + r->done, n);
      h->tag = r->tag;
      h->first = !r->queued;
      h->msg_bytes = r->bytes;
      h->offset = r->done;
      atomic_store_explicit(&h->flag, (uint64_t)s << 32 | (uint32_t)n, memory_order_seq_cst);
      x->sent[p] = s;
      r->queued = 1;
      r->done += n;
      moved = 1;
      ring_bell(c, p);
    }
    q->head = r->next;
    if (!q->head) q->tail = NULL;
    finish(c, r);
  }
  return moved;
}

/* The oldest posted receive that takes a message of `tag` from p, unlinked; or NULL. */
static p2p_req *take_posted(struct kccl_p2p *x, int p, int32_t tag) {
  for (p2p_req **at = &x->posted.head, *prev = NULL; *at; prev = *at, at = &(*at)->next) {
    p2p_req *r = *at;
    if ((r->peer == p || r->peer == KCCL_ANY_SOURCE) && r->tag == tag) {
      *at = r->next;
      if (x->posted.tail == r) x->posted.tail = prev;
      if (r->peer == KCCL_ANY_SOURCE) x->posted_any--;
      else x->posted_for[p]--;
      r->next = NULL;
      return r;
    }
  }
  return NULL;
}

static kcclResult_t size_mismatch(struct kcclComm *c, int from, int32_t tag, size_t want, size_t got) {
  return kccl_comm_fail(c, kcclRemoteError,
                        "point-to-point mismatch: rank %d receives %zu bytes with tag %d from rank %d, whose "
                        "message with that tag has %zu bytes", c->rank, want, (int)tag, from, got);
}

/* Reads what p's stream has for this rank: pieces of the message in delivery, then new
 * messages as long as a receive wants them (or waits behind them). */
static kcclResult_t pull(struct kcclComm *c, int p, int *moved) {
  struct kccl_p2p *x = c->p2p;
  incoming *in = &x->in[p];
  for (;;) {
    const uint32_t s = x->read[p] + 1;
    p2p_slot_head *h = slot(c, p, c->rank, s);
    uint64_t f = atomic_load_explicit(&h->flag, memory_order_acquire);
    if ((uint32_t)(f >> 32) != s) return kcclSuccess;
    const size_t n = (uint32_t)f;
    if (!in->req && !in->unx) { /* a new message: who takes it? */
      if (!h->first)
        return kccl_comm_fail(c, kcclInternalError, "rank %d's piece %u to rank %d starts no message", p, s,
                              c->rank);
      p2p_req *r = take_posted(x, p, h->tag);
      if (r) {
        if (r->bytes != h->msg_bytes) return size_mismatch(c, p, h->tag, r->bytes, h->msg_bytes);
        r->peer = p;
        r->queued = 1;
        in->req = r;
      } else if (x->posted_for[p] || x->posted_any) {
        unexpected *u = calloc(1, sizeof *u);
        if (!u || !(u->data = malloc(h->msg_bytes ? h->msg_bytes : 1))) {
          free(u);
          return kccl_comm_fail(c, kcclSystemError, "out of memory for a %llu-byte message from rank %d",
                                (unsigned long long)h->msg_bytes, p);
        }
        u->tag = h->tag;
        u->bytes = h->msg_bytes;
        u->order = ++x->arrivals;
        unexpected **end = &x->unx[p];
        while (*end) end = &(*end)->next;
        *end = u;
        in->unx = u;
      } else {
        return kcclSuccess; /* nobody asks for it yet: it waits in the ring */
      }
      in->bytes = h->msg_bytes;
      in->done = 0;
    }
    if (h->offset != in->done || in->done + n > in->bytes)
      return kccl_comm_fail(c, kcclInternalError, "rank %d's piece %u to rank %d is out of place", p, s, c->rank);
    uint8_t *dst = in->req ? in->req->buf : in->unx->data;
    if (n) memcpy(dst + in->done, slot_data(h), n);
    in->done += n;
    x->read[p] = s;
    atomic_store_explicit(taken(c, c->rank, p), s, memory_order_seq_cst); /* the slot is free */
    ring_bell(c, p);
    *moved = 1;
    if (in->done == in->bytes) {
      if (in->req) {
        in->req->done = in->bytes;
        finish(c, in->req);
      } else {
        in->unx->done = in->bytes;
      }
      in->req = NULL;
      in->unx = NULL;
    } else if (in->unx) {
      in->unx->done = in->done;
    }
  }
}

/* One pass over everything outstanding; *moved when anything did. */
static kcclResult_t progress(struct kcclComm *c, int *moved) {
  struct kccl_p2p *x = c->p2p;
  *moved = 0;
  for (int p = 0; p < c->nranks; p++) {
    if (p == c->rank) continue;
    if (x->sendq[p].head) *moved |= push_sends(c, p);
    if (x->in[p].req || x->in[p].unx || x->posted_for[p] || x->posted_any) {
      kcclResult_t r = pull(c, p, moved);
      if (r != kcclSuccess) return r;
    }
  }
  return kcclSuccess;
}

static void idle_work(struct kcclComm *c) {
  int moved;
  if (c->error == kcclSuccess) progress(c, &moved);
}

static void track(struct kcclComm *c) { c->idle_work = c->p2p->outstanding ? idle_work : NULL; }

/* --------------------------------------------------------------- requests -- */

static kcclResult_t p2p_enter(struct kcclComm *c, const void *buf, size_t count, int dt, int peer, int any_ok,
                              const char *what) {
  kcclResult_t r = kccl_comm_check(c);
  if (r != kcclSuccess) return r;
  if (!c->p2p)
    return kccl_err(kcclInvalidUsage, "%s: point-to-point is the host transport's; this is a GPU communicator", what);
  if (dt < 0 || dt >= kcclNumTypes) return kccl_err(kcclInvalidArgument, "%s: unknown data type %d", what, dt);
  if (count > ((size_t)1 << 56) / 8) return kccl_err(kcclInvalidArgument, "%s: count=%zu is too large", what, count);
  if (count && !buf) return kccl_err(kcclInvalidArgument, "%s: NULL buffer with count=%zu", what, count);
  if (peer == c->rank)
    return kccl_err(kcclInvalidArgument, "%s: peer %d is this rank (point-to-point goes between two ranks)", what,
                    peer);
  if ((peer < 0 || peer >= c->nranks) && !(any_ok && peer == KCCL_ANY_SOURCE))
    return kccl_err(kcclInvalidArgument, "%s: peer %d out of range for %d ranks", what, peer, c->nranks);
  return kcclSuccess;
}

static p2p_req *new_req(struct kcclComm *c, int send, const void *buf, size_t bytes, int peer, int tag) {
  p2p_req *r = calloc(1, sizeof *r);
  if (!r) return NULL;
  struct kccl_p2p *x = c->p2p;
  r->id = ++x->next_id;
  r->send = send;
  r->peer = peer;
  r->tag = tag;
  r->buf = (uint8_t *)buf;
  r->bytes = bytes;
  r->live = x->live;
  x->live = r;
  x->outstanding++;
  return r;
}

static void enqueue(req_queue *q, p2p_req *r) {
  if (q->tail) q->tail->next = r;
  else q->head = r;
  q->tail = r;
}

kcclResult_t kcclSendStart(const void *sendbuff, size_t count, kcclDataType_t dt, int peer, int tag, kcclComm_t c,
                           uint64_t *request) {
  if (!request) return kccl_err(kcclInvalidArgument, "send: request is NULL");
  *request = 0;
  kcclResult_t r = p2p_enter(c, sendbuff, count, dt, peer, 0, "send");
  if (r != kcclSuccess) return r;
  p2p_req *q = new_req(c, 1, sendbuff, count * kccl_dtype_size(dt), peer, tag);
  if (!q) return kccl_err(kcclSystemError, "out of memory");
  enqueue(&c->p2p->sendq[peer], q);
  if (c->p2p->sendq[peer].head == q) push_sends(c, peer);
  track(c);
  *request = q->id;
  return kcclSuccess;
}

/* The oldest unexpected message of `tag` from p (any peer for KCCL_ANY_SOURCE), unlinked. */
static unexpected *take_unexpected(struct kcclComm *c, int peer, int32_t tag, int *from) {
  struct kccl_p2p *x = c->p2p;
  unexpected **best = NULL;
  for (int p = 0; p < c->nranks; p++) {
    if (p == c->rank || (peer != KCCL_ANY_SOURCE && p != peer)) continue;
    for (unexpected **at = &x->unx[p]; *at; at = &(*at)->next)
      if ((*at)->tag == tag) {
        if (!best || (*at)->order < (*best)->order) {
          best = at;
          *from = p;
        }
        break;
      }
  }
  if (!best) return NULL;
  unexpected *u = *best;
  *best = u->next;
  return u;
}

kcclResult_t kcclRecvStart(void *recvbuff, size_t count, kcclDataType_t dt, int peer, int tag, kcclComm_t c,
                           uint64_t *request) {
  if (!request) return kccl_err(kcclInvalidArgument, "recv: request is NULL");
  *request = 0;
  kcclResult_t r = p2p_enter(c, recvbuff, count, dt, peer, 1, "recv");
  if (r != kcclSuccess) return r;
  struct kccl_p2p *x = c->p2p;
  const size_t bytes = count * kccl_dtype_size(dt);
  int from = -1;
  unexpected *u = take_unexpected(c, peer, tag, &from);
  if (u && u->bytes != bytes) {
    r = size_mismatch(c, from, tag, bytes, u->bytes);
    free(u->data);
    free(u);
    return r;
  }
  p2p_req *q = new_req(c, 0, recvbuff, bytes, peer, tag);
  if (!q) {
    if (u) { free(u->data); free(u); }
    return kccl_err(kcclSystemError, "out of memory");
  }
  if (u) { /* already here, whole or in part: the rest of it comes straight to recvbuff */
    q->peer = from;
    q->queued = 1;
    if (u->done) memcpy(q->buf, u->data, u->done);
    if (u->done == u->bytes) {
      q->done = bytes;
      finish(c, q);
    } else {
      x->in[from].unx = NULL;
      x->in[from].req = q;
    }
    free(u->data);
    free(u);
  } else {
    enqueue(&x->posted, q);
    if (peer == KCCL_ANY_SOURCE) x->posted_any++;
    else x->posted_for[peer]++;
  }
  track(c);
  *request = q->id;
  return kcclSuccess;
}

static p2p_req *find(struct kcclComm *c, uint64_t id, p2p_req ***link) {
  for (p2p_req **at = &c->p2p->live; *at; at = &(*at)->live)
    if ((*at)->id == id) {
      *link = at;
      return *at;
    }
  return NULL;
}

static kcclResult_t lookup(struct kcclComm *c, uint64_t id, p2p_req **out, p2p_req ***link, const char *what) {
  kcclResult_t r = kccl_comm_check(c);
  if (r != kcclSuccess) return r;
  if (!c->p2p) return kccl_err(kcclInvalidUsage, "%s: point-to-point is the host transport's", what);
  *out = find(c, id, link);
  if (!*out)
    return kccl_err(kcclInvalidArgument, "%s: request %llu is not an outstanding point-to-point request of this "
                    "communicator (each is reported complete once)", what, (unsigned long long)id);
  return kcclSuccess;
}

/* A request reported complete is forgotten. */
static void report(struct kcclComm *c, p2p_req *q, p2p_req **link, int *source) {
  if (source) *source = q->send ? c->rank : q->peer;
  *link = q->live;
  free(q);
  track(c);
}

/* Why request q cannot complete (into why), if a peer it depends on is gone; kcclSuccess
 * otherwise.  Only reports: a peer may publish its last piece and then exit, so the caller
 * moves pieces once more before it declares the communicator broken. */
static kcclResult_t peer_problem(struct kcclComm *c, const p2p_req *q, char *why, size_t n) {
  if (q->peer != KCCL_ANY_SOURCE) return kccl_peer_gone(c, q->peer, why, n);
  int failed = -1;
  kcclResult_t r = kccl_peers_gone(c, why, n, &failed);
  if (r == kcclSuccess && failed >= 0) r = kccl_peer_gone(c, failed, why, n);
  return r;
}

/* kcclSuccess while q may still complete (*moved: pieces moved meanwhile); else the
 * communicator's new error. */
static kcclResult_t check_peers(struct kcclComm *c, const p2p_req *q, int *moved) {
  char why[400];
  *moved = 0;
  kcclResult_t bad = peer_problem(c, q, why, sizeof why);
  if (bad == kcclSuccess) return kcclSuccess;
  kcclResult_t r = progress(c, moved);
  if (r != kcclSuccess || *moved || q->complete) return r;
  return kccl_comm_fail(c, bad, "%s", why);
}

/* Until q completes: progress; spin, then yield, then sleep on this rank's doorbell, which
 * a peer rings when it publishes a piece or frees a slot while this rank sleeps.
 * KCCL_TIMEOUT_MS counts from the last piece that moved. */
static kcclResult_t wait_request(struct kcclComm *c, p2p_req *q) {
  int64_t now = kccl_now_ns(), last_move = now, next_check = now + 1000000;
  const int64_t spin_end = now + c->spin_ns, yield_end = spin_end + c->yield_ns;
  const int64_t timeout = c->cfg.timeout_ms > 0 ? (int64_t)c->cfg.timeout_ms * 1000000 : INT64_MAX;
  p2p_doorbell *d = doorbell(c, c->rank);
  for (unsigned i = 1;; i++) {
    int moved;
    kcclResult_t r = progress(c, &moved);
    if (r != kcclSuccess) return r;
    if (q->complete) return q->error;
    if ((i & 63) == 0 || moved || now >= spin_end) now = kccl_now_ns();
    if (moved) {
      last_move = now;
      continue;
    }
    if (now < spin_end) {
      cpu_relax();
      continue;
    }
    if (now < yield_end) {
      sched_yield();
    } else {
      atomic_store_explicit(&d->sleeping, 1, memory_order_seq_cst);
      uint32_t bell = atomic_load_explicit(&d->bell, memory_order_seq_cst);
      r = progress(c, &moved);
      if (r == kcclSuccess && !moved && !q->complete) {
        struct timespec ts = {0, 1000000};
        kccl_futex_wait((uint32_t *)&d->bell, bell, &ts);
      }
      atomic_store_explicit(&d->sleeping, 0, memory_order_relaxed);
      if (r != kcclSuccess) return r;
      if (moved) last_move = kccl_now_ns();
      if (moved || q->complete) continue;
    }
    now = kccl_now_ns();
    if (now < next_check) continue;
    next_check = now + 1000000;
    if ((r = check_peers(c, q, &moved)) != kcclSuccess) return r;
    if (moved) last_move = now;
    if (moved || q->complete) continue;
    if (timeout != INT64_MAX && now - last_move >= timeout)
      return kccl_comm_fail(c, kcclTimeout, "rank %d waited %d ms for a %s %s rank %d (tag %d, %zu of %zu bytes "
                            "moved; KCCL_TIMEOUT_MS)", c->rank, c->cfg.timeout_ms, q->send ? "send" : "receive",
                            q->send ? "to" : "from", q->peer, (int)q->tag, q->done, q->bytes);
  }
}

kcclResult_t kcclP2PWait(kcclComm_t c, uint64_t request, int *source) {
  p2p_req *q = NULL, **link = NULL;
  kcclResult_t r = lookup(c, request, &q, &link, "p2p wait");
  if (r == kcclSuccess && !q->complete) r = wait_request(c, q);
  if (r == kcclSuccess) report(c, q, link, source);
  return r;
}

kcclResult_t kcclP2PTest(kcclComm_t c, uint64_t request, int *done, int *source) {
  if (!done) return kccl_err(kcclInvalidArgument, "p2p test: done is NULL");
  *done = 0;
  p2p_req *q = NULL, **link = NULL;
  kcclResult_t r = lookup(c, request, &q, &link, "p2p test");
  if (r != kcclSuccess) return r;
  int moved;
  if ((r = progress(c, &moved)) != kcclSuccess) return r;
  if (!q->complete) {
    /* Not there yet: a polling caller learns of a peer that will never deliver. */
    int64_t now = kccl_now_ns();
    if (now < c->nb_next_check) return kcclSuccess;
    c->nb_next_check = now + 1000000;
    if ((r = check_peers(c, q, &moved)) != kcclSuccess || !q->complete) return r;
  }
  *done = 1;
  report(c, q, link, source);
  return kcclSuccess;
}

kcclResult_t kcclP2PProgress(kcclComm_t c, int *moved) {
  if (!moved) return kccl_err(kcclInvalidArgument, "p2p progress: moved is NULL");
  *moved = 0;
  kcclResult_t r = kccl_comm_check(c);
  if (r != kcclSuccess) return r;
  if (!c->p2p) return kccl_err(kcclInvalidUsage, "p2p progress: point-to-point is the host transport's");
  return progress(c, moved);
}

static kcclResult_t host_stream(kcclComm_t c, void *stream, const char *what) {
  if (stream && kccl_comm_valid(c) && !c->gpu)
    return kccl_err(kcclInvalidArgument, "%s: the host transport takes stream=NULL", what);
  return kcclSuccess;
}

kcclResult_t kcclSend(const void *sendbuff, size_t count, kcclDataType_t dt, int peer, kcclComm_t c, void *stream) {
  uint64_t req;
  kcclResult_t r = host_stream(c, stream, "send");
  if (r == kcclSuccess) r = kcclSendStart(sendbuff, count, dt, peer, 0, c, &req);
  return r == kcclSuccess ? kcclP2PWait(c, req, NULL) : r;
}

kcclResult_t kcclRecv(void *recvbuff, size_t count, kcclDataType_t dt, int peer, kcclComm_t c, void *stream) {
  uint64_t req;
  kcclResult_t r = host_stream(c, stream, "recv");
  if (r == kcclSuccess) r = kcclRecvStart(recvbuff, count, dt, peer, 0, c, &req);
  return r == kcclSuccess ? kcclP2PWait(c, req, NULL) : r;
}
