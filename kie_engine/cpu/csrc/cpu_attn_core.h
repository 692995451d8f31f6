/* cpu_attn_core.h: the attention kernel (cpu_attn.h's kie_attn), written once in plain C
 * that compilers vectorize, and compiled once per instruction set: each including file
 * sets its target, then defines ATTN_FN (the function's name) and ATTN_FMA(a, b, c)
 * (fused on the levels that have FMA, a * b + c on the portable one).
 *
 * Per query, over tiles of 64 positions (position 64t onwards, whoever else is in the
 * call): the 16-position blocks' scores as four partial sums over the head's elements,
 * the tile's maximum, then online softmax: the running sum and output rescaled by
 * exp(old max - new max), and the tile's exp(score - max) added, position by position.
 * A query's result depends on its own inputs only, so one query alone, a token's group
 * of heads, or a prompt's rows together get the same bits. */
#include <math.h>
#include <string.h>

#define ATTN_CAT2(a, b) a##_##b
#define ATTN_CAT(a, b) ATTN_CAT2(a, b)
#define ATTN_LOCAL(name) ATTN_CAT(ATTN_FN, name)

/* exp(x) elementwise for x <= 0 (scores less their maximum): 2^n times a degree-6
 * polynomial of the remainder (|r| <= ln 2 / 2, relative error ~2e-7); 0 below -87
 * (where the float would be subnormal) and for -inf; NaN stays NaN. */
static inline void ATTN_LOCAL(exp16)(float v[16])
{
    for (int c = 0; c < 16; c++) {
        float x = v[c];
        float xc = x < -87.0f ? -87.0f : x;
        float n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f; /* nearest integer */
        float r = ATTN_FMA(n, -0.693145751953125f, xc);
        r = ATTN_FMA(n, -1.428606765330187e-6f, r);
        float p = ATTN_FMA(r, 1.0f / 720, 1.0f / 120);
        p = ATTN_FMA(p, r, 1.0f / 24);
        p = ATTN_FMA(p, r, 1.0f / 6);
        p = ATTN_FMA(p, r, 0.5f);
        p = ATTN_FMA(p, r, 1.0f);
        p = ATTN_FMA(p, r, 1.0f);
        int32_t bits = ((int32_t)n + 127) << 23;
        float scale;
        memcpy(&scale, &bits, 4);
        float e = p * scale;
        v[c] = x != x ? x : (x < -87.0f ? 0.0f : e);
    }
}

/* The scores of one 16-position block: kt is [hd][16] (element d of positions 0..15) */
static inline void ATTN_LOCAL(block)(const float *qs, const float *kt, int hd, float s[16])
{
    float a0[16], a1[16], a2[16], a3[16];
    for (int c = 0; c < 16; c++)
        a0[c] = a1[c] = a2[c] = a3[c] = 0.0f;
    int d = 0;
    for (; d + 4 <= hd; d += 4) {
        const float *k = kt + (size_t)d * 16;
        for (int c = 0; c < 16; c++) {
            a0[c] = ATTN_FMA(qs[d], k[c], a0[c]);
            a1[c] = ATTN_FMA(qs[d + 1], k[16 + c], a1[c]);
            a2[c] = ATTN_FMA(qs[d + 2], k[32 + c], a2[c]);
            a3[c] = ATTN_FMA(qs[d + 3], k[48 + c], a3[c]);
        }
    }
    for (; d < hd; d++) /* hd is even: at most two left */
        for (int c = 0; c < 16; c++)
            a0[c] = ATTN_FMA(qs[d], kt[(size_t)d * 16 + c], a0[c]);
    for (int c = 0; c < 16; c++)
        s[c] = (a0[c] + a1[c]) + (a2[c] + a3[c]);
}

/* n halves or floats from src into dst as floats */
static inline void ATTN_LOCAL(widen)(const void *src, int f16, size_t n, float *dst)
{
    if (!f16) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    const uint16_t *h = (const uint16_t *)src;
    size_t i = 0;
    for (; i < n; i++)
        dst[i] = kie_h2f(h[i]);
}

/* o[d] += sum over positions p < n of w[p] v[p][d], position after position; the
 * running sums of 64 or 16 elements at a time live in registers across the positions */
static inline void ATTN_LOCAL(mix)(const float *w, const float *vt, int n, int hd, float *o)
{
    int d0 = 0;
    for (; d0 + 64 <= hd; d0 += 64) {
        float acc[64];
        memcpy(acc, o + d0, sizeof acc);
        for (int p = 0; p < n; p++)
            for (int c = 0; c < 64; c++)
                acc[c] = ATTN_FMA(w[p], vt[(size_t)p * hd + d0 + c], acc[c]);
        memcpy(o + d0, acc, sizeof acc);
    }
    for (; d0 + 16 <= hd; d0 += 16) {
        float acc[16];
        memcpy(acc, o + d0, sizeof acc);
        for (int p = 0; p < n; p++)
            for (int c = 0; c < 16; c++)
                acc[c] = ATTN_FMA(w[p], vt[(size_t)p * hd + d0 + c], acc[c]);
        memcpy(o + d0, acc, sizeof acc);
    }
    for (; d0 < hd; d0++)
        for (int p = 0; p < n; p++)
            o[d0] = ATTN_FMA(w[p], vt[(size_t)p * hd + d0], o[d0]);
}

static inline float ATTN_LOCAL(sum16)(const float v[16])
{
    float t[8];
    for (int c = 0; c < 8; c++)
        t[c] = v[c] + v[c + 8];
    for (int c = 0; c < 4; c++)
        t[c] += t[c + 4];
    return (t[0] + t[2]) + (t[1] + t[3]);
}

void ATTN_FN(const kie_attn_job *a, float *scratch)
{
    const int hd = a->hd, nq = a->nq;
    const size_t esz = a->f16 ? 2 : 4, qst = ((size_t)2 * hd + 2 + 15) & ~(size_t)15;
#if defined(__GNUC__) || defined(__clang__)
    for (int r = 0; r < 2; r++) /* the caller's next reads, at once: this kernel's loops stay plain */
        for (size_t o = 0; o < a->pf.bytes[r]; o += 64)
            __builtin_prefetch((const char *)a->pf.at[r] + o, 0, 2);
#endif
    float *kt = scratch, *vt = kt + (size_t)KIE_ATTN_TILE * hd, *st = vt + (size_t)KIE_ATTN_TILE * hd;
    int maxn = 0;
    for (int i = 0; i < nq; i++) { /* per query: q * scale, output, max, sum */
        float *qs = st + i * qst, *o = qs + hd;
        for (int d = 0; d < hd; d++) {
            qs[d] = a->q[i][d] * a->scale;
            o[d] = 0.0f;
        }
        o[hd] = -INFINITY;
        o[hd + 1] = 0.0f;
        if (a->n[i] > maxn)
            maxn = a->n[i];
    }
    for (int t0 = 0; t0 < maxn; t0 += KIE_ATTN_TILE) {
        const int tn = maxn - t0 < KIE_ATTN_TILE ? maxn - t0 : KIE_ATTN_TILE, nb = (tn + 15) / 16;
        /* the tile's keys (whole blocks: the cache's capacity is a multiple of 16) and
         * values; position cur (when in the tile, the last one: another thread may be
         * writing it to the cache) from kcur / vcur, and the cache read only before it */
        const char *kc = (const char *)a->k + (size_t)t0 * hd * esz, *vc = (const char *)a->v + (size_t)t0 * hd * esz;
        if (a->cur >= t0 && a->cur < t0 + tn) {
            const int c = a->cur - t0, cb = c / 16, cc = c % 16;
            ATTN_LOCAL(widen)(kc, a->f16, (size_t)cb * 16 * hd, kt);
            ATTN_LOCAL(widen)(vc, a->f16, (size_t)c * hd, vt);
            float *kb = kt + (size_t)cb * 16 * hd;
            for (int d = 0; d < hd; d++) {
                ATTN_LOCAL(widen)(kc + ((size_t)cb * 16 * hd + (size_t)d * 16) * esz, a->f16, (size_t)cc, kb + d * 16);
                kb[d * 16 + cc] = a->kcur[d];
                for (int e = cc + 1; e < 16; e++)
                    kb[d * 16 + e] = 0.0f;
                vt[(size_t)c * hd + d] = a->vcur[d];
            }
        } else {
            ATTN_LOCAL(widen)(kc, a->f16, (size_t)nb * 16 * hd, kt);
            ATTN_LOCAL(widen)(vc, a->f16, (size_t)tn * hd, vt);
        }
        for (int i = 0; i < nq; i++) {
            if (a->n[i] <= t0)
                continue;
            float *qs = st + i * qst, *o = qs + hd;
            const int vn = a->n[i] - t0 < KIE_ATTN_TILE ? a->n[i] - t0 : KIE_ATTN_TILE, vb = (vn + 15) / 16;
            float s[KIE_ATTN_TILE], mx[16], al[16];
            for (int b = 0; b < vb; b++)
                ATTN_LOCAL(block)(qs, kt + (size_t)b * 16 * hd, hd, s + 16 * b);
            for (int c = vn; c < 16 * vb; c++)
                s[c] = -INFINITY;
            for (int c = 0; c < 16; c++)
                mx[c] = s[c];
            for (int b = 1; b < vb; b++)
                for (int c = 0; c < 16; c++)
                    mx[c] = s[16 * b + c] > mx[c] ? s[16 * b + c] : mx[c];
            float m = o[hd];
            for (int c = 0; c < 16; c++)
                m = mx[c] > m ? mx[c] : m;
            for (int c = 0; c < 16; c++)
                al[c] = o[hd] - m;
            ATTN_LOCAL(exp16)(al); /* exp(old max - new max): 0 on the first tile */
            float psum = 0.0f;
            for (int b = 0; b < vb; b++) {
                for (int c = 0; c < 16; c++)
                    s[16 * b + c] -= m;
                ATTN_LOCAL(exp16)(s + 16 * b);
                psum += ATTN_LOCAL(sum16)(s + 16 * b);
            }
            o[hd + 1] = ATTN_FMA(o[hd + 1], al[0], psum);
            for (int d = 0; d < hd; d++)
                o[d] *= al[0];
            ATTN_LOCAL(mix)(s, vt, vn, hd, o);
            o[hd] = m;
        }
    }
    for (int i = 0; i < nq; i++) {
        const float *o = st + i * qst + hd;
        float inv = 1.0f / o[hd + 1];
        for (int d = 0; d < hd; d++)
            a->out[i][d] = o[d] * inv;
    }
}

#undef ATTN_LOCAL
#undef ATTN_CAT
#undef ATTN_CAT2
