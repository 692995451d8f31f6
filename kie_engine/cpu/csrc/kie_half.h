/* kie_half.h: IEEE half -> float without F16C, for the kernels and the KV cache. */
#ifndef KIE_HALF_H
#define KIE_HALF_H

#include <stdint.h>
#include <string.h>

/* IEEE half -> float, exact, no F16C needed, without branches a compiler cannot turn
 * into selects: the half's exponent and mantissa shifted into a float's place read as
 * a float 2^112 too small for every finite half (normal or subnormal: the product is
 * exact), so one multiply rescales it; infinities and NaNs get the float's all-ones
 * exponent instead. */
static inline float kie_h2f(uint16_t h)
{
    uint32_t mag = (uint32_t)(h & 0x7fff) << 13, bits;
    float f;
    memcpy(&f, &mag, 4);
    f *= 0x1p112f;
    memcpy(&bits, &f, 4);
    bits = (h & 0x7c00) == 0x7c00 ? 0x7f800000u | mag : bits;
    bits |= (uint32_t)(h & 0x8000) << 16;
    memcpy(&f, &bits, 4);
    return f;
}

#endif
