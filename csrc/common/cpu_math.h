/* Elementary functions for the C CPU kernels, written so that loops calling
 * them vectorise (libm's expf does not without -ffast-math). */
#pragma once
#include <stdint.h>

#include "cpu_dtype.h"

/* e^x in fp32, within 2 ulp of the exact value for normal results: x = n ln2
 * + r with |r| <= ln2/2, e^r from a degree-6 polynomial (Cephes' coefficients),
 * times 2^n applied as two factors, so that IEEE overflow and underflow give
 * inf and 0 (and gradual subnormals) without branches. NaN stays NaN; the
 * clamp only keeps n within the range of the two factors. */
static inline float fo_expf(float x) {
  x = x < -150.f ? -150.f : x;
  x = x > 100.f ? 100.f : x;
  const float magic = 12582912.f; /* 1.5 * 2^23: adding it rounds to an integer */
  const float t = x * 1.44269504088896341f + magic;
  const float n = t - magic;
  const int32_t ni = (int32_t)(fo_f32_bits(t) - fo_f32_bits(magic));
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f; /* ln2 in two parts */
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t half = ni >> 1;
  const float s1 = fo_bits_f32((uint32_t)(half + 127) << 23);
  const float s2 = fo_bits_f32((uint32_t)(ni - half + 127) << 23);
  return p * s1 * s2;
}
