/* cpu_pool.h: the decode step's thread pool.  One kpool_run per token runs the same
 * function on every thread (the caller is thread 0), which walks the whole model and
 * meets the others at kpool_barrier between stages.  Workers spin between stages and
 * for a short while after a run (the next token's call comes soon), then sleep on a
 * futex, so an idle engine takes no CPU. */
#ifndef KIE_CPU_POOL_H
#define KIE_CPU_POOL_H

typedef struct kpool kpool;
typedef void (*kpool_fn)(void *arg, int tid, int nthreads);

/* n threads in all (n - 1 started here); cpus: NULL or n CPU ids, worker i pinned to
 * cpus[i].  0, or -1 with *err set (a static string). */
int kpool_create(int n, const int *cpus, kpool **out, const char **err);
void kpool_destroy(kpool *p);
int kpool_size(const kpool *p);
/* How long a worker polls for the next run before it sleeps (default 2 ms: a decode
 * loop's next token comes sooner; a caller with more work of its own between runs sets
 * less, so that polling does not take the cores that work needs). */
void kpool_set_idle_spin(kpool *p, long long ns);
/* fn(arg, tid, n) on every thread; returns when all have returned. */
void kpool_run(kpool *p, kpool_fn fn, void *arg);
/* Every thread of the current run waits here until all have arrived. */
void kpool_barrier(kpool *p, int tid);
/* The same, calling idle(arg) while it waits, until idle returns 0 (a short piece of
 * work each call: the decode step prefetches its next weights). */
void kpool_barrier_idle(kpool *p, int tid, int (*idle)(void *), void *arg);

#endif
