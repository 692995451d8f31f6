/* kq_dispatch.c: picks the kernels once from the CPU's features (CPUID, through the
 * compiler's cpu-supports builtins, which also check that the OS saves the wide
 * registers) and routes the public calls of kq.h to them. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kq_internal.h"

static const kq_impl *kq_cur; /* set once, or by kq_set_level; read with atomics */

/* KIE_CPU_HIDE=avx512,avx2 hides those features from the choice below, as if the CPU
 * lacked them (to see what an older CPU gets, and to test that path on this one). */
static int hidden(const char *name)
{
    const char *h = getenv("KIE_CPU_HIDE");
    size_t n = strlen(name);
    while (h && *h) {
        const char *end = strchr(h, ',');
        size_t len = end ? (size_t)(end - h) : strlen(h);
        if (len == n && !strncmp(h, name, n))
            return 1;
        h = end ? end + 1 : NULL;
    }
    return 0;
}

static int cpu_can(const char *name)
{
    if (hidden(name))
        return 0;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (!strcmp(name, "avx2"))
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (!strcmp(name, "avx512")) /* VNNI is what makes this level worth having */
        return cpu_can("avx2") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vnni");
#endif
    return !strcmp(name, "scalar");
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
        if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
            fprintf(stderr, "kie_engine.cpu: this CPU has no AVX2/FMA; using the portable scalar kernels (slow)\n");
#endif
    }
    __atomic_store_n(&kq_cur, p, __ATOMIC_RELEASE);
    return p;
}

const char *kq_level(void) { return impl()->name; }

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
    if (type == KQ_F32 || type == KQ_F16 || type == KQ_BF16)
        memcpy(act, x, (size_t)cols * sizeof(float));
    else
        impl()->quantize_act(x, cols, act);
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
    if (kq_row_bytes(type, cols))
        kq_scalar_dequant_row(type, row, cols, out);
}
