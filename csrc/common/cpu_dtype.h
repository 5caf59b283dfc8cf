/* fp16 / bf16 <-> fp32 conversion for the C CPU kernels, and row load/store
 * helpers. Branch-free bit manipulation (round to nearest even, NaN kept), so
 * that loops over rows vectorise with no special instruction set. */
#pragma once
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "fo_types.h"

/* Hot loops of the CPU kernels are compiled once per x86-64 level (v4:
 * AVX-512, v3: AVX2 + FMA, and the baseline) and picked at load time: one
 * binary, full-width vectors on whatever CPU it runs on. Everything a marked
 * function calls is static inline and is compiled into each clone. Use feature
 * levels, not arch= CPU names: target_clones("arch=haswell") is a CPU-model
 * test and picked the baseline clone on an AMD EPYC. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FO_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FO_CLONES
#endif

static inline float fo_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t fo_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float fo_bf16_to_f32(uint16_t h) { return fo_bits_f32((uint32_t)h << 16); }

static inline uint16_t fo_f32_to_bf16(float f) {
  uint32_t u = fo_f32_bits(f);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = ((u >> 16) | 0x40u);  /* quiet NaN, sign and payload top kept */
  return (uint16_t)(((u & 0x7FFFFFFFu) > 0x7F800000u) ? nan : rounded);
}

/* IEEE half -> float. Normal numbers: shift the exponent/mantissa into place and
 * rescale by 2^-112; subnormals: build 0.5 + m*2^-24 in the float mantissa and
 * subtract 0.5. Inf/NaN come out of the normal path as exponent 255. */
static inline float fo_f16_to_f32(uint16_t h) {
  const uint32_t w = (uint32_t)h << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normal = fo_bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float subnormal = fo_bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  /* a mask, not a branch: GCC will not vectorise the select of two bit casts */
  const uint32_t sub = 0u - (uint32_t)(two_w < (1u << 27));
  const uint32_t mag = (fo_f32_bits(subnormal) & sub) | (fo_f32_bits(normal) & ~sub);
  return fo_bits_f32(sign | mag);
}

/* float -> IEEE half, round to nearest even. Scaling by 2^112 then 2^-110
 * makes the FPU do the rounding at the half's precision (and saturate to inf);
 * adding a power of two aligned to the value's exponent drops the bits. */
static inline uint16_t fo_f32_to_f16(float f) {
  float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = fo_f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = fo_bits_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = fo_f32_bits(base);
  const uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
  const uint32_t nan = 0u - (uint32_t)(shl1_w > 0xFF000000u);  /* masks: vectorises */
  return (uint16_t)((sign >> 16) | (0x7E00u & nan) | (nonsign & ~nan));
}

/* out[j] = (float)in[j] for n elements of dtype t. */
static inline void fo_load_row(fo_dtype t, const void *in, float *restrict out, int64_t n) {
  if (t == FO_F32) {
    memcpy(out, in, (size_t)n * 4);
  } else if (t == FO_BF16) {
    const uint16_t *p = (const uint16_t *)in;
    for (int64_t j = 0; j < n; ++j) out[j] = fo_bf16_to_f32(p[j]);
  } else {
    const uint16_t *p = (const uint16_t *)in;
    for (int64_t j = 0; j < n; ++j) out[j] = fo_f16_to_f32(p[j]);
  }
}

/* out[j] = in[j] rounded to dtype t, for n elements. */
static inline void fo_store_row(fo_dtype t, void *out, const float *restrict in, int64_t n) {
  if (t == FO_F32) {
    memcpy(out, in, (size_t)n * 4);
  } else if (t == FO_BF16) {
    uint16_t *p = (uint16_t *)out;
    for (int64_t j = 0; j < n; ++j) p[j] = fo_f32_to_bf16(in[j]);
  } else {
    uint16_t *p = (uint16_t *)out;
    for (int64_t j = 0; j < n; ++j) p[j] = fo_f32_to_f16(in[j]);
  }
}

/* v[j] = (float)(dtype t)v[j]: round in place to what storing in t keeps. */
static inline void fo_round_row(fo_dtype t, float *restrict v, int64_t n) {
  if (t == FO_BF16) {
    for (int64_t j = 0; j < n; ++j) v[j] = fo_bf16_to_f32(fo_f32_to_bf16(v[j]));
  } else if (t == FO_F16) {
    for (int64_t j = 0; j < n; ++j) v[j] = fo_f16_to_f32(fo_f32_to_f16(v[j]));
  }
}

/* Sum of n floats with 16 independent fp32 accumulators (vectorisable, and
 * more accurate than one running sum). */
static inline float fo_sum(const float *restrict v, int64_t n) {
  float acc[16] = {0};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int k = 0; k < 16; ++k) acc[k] += v[j + k];
  for (; j < n; ++j) acc[j & 15] += v[j];
  for (int w = 8; w > 0; w >>= 1)
    for (int k = 0; k < w; ++k) acc[k] += acc[k + w];
  return acc[0];
}

/* Sum of (v[j] - c)^2, same scheme: the squared deviations of a row. */
static inline float fo_sqdev(const float *restrict v, float c, int64_t n) {
  float acc[16] = {0};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int k = 0; k < 16; ++k) acc[k] += (v[j + k] - c) * (v[j + k] - c);
  for (; j < n; ++j) acc[j & 15] += (v[j] - c) * (v[j] - c);
  for (int w = 8; w > 0; w >>= 1)
    for (int k = 0; k < w; ++k) acc[k] += acc[k + w];
  return acc[0];
}
