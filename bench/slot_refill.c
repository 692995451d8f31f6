/* slot_refill.c: what it costs a rank to refill a shared buffer that its peer has just
 * read, with plain stores and with streaming (non-temporal) stores, and what the peer's
 * next read of it then costs: the two halves of every step of KCCL's host collectives
 * (kccl_native/src/slot_store.c chooses between the two kinds of store from this).
 *
 *   gcc -O2 -o /tmp/slot_refill bench/slot_refill.c && /tmp/slot_refill [SECONDS] [MB]
 *
 * Two processes pinned to CPUs 0 and 1 share one buffer (default 2 MB).  Every sample
 * first times 2000 round trips of one cache line between them (the line's round trip
 * tells whether the two CPUs share a cache: on this project's VM ~40-100 ns when they
 * do, ~360 ns when the host has put them on different core complexes), then 20 rounds of
 * each kind of store: CPU 1 rewrites the whole buffer (timed there), CPU 0 copies it out
 * (timed here).  Prints one line per sample and, at the end, the medians of the samples
 * whose round trip was below and above 200 ns.  x86-64 only (SSE2 streaming stores). */
#define _GNU_SOURCE
#include <emmintrin.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define ROUNDS 20
#define MAX_SAMPLES 10000

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  if (sched_setaffinity(0, sizeof s, &s) != 0) perror("sched_setaffinity (needs 2 CPUs)");
}

static void stream_fill(uint8_t *p, int v, size_t n) {
  __m128i x = _mm_set1_epi8((char)v);
  for (size_t i = 0; i < n; i += 16) _mm_stream_si128((__m128i *)(p + i), x);
  _mm_sfence();
}

/* Shared control block: one line per field, so that the ping-pong moves one line. */
struct ctl {
  _Alignas(64) _Atomic uint64_t go;   /* written by CPU 0: the request's sequence number */
  _Alignas(64) _Atomic uint64_t done; /* written by CPU 1: the request it finished */
  _Alignas(64) _Atomic int mode;      /* 0 ping, 1 plain fill, 2 streaming fill, 3 quit */
  _Alignas(64) double fill_s;         /* CPU 1's time in fills since last reset */
};

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp);
  return n ? v[n / 2] : 0;
}

int main(int argc, char **argv) {
  double seconds = argc > 1 ? atof(argv[1]) : 30;
  size_t bytes = (size_t)(argc > 2 ? atof(argv[2]) : 2) * (1 << 20);
  struct ctl *c = mmap(NULL, sizeof *c, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  uint8_t *buf = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  uint8_t *out = aligned_alloc(4096, bytes);
  if (c == MAP_FAILED || buf == MAP_FAILED || !out) return perror("mmap"), 1;
  memset(buf, 1, bytes);
  memset(out, 0, bytes);
  pid_t pid = fork();
  if (pid == 0) {
    pin(1);
    uint64_t seen = 0;
    for (;;) {
      while (c->go == seen) {}
      seen = c->go;
      int m = c->mode;
      if (m == 3) _exit(0);
      if (m) {
        double t = now();
        if (m == 1) memset(buf, (int)seen, bytes);
        else stream_fill(buf, (int)seen, bytes);
        c->fill_s += now() - t;
      }
      c->done = seen;
    }
  }
  pin(0);
  static double rtt[MAX_SAMPLES], gbs[MAX_SAMPLES][4];
  int n = 0;
  uint64_t seq = 0;
  printf("# %zu-byte buffer; GB/s: plain fill, read after it, streaming fill, read after it\n", bytes);
  for (double end = now() + seconds; now() < end && n < MAX_SAMPLES; n++) {
    c->mode = 0;
    double t = now();
    for (int i = 0; i < 2000; i++) {
      c->go = ++seq;
      while (c->done != seq) {}
    }
    rtt[n] = (now() - t) / 2000 * 1e9;
    for (int m = 1; m <= 2; m++) {
      double read_s = 0;
      c->mode = m;
      c->fill_s = 0;
      for (int r = 0; r < ROUNDS; r++) {
        c->go = ++seq;
        while (c->done != seq) {}
        t = now();
        memcpy(out, buf, bytes);
        read_s += now() - t;
      }
      gbs[n][2 * (m - 1)] = ROUNDS * (double)bytes / c->fill_s / 1e9;
      gbs[n][2 * (m - 1) + 1] = ROUNDS * (double)bytes / read_s / 1e9;
    }
    printf("round trip %4.0f ns | plain fill %5.1f read %5.1f | streaming fill %5.1f read %5.1f\n", rtt[n],
           gbs[n][0], gbs[n][1], gbs[n][2], gbs[n][3]);
    fflush(stdout);
    usleep(200000);
  }
  c->mode = 3;
  c->go = ++seq;
  waitpid(pid, NULL, 0);
  for (int far = 0; far <= 1; far++) {
    double col[4][MAX_SAMPLES];
    int k = 0;
    for (int i = 0; i < n; i++)
      if ((rtt[i] >= 200) == far) {
        for (int j = 0; j < 4; j++) col[j][k] = gbs[i][j];
        k++;
      }
    printf("# %s (round trip %s 200 ns), %d samples, medians: plain fill %.1f read %.1f | streaming fill %.1f read %.1f\n",
           far ? "no shared cache" : "shared cache", far ? ">=" : "<", k, median(col[0], k), median(col[1], k),
           median(col[2], k), median(col[3], k));
  }
  return 0;
}
