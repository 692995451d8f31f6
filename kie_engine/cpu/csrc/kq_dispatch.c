/* kq_dispatch.c: picks the kernels once from the CPU's features (CPUID, through the
 * compiler's cpu-supports builtins, which also check that the OS saves the wide
 * registers) and routes the public calls of kq.h to them. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "kq_internal.h"

static const kq_impl *kq_cur; /* set once, or by kq_set_level; read with atomics */

/* KIE_CPU_HIDE=avx512,avx2 hides those features from the choice below, as if the CPU
 * lacked them (to see what an older CPU gets, and to test that path on this one).  The
 * setting is KIE's (kie_engine/settings.py, which checks it when Python loads this
 * module); parsed here as there: comma-separated, blanks around a name and case ignored. */
static int hidden(const char *name)
{
    const char *h = getenv("KIE_CPU_HIDE");
    size_t n = strlen(name);
    while (h && *h) {
        const char *end = strchr(h, ',');
        size_t len = end ? (size_t)(end - h) : strlen(h);
        const char *p = h;
        while (len && (*p == ' ' || *p == '\t')) {
            p++;
            len--;
        }
        while (len && (p[len - 1] == ' ' || p[len - 1] == '\t'))
            len--;
        if (len == n && !strncasecmp(p, name, n))
            return 1;
        h = end ? end + 1 : NULL;
    }
    return 0;
}

/* Whether the CPU has what level `name` needs, KIE_CPU_HIDE aside. */
static int cpu_has(const char *name)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (!strcmp(name, "avx2"))
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (!strcmp(name, "avx512")) /* VNNI is what makes this level worth having */
        return cpu_has("avx2") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vnni");
#endif
    return !strcmp(name, "scalar");
}

/* Whether level `name` may run: the CPU has it and nothing it needs is hidden (AVX-512's
 * kernels use AVX2's too). */
static int cpu_can(const char *name)
{
    if (hidden(name) || (!strcmp(name, "avx512") && hidden("avx2")))
        return 0;
    return cpu_has(name);
}

static const kq_impl *impl_named(const char *name)
{
    if (!strcmp(name, "scalar"))
        return &kq_impl_scalar;
    if (!strcmp(name, "avx2"))
        return kq_impl_avx2;
    if (!strcmp(name, "avx512"))
        return kq_impl_avx512;
    return NULL;
}

static const kq_impl *impl(void)
{
    const kq_impl *p = __atomic_load_n(&kq_cur, __ATOMIC_ACQUIRE);
    if (p)
        return p;
    static const char *const order[] = {"avx512", "avx2"};
    for (size_t i = 0; i < sizeof order / sizeof order[0] && !p; i++)
        if (impl_named(order[i]) && cpu_can(order[i]))
            p = impl_named(order[i]);
    if (!p) {
        p = &kq_impl_scalar;
#if defined(__x86_64__) || defined(__i386__)
        static int told;
        const char *hide = getenv("KIE_CPU_HIDE");
        if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED)) {
            if (hide && hidden("avx2") && cpu_has("avx2")) /* the CPU has them: the setting took them away */
                fprintf(stderr, "kie_engine.cpu: KIE_CPU_HIDE=%s hides AVX2%s from the kernels; using the portable "
                        "scalar kernels (slow)\n", hide, cpu_has("avx512") ? " and AVX-512" : "");
            else
                fprintf(stderr, "kie_engine.cpu: this CPU has no AVX2/FMA; using the portable scalar kernels "
                        "(slow)\n");
        }
#endif
    }
    __atomic_store_n(&kq_cur, p, __ATOMIC_RELEASE);
    return p;
}

const char *kq_level(void) { return impl()->name; }

const kq_impl *kq_current(void) { return impl(); }

int kq_set_level(const char *name)
{
    if (!name)
        return -1;
    const kq_impl *p = impl_named(name);
    if (!p || !cpu_can(name))
        return -1;
    __atomic_store_n(&kq_cur, p, __ATOMIC_RELEASE);
    return 0;
}

static kq_matvec_fn kernel_of(const kq_impl *p, int type)
{
    switch (type) {
    case KQ_F32: return p->f32;
    case KQ_F16: return p->f16;
    case KQ_BF16: return p->bf16;
    case KQ_Q8_0: return p->q8_0;
    case KQ_Q4_0: return p->q4_0;
    case KQ_Q4_1: return p->q4_1;
    case KQ_Q4_K: return p->q4_k;
    case KQ_Q6_K: return p->q6_k;
    default: return NULL;
    }
}

void kq_prepare_act(int type, const float *x, int64_t cols, void *act)
{
    if (!kq_act_bytes(type, cols))
        return;
    if (type == KQ_F32 || type == KQ_F16 || type == KQ_BF16) {
        memcpy(act, x, (size_t)cols * sizeof(float));
    } else {
        impl()->quantize_act(x, cols, act);
    }
}

void kq_matvec(int type, const void *w, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    size_t rb = kq_row_bytes(type, cols);
    kq_matvec_fn f = kernel_of(impl(), type);
    if (!rb || !f) { /* unsupported type or width: say so loudly in the output */
        for (int64_t r = r0; r < r1; r++)
            y[r] = NAN;
        return;
    }
    if (r1 > r0)
        f(w, rb, cols, act, y, r0, r1);
}

void kq_dequant_row(int type, const void *row, int64_t cols, float *out)
{
    if (type & KQ_PACKED) { /* a packed row is not contiguous: not a row to read */
        for (int64_t i = 0; i < cols && kq_row_bytes(type, cols); i++)
            out[i] = NAN;
        return;
    }
    if (kq_row_bytes(type, cols))
        kq_scalar_dequant_row(type, row, cols, out);
}

/* -- the packed layout (kq.h) ------------------------------------------------------------ */

#define KQ_PACK_MAX_ROW 16384 /* four such rows fit the fallback's stack buffer */
#define G KQ_GROUP

size_t kq_packed_bytes(int type, int64_t rows, int64_t cols)
{
    size_t qb = 0, sb = 0, rb = kq_row_bytes(type, cols);
    if ((type & KQ_PACKED) || !kq_packed_parts(type, &qb, &sb) || !rb || rb > KQ_PACK_MAX_ROW || rows < 1)
        return 0;
    return (size_t)((rows + G - 1) / G * G) * rb;
}

/* Where row r's block b lives in the packed layout: its scale half k (d, then m) */
static inline size_t packed_s(int64_t r, int64_t b, int64_t nb, size_t sb, size_t k)
{
    return ((size_t)(r / G) * (size_t)nb + (size_t)b) * G * sb + k * 2 * G + (size_t)(r % G) * 2;
}

/* ... and byte i of its quants (qb of them): 4-byte piece i / 4 of the group's rows side by side */
static inline size_t packed_q(int64_t r, int64_t b, int64_t nb, size_t qb, size_t i)
{
    return ((size_t)(r / G) * (size_t)nb + (size_t)b) * G * qb + (i / 4) * 4 * G + (size_t)(r % G) * 4 + i % 4;
}

/* One row's block between its GGUF form (scales, then quants) and the packed layout */
static void block_to_packed(const char *blk, char *q, char *s, int64_t r, int64_t b, int64_t nb, size_t qb, size_t sb)
{
    for (size_t k = 0; k < sb / 2; k++) /* every block starts with its scales */
        memcpy(s + packed_s(r, b, nb, sb, k), blk + 2 * k, 2);
    for (size_t i = 0; i < qb; i += 4)
        memcpy(q + packed_q(r, b, nb, qb, i), blk + sb + i, 4);
}

static void block_from_packed(char *blk, const char *q, const char *s, int64_t r, int64_t b, int64_t nb, size_t qb,
                              size_t sb)
{
    for (size_t k = 0; k < sb / 2; k++)
        memcpy(blk + 2 * k, s + packed_s(r, b, nb, sb, k), 2);
    for (size_t i = 0; i < qb; i += 4)
        memcpy(blk + sb + i, q + packed_q(r, b, nb, qb, i), 4);
}

int kq_pack(int type, const void *src, int64_t rows, int64_t cols, void *dst)
{
    size_t n = kq_packed_bytes(type, rows, cols), qb = 0, sb = 0;
    if (!n || !kq_packed_parts(type, &qb, &sb))
        return -1;
    const size_t rb = kq_row_bytes(type, cols), bs = qb + sb;
    const int64_t nb = cols / 32, r16 = (rows + G - 1) / G * G;
    char *q = (char *)dst, *s = q + (size_t)r16 * (size_t)nb * qb;
    memset(dst, 0, n); /* the padding rows: zero scales and quants, a zero product */
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++)
            block_to_packed((const char *)src + (size_t)r * rb + (size_t)b * bs, q, s, r, b, nb, qb, sb);
    return type | KQ_PACKED;
}

/* A level without a packed kernel: four rows at a time back into GGUF rows on the stack,
 * then the level's row kernel (so its results are the row kernel's, bit for bit). */
static void packed_via_rows(kq_matvec_fn f, int base, const void *w, int64_t rows, int64_t cols, const void *act,
                            float *y, int64_t r0, int64_t r1)
{
    size_t qb = 0, sb = 0;
    kq_packed_parts(base, &qb, &sb);
    const size_t rb = kq_row_bytes(base, cols), bs = qb + sb;
    const int64_t nb = cols / 32, r16 = (rows + G - 1) / G * G;
    const char *q = (const char *)w, *s = q + (size_t)r16 * (size_t)nb * qb;
    _Alignas(64) char buf[4 * KQ_PACK_MAX_ROW];
    for (int64_t g = r0 / 4 * 4; g < r1; g += 4) {
        for (int k = 0; k < 4; k++)
            for (int64_t b = 0; b < nb; b++)
                block_from_packed(buf + (size_t)k * rb + (size_t)b * bs, q, s, g + k, b, nb, qb, sb);
        int64_t a = g > r0 ? g : r0, e = g + 4 < r1 ? g + 4 : r1;
        f(buf, rb, cols, act, y + g, a - g, e - g); /* row r of the group at buf + (r - g) * rb */
    }
}

void kq_matvec_mat(int type, const void *w, int64_t rows, int64_t cols, const void *act, float *y, int64_t r0,
                   int64_t r1)
{
    if (!(type & KQ_PACKED)) {
        kq_matvec(type, w, cols, act, y, r0, r1);
        return;
    }
    const kq_impl *p = impl();
    int base = type & ~KQ_PACKED;
    kq_packed_fn f = base == KQ_Q8_0 ? p->q8_0x4 : base == KQ_Q4_0 ? p->q4_0x4 : base == KQ_Q4_1 ? p->q4_1x4 : NULL;
    if (!kq_packed_bytes(base, rows, cols) || r1 > rows) {
        for (int64_t r = r0; r < r1; r++)
            y[r] = NAN;
        return;
    }
    if (r1 <= r0)
        return;
    if (f)
        f(w, rows, cols, act, y, r0, r1);
    else
        packed_via_rows(kernel_of(p, base), base, w, rows, cols, act, y, r0, r1);
}

int kq_share_spans(int type, const void *w, int64_t rows, int64_t cols, int64_t r0, int64_t r1, const void **p,
                   size_t *n)
{
    size_t rb = kq_row_bytes(type, cols), qb = 0, sb = 0;
    if (!rb || r1 <= r0)
        return 0;
    if (!(type & KQ_PACKED)) {
        p[0] = (const char *)w + (size_t)r0 * rb;
        n[0] = (size_t)(r1 - r0) * rb;
        return 1;
    }
    if (!kq_packed_parts(type & ~KQ_PACKED, &qb, &sb))
        return 0;
    const int64_t nb = cols / 32, r16 = (rows + G - 1) / G * G, g0 = r0 / G * G, g1 = (r1 + G - 1) / G * G;
    const char *q = (const char *)w, *s = q + (size_t)r16 * (size_t)nb * qb;
    p[0] = q + (size_t)g0 * (size_t)nb * qb;
    n[0] = (size_t)(g1 - g0) * (size_t)nb * qb;
    p[1] = s + (size_t)g0 * (size_t)nb * sb;
    n[1] = (size_t)(g1 - g0) * (size_t)nb * sb;
    return 2;
}
