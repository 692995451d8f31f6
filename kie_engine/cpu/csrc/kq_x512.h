/* kq_x512.h: small AVX-512 helpers that the files compiled for that level share
 * (included after their target pragma). */
#ifndef KQ_X512_H
#define KQ_X512_H

#include <immintrin.h>
#include <stdint.h>

/* The sums of each 4-lane group of v, in the 4 lanes of the result (group k -> lane k) */
static inline __m128 sum_groups4(__m512 v)
{
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v));
}

/* Group g's four rows into y[g..g+3], only those in [r0, r1) */
static inline void store_group(float *y, int64_t g, int64_t r0, int64_t r1, __m128 v)
{
    if (g >= r0 && g + 4 <= r1) {
        _mm_storeu_ps(y + g, v);
    } else {
        float t[4];
        _mm_storeu_ps(t, v);
        for (int k = 0; k < 4; k++)
            if (g + k >= r0 && g + k < r1)
                y[g + k] = t[k];
    }
}

#endif
