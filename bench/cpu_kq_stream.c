/* cpu_kq_stream.c: one kq_matvec kernel streamed from memory, timed in C (no Python
 * between calls), for A/B runs of two builds of kie_engine/cpu/csrc.
 *
 *   gcc -O3 -Ikie_engine/cpu/csrc bench/cpu_kq_stream.c kie_engine/cpu/csrc/kq_*.c -o /tmp/kq_stream -lpthread -lm
 *   /tmp/kq_stream TYPE ROWS COLS THREADS ROUNDS      (TYPE: the ggml id, e.g. 3 for Q4_1)
 *
 * Walks 256 MB of copies of a ROWS x COLS matrix (one matvec per copy, rows split over
 * THREADS) per round; prints the best and median GB/s of weight bytes over the rounds
 * after the first.  Weights are random bytes with every block scale set to 1/16, so the
 * arithmetic stays finite. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kq.h"

typedef struct {
    int type;
    const char *w;
    size_t mat;
    int nmat;
    int64_t cols, r0, r1;
    const void *act;
    float *y;
} job;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void *run(void *arg)
{
    job *j = arg;
    for (int m = 0; m < j->nmat; m++)
        kq_matvec(j->type, j->w + (size_t)m * j->mat, j->cols, j->act, j->y, j->r0, j->r1);
    return NULL;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: %s TYPE ROWS COLS THREADS ROUNDS\n", argv[0]);
        return 2;
    }
    int type = atoi(argv[1]), threads = atoi(argv[4]), rounds = atoi(argv[5]);
    int64_t rows = atoll(argv[2]), cols = atoll(argv[3]);
    size_t rb = kq_row_bytes(type, cols);
    if (!rb || threads < 1 || threads > 64 || rounds < 2 || rounds > 1000 || rows < 1) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    size_t mat = rb * (size_t)rows;
    int nmat = (int)((256u << 20) / mat) + 1;
    char *w = aligned_alloc(64, (mat * nmat + 63) / 64 * 64);
    uint64_t s = 88172645463325252ull;
    for (size_t i = 0; i < mat * nmat; i++) { /* xorshift: fast, and not all zeros */
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        w[i] = (char)s;
    }
    int64_t be = kq_block_elems(type);
    size_t bb = rb / (size_t)(cols / be);
    for (size_t r = 0; r < (size_t)rows * nmat; r++) /* finite scales: 0x2c00 = 1/16 */
        for (int64_t b = 0; b < cols / be; b++) {
            unsigned char *p = (unsigned char *)w + r * rb + b * bb;
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
        for (int k = 0; k < threads; k++)
            j[k] = (job){type, w, mat, nmat, cols, rows * k / threads, rows * (k + 1) / threads, act, y};
        double t0 = now();
        for (int k = 1; k < threads; k++)
            pthread_create(&th[k], NULL, run, &j[k]);
        run(&j[0]);
        for (int k = 1; k < threads; k++)
            pthread_join(th[k], NULL);
        t[rd] = now() - t0;
    }
    qsort(t + 1, rounds - 1, sizeof(double), cmp);
    double gb = (double)mat * nmat / 1e9;
    printf("%s %s %lldx%lld threads %d: best %.1f GB/s, median %.1f GB/s\n", kq_level(), kq_type_name(type),
           (long long)rows, (long long)cols, threads, gb / t[1], gb / t[1 + (rounds - 1) / 2]);
    return 0;
}
