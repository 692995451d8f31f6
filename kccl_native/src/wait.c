/* wait.c - publishing flags, waiting for them, and failing the communicator when a wait cannot end.
 *
 * A wait spins (with the pause instruction) for spin_ns, then calls
 * sched_yield for yield_ns, then sleeps on a futex in 1 ms slices.  A sleeper
 * first registers in the writer's header (`sleepers`), then re-reads the flag,
 * then sleeps on the flag's sequence half; the writer stores the flag, then
 * reads `sleepers`, and only then pays for a FUTEX_WAKE.  Both sides use
 * sequentially consistent operations, so a wake-up cannot be lost between the
 * check and the sleep (and the 1 ms slice bounds the damage if it were).
 *
 * Outside the spin phase every wait checks, about once a millisecond, that
 * every peer is alive (pidfd or /proc) and has not aborted or failed, and
 * that KCCL_TIMEOUT_MS has not passed.
 *
 * Contention.  When other busy processes share the cores, a spinning waiter holds
 * its core against the peer it waits for or the process that took the peer's
 * core for as long as it spins.  So a wait that outlasts its spin looks for signs
 * of oversubscription, and for CONTENDED_HOLD_NS after the last one this thread's
 * waits skip the spin and start with the yield phase.  Yielding, not sleeping:
 * with ranks sharing a core, sched_yield hands the core straight to the peer,
 * where a futex sleep costs a wake-up and two scheduler round trips (several
 * times the exchange itself; bench/RESULTS.md, "New-user fixes").  The futex still
 * follows the yield phase, so a rank that waits long leaves the run queue.  The
 * signs: this thread lost its core during the wait (the clock jumped by
 * PREEMPT_GAP_NS between two polls, or a sched_yield lasted that long), or
 * /proc/loadavg counts more runnable threads than there are CPUs (read at most
 * every LOAD_CHECK_NS, by a wait that already spun).  A quiet machine shows none
 * of them, so its waits spin as before; an explicit KCCL_SPIN_US or
 * KCCL_YIELD_US turns the backoff off.
 *
 * A caller that knows its next collective waits long (kcclCommExpectLongWait: a rank
 * of a communicator over several hosts waiting while its leader is in the network leg)
 * skips the spin and yield phases of that collective's waits altogether. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#include "replicas.h"

void kccl_publish(struct kcclComm *c, _Atomic uint64_t *flag, uint32_t seq, uint32_t sig) {
  /* seq_cst store: orders the data before it (release) and the sleepers load
   * after it (store-load, against the sleeper's register-then-recheck). */
  atomic_store_explicit(flag, ((uint64_t)seq << 32) | sig, memory_order_seq_cst);
  if (atomic_load_explicit(&c->hdr[c->rank]->sleepers, memory_order_seq_cst))
    kccl_futex_wake(kccl_seq_word(flag));
}

void kccl_publish_slot(struct kcclComm *c, uint32_t set, int which, size_t bytes, uint32_t seq, uint32_t sig) {
  if (__builtin_expect(c->rep != NULL && c->rep->ntargets > 0 && bytes <= c->rep->data_bytes, 0))
    kccl_publish_replicated(c, set, which, bytes, seq, sig);
  else
    kccl_publish(c, kccl_flag(kccl_slot(c, c->rank, set, which)), seq, sig);
}

/* Wakes every sleeper on any of this rank's flags (used on abort and failure). */
void kccl_wake_all(struct kcclComm *c) {
  for (uint32_t set = 0; set < c->nsets; set++)
    for (int which = 0; which < 2; which++)
      kccl_futex_wake(kccl_seq_word(kccl_flag(kccl_slot(c, c->rank, set, which))));
  kccl_replicas_wake_all(c);
}

/* Records the error on the communicator (sticky) and tells the peers this rank
 * has failed, so that any of them waiting on it stops waiting. */
kcclResult_t kccl_comm_fail(struct kcclComm *c, kcclResult_t code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  kccl_verr(code, fmt, ap);
  va_end(ap);
  if (c->error == kcclSuccess) {
    c->error = code;
    kccl_seg_mark_failed(c);
    kccl_wake_all(c);
  }
  return code;
}

static const char *state_word(uint32_t s) {
  switch (s) {
    case SEG_CLOSED: return "closed its communicator";
    case SEG_ABORTED: return "aborted";
    case SEG_FAILED: return "failed";
    default: return "left";
  }
}

/* A call in words, with the arguments its collective has: an op for reductions, a root
 * for broadcast, neither for all-gather, nothing for barrier. */
static void describe_call(const kccl_call_desc *d, char *buf, size_t n) {
  const char *name = kccl_coll_name((int)d->coll);
  unsigned long long count = (unsigned long long)d->count;
  const char *type = kccl_dtype_name((int)d->dtype);
  switch (d->coll) {
    case COLL_ALLREDUCE: case COLL_ALLREDUCE_2SHOT: case COLL_ALLREDUCE_NB: case COLL_REDUCESCATTER:
      snprintf(buf, n, "%s(count=%llu, %s, op=%s)", name, count, type, kccl_op_name((int)d->op));
      break;
    case COLL_BROADCAST:
      snprintf(buf, n, "%s(count=%llu, %s, root=%u)", name, count, type, d->root);
      break;
    case COLL_ALLGATHER:
      snprintf(buf, n, "%s(count=%llu, %s)", name, count, type);
      break;
    default:
      snprintf(buf, n, "%s()", name);
  }
}

/* Explains a flag of step `seq` whose signature is not ours. */
static void describe_mismatch(struct kcclComm *c, int peer, uint32_t seq, uint32_t theirsig, char *buf,
                              size_t n) {
  const kccl_call_desc *me = &c->hdr[c->rank]->call, *them = &c->hdr[peer]->call;
  char mine[160], theirs[160];
  describe_call(me, mine, sizeof mine);
  if (them->seq == seq)
    describe_call(them, theirs, sizeof theirs);
  else
    snprintf(theirs, sizeof theirs, "a call with signature %08x", theirsig);
  snprintf(buf, n, "collective mismatch: rank %d called %s but rank %d called %s", c->rank, mine, peer, theirs);
}

/* Sets dead[p] for every peer whose process is gone (its pidfd is readable, or
 * /proc says so where pidfd_open is unavailable). */
static void find_dead_peers(struct kcclComm *c, unsigned char *dead) {
  struct pollfd pfd[64];
  for (int p0 = 0; p0 < c->nranks; p0 += 64) {
    int n = 0, who[64];
    for (int p = p0; p < c->nranks && p < p0 + 64; p++) {
      dead[p] = 0;
      if (p == c->rank) continue;
      if (c->pidfd[p] >= 0) {
        pfd[n].fd = c->pidfd[p];
        pfd[n].events = POLLIN;
        pfd[n].revents = 0;
        who[n++] = p;
      } else if (!kccl_pid_alive(c->pid[p], c->hdr[p]->starttime)) {
        dead[p] = 1;
      }
    }
    if (n > 0 && poll(pfd, (nfds_t)n, 0) > 0)
      for (int i = 0; i < n; i++)
        if (pfd[i].revents) dead[who[i]] = 1;
  }
}

/* Whether a wait on the peers is futile.  A peer that aborted or closed makes
 * it so, and is reported first; then a peer that died.  *failed gets the
 * first peer that failed (or -1): the caller reports it, with the reason its
 * segment spells out, if nothing more telling turns up.
 *
 * A dead peer counts as having died only if its state is still SEG_READY.  One
 * that failed and then exited (a survivor that reported another rank's death
 * and left) is reported as failed, with its reason, which names the rank that
 * really died.  The states are read after the deaths were seen: a peer stores
 * its state before it can exit, so a dead peer's state is its last. */
kcclResult_t kccl_peers_gone(struct kcclComm *c, char *why, size_t whylen, int *failed) {
  unsigned char dead[KCCL_MAX_RANKS];
  find_dead_peers(c, dead);
  *failed = -1;
  int died = -1;
  for (int p = 0; p < c->nranks; p++) {
    if (p == c->rank) continue;
    uint32_t s = atomic_load_explicit(&c->hdr[p]->state, memory_order_acquire);
    if (s == SEG_ABORTED || s == SEG_CLOSED) {
      snprintf(why, whylen, "rank %d (pid %d) %s while rank %d waited for it", p, (int)c->pid[p],
               state_word(s), c->rank);
      return kcclRemoteError;
    }
    if (s != SEG_READY) {
      if (*failed < 0) *failed = p;
    } else if (dead[p] && died < 0) {
      died = p;
    }
  }
  if (died >= 0) {
    snprintf(why, whylen, "rank %d (pid %d) died while rank %d waited for it", died, (int)c->pid[died], c->rank);
    return kcclRemoteError;
  }
  return kcclSuccess;
}

kcclResult_t kccl_peer_gone(struct kcclComm *c, int p, char *why, size_t whylen) {
  uint32_t s = atomic_load_explicit(&c->hdr[p]->state, memory_order_acquire);
  if (s == SEG_ABORTED || s == SEG_CLOSED) {
    snprintf(why, whylen, "rank %d (pid %d) %s while rank %d waited for it", p, (int)c->pid[p], state_word(s),
             c->rank);
    return kcclRemoteError;
  }
  if (s != SEG_READY) {
    char text[200];
    snprintf(text, sizeof text, "%.199s", c->hdr[p]->error_text);
    snprintf(why, whylen, "rank %d (pid %d) failed while rank %d waited for it: %s", p, (int)c->pid[p], c->rank,
             text);
    return kcclRemoteError;
  }
  int dead;
  if (c->pidfd[p] >= 0) {
    struct pollfd pfd = {c->pidfd[p], POLLIN, 0};
    dead = poll(&pfd, 1, 0) > 0 && pfd.revents;
  } else {
    dead = !kccl_pid_alive(c->pid[p], c->hdr[p]->starttime);
  }
  /* a peer stores its state before it can exit: read it again after seeing the death */
  if (dead && atomic_load_explicit(&c->hdr[p]->state, memory_order_acquire) == SEG_READY) {
    snprintf(why, whylen, "rank %d (pid %d) died while rank %d waited for it", p, (int)c->pid[p], c->rank);
    return kcclRemoteError;
  }
  return dead ? kccl_peer_gone(c, p, why, whylen) : kcclSuccess;
}

/* Why step `seq` cannot complete, if it cannot.  Only reports (into why): a
 * peer that finished the step may close or exit right after, so the caller
 * re-reads its flag before it declares the communicator broken.  The most
 * telling cause comes first: a peer that aborted or closed, one that died, a
 * mismatching call, and last a peer that failed (which its segment spells out). */
static kcclResult_t check_peers(struct kcclComm *c, uint32_t seq, uint32_t sig, char *why, size_t whylen) {
  int failed;
  kcclResult_t r = kccl_peers_gone(c, why, whylen, &failed);
  if (r != kcclSuccess) return r;
  for (int p = 0; p < c->nranks; p++) {
    if (p == c->rank) continue;
    uint64_t v = atomic_load_explicit(kccl_flag(kccl_slot(c, p, seq % c->nsets, 0)), memory_order_acquire);
    if ((uint32_t)(v >> 32) == seq && (uint32_t)v != sig) {
      describe_mismatch(c, p, seq, (uint32_t)v, why, whylen);
      return kcclRemoteError;
    }
  }
  if (failed >= 0) {
    char text[200];
    snprintf(text, sizeof text, "%.199s", c->hdr[failed]->error_text);
    snprintf(why, whylen, "rank %d (pid %d) failed while rank %d waited for it: %s", failed,
             (int)c->pid[failed], c->rank, text);
    return kcclRemoteError;
  }
  return kcclSuccess;
}

kcclResult_t kccl_peer_problem(struct kcclComm *c, uint32_t seq, uint32_t sig, char *why, size_t n) {
  return check_peers(c, seq, sig, why, n);
}

static kcclResult_t mismatch(struct kcclComm *c, int peer, uint32_t seq, uint32_t sig) {
  char buf[400];
  describe_mismatch(c, peer, seq, sig, buf, sizeof buf);
  return kccl_comm_fail(c, kcclRemoteError, "%s", buf);
}

static inline int seq_arrived(_Atomic uint64_t *flag, uint32_t seq, uint64_t *v) {
  *v = atomic_load_explicit(flag, memory_order_acquire);
  return (uint32_t)(*v >> 32) == seq;
}

#define PREEMPT_GAP_NS 50000         /* a gap this long between two polls: the thread lost its core */
#define CONTENDED_HOLD_NS 50000000    /* how long one sign of contention keeps the waits backing off */
#define LOAD_CHECK_NS 1000000         /* /proc/loadavg at most this often (a read costs a few us) */

/* Per thread: a communicator is used by one thread at a time, and whether the cores are
 * shared is a property of where that thread runs. */
static __thread int64_t contended_until, next_load_check;

/* `why`: the sign seen; logged (KCCL_DEBUG=INFO) when the waits start backing off. */
static void saw_contention(struct kcclComm *c, int64_t now, const char *why) {
  if (now >= contended_until) kccl_log(2, "rank %d: waits back off for %d ms: %s", c->rank,
                                       (int)(CONTENDED_HOLD_NS / 1000000), why);
  contended_until = now + CONTENDED_HOLD_NS;
}

/* Whether /proc/loadavg's count of runnable threads (this one included) exceeds the
 * online CPUs: someone is waiting for a core. */
static int machine_oversubscribed(void) {
  static int ncpu;
  if (!ncpu) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    ncpu = n > 0 ? (int)n : 1;
  }
  char buf[128];
  int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  char *p = buf; /* "0.11 0.43 0.24 3/234 5678": the fourth field is running/total */
  for (int f = 0; f < 3 && p; f++) {
    p = strchr(p, ' ');
    if (p) p++;
  }
  return p && strtol(p, NULL, 10) > ncpu;
}

kcclResult_t kccl_wait_flag(struct kcclComm *c, int peer, _Atomic uint64_t *flag, uint32_t seq,
                            uint32_t sig) {
  uint64_t v;
  if (__builtin_expect(seq_arrived(flag, seq, &v), 1)) goto got;

  int64_t t0 = kccl_now_ns(), now = t0, last = t0;
  const int adaptive = c->cfg.spin_us < 0 && c->cfg.yield_us < 0;
  const int backoff = adaptive && t0 < contended_until;
  int64_t spin_end = backoff ? t0 : t0 + c->spin_ns;
  int64_t yield_end = spin_end + c->yield_ns;
  if (c->long_wait) spin_end = yield_end = t0; /* kcclCommExpectLongWait: straight to the futex */
  int64_t deadline = c->cfg.timeout_ms > 0 ? t0 + (int64_t)c->cfg.timeout_ms * 1000000 : INT64_MAX;
  int64_t next_check = t0 + 1000000;

  /* Phase 1: spin.  The clock is read every 64 polls (a vDSO call, ~20 ns). */
  for (unsigned i = 1; now < spin_end; i++) {
    cpu_relax();
    if (seq_arrived(flag, seq, &v)) goto got;
    if ((i & 63) == 0) {
      if (c->idle_work) c->idle_work(c);
      now = kccl_now_ns();
      if (adaptive && now - last > PREEMPT_GAP_NS) { /* descheduled mid-spin: yield from now on */
        saw_contention(c, now, "this rank lost its core while spinning");
        yield_end = now + c->yield_ns;
        break;
      }
      last = now;
      if (now >= spin_end) break;
    }
  }
  if (adaptive && now < yield_end && now >= next_load_check) {
    next_load_check = now + LOAD_CHECK_NS;
    if (machine_oversubscribed()) saw_contention(c, now, "more runnable threads than CPUs (/proc/loadavg)");
  }
  /* Phases 2 and 3: yield, then sleep; both check peers and the deadline. */
  _Atomic uint32_t *sleepers = &c->hdr[peer]->sleepers;
  for (;;) {
    if (c->idle_work) c->idle_work(c);
    if (now < yield_end) {
      sched_yield();
      if (adaptive && kccl_now_ns() - now > PREEMPT_GAP_NS) /* the yield ran someone else here */
        saw_contention(c, now, "sched_yield ran another thread on this core");
    } else {
      atomic_fetch_add_explicit(sleepers, 1, memory_order_seq_cst);
      if (!seq_arrived(flag, seq, &v)) {
        struct timespec ts = {0, 1000000};
        kccl_futex_wait(kccl_seq_word(flag), (uint32_t)(v >> 32), &ts);
      }
      atomic_fetch_sub_explicit(sleepers, 1, memory_order_seq_cst);
    }
    if (seq_arrived(flag, seq, &v)) goto got;
    now = kccl_now_ns();
    if (now >= next_check || now >= yield_end) {
      next_check = now + 1000000;
      char why[480];
      kcclResult_t r = check_peers(c, seq, sig, why, sizeof why);
      if (seq_arrived(flag, seq, &v)) goto got;
      if (r != kcclSuccess) return kccl_comm_fail(c, r, "%s", why);
      if (now >= deadline)
        return kccl_comm_fail(c, kcclTimeout,
                              "rank %d waited %d ms for rank %d (pid %d) at step %u (KCCL_TIMEOUT_MS)",
                              c->rank, c->cfg.timeout_ms, peer, (int)c->pid[peer], seq);
    }
  }
got:
  if (__builtin_expect((uint32_t)v != sig, 0)) return mismatch(c, peer, seq, (uint32_t)v);
  return kcclSuccess;
}
