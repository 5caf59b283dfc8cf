/* fo_vexpf (csrc/common/cpu_math.h) against fo_expf, its scalar twin: the
 * vector code is to give the same value a lane (NaN for NaN). Inputs: every
 * 97th bit pattern, and every float where the result rounds to a subnormal
 * or overflows (the two-factor scaling's cases). Built by
 * tests/test_cpu_math.py once per level; prints the count of differing
 * inputs and the first few. */
#include <stdio.h>

#include "common/cpu_math.h"

static int is_nan(uint32_t u) { return ((u >> 23) & 255) == 255 && (u & 0x7fffff); }

static long bad;

/* Bit patterns first, first + step, ... below end. */
static void check(uint64_t first, uint64_t end, uint64_t step) {
  for (uint64_t b = first; b < end; b += FO_VL * step) {
    fo_vu u;
    for (int k = 0; k < FO_VL; ++k) u[k] = (uint32_t)(b + k * step < end ? b + k * step : first);
    const fo_vu v = (fo_vu)fo_vexpf((fo_vf)u);
    for (int k = 0; k < FO_VL; ++k) {
      const uint32_t s = fo_f32_bits(fo_expf(fo_bits_f32(u[k])));
      if (v[k] == s || (is_nan(v[k]) && is_nan(s))) continue;
      if (bad++ < 5) printf("x %08x: vector %08x, scalar %08x\n", (unsigned)u[k], (unsigned)v[k], (unsigned)s);
    }
  }
}

int main(void) {
  check(0, 1ull << 32, 97);
  check(fo_f32_bits(-106.f), fo_f32_bits(-86.f) + 1ull, 1); /* negative: bits grow with |x| */
  check(fo_f32_bits(88.f), fo_f32_bits(89.f) + 1ull, 1);
  printf("differing %ld\n", bad);
  return bad != 0;
}
