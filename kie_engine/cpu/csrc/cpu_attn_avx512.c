/* cpu_attn_avx512.c: kie_attn (cpu_attn.h) in AVX-512 intrinsics.
 *
 * Per tile of 64 positions, the queries that reach it go by threes (a KV head's query
 * heads in SmolLM2): each key element (widened from half precision in a register, never
 * stored) serves the group on the tile's four 16-position blocks, and each value row the
 * group's running outputs.  A query's arithmetic does not depend on its partners: its
 * scores are two chains of fused multiply-adds per block (even and odd elements of the
 * head, two chains so that one query alone is not bound by the adds' latency), its
 * softmax is online over the tiles (running maximum, sum and output rescaled by
 * exp(old max - new max)), its output adds even and odd positions in two sums, and
 * positions past its own end never enter it.  So one query alone, a token's heads
 * together, or a prompt's rows get the same bits.  The caller's next reads (the job's pf)
 * are prefetched a few lines at each step of the loops: a decode step's attention is a
 * string of short calls whose caches come from memory, and this way the next call's
 * cache arrives while this one computes. */
#include "cpu_attn.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <math.h>
#include <string.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

#define QG 3 /* queries per group: a KV head's three query heads of SmolLM2 at once */

/* exp(x) for x <= 0, as cpu_attn_core.h's: 2^n p(r), 0 below -87, NaN kept */
static inline __m512 exp16(__m512 x)
{
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    __m512 xc = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), xc);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187e-6f), r);
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.0f / 720), _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    y = _mm512_maskz_mov_ps((__mmask16)~under, y);
    return _mm512_mask_mov_ps(y, nan, x);
}

#define INLINE static inline __attribute__((always_inline))

INLINE __m512 load16(const void *base, int f16, size_t i)
{
    if (f16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
    return _mm512_loadu_ps((const float *)base + i);
}

INLINE __m512 load16_mask(const void *base, int f16, size_t i, __mmask16 m)
{
    if (f16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)base + i));
    return _mm512_maskz_loadu_ps(m, (const float *)base + i);
}

/* The caller's next reads (kie_attn_job's pf), a cache line at a time: `per` lines at
 * each step of the loops below, so that the lines arrive while this call computes,
 * rather than all at once, which would hold the core up until memory had most of them */
typedef struct {
    const char *p, *end, *p2, *end2;
    int per;
} pfcur;

INLINE void pf_more(pfcur *c)
{
    for (int i = 0; i < c->per; i++) {
        if (c->p >= c->end) {
            if (c->p2 >= c->end2)
                return;
            c->p = c->p2;
            c->end = c->end2;
            c->p2 = c->end2;
        }
        _mm_prefetch(c->p, _MM_HINT_T1);
        c->p += 64;
    }
}

/* Per query: scaled q [hd], output [hd], then max and sum; hd rounded up to 16 */
typedef struct {
    float *qs, *o, *ml;
    int n;
} qstate;

/* The scores of QN queries on blocks [0, NB) of the tile at K: per (query, block) two
 * chains over the head's elements (even, odd), added at the end.  F16, QN and NB are
 * constants where this is inlined, so every array below lives in registers and a tile's
 * last blocks cost nothing when its positions end before them. */
INLINE void scores(const void *K, int F16, int hd, const float *const *qs, int QN, int NB, __m512 s[QG][4], pfcur *pf)
{
    __m512 acc[QG][4][2];
    for (int q = 0; q < QN; q++)
        for (int b = 0; b < NB; b++)
            acc[q][b][0] = acc[q][b][1] = _mm512_setzero_ps();
    for (int d = 0; d < hd; d += 2) { /* hd is even */
        pf_more(pf);
        for (int par = 0; par < 2; par++) {
            __m512 k[4];
            for (int b = 0; b < NB; b++)
                k[b] = load16(K, F16, ((size_t)b * hd + d + par) * 16);
            for (int q = 0; q < QN; q++) {
                __m512 x = _mm512_set1_ps(qs[q][d + par]);
                for (int b = 0; b < NB; b++)
                    acc[q][b][par] = _mm512_fmadd_ps(x, k[b], acc[q][b][par]);
            }
        }
    }
    for (int q = 0; q < QN; q++)
        for (int b = 0; b < NB; b++)
            s[q][b] = _mm512_add_ps(acc[q][b][0], acc[q][b][1]);
}

/* scores() with QN queries of F16 keys, NB taken from nb */
INLINE void scores_nb(const void *K, int F16, int hd, const float *const *qs, int QN, int nb, __m512 s[QG][4],
                      pfcur *pf)
{
    switch (nb) {
    case 1: scores(K, F16, hd, qs, QN, 1, s, pf); break;
    case 2: scores(K, F16, hd, qs, QN, 2, s, pf); break;
    case 3: scores(K, F16, hd, qs, QN, 3, s, pf); break;
    default: scores(K, F16, hd, qs, QN, 4, s, pf); break;
    }
}

/* o[0 .. NV * 16) of QN queries += w[q][p] V[p] over each one's positions p < vn[q]
 * (rows of V hd apart, the last vector masked by tail): even and odd positions in two
 * sums, added at the end */
INLINE void mix(const void *V, int F16, int hd, float *const *o, const float w[QG][64], const int *vn, int QN,
                int NV, __mmask16 tail, pfcur *pf)
{
    int vmax = 0;
    __m512 acc[QG][4][2];
    for (int q = 0; q < QN; q++) {
        vmax = vn[q] > vmax ? vn[q] : vmax;
        for (int c = 0; c < NV; c++) {
            acc[q][c][0] = _mm512_maskz_loadu_ps(c == NV - 1 ? tail : 0xffff, o[q] + 16 * c);
            acc[q][c][1] = _mm512_setzero_ps();
        }
    }
    for (int p0 = 0; p0 < vmax; p0 += 2) {
        pf_more(pf);
        for (int par = 0; par < 2; par++) {
            const int p = p0 + par;
            if (p >= vmax)
                break;
            __m512 v[4];
            for (int c = 0; c < NV; c++)
                v[c] = c == NV - 1 ? load16_mask(V, F16, (size_t)p * hd + 16 * c, tail)
                                   : load16(V, F16, (size_t)p * hd + 16 * c);
            for (int q = 0; q < QN; q++) {
                if (p >= vn[q])
                    continue;
                __m512 x = _mm512_set1_ps(w[q][p]);
                for (int c = 0; c < NV; c++)
                    acc[q][c][par] = _mm512_fmadd_ps(x, v[c], acc[q][c][par]);
            }
        }
    }
    for (int q = 0; q < QN; q++)
        for (int c = 0; c < NV; c++)
            _mm512_mask_storeu_ps(o[q] + 16 * c, c == NV - 1 ? tail : 0xffff, _mm512_add_ps(acc[q][c][0], acc[q][c][1]));
}

/* The online softmax of one query on a tile: s its scores (vn valid), into w its
 * weights; its max, sum and output rescaled. */
static inline void softmax_tile(qstate *g, __m512 s[4], int vn, int hd, float w[64])
{
    const int vb = (vn + 15) / 16;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int b = 0; b < vb; b++) {
        int left = vn - 16 * b;
        __mmask16 valid = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        s[b] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s[b]);
        mx = _mm512_max_ps(mx, s[b]);
    }
    float m_old = g->ml[0], m = _mm512_reduce_max_ps(mx);
    m = m_old > m ? m_old : m;
    float al = _mm512_cvtss_f32(exp16(_mm512_set1_ps(m_old - m)));
    __m512 sum = _mm512_setzero_ps(), mv = _mm512_set1_ps(m);
    for (int b = 0; b < vb; b++) {
        __m512 p = exp16(_mm512_sub_ps(s[b], mv));
        sum = _mm512_add_ps(sum, p);
        _mm512_storeu_ps(w + 16 * b, p);
    }
    g->ml[0] = m;
    g->ml[1] = g->ml[1] * al + _mm512_reduce_add_ps(sum);
    __m512 alv = _mm512_set1_ps(al);
    for (int d = 0; d < hd; d += 16) {
        __mmask16 mk = hd - d >= 16 ? 0xffff : (__mmask16)((1u << (hd - d)) - 1);
        _mm512_mask_storeu_ps(g->o + d, mk, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, g->o + d), alv));
    }
}

/* QN queries (F16: the cache's type) on the tile at t0 with tn positions */
INLINE void group(const void *K, const void *V, int F16, int hd, qstate *g, int QN, int t0, int tn, pfcur *pf)
{
    const int nb = (tn + 15) / 16;
    __m512 s[QG][4];
    float w[QG][64];
    int vn[QG];
    const float *qs[QG];
    float *o[QG];
    for (int q = 0; q < QN; q++)
        qs[q] = g[q].qs;
    scores_nb((const char *)K + (size_t)t0 * hd * (F16 ? 2 : 4), F16, hd, qs, QN, nb, s, pf);
    for (int q = 0; q < QN; q++) {
        vn[q] = g[q].n - t0 < 64 ? g[q].n - t0 : 64;
        softmax_tile(&g[q], s[q], vn[q], hd, w[q]);
    }
    const char *vt = (const char *)V + (size_t)t0 * hd * (F16 ? 2 : 4);
    for (int d0 = 0; d0 < hd; d0 += 64) {
        for (int q = 0; q < QN; q++)
            o[q] = g[q].o + d0;
        const char *vd = vt + (size_t)d0 * (F16 ? 2 : 4);
        int left = hd - d0;
        if (left >= 64) {
            mix(vd, F16, hd, o, (const float(*)[64])w, vn, QN, 4, 0xffff, pf);
        } else {
            __mmask16 tail = left % 16 ? (__mmask16)((1u << (left % 16)) - 1) : 0xffff;
            switch ((left + 15) / 16) {
            case 1: mix(vd, F16, hd, o, (const float(*)[64])w, vn, QN, 1, tail, pf); break;
            case 2: mix(vd, F16, hd, o, (const float(*)[64])w, vn, QN, 2, tail, pf); break;
            default: mix(vd, F16, hd, o, (const float(*)[64])w, vn, QN, 3, tail, pf); break;
            }
        }
    }
}

static void group_tile(const kie_attn_job *a, qstate *g, int qn, int t0, int tn, pfcur *pf)
{
    if (a->f16) {
        if (qn == 3)
            group(a->k, a->v, 1, a->hd, g, 3, t0, tn, pf);
        else if (qn == 2)
            group(a->k, a->v, 1, a->hd, g, 2, t0, tn, pf);
        else
            group(a->k, a->v, 1, a->hd, g, 1, t0, tn, pf);
    } else {
        if (qn == 3)
            group(a->k, a->v, 0, a->hd, g, 3, t0, tn, pf);
        else if (qn == 2)
            group(a->k, a->v, 0, a->hd, g, 2, t0, tn, pf);
        else
            group(a->k, a->v, 0, a->hd, g, 1, t0, tn, pf);
    }
}

/* n values from src + i (halves or floats) as floats into dst */
static inline void widen(const void *src, int f16, size_t i, int n, float *dst)
{
    for (int c = 0; c < n; c += 16) {
        __mmask16 m = n - c >= 16 ? 0xffff : (__mmask16)((1u << (n - c)) - 1);
        _mm512_mask_storeu_ps(dst + c, m, load16_mask(src, f16, i + c, m));
    }
}

/* The tile at t0 holding position cur as floats: the cache read only before cur (another
 * thread may be writing cur's place), cur from kcur / vcur, zeros after it. */
static void cur_tile(const kie_attn_job *a, int t0, float *ktile, float *vtile)
{
    const int hd = a->hd, c = a->cur - t0, cb = c / 16, cc = c % 16;
    const size_t base = (size_t)t0 * hd;
    widen(a->k, a->f16, base, cb * 16 * hd, ktile);
    for (int d = 0; d < hd; d++) {
        size_t li = ((size_t)cb * hd + d) * 16;
        __m512 v = load16_mask(a->k, a->f16, base + li, (__mmask16)((1u << cc) - 1));
        _mm512_storeu_ps(ktile + li, _mm512_mask_mov_ps(v, (__mmask16)(1u << cc), _mm512_set1_ps(a->kcur[d])));
    }
    widen(a->v, a->f16, base, c * hd, vtile);
    memcpy(vtile + (size_t)c * hd, a->vcur, sizeof(float) * hd);
}

void kie_attn_avx512(const kie_attn_job *a, float *scratch)
{
    const int hd = a->hd, nq = a->nq, hd16 = (hd + 15) & ~15;
    const float *kc = a->k, *vc = a->v;
    qstate st[KIE_ATTN_MAXQ];
    /* a position not in the cache yet (cur): the caller's K and V, in a tile of their own */
    float *ktile = scratch, *vtile = ktile + (size_t)KIE_ATTN_TILE * hd, *state = vtile + (size_t)KIE_ATTN_TILE * hd;
    int maxn = 0;
    for (int i = 0; i < nq; i++) {
        qstate *q = &st[i];
        q->qs = state + (size_t)i * (2 * hd16 + 16);
        q->o = q->qs + hd16;
        q->ml = q->o + hd16;
        q->n = a->n[i];
        for (int d = 0; d < hd; d++) {
            q->qs[d] = a->q[i][d] * a->scale;
            q->o[d] = 0.0f;
        }
        q->ml[0] = -INFINITY;
        q->ml[1] = 0.0f;
        maxn = a->n[i] > maxn ? a->n[i] : maxn;
    }
    /* the caller's next reads, spread over the loops' steps (a step: two elements of the
     * head in the scores, two positions in the output) */
    const kie_attn_next *nx = &a->pf;
    pfcur pf = {(const char *)((uintptr_t)nx->at[0] & ~(uintptr_t)63), (const char *)nx->at[0] + nx->bytes[0],
                (const char *)((uintptr_t)nx->at[1] & ~(uintptr_t)63), (const char *)nx->at[1] + nx->bytes[1], 0};
    if (nx->bytes[0] + nx->bytes[1]) {
        size_t lines = (nx->bytes[0] + nx->bytes[1]) / 64 + 2, steps = 0;
        for (int t0 = 0; t0 < maxn; t0 += KIE_ATTN_TILE) {
            int qn = 0, vmax = 0;
            for (int i = 0; i < nq; i++)
                if (st[i].n > t0) {
                    qn++;
                    vmax = st[i].n - t0 > vmax ? st[i].n - t0 : vmax;
                }
            vmax = vmax < KIE_ATTN_TILE ? vmax : KIE_ATTN_TILE;
            steps += (size_t)(qn + QG - 1) / QG * ((hd + 1) / 2 + (vmax + 1) / 2 * ((hd + 63) / 64));
        }
        pf.per = (int)((lines + steps - 1) / (steps ? steps : 1));
    }
    kie_attn_job t = *a;
    for (int t0 = 0; t0 < maxn; t0 += KIE_ATTN_TILE) {
        const int tn = maxn - t0 < KIE_ATTN_TILE ? maxn - t0 : KIE_ATTN_TILE;
        t.k = kc;
        t.v = vc;
        t.f16 = a->f16;
        int base = t0;
        if (a->cur >= t0 && a->cur < t0 + tn) {
            cur_tile(a, t0, ktile, vtile);
            t.k = ktile;
            t.v = vtile;
            t.f16 = 0;
            base = 0;
        }
        /* the queries that reach this tile, QG at a time */
        qstate g[QG];
        int qn = 0;
        for (int i = 0; i < nq; i++) {
            if (st[i].n <= t0)
                continue;
            g[qn] = st[i];
            g[qn].n -= t0 - base; /* positions relative to the tile's own base */
            if (++qn == QG || i == nq - 1) {
                group_tile(&t, g, qn, base, tn, &pf);
                qn = 0;
            }
        }
        if (qn)
            group_tile(&t, g, qn, base, tn, &pf);
    }
    for (int i = 0; i < nq; i++) {
        float inv = 1.0f / st[i].ml[1];
        for (int d = 0; d < hd; d++)
            a->out[i][d] = st[i].o[d] * inv;
    }
}

#pragma GCC pop_options
#endif
