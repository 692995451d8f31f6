/* kq_scalar.c: the portable kernels, plain C for any CPU; also the definition of what
 * every SIMD level must compute (the tests hold each level to these results). */
#include <math.h>

#include "kq_internal.h"

/* x -> the 8-bit prepared input (kq_internal.h).  Rounding is to nearest even, as
 * the SIMD levels' conversions do, so every level prepares the same bytes.  A block
 * holding a NaN or an infinity gets q = 0 and scale NaN, so that every product with
 * it is NaN (a diverged model is seen as such downstream, not as plausible numbers). */
static void quantize_act_scalar(const float *x, int64_t cols, void *act)
{
    char *p = (char *)act;
    int8_t *q = (int8_t *)p;
    int32_t *s4 = (int32_t *)(p + kq_up64((size_t)cols));
    float *dds = (float *)(p + 2 * kq_up64((size_t)cols));
    for (int64_t b = 0; b < cols / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        int finite = 1;
        for (int i = 0; i < 32; i++) {
            amax = fmaxf(amax, fabsf(xb[i]));
            finite &= isfinite(xb[i]) != 0;
        }
        float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        if (!finite) /* a NaN or Inf must reach the output, not vanish into int8 */
            db = NAN, id = 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; i += 4) {
            int s = 0;
            for (int k = 0; k < 4; k++) {
                int v = (int)nearbyintf(xb[i + k] * id);
                q[b * 32 + i + k] = (int8_t)v;
                s += v;
            }
            s4[(b * 32 + i) / 4] = s;
            sum += s;
        }
        dds[2 * b] = db;
        dds[2 * b + 1] = db * (float)sum;
    }
}

#define ROW(w, rb, r) ((const char *)(w) + (size_t)(r) * (rb))

/* Plain loops that compilers turn into SIMD on any target (SSE2, NEON); the float
 * kernels below keep 8 partial sums for the same reason (one running sum is a chain
 * the compiler may not reorder) */
static inline int dot32(const int8_t *w, const int8_t *x)
{
    int dot = 0;
    for (int i = 0; i < 32; i++)
        dot += w[i] * x[i];
    return dot;
}

/* 16 nibble bytes -> 32 values (low nibbles first), minus `bias`, into v */
static inline const int8_t *nibbles32(const uint8_t *qs, int bias, int8_t v[32])
{
    for (int i = 0; i < 16; i++) {
        v[i] = (int8_t)((qs[i] & 15) - bias);
        v[i + 16] = (int8_t)((qs[i] >> 4) - bias);
    }
    return v;
}

static void mv_f32(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    const float *x = (const float *)act;
    for (int64_t r = r0; r < r1; r++) {
        const float *row = (const float *)ROW(w, rb, r);
        float acc[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= cols; i += 8)
            for (int k = 0; k < 8; k++)
                acc[k] += row[i + k] * x[i + k];
        float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        for (; i < cols; i++)
            s += row[i] * x[i];
        y[r] = s;
    }
}

static void mv_f16(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    const float *x = (const float *)act;
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *row = (const uint16_t *)ROW(w, rb, r);
        float acc[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= cols; i += 8)
            for (int k = 0; k < 8; k++)
                acc[k] += kie_h2f(row[i + k]) * x[i + k];
        float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        for (; i < cols; i++)
            s += kie_h2f(row[i]) * x[i];
        y[r] = s;
    }
}

static void mv_bf16(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    const float *x = (const float *)act;
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *row = (const uint16_t *)ROW(w, rb, r);
        float acc[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= cols; i += 8)
            for (int k = 0; k < 8; k++)
                acc[k] += kq_bf2f(row[i + k]) * x[i + k];
        float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        for (; i < cols; i++)
            s += kq_bf2f(row[i]) * x[i];
        y[r] = s;
    }
}

static void mv_q8_0(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    kq_act8 a = kq_act8_view(act, cols);
    for (int64_t r = r0; r < r1; r++) {
        const kq_block_q8_0 *bl = (const kq_block_q8_0 *)ROW(w, rb, r);
        float s = 0.0f;
        for (int64_t b = 0; b < cols / 32; b++) {
            int dot = dot32(bl[b].qs, a.q + b * 32);
            s += kie_h2f(bl[b].d) * a.dds[2 * b] * (float)dot;
        }
        y[r] = s;
    }
}

static void mv_q4_0(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    kq_act8 a = kq_act8_view(act, cols);
    for (int64_t r = r0; r < r1; r++) {
        const kq_block_q4_0 *bl = (const kq_block_q4_0 *)ROW(w, rb, r);
        int8_t v[32];
        float s = 0.0f;
        for (int64_t b = 0; b < cols / 32; b++) {
            int dot = dot32(nibbles32(bl[b].qs, 8, v), a.q + b * 32);
            s += kie_h2f(bl[b].d) * a.dds[2 * b] * (float)dot;
        }
        y[r] = s;
    }
}

static void mv_q4_1(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    kq_act8 a = kq_act8_view(act, cols);
    for (int64_t r = r0; r < r1; r++) {
        const kq_block_q4_1 *bl = (const kq_block_q4_1 *)ROW(w, rb, r);
        int8_t v[32];
        float s = 0.0f;
        for (int64_t b = 0; b < cols / 32; b++) {
            int dot = dot32(nibbles32(bl[b].qs, 0, v), a.q + b * 32);
            s += kie_h2f(bl[b].d) * a.dds[2 * b] * (float)dot + kie_h2f(bl[b].m) * a.dds[2 * b + 1];
        }
        y[r] = s;
    }
}

static void mv_q4_k(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    kq_act8 a = kq_act8_view(act, cols);
    for (int64_t r = r0; r < r1; r++) {
        const kq_block_q4_k *bl = (const kq_block_q4_k *)ROW(w, rb, r);
        float s = 0.0f;
        for (int64_t b = 0; b < cols / 256; b++) {
            uint8_t sm[16];
            kq_q4k_scales(bl[b].scales, sm);
            float d = kie_h2f(bl[b].d), dmin = kie_h2f(bl[b].dmin);
            int8_t v[256];
            for (int c = 0; c < 4; c++) /* sub-blocks 2c, 2c+1: low, high nibbles of bytes 32c.. */
                for (int i = 0; i < 32; i++) {
                    v[64 * c + i] = (int8_t)(bl[b].qs[32 * c + i] & 15);
                    v[64 * c + 32 + i] = (int8_t)(bl[b].qs[32 * c + i] >> 4);
                }
            for (int j = 0; j < 8; j++) {
                int dot = dot32(v + 32 * j, a.q + b * 256 + j * 32);
                int64_t k = b * 8 + j;
                s += d * (float)sm[j] * a.dds[2 * k] * (float)dot - dmin * (float)sm[8 + j] * a.dds[2 * k + 1];
            }
        }
        y[r] = s;
    }
}

/* Q6_K element e of a block (0..255): half n = e/128, within it k = (e%128)/32 and
 * l = e%32; low 4 bits: nibble k/2 of ql[64n + 32(k&1) + l], high 2: bits 2k of
 * qh[32n + l]; its scale is scales[e/16]. */
static inline int q6k_value(const kq_block_q6_k *b, int e)
{
    int n = e / 128, k = (e % 128) / 32, l = e % 32;
    int lo = (b->ql[64 * n + 32 * (k & 1) + l] >> (4 * (k / 2))) & 15;
    int hi = (b->qh[32 * n + l] >> (2 * k)) & 3;
    return lo | (hi << 4);
}

/* All 256 values of a Q6_K block, minus 32, in element order: the same mapping as
 * q6k_value, as loops over whole runs of 32 (which compilers vectorize) */
static void q6k_values(const kq_block_q6_k *b, int8_t v[256])
{
    for (int n = 0; n < 2; n++)
        for (int k = 0; k < 4; k++) {
            const uint8_t *ql = b->ql + 64 * n + 32 * (k & 1), *qh = b->qh + 32 * n;
            for (int l = 0; l < 32; l++)
                v[128 * n + 32 * k + l] = (int8_t)((((ql[l] >> (4 * (k / 2))) & 15) | (((qh[l] >> (2 * k)) & 3) << 4)) - 32);
        }
}

static void mv_q6_k(const void *w, size_t rb, int64_t cols, const void *act, float *y, int64_t r0, int64_t r1)
{
    kq_act8 a = kq_act8_view(act, cols);
    for (int64_t r = r0; r < r1; r++) {
        const kq_block_q6_k *bl = (const kq_block_q6_k *)ROW(w, rb, r);
        float s = 0.0f;
        for (int64_t b = 0; b < cols / 256; b++) {
            float d = kie_h2f(bl[b].d);
            int8_t v[256];
            q6k_values(&bl[b], v);
            for (int g = 0; g < 16; g++) {
                const int8_t *aq = a.q + b * 256 + g * 16;
                int dot = 0;
                for (int i = 0; i < 16; i++)
                    dot += v[g * 16 + i] * aq[i];
                s += d * (float)bl[b].scales[g] * a.dds[2 * (b * 8 + g / 2)] * (float)dot;
            }
        }
        y[r] = s;
    }
}

void kq_scalar_dequant_row(int type, const void *row, int64_t cols, float *out)
{
    switch (type) {
    case KQ_F32:
        memcpy(out, row, (size_t)cols * sizeof(float));
        return;
    case KQ_F16:
        for (int64_t i = 0; i < cols; i++)
            out[i] = kie_h2f(((const uint16_t *)row)[i]);
        return;
    case KQ_BF16:
        for (int64_t i = 0; i < cols; i++)
            out[i] = kq_bf2f(((const uint16_t *)row)[i]);
        return;
    case KQ_Q8_0:
        for (int64_t b = 0; b < cols / 32; b++) {
            const kq_block_q8_0 *bl = (const kq_block_q8_0 *)row + b;
            float d = kie_h2f(bl->d);
            for (int i = 0; i < 32; i++)
                out[b * 32 + i] = d * (float)bl->qs[i];
        }
        return;
    case KQ_Q4_0:
        for (int64_t b = 0; b < cols / 32; b++) {
            const kq_block_q4_0 *bl = (const kq_block_q4_0 *)row + b;
            float d = kie_h2f(bl->d);
            for (int i = 0; i < 16; i++) {
                out[b * 32 + i] = d * (float)((bl->qs[i] & 15) - 8);
                out[b * 32 + i + 16] = d * (float)((bl->qs[i] >> 4) - 8);
            }
        }
        return;
    case KQ_Q4_1:
        for (int64_t b = 0; b < cols / 32; b++) {
            const kq_block_q4_1 *bl = (const kq_block_q4_1 *)row + b;
            float d = kie_h2f(bl->d), m = kie_h2f(bl->m);
            for (int i = 0; i < 16; i++) {
                out[b * 32 + i] = d * (float)(bl->qs[i] & 15) + m;
                out[b * 32 + i + 16] = d * (float)(bl->qs[i] >> 4) + m;
            }
        }
        return;
    case KQ_Q4_K:
        for (int64_t b = 0; b < cols / 256; b++) {
            const kq_block_q4_k *bl = (const kq_block_q4_k *)row + b;
            uint8_t sm[16];
            kq_q4k_scales(bl->scales, sm);
            float d = kie_h2f(bl->d), dmin = kie_h2f(bl->dmin);
            for (int j = 0; j < 8; j++) {
                const uint8_t *qs = bl->qs + 32 * (j / 2);
                float dj = d * (float)sm[j], mj = dmin * (float)sm[8 + j];
                for (int i = 0; i < 32; i++)
                    out[b * 256 + j * 32 + i] = dj * (float)((qs[i] >> (4 * (j & 1))) & 15) - mj;
            }
        }
        return;
    case KQ_Q6_K:
        for (int64_t b = 0; b < cols / 256; b++) {
            const kq_block_q6_k *bl = (const kq_block_q6_k *)row + b;
            float d = kie_h2f(bl->d);
            for (int e = 0; e < 256; e++)
                out[b * 256 + e] = d * (float)bl->scales[e / 16] * (float)(q6k_value(bl, e) - 32);
        }
        return;
    default:
        return;
    }
}

const kq_impl kq_impl_scalar = {
    "scalar", quantize_act_scalar, mv_f32, mv_f16, mv_bf16, mv_q8_0, mv_q4_0, mv_q4_1, mv_q4_k, mv_q6_k,
    NULL, NULL, NULL, /* packed: through the row kernels (kq_dispatch.c) */
};
