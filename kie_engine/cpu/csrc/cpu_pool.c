/* cpu_pool.c: see cpu_pool.h.
 *
 * A decode step of a small model is ~150 stages of a few tens of microseconds, so a
 * barrier must cost well under a microsecond: the barrier is a counter and a
 * generation word in their own cache lines, polled with a pause instruction.  When
 * the machine has fewer free cores than threads a spinning waiter would hold the core
 * its peer needs, so after a while of polling a waiter yields, and between runs it
 * sleeps on a futex. */
#define _GNU_SOURCE
#include "cpu_pool.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#define LINE 64
/* Polls in a wait before each sched_yield.  Few: a waiter's peer may be off its core
 * (another process's thread took it, or the pool has more threads than CPUs), and the
 * yield hands the waiter's core to whatever else is runnable there, work that would
 * otherwise take a core from the pool later.  Against 20,000 polls: the server's 4
 * streams beside the client on 2 CPUs 2.51 against 2.39x one alone (medians of 7
 * alternations), 3 threads on 2 CPUs 186 against 12 tokens/s; one process alone
 * within 1.5 % (bench/RESULTS.md). */
#define SPIN_BEFORE_YIELD 64
#define IDLE_SPIN_NS 2000000        /* by default a worker polls this long after a run before it sleeps */

struct kpool {
  int n;
  pthread_t *threads;
  kpool_fn fn;
  void *arg;
  _Alignas(LINE) atomic_uint run_gen;   /* bumped to start a run (or to stop: see quit) */
  _Alignas(LINE) atomic_int done;       /* workers finished with the current run */
  _Alignas(LINE) atomic_int sleepers;   /* workers asleep on run_gen */
  _Alignas(LINE) atomic_int arrived;    /* barrier */
  _Alignas(LINE) atomic_uint bar_gen;
  _Alignas(LINE) int quit;
  long long idle_spin_ns;               /* kpool_set_idle_spin */
  int cpu_of[];                         /* -1: not pinned */
};

typedef struct {
  kpool *p;
  int tid;
} worker_arg;

static void futex_wait(atomic_uint *addr, unsigned val) {
#ifdef __linux__
  struct timespec ts = {0, 100 * 1000 * 1000}; /* a bounded sleep: a lost wake costs 100 ms, not a hang */
  syscall(SYS_futex, (unsigned *)addr, FUTEX_WAIT_PRIVATE, val, &ts, NULL, 0);
#else
  (void)addr; (void)val;
  sched_yield();
#endif
}

static void futex_wake_all(atomic_uint *addr) {
#ifdef __linux__
  syscall(SYS_futex, (unsigned *)addr, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0);
#else
  (void)addr;
#endif
}

static long long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void pin_self(int cpu) {
#ifdef __linux__
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set); /* best effort: a refused pin only costs speed */
#else
  (void)cpu;
#endif
}

static void *worker(void *v) {
  worker_arg wa = *(worker_arg *)v;
  free(v);
  kpool *p = wa.p;
  pin_self(p->cpu_of[wa.tid]);
  /* The generation the pool was made with, not the one this thread finds when it
   * starts: a first run may be dispatched before a slow-starting worker gets here. */
  unsigned seen = 0;
  for (;;) {
    /* wait for the next run: poll a while, then sleep */
    long long idle_from = 0;
    unsigned g;
    int polls = 0;
    while ((g = atomic_load_explicit(&p->run_gen, memory_order_acquire)) == seen) {
      CPU_RELAX();
      if (++polls < 1024) continue;
      polls = 0;
      long long t = now_ns();
      if (!idle_from) idle_from = t;
      if (t - idle_from < p->idle_spin_ns) {
        sched_yield();
        continue;
      }
      atomic_fetch_add(&p->sleepers, 1);
      if (atomic_load_explicit(&p->run_gen, memory_order_acquire) == seen) futex_wait(&p->run_gen, seen);
      atomic_fetch_sub(&p->sleepers, 1);
    }
    seen = g;
    if (p->quit) return NULL;
    p->fn(p->arg, wa.tid, p->n);
    atomic_fetch_add_explicit(&p->done, 1, memory_order_acq_rel);
  }
}

int kpool_create(int n, const int *cpus, kpool **out, const char **err) {
  *out = NULL;
  if (n < 1 || n > 1024) {
    *err = "thread count out of range 1..1024";
    return -1;
  }
  kpool *p = aligned_alloc(LINE, (sizeof(kpool) + n * sizeof(int) + LINE - 1) / LINE * LINE);
  if (!p) {
    *err = "out of memory";
    return -1;
  }
  memset(p, 0, sizeof *p);
  p->n = n;
  p->idle_spin_ns = IDLE_SPIN_NS;
  for (int i = 0; i < n; i++) p->cpu_of[i] = cpus ? cpus[i] : -1;
  p->threads = calloc(n, sizeof(pthread_t));
  if (!p->threads) {
    free(p);
    *err = "out of memory";
    return -1;
  }
  for (int i = 1; i < n; i++) {
    worker_arg *wa = malloc(sizeof *wa);
    int rc = wa ? 0 : ENOMEM;
    if (wa) {
      wa->p = p;
      wa->tid = i;
      rc = pthread_create(&p->threads[i], NULL, worker, wa);
      if (rc) free(wa);
    }
    if (rc) {
      p->n = i; /* stop the ones started */
      kpool_destroy(p);
      *err = "pthread_create failed";
      return -1;
    }
  }
  *out = p;
  return 0;
}

void kpool_destroy(kpool *p) {
  if (!p) return;
  p->quit = 1;
  atomic_fetch_add_explicit(&p->run_gen, 1, memory_order_release);
  futex_wake_all(&p->run_gen);
  for (int i = 1; i < p->n; i++) pthread_join(p->threads[i], NULL);
  free(p->threads);
  free(p);
}

int kpool_size(const kpool *p) { return p->n; }

void kpool_set_idle_spin(kpool *p, long long ns) { p->idle_spin_ns = ns < 0 ? 0 : ns; }

void kpool_run(kpool *p, kpool_fn fn, void *arg) {
  if (p->n == 1) {
    fn(arg, 0, 1);
    return;
  }
  p->fn = fn;
  p->arg = arg;
  atomic_store_explicit(&p->done, 0, memory_order_relaxed);
  atomic_fetch_add_explicit(&p->run_gen, 1, memory_order_release);
  if (atomic_load(&p->sleepers) > 0) futex_wake_all(&p->run_gen);
  fn(arg, 0, p->n);
  int polls = 0;
  while (atomic_load_explicit(&p->done, memory_order_acquire) != p->n - 1) {
    CPU_RELAX();
    if (++polls >= SPIN_BEFORE_YIELD) {
      polls = 0;
      sched_yield();
    }
  }
}

void kpool_barrier(kpool *p, int tid) { kpool_barrier_idle(p, tid, NULL, NULL); }

void kpool_barrier_idle(kpool *p, int tid, int (*idle)(void *), void *arg) {
  (void)tid;
  if (p->n == 1) return;
  unsigned g = atomic_load_explicit(&p->bar_gen, memory_order_acquire);
  if (atomic_fetch_add_explicit(&p->arrived, 1, memory_order_acq_rel) == p->n - 1) {
    atomic_store_explicit(&p->arrived, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->bar_gen, 1, memory_order_release);
    return;
  }
  int polls = 0, busy = idle != NULL;
  while (atomic_load_explicit(&p->bar_gen, memory_order_acquire) == g) {
    if (busy) {
      busy = idle(arg);
      continue;
    }
    CPU_RELAX();
    if (++polls >= SPIN_BEFORE_YIELD) {
      polls = 0;
      sched_yield();
    }
  }
}
