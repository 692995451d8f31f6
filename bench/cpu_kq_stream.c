/* cpu_kq_stream.c: one kq kernel streamed from memory, timed in C (no Python between
 * calls), against a plain read of the same bytes: what the decode step's products can
 * reach on this machine, and A/B runs of two builds of kie_engine/cpu/csrc.
 *
 *   gcc -O3 -Ikie_engine/cpu/csrc bench/cpu_kq_stream.c kie_engine/cpu/csrc/kq_*.c -o /tmp/kq_stream -lpthread -lm
 *   /tmp/kq_stream TYPE ROWS COLS THREADS ROUNDS [rows|packed|read]
 *       TYPE: the ggml id (8 Q8_0, 3 Q4_1, ...); rows: the GGUF rows (default), packed:
 *       kq_pack's four-row layout, read: no kernel, a sum of the same bytes (the ceiling)
 *
 * Walks 256 MB of copies of a ROWS x COLS matrix (one matvec per copy, each thread its
 * contiguous share of the rows, as the decode step splits them) per round; prints the
 * best and median GB/s of weight bytes over the rounds after the first.  The matrices
 * lie in one anonymous mapping with MADV_HUGEPAGE (as the engine's weights do: numpy's
 * large arrays); the calling thread is thread 0 and every thread is pinned to its own
 * CPU, so that THREADS up to the core count never oversubscribe (a timer thread of its
 * own once let the workers run while it was descheduled).  Weights are random bytes
 * with every block scale set to 1/16, so the arithmetic stays finite. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "kq.h"

typedef struct {
    int type, mode, cpu;
    const char *w;
    size_t mat;
    int nmat;
    int64_t rows, cols, r0, r1;
    const void *act;
    float *y;
    double t0, t1;
} job;

enum { ROWS, PACKED, READ };

static pthread_barrier_t start, stop;
static volatile double sink;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void read_span(const char *p, size_t n)
{
    const long long *q = (const long long *)p;
    long long s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i + 4 <= n / 8; i += 4)
        s0 += q[i], s1 += q[i + 1], s2 += q[i + 2], s3 += q[i + 3];
    sink += (double)(s0 + s1 + s2 + s3);
}

static void *run(void *arg)
{
    job *j = arg;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(j->cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    pthread_barrier_wait(&start);
    j->t0 = now();
    size_t rb = kq_row_bytes(j->type, j->cols);
    for (int m = 0; m < j->nmat; m++) {
        const char *w = j->w + (size_t)m * j->mat;
        if (j->mode == READ)
            read_span(w + (size_t)j->r0 * rb, (size_t)(j->r1 - j->r0) * rb);
        else
            kq_matvec_mat(j->type, w, j->rows, j->cols, j->act, j->y, j->r0, j->r1);
    }
    pthread_barrier_wait(&stop);
    j->t1 = now();
    return NULL;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    if (argc != 6 && argc != 7) {
        fprintf(stderr, "usage: %s TYPE ROWS COLS THREADS ROUNDS [rows|packed|read]\n", argv[0]);
        return 2;
    }
    int type = atoi(argv[1]), threads = atoi(argv[4]), rounds = atoi(argv[5]);
    int mode = argc == 7 ? (!strcmp(argv[6], "packed") ? PACKED : !strcmp(argv[6], "read") ? READ : ROWS) : ROWS;
    int64_t rows = atoll(argv[2]), cols = atoll(argv[3]);
    size_t rb = kq_row_bytes(type, cols);
    if (!rb || threads < 1 || threads > 64 || rounds < 2 || rounds > 1000 || rows < 1 ||
        (mode == PACKED && (rows % 4 || !kq_packed_bytes(type, rows, cols)))) {
        fprintf(stderr, "bad arguments (packed: a Q8_0/Q4_0/Q4_1 matrix of a multiple of 4 rows)\n");
        return 2;
    }
    size_t mat = rb * (size_t)rows, huge = 2u << 20;
    int nmat = (int)((256u << 20) / mat) + 1;
    size_t total = (mat * nmat + huge - 1) / huge * huge;
    char *map = mmap(NULL, total + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    char *w = (char *)(((size_t)map + huge - 1) / huge * huge);
    madvise(w, total, MADV_HUGEPAGE);
    char *one = malloc(mat);
    uint64_t s = 88172645463325252ull;
    for (size_t i = 0; i < mat; i++) { /* xorshift: fast, and not all zeros */
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        one[i] = (char)s;
    }
    int64_t be = kq_block_elems(type);
    size_t bb = rb / (size_t)(cols / be);
    for (int64_t r = 0; r < rows; r++) /* finite scales: 0x2c00 = 1/16 */
        for (int64_t b = 0; b < cols / be; b++) {
            unsigned char *p = (unsigned char *)one + r * rb + b * bb;
            size_t at[2] = {0, 0};
            int n = 0;
            if (type == KQ_Q8_0 || type == KQ_Q4_0)
                at[n++] = 0;
            else if (type == KQ_Q4_1 || type == KQ_Q4_K)
                at[n++] = 0, at[n++] = 2;
            else if (type == KQ_Q6_K)
                at[n++] = 208;
            else if (type == KQ_F16 || type == KQ_BF16)
                at[n++] = 0;
            else if (type == KQ_F32)
                p[3] = 0x3d; /* exponent of ~0.03..0.06 */
            for (int k = 0; k < n; k++)
                p[at[k]] = 0, p[at[k] + 1] = type == KQ_BF16 ? 0x3d : 0x2c;
        }
    int wtype = type;
    for (int m = 0; m < nmat; m++) {
        if (mode == PACKED)
            wtype = kq_pack(type, one, rows, cols, w + (size_t)m * mat);
        else
            memcpy(w + (size_t)m * mat, one, mat);
    }
    float *x = malloc(cols * sizeof(float));
    for (int64_t i = 0; i < cols; i++)
        x[i] = (float)(i % 13) - 6.0f;
    void *act = aligned_alloc(64, (kq_act_bytes(type, cols) + 63) / 64 * 64);
    kq_prepare_act(type, x, cols, act);
    float *y = malloc(rows * sizeof(float));
    double *t = malloc(rounds * sizeof(double));
    for (int rd = 0; rd < rounds; rd++) {
        pthread_t th[64];
        job j[64];
        pthread_barrier_init(&start, NULL, threads);
        pthread_barrier_init(&stop, NULL, threads);
        for (int k = 0; k < threads; k++) { /* shares on multiples of 4 rows, as the engine's */
            int64_t a = rows * k / threads / 4 * 4, b = k == threads - 1 ? rows : rows * (k + 1) / threads / 4 * 4;
            j[k] = (job){wtype, mode, k, w, mat, nmat, rows, cols, a, b, act, y, 0, 0};
        }
        for (int k = 1; k < threads; k++)
            pthread_create(&th[k], NULL, run, &j[k]);
        run(&j[0]);
        for (int k = 1; k < threads; k++)
            pthread_join(th[k], NULL);
        pthread_barrier_destroy(&start);
        pthread_barrier_destroy(&stop);
        t[rd] = j[0].t1 - j[0].t0;
    }
    qsort(t + 1, rounds - 1, sizeof(double), cmp);
    double gb = (double)mat * nmat / 1e9;
    static const char *const names[] = {"rows", "packed", "read"};
    printf("%s %s %lldx%lld %s threads %d: best %.1f GB/s, median %.1f GB/s\n", kq_level(), kq_type_name(type),
           (long long)rows, (long long)cols, names[mode], threads, gb / t[1], gb / t[1 + (rounds - 1) / 2]);
    return 0;
}
