/* Elementary functions for the C CPU kernels, written so that loops calling
 * them vectorise (libm's expf does not without -ffast-math). */
#pragma once
#include <stdint.h>

#include "cpu_dtype.h"

/* e^x in fp32, within 2 ulp of the exact value for normal results: x = n ln2
 * + r with |r| <= ln2/2, e^r from a degree-6 polynomial (Cephes' coefficients),
 * times 2^n applied as two factors, so that IEEE overflow and underflow give
 * inf and 0 (and gradual subnormals) without branches. NaN stays NaN; the
 * clamp to [-150, 100] only keeps n within the range of the two factors.
 *
 * FO_EXP_STEPS is the arithmetic between the clamp and the factors, for a
 * float or an fo_vf x (scalars broadcast): it declares t (x log2 e + MAGIC,
 * whose low bits are the integer n), n and p (e^r). */
#define FO_EXP_MAGIC 12582912.f /* 1.5 * 2^23: adding it rounds to an integer */
#define FO_EXP_STEPS(T, x, t, n, p)                                                    \
  const T t = (x) * 1.44269504088896341f + FO_EXP_MAGIC;                             \
  const T n = t - FO_EXP_MAGIC;                                                      \
  const T r_ = ((x) - n * 0.693359375f) - n * -2.12194440e-4f; /* ln2 in two parts */ \
  T p = r_ * 1.9875691500e-4f + 1.3981999507e-3f;                                    \
  p = p * r_ + 8.3334519073e-3f;                                                     \
  p = p * r_ + 4.1665795894e-2f;                                                     \
  p = p * r_ + 1.6666665459e-1f;                                                     \
  p = p * r_ + 5.0000001201e-1f;                                                     \
  p = p * r_ * r_ + r_ + 1.f

static inline float fo_expf(float x) {
  x = x < -150.f ? -150.f : x;
  x = x > 100.f ? 100.f : x;
  FO_EXP_STEPS(float, x, t, n, p);
  const int32_t ni = (int32_t)(fo_f32_bits(t) - fo_f32_bits(FO_EXP_MAGIC));
  const int32_t half = ni >> 1;
  const float s1 = fo_bits_f32((uint32_t)(half + 127) << 23);
  const float s2 = fo_bits_f32((uint32_t)(ni - half + 127) << 23);
  return p * s1 * s2;
}

/* fo_expf of each lane, in vector operations (the same steps, so the same
 * value a lane), where a loop calling fo_expf lane by lane compiled to
 * scalar code at x86-64-v3 (xent_cpu.c's exponentials: 480 scalar
 * instructions in that copy, and 0.2-0.6x eager's cross-entropy on an AVX2
 * CPU; docs/perf-notes.md). The clamps are selects: a NaN lane compares
 * false and passes through, as in fo_expf. */
static inline fo_vf fo_vexpf(fo_vf x) {
#if FO_LEVEL >= 4
  /* The clamps one vmaxps / vminps each (a NaN in the second operand is
   * their result), and 2^n by vscalefps: p 2^n rounded once, as the two
   * factors below round it (exact unless subnormal), so the same value. */
  x = (fo_vf)_mm512_min_ps(_mm512_set1_ps(100.f), _mm512_max_ps(_mm512_set1_ps(-150.f), (__m512)x));
  FO_EXP_STEPS(fo_vf, x, t, n, p);
  (void)t;
  return (fo_vf)_mm512_scalef_ps((__m512)p, (__m512)n);
#else
#if FO_LEVEL == 3
  x = (fo_vf)_mm256_min_ps(_mm256_set1_ps(100.f), _mm256_max_ps(_mm256_set1_ps(-150.f), (__m256)x));
#else
  const fo_vi lo = x < -150.f, hi = x > 100.f;
  x = fo_vselect(lo, (fo_vf){0} - 150.f, x);
  x = fo_vselect(hi, (fo_vf){0} + 100.f, x);
#endif
  FO_EXP_STEPS(fo_vf, x, t, n, p);
  const fo_vi ni = (fo_vi)t - (int32_t)fo_f32_bits(FO_EXP_MAGIC);
  const fo_vi half = ni >> 1;
  const fo_vf s1 = (fo_vf)((half + 127) << 23);
  const fo_vf s2 = (fo_vf)((ni - half + 127) << 23);
  return p * s1 * s2;
#endif
}

/* tanh of each lane as 1 - 2 / (e^2x + 1): within a few ulp of 1 absolute
 * (near 0 the result's own ulp is finer: an absolute, not a relative, bound),
 * exactly +-1 past |x| ~ 9, NaN for NaN, +-1 for +-inf. */
static inline fo_vf fo_vtanhf(fo_vf x) {
  return 1.f - 2.f / (fo_vexpf(x + x) + 1.f);
}
