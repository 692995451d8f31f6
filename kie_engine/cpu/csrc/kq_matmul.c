/* kq_matmul.c: products of one matrix with several inputs (kq.h's kq_matmul_mat): the
 * inputs' buffer, and the routing to a level's multi-input kernels, or, for the types
 * and levels without one, to its matvec kernel over a few rows at a time. */
#include <math.h>

#include "kq_internal.h"

size_t kq_acts_bytes(int type, int64_t cols, int nt)
{
    size_t one = kq_act_bytes(type & ~KQ_PACKED, cols);
    return one && nt >= 1 ? one * (size_t)nt : 0;
}

void kq_prepare_acts(int type, const float *x, size_t ldx, int64_t cols, int nt, int t0, int t1, void *acts)
{
    int base = type & ~KQ_PACKED;
    size_t one = kq_act_bytes(base, cols);
    if (!one || t0 < 0 || t1 > nt)
        return;
    for (int t = t0; t < t1; t++)
        kq_prepare_act(base, x + (size_t)t * ldx, cols, (char *)acts + (size_t)t * one);
}

/* Rows per pass of the fallback: their weights (at most a few kB for the widths of a
 * small model) stay in L1 while every input goes over them. */
#define FALLBACK_ROWS 16

static void by_matvec(int type, const void *w, int64_t rows, int64_t cols, const char *acts, size_t one, int nt,
                      float *y, size_t ldy, int64_t r0, int64_t r1)
{
    for (int64_t g = r0; g < r1; g = (g / FALLBACK_ROWS + 1) * FALLBACK_ROWS) {
        int64_t e = (g / FALLBACK_ROWS + 1) * FALLBACK_ROWS;
        if (e > r1)
            e = r1;
        for (int t = 0; t < nt; t++)
            kq_matvec_mat(type, w, rows, cols, acts + (size_t)t * one, y + (size_t)t * ldy, g, e);
    }
}

void kq_matmul_mat(int type, const void *w, int64_t rows, int64_t cols, const void *acts, int nt, float *y,
                   size_t ldy, int64_t r0, int64_t r1)
{
    int base = type & ~KQ_PACKED;
    size_t one = kq_act_bytes(base, cols);
    if (nt < 1 || r1 <= r0)
        return;
    if (!one || ((type & KQ_PACKED) && (!kq_packed_bytes(base, rows, cols) || r1 > rows))) {
        for (int t = 0; t < nt; t++)
            for (int64_t r = r0; r < r1; r++)
                y[(size_t)t * ldy + r] = NAN;
        return;
    }
    const kq_mm_impl *mm = kq_current()->mm;
    kq_packed_mm_fn f = NULL;
    if (mm && (type & KQ_PACKED) && nt > 1) /* one input: the matvec kernel, whose bits these are */
        f = base == KQ_Q8_0 ? mm->q8_0x4 : base == KQ_Q4_0 ? mm->q4_0x4 : base == KQ_Q4_1 ? mm->q4_1x4 : NULL;
    if (f) {
        f(w, rows, cols, (const char *)acts, one, nt, y, ldy, r0, r1);
        return;
    }
    by_matvec(type, w, rows, cols, (const char *)acts, one, nt, y, ldy, r0, r1);
}
