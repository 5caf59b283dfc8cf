/* fp16 / bf16 <-> fp32 conversion for the C CPU kernels: one implementation,
 * used by every CPU op (norm, Adam, SwiGLU, attention), and the machinery that
 * compiles the kernels once per x86-64 level.
 *   - blocks: FO_VL = 16 values as a GNU C vector (fo_vload, fo_vstore and
 *     their _n forms for a row's last, partial block); kernels walk their
 *     rows a block at a time and convert inside the pass that reads or writes;
 *   - rows: fo_load_row_at / fo_store_row_at, built on the blocks.
 * All round to nearest even, keep a NaN a NaN (of its sign) and subnormals
 * exact; tests/test_dtype.py checks every 16-bit pattern, and ties,
 * subnormals, overflow, inf and NaN of fp32, against torch at every level.
 * They take the level the caller is compiled for (isa, a constant: see
 * FO_ISA_DISPATCH): fp16 goes through the F16C instructions at v3 and v4 and
 * through bit manipulation at the baseline; bf16 is a shift one way and an
 * integer rounding the other, written out with AVX-512 intrinsics at v4. */
#pragma once
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "fo_types.h"

/* Inlined into its caller whatever the heuristics say: a helper left out of
 * line is compiled once, for the baseline, not for the caller's level. */
#define FO_INLINE static inline __attribute__((always_inline))

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FO_X86 1
#include <immintrin.h>
#else
#define FO_X86 0
#endif

/* Hot loops are compiled once per x86-64 level (v4: AVX-512, v3: AVX2 + FMA
 * + F16C, and the baseline) and picked at run time: one binary, full-width
 * vectors on whatever CPU it runs on. Use feature levels, not arch= CPU names:
 * target_clones("arch=haswell") is a CPU-model test and picked the baseline
 * clone on an AMD EPYC.
 *
 * FO_CLONES: the same source for each level (GCC target_clones). Everything a
 * marked function calls must be FO_INLINE.
 *
 * FO_ISA_DISPATCH: for code that must know its level at compile time (the
 * fp16 hardware conversions: an F16C intrinsic does not compile into a
 * baseline clone). `name##_at(args..., isa)`, an FO_INLINE function, is
 * compiled into one function per level with isa a constant, and `name(args)`
 * calls the one fo_cpu_isa() picks. */
/* FO_ISA_V4_BF16: v4 with AVX512-BF16's dot products (vdpbf16ps), which the
 * bf16 attention tiles use (attention_cpu.c); every other kernel runs its v4
 * code there. */
enum { FO_ISA_BASE = 0, FO_ISA_V3 = 3, FO_ISA_V4 = 4, FO_ISA_V4_BF16 = 5 };

#if FO_X86
#define FO_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define FO_TARGET_V4 __attribute__((target("arch=x86-64-v4,prefer-vector-width=512")))
#define FO_TARGET_V3 __attribute__((target("arch=x86-64-v3")))
#define FO_TARGET_V4_BF16 __attribute__((target("arch=x86-64-v4,avx512bf16,prefer-vector-width=512")))
#else
#define FO_CLONES
#endif

/* The level the kernels run at: the highest this CPU supports, lowered (never
 * raised) by FUSEDOPS_CPU_ISA=0|3|4|5 in the environment or by fo_cpu_set_isa.
 * One copy for the library (dtype_cpu.c). */
int fo_cpu_isa(void);
int fo_cpu_set_isa(int cap);

#define FO_ISA_ARGS(...) __VA_ARGS__
#if FO_X86
#define FO_ISA_DISPATCH(name, params, args)                                                  \
  FO_TARGET_V4 static void name##_v4 params { name##_at(FO_ISA_ARGS args, FO_ISA_V4); }     \
  FO_TARGET_V3 static void name##_v3 params { name##_at(FO_ISA_ARGS args, FO_ISA_V3); }     \
  static void name##_v0 params { name##_at(FO_ISA_ARGS args, FO_ISA_BASE); }                \
  __attribute__((unused)) static void name params {                                         \
    const int isa_ = fo_cpu_isa();                                                          \
    if (isa_ >= FO_ISA_V4) name##_v4 args;                                                  \
    else if (isa_ >= FO_ISA_V3) name##_v3 args;                                             \
    else name##_v0 args;                                                                    \
  }
#else
#define FO_ISA_DISPATCH(name, params, args) \
  static void name params { name##_at(FO_ISA_ARGS args, FO_ISA_BASE); }
#endif

/* Whether a loop over `items` independent pieces holding `elems` values in all
 * is worth a parallel region: its fork and join cost about a microsecond with
 * the pool's threads spinning and tens of microseconds where they sleep
 * (OMP_WAIT_POLICY=passive, or a pool idle for long). Below torch's grain
 * (at::internal::GRAIN_SIZE, 32768) the calling thread runs it alone, as torch
 * runs its own small ops. docs/perf-notes.md, v23. */
enum { FO_GRAIN = 32768 };
static inline int fo_parallel(int64_t items, int64_t elems) { return items > 1 && elems >= FO_GRAIN; }

static inline float fo_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t fo_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* ---- blocks of FO_VL values -------------------------------------------------
 * Kernels walk their rows FO_VL values at a time as GNU C vectors: each
 * operation on an fo_vf is one AVX-512 instruction at v4, two AVX2 ones at v3,
 * four SSE2 ones at the baseline. (Loops over float[16] arrays were left to
 * the SLP vectoriser at first: it built some vectors lane by lane from scalar
 * loads, and stored a widened bf16 block as two 32-byte halves that the next
 * 64-byte load could not forward from.) aligned(4) / aligned(2): a vector may
 * sit at any element boundary. */
enum { FO_VL = 16 };
typedef float fo_vf __attribute__((vector_size(4 * FO_VL), aligned(4)));
typedef uint32_t fo_vu __attribute__((vector_size(4 * FO_VL), aligned(4)));
typedef int32_t fo_vi __attribute__((vector_size(4 * FO_VL), aligned(4)));
typedef uint16_t fo_vh __attribute__((vector_size(2 * FO_VL), aligned(2)));
#if defined(__GNUC__) && !defined(__clang__)
/* Vectors passed by value between FO_INLINE functions: the ABI it warns about
 * never applies. */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

/* Lane masks (all ones where true) from shifts, not vector comparisons: GCC 12
 * splits a comparison of a vector wider than the level's registers into one
 * scalar compare a lane. Both take operands below 2^31. */
FO_INLINE fo_vu fo_mask_gt(fo_vu a, uint32_t c) { return (fo_vu)((fo_vi)(c - a) >> 31); }
FO_INLINE fo_vu fo_mask_lt(fo_vu a, uint32_t c) { return (fo_vu)((fo_vi)(a - c) >> 31); }

/* bf16 is the top half of an fp32. Narrowing rounds to nearest even by integer
 * addition; a NaN is kept (sign and top of the payload) and made quiet. */
FO_INLINE fo_vf fo_bf16_widen(fo_vh h) { return (fo_vf)(__builtin_convertvector(h, fo_vu) << 16); }

FO_INLINE fo_vh fo_bf16_narrow(fo_vf f) {
  const fo_vu u = (fo_vu)f;
  const fo_vu rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const fo_vu nan = fo_mask_gt(u & 0x7FFFFFFFu, 0x7F800000u);
  return __builtin_convertvector((((u >> 16) | 0x40u) & nan) | (rounded & ~nan), fo_vh);
}

/* IEEE half -> float without F16C. Normal numbers: shift the exponent and
 * mantissa into place and rescale by 2^-112; subnormals: build 0.5 + m*2^-24
 * in the float mantissa and subtract 0.5. Inf/NaN come out of the normal path
 * as exponent 255. */
FO_INLINE fo_vf fo_f16_widen_soft(fo_vh h) {
  const fo_vu w = __builtin_convertvector(h, fo_vu) << 16;
  const fo_vu sign = w & 0x80000000u;
  const fo_vu two_w = w + w;
  const fo_vf normal = (fo_vf)((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const fo_vf subnormal = (fo_vf)((two_w >> 17) | (126u << 23)) - 0.5f;
  const fo_vu sub = fo_mask_lt(two_w >> 1, 1u << 26);
  return (fo_vf)(sign | ((fo_vu)subnormal & sub) | ((fo_vu)normal & ~sub));
}

/* float -> IEEE half without F16C, round to nearest even. Scaling by 2^112
 * then 2^-110 makes the FPU do the rounding at the half's precision (and
 * saturate to inf); adding a power of two aligned to the value's exponent
 * drops the bits. NaN becomes the quiet NaN 0x7E00 with its sign. */
FO_INLINE fo_vh fo_f16_narrow_soft(fo_vf f) {
  const fo_vu w = (fo_vu)f;
  const fo_vu sign = w & 0x80000000u, abs = w & 0x7FFFFFFFu;
  fo_vf base = ((fo_vf)abs * 0x1.0p+112f) * 0x1.0p-110f;
  fo_vu bias = (w + w) & 0xFF000000u;
  const fo_vu low = fo_mask_lt(bias >> 1, 0x71000000u >> 1);
  bias = (0x71000000u & low) | (bias & ~low);
  base = (fo_vf)((bias >> 1) + 0x07800000u) + base;
  const fo_vu b = (fo_vu)base;
  const fo_vu nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
  const fo_vu nan = fo_mask_gt(abs, 0x7F800000u);
  return __builtin_convertvector((sign >> 16) | (0x7E00u & nan) | (nonsign & ~nan), fo_vh);
}

#if FO_X86
/* The F16C conversions (vcvtph2ps / vcvtps2ph), round to nearest even; a NaN
 * stays a quiet NaN of its sign (the payload's top bits kept, where the soft
 * path gives 0x7E00). Not FO_INLINE: inlined where the caller's level allows,
 * and left as a never-taken call in lower levels' code until dead-code
 * elimination removes it (an always_inline one would not compile there). */
FO_TARGET_V4 static inline void fo_f16_widen_v4(const void *src, float *dst) {
  _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)src)));
}
FO_TARGET_V4 static inline void fo_f16_narrow_v4(const float *src, void *dst) {
  _mm256_storeu_si256((__m256i *)dst,
                      _mm512_cvtps_ph(_mm512_loadu_ps(src), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/* bf16 at v4: one vpmovzxwd (GCC widens a 16-lane vector as two halves), and
 * the NaN test one compare into a mask register. Same rounding as
 * fo_bf16_narrow. */
FO_TARGET_V4 static inline void fo_bf16_widen_v4(const void *src, float *dst) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
  _mm512_storeu_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
}
FO_TARGET_V4 static inline void fo_bf16_narrow_v4(const float *src, void *dst) {
  const __m512 f = _mm512_loadu_ps(src);
  const __m512i u = _mm512_castps_si512(f), hi = _mm512_srli_epi32(u, 16);
  const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
  const __m512i h = _mm512_mask_or_epi32(rounded, nan, hi, _mm512_set1_epi32(0x40));
  _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(h));
}
FO_TARGET_V3 static inline void fo_f16_widen_v3(const void *src, float *dst) {
  const __m128i *s = (const __m128i *)src;
  _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128(s)));
  _mm256_storeu_ps(dst + 8, _mm256_cvtph_ps(_mm_loadu_si128(s + 1)));
}
FO_TARGET_V3 static inline void fo_f16_narrow_v3(const float *src, void *dst) {
  __m128i *d = (__m128i *)dst;
  _mm_storeu_si128(d, _mm256_cvtps_ph(_mm256_loadu_ps(src), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  _mm_storeu_si128(d + 1, _mm256_cvtps_ph(_mm256_loadu_ps(src + 8), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

/* FO_VL values of dtype t at src, as fp32. isa: the caller's level (a
 * constant), which picks the fp16 conversion. */
FO_INLINE fo_vf fo_vload(int isa, fo_dtype t, const void *src) {
  (void)isa; /* unused off x86 */
  fo_vf v;
  if (t == FO_F32) {
    memcpy(&v, src, sizeof v);
#if FO_X86
  } else if (t == FO_BF16 && isa >= FO_ISA_V4) {
    fo_bf16_widen_v4(src, (float *)&v);
#endif
  } else if (t == FO_BF16) {
    fo_vh h;
    memcpy(&h, src, sizeof h);
    v = fo_bf16_widen(h);
#if FO_X86
  } else if (isa >= FO_ISA_V4) {
    fo_f16_widen_v4(src, (float *)&v);
  } else if (isa >= FO_ISA_V3) {
    fo_f16_widen_v3(src, (float *)&v);
#endif
  } else {
    fo_vh h;
    memcpy(&h, src, sizeof h);
    v = fo_f16_widen_soft(h);
  }
  return v;
}

/* v rounded to dtype t, stored at dst. */
FO_INLINE void fo_vstore(int isa, fo_dtype t, void *dst, fo_vf v) {
  (void)isa;
  if (t == FO_F32) {
    memcpy(dst, &v, sizeof v);
#if FO_X86
  } else if (t == FO_BF16 && isa >= FO_ISA_V4) {
    fo_bf16_narrow_v4((const float *)&v, dst);
#endif
  } else if (t == FO_BF16) {
    const fo_vh h = fo_bf16_narrow(v);
    memcpy(dst, &h, sizeof h);
#if FO_X86
  } else if (isa >= FO_ISA_V4) {
    fo_f16_narrow_v4((const float *)&v, dst);
  } else if (isa >= FO_ISA_V3) {
    fo_f16_narrow_v3((const float *)&v, dst);
#endif
  } else {
    const fo_vh h = fo_f16_narrow_soft(v);
    memcpy(dst, &h, sizeof h);
  }
}

/* The first m <= FO_VL values; the lanes from m on are 0. */
FO_INLINE fo_vf fo_vload_n(int isa, fo_dtype t, const void *src, int m) {
  if (m == FO_VL) return fo_vload(isa, t, src);
  fo_vf buf = {0}; /* room for FO_VL values of any dtype */
  memcpy(&buf, src, (size_t)m * (size_t)fo_dtype_size(t));
  return fo_vload(isa, t, &buf);
}

/* The first m <= FO_VL lanes of v, rounded to dtype t. */
FO_INLINE void fo_vstore_n(int isa, fo_dtype t, void *dst, fo_vf v, int m) {
  if (m == FO_VL) {
    fo_vstore(isa, t, dst, v);
  } else {
    fo_vf buf;
    fo_vstore(isa, t, &buf, v);
    memcpy(dst, &buf, (size_t)m * (size_t)fo_dtype_size(t));
  }
}

/* Stores the first m lanes of v rounded to dtype t and returns what was
 * stored, widened back: (float)(t)v. */
FO_INLINE fo_vf fo_vstore_keep_n(int isa, fo_dtype t, void *dst, fo_vf v, int m) {
  if (t == FO_F32) {
    fo_vstore_n(isa, t, dst, v, m);
    return v;
  }
  fo_vh h;
  fo_vstore(isa, t, &h, v);
  memcpy(dst, &h, (size_t)m * 2);
  return fo_vload(isa, t, &h);
}

/* ---- rows ------------------------------------------------------------------ */
/* out[j] = (float)in[j] for n elements of dtype t. */
FO_INLINE void fo_load_row_at(int isa, fo_dtype t, const void *in, float *out, int64_t n) {
  const char *src = (const char *)in;
  const int es = fo_dtype_size(t);
  int64_t j = 0;
  for (; j + FO_VL <= n; j += FO_VL) {
    const fo_vf v = fo_vload(isa, t, src + j * es);
    memcpy(out + j, &v, sizeof v);
  }
  if (j < n) {
    const fo_vf v = fo_vload_n(isa, t, src + j * es, (int)(n - j));
    memcpy(out + j, &v, (size_t)(n - j) * 4);
  }
}

/* out[j] = in[j] rounded to dtype t, for n elements. */
FO_INLINE void fo_store_row_at(int isa, fo_dtype t, void *out, const float *in, int64_t n) {
  char *dst = (char *)out;
  const int es = fo_dtype_size(t);
  int64_t j = 0;
  for (; j + FO_VL <= n; j += FO_VL) fo_vstore(isa, t, dst + j * es, *(const fo_vf *)(in + j));
  if (j < n) {
    fo_vf v = {0};
    memcpy(&v, in + j, (size_t)(n - j) * 4);
    fo_vstore_n(isa, t, dst + j * es, v, (int)(n - j));
  }
}

/* An fp32 view of n elements of dtype t: the data itself when it is fp32,
 * else widened into `scratch`. */
FO_INLINE const float *fo_as_f32_at(int isa, fo_dtype t, const void *p, float *scratch, int64_t n) {
  if (t == FO_F32) return (const float *)p;
  fo_load_row_at(isa, t, p, scratch, n);
  return scratch;
}

/* The same at the baseline level, for code outside a dispatched function. */
FO_INLINE void fo_load_row(fo_dtype t, const void *in, float *out, int64_t n) {
  fo_load_row_at(FO_ISA_BASE, t, in, out, n);
}
FO_INLINE void fo_store_row(fo_dtype t, void *out, const float *in, int64_t n) {
  fo_store_row_at(FO_ISA_BASE, t, out, in, n);
}

/* Sum of n floats with 16 independent fp32 accumulators (vectorisable, and
 * more accurate than one running sum). */
FO_INLINE float fo_sum(const float *restrict v, int64_t n) {
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
FO_INLINE float fo_sqdev(const float *restrict v, float c, int64_t n) {
  float acc[16] = {0};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int k = 0; k < 16; ++k) acc[k] += (v[j + k] - c) * (v[j + k] - c);
  for (; j < n; ++j) acc[j & 15] += (v[j] - c) * (v[j] - c);
  for (int w = 8; w > 0; w >>= 1)
    for (int k = 0; k < w; ++k) acc[k] += acc[k + w];
  return acc[0];
}
