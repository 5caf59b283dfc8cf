/* fp16 / bf16 <-> fp32 conversion for the C CPU kernels: one implementation,
 * used by every CPU op (norm, Adam, SwiGLU, attention, ...), and the
 * machinery that builds the kernels once per x86-64 level.
 *   - levels: setup.py compiles every CPU source once per level, with
 *     -DFO_LEVEL=N and the matching -march (below); each copy names its entry
 *     points name_vN (FO_FN) and the baseline copy adds name(), which calls
 *     the copy for the level the CPU supports (FO_ENTRY);
 *   - blocks: FO_VL values, one vector register of the level, as a GNU C
 *     vector (fo_vload, fo_vstore and their _n forms for a row's last,
 *     partial block); kernels walk their rows a block at a time and convert
 *     inside the pass that reads or writes;
 *   - rows: fo_load_row / fo_store_row, built on the blocks.
 * All round to nearest even, keep a NaN a NaN (of its sign) and subnormals
 * exact; tests/test_dtype.py checks every 16-bit pattern, and ties,
 * subnormals, overflow, inf and NaN of fp32, against torch at every level.
 * fp16 goes through the F16C instructions at v3 and v4 and through bit
 * manipulation at the baseline; bf16 is a shift one way and an integer
 * rounding the other, written out with intrinsics at v3 (AVX2) and v4 (AVX-512). */
#pragma once
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "fo_types.h"

/* Levels: v4 (AVX-512: -march=x86-64-v4), v3 (AVX2 + FMA + F16C:
 * -march=x86-64-v3) and the baseline (x86-64, or whatever the machine is off
 * x86-64). Use feature levels, not CPU names: a CPU-name test
 * (arch=haswell) picked the baseline on an AMD EPYC. V4_BF16: v4 with
 * AVX512-BF16's dot products (vdpbf16ps), which the bf16 attention tiles use
 * (attention_cpu.c, in its v4 copy); AMX: V4_BF16 with Intel's AMX tiles
 * (AMX-TILE, AMX-BF16 and Linux's permission to use them, asked at load time
 * by dtype_cpu.c; cpu_amx.h), which those tiles' products then run on. Every
 * other kernel runs its v4 copy at both. Each level has all below it. */
enum { FO_ISA_BASE = 0, FO_ISA_V3 = 3, FO_ISA_V4 = 4, FO_ISA_V4_BF16 = 5, FO_ISA_AMX = 6 };

#ifndef FO_LEVEL
#error "the CPU sources are compiled once per level with -DFO_LEVEL=0|3|4 (setup.py)"
#endif
/* FO_X86_LEVELS (setup.py, on x86-64): the v3 and v4 copies are built too. */
#ifndef FO_X86_LEVELS
#define FO_X86_LEVELS 0
#endif
#if FO_LEVEL >= 3
#include <immintrin.h>
#endif

/* Inlined into its caller whatever the heuristics say. */
#define FO_INLINE static inline __attribute__((always_inline))

/* The level the kernels run at: the highest this CPU supports, lowered (never
 * raised) by FUSEDOPS_CPU_ISA=0|3|4|5|6 in the environment or by fo_cpu_set_isa.
 * One copy for the library (dtype_cpu.c). */
int fo_cpu_isa(void);
int fo_cpu_set_isa(int cap);

/* FO_FN(name): this copy's name for an entry point, name_v0, name_v3 or
 * name_v4. FO_PICK(level, name, args): the call of the copy for `level`.
 * FO_ENTRY(ret, name, params, args), placed after the entry point's
 * definition: in the baseline copy, name() itself, which calls the copy for
 * fo_cpu_isa(); nothing in the others. */
#define FO_CAT_(a, b) a##_v##b
#define FO_CAT(a, b) FO_CAT_(a, b)
#define FO_FN(name) FO_CAT(name, FO_LEVEL)
#if FO_X86_LEVELS
#define FO_DECLARE(ret, name, params) ret name##_v0 params; ret name##_v3 params; ret name##_v4 params;
#define FO_PICK(level, name, args) \
  ((level) >= FO_ISA_V4 ? name##_v4 args : (level) >= FO_ISA_V3 ? name##_v3 args : name##_v0 args)
#else
#define FO_DECLARE(ret, name, params) ret name##_v0 params;
#define FO_PICK(level, name, args) ((void)(level), name##_v0 args)
#endif
#if FO_LEVEL == 0
#define FO_ENTRY(ret, name, params, args) \
  FO_DECLARE(ret, name, params)           \
  ret name params { return FO_PICK(fo_cpu_isa(), name, args); }
#else
#define FO_ENTRY(ret, name, params, args)
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
 * Kernels walk their rows FO_VL values at a time as GNU C vectors, one
 * register of the level: 16 floats at v4, 8 at v3, 4 at the baseline. (A
 * block wider than the level's registers has no register mode: GCC 12 kept
 * 16-float blocks at v3 on the stack, and every loop-carried sum went through
 * memory, docs/perf-notes.md CPU v4. Loops over float[16] arrays left to the
 * SLP vectoriser built some vectors lane by lane, v12.) aligned(4) /
 * aligned(2): a vector may sit at any element boundary. */
enum { FO_VL = FO_LEVEL >= 4 ? 16 : FO_LEVEL == 3 ? 8 : 4 };
typedef float fo_vf __attribute__((vector_size(4 * FO_VL), aligned(4)));
typedef uint32_t fo_vu __attribute__((vector_size(4 * FO_VL), aligned(4)));
typedef int32_t fo_vi __attribute__((vector_size(4 * FO_VL), aligned(4)));
typedef uint16_t fo_vh __attribute__((vector_size(2 * FO_VL), aligned(2)));
/* Blocks read and written in memory through these (any address, any array):
 * a memcpy of a 32-byte block became two 16-byte moves through the stack at
 * v3 (generic tuning splits 32-byte copies), and the 32-byte load after them
 * could not forward from the two stores. */
typedef float fo_vf_at __attribute__((vector_size(4 * FO_VL), aligned(4), may_alias));
typedef uint16_t fo_vh_at __attribute__((vector_size(2 * FO_VL), aligned(2), may_alias));
#if defined(__GNUC__) && !defined(__clang__)
/* Vectors passed by value between FO_INLINE functions: the ABI it warns about
 * never applies. */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

/* Lane masks (all ones where true) from shifts; both take operands below
 * 2^31. */
FO_INLINE fo_vu fo_mask_gt(fo_vu a, uint32_t c) { return (fo_vu)((fo_vi)(c - a) >> 31); }
FO_INLINE fo_vu fo_mask_lt(fo_vu a, uint32_t c) { return (fo_vu)((fo_vi)(a - c) >> 31); }

/* mask ? a : b, lane by lane (mask: all ones or all zeros a lane, as a
 * vector comparison gives; C has no ?: on vectors). */
FO_INLINE fo_vf fo_vselect(fo_vi mask, fo_vf a, fo_vf b) { return (fo_vf)(((fo_vi)a & mask) | ((fo_vi)b & ~mask)); }

/* All ones in the lanes below m (0 <= m <= FO_VL), zeros from m on. */
FO_INLINE fo_vu fo_mask_first(int m) {
  fo_vu lane;
  for (int k = 0; k < FO_VL; ++k) lane[k] = (uint32_t)k;
  return fo_mask_lt(lane, (uint32_t)m);
}

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


/* The hardware conversions of the level, round to nearest even, register to
 * register: F16C (vcvtph2ps / vcvtps2ph) at v3 and v4, where a NaN stays a
 * quiet NaN of its sign with the payload's top bits (the soft path gives
 * 0x7E00); bf16 one vpmovzxwd and a shift one way, the other the rounding of
 * fo_bf16_narrow with the NaN test one compare (into a mask register at v4)
 * and the 16-bit lanes packed by vpmovdw (v4) or vpackusdw and vpermq (v3;
 * GCC widens and packs the generic vectors in halves). */
#define FO_RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#if FO_LEVEL >= 4
FO_INLINE fo_vf fo_f16_widen_hw(fo_vh h) { return (fo_vf)_mm512_cvtph_ps((__m256i)h); }
FO_INLINE fo_vh fo_f16_narrow_hw(fo_vf v) { return (fo_vh)_mm512_cvtps_ph((__m512)v, FO_RN); }
FO_INLINE fo_vf fo_bf16_widen_hw(fo_vh h) {
  return (fo_vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16);
}
FO_INLINE fo_vh fo_bf16_narrow_hw(fo_vf v) {
  const __m512 f = (__m512)v;
  const __m512i u = _mm512_castps_si512(f), hi = _mm512_srli_epi32(u, 16);
  const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
  return (fo_vh)_mm512_cvtepi32_epi16(_mm512_mask_or_epi32(rounded, nan, hi, _mm512_set1_epi32(0x40)));
}
#elif FO_LEVEL == 3
FO_INLINE fo_vf fo_f16_widen_hw(fo_vh h) { return (fo_vf)_mm256_cvtph_ps((__m128i)h); }
FO_INLINE fo_vh fo_f16_narrow_hw(fo_vf v) { return (fo_vh)_mm256_cvtps_ph((__m256)v, FO_RN); }
FO_INLINE fo_vf fo_bf16_widen_hw(fo_vh h) {
  return (fo_vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32((__m128i)h), 16);
}
FO_INLINE fo_vh fo_bf16_narrow_hw(fo_vf v) {
  const __m256 f = (__m256)v;
  const __m256i u = _mm256_castps_si256(f), hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
  const __m256i h = _mm256_castps_si256(_mm256_blendv_ps(
      _mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_or_si256(hi, _mm256_set1_epi32(0x40))), nan));
  return (fo_vh)_mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0xD8));
}
#endif

/* A block of 16-bit values of dtype t (FO_BF16 or FO_F16), as fp32. */
FO_INLINE fo_vf fo_widen(fo_dtype t, fo_vh h) {
#if FO_LEVEL >= 3
  return t == FO_BF16 ? fo_bf16_widen_hw(h) : fo_f16_widen_hw(h);
#else
  return t == FO_BF16 ? fo_bf16_widen(h) : fo_f16_widen_soft(h);
#endif
}

/* v rounded to the 16-bit dtype t. */
FO_INLINE fo_vh fo_narrow(fo_dtype t, fo_vf v) {
#if FO_LEVEL >= 3
  return t == FO_BF16 ? fo_bf16_narrow_hw(v) : fo_f16_narrow_hw(v);
#else
  return t == FO_BF16 ? fo_bf16_narrow(v) : fo_f16_narrow_soft(v);
#endif
}

/* FO_VL values of dtype t at src, as fp32. */
FO_INLINE fo_vf fo_vload(fo_dtype t, const void *src) {
  if (t == FO_F32) return *(const fo_vf_at *)src;
  return fo_widen(t, *(const fo_vh_at *)src);
}

/* v rounded to dtype t, stored at dst. */
FO_INLINE void fo_vstore(fo_dtype t, void *dst, fo_vf v) {
  if (t == FO_F32) *(fo_vf_at *)dst = v;
  else *(fo_vh_at *)dst = fo_narrow(t, v);
}

/* The first m <= FO_VL values; the lanes from m on are 0. */
FO_INLINE fo_vf fo_vload_n(fo_dtype t, const void *src, int m) {
  if (m == FO_VL) return fo_vload(t, src);
  fo_vf buf = {0}; /* room for FO_VL values of any dtype */
  memcpy(&buf, src, (size_t)m * (size_t)fo_dtype_size(t));
  return fo_vload(t, &buf);
}

/* The first m <= FO_VL lanes of v, rounded to dtype t. */
FO_INLINE void fo_vstore_n(fo_dtype t, void *dst, fo_vf v, int m) {
  if (m == FO_VL) {
    fo_vstore(t, dst, v);
  } else {
    fo_vf buf;
    fo_vstore(t, &buf, v);
    memcpy(dst, &buf, (size_t)m * (size_t)fo_dtype_size(t));
  }
}

/* Stores the first m lanes of v rounded to dtype t and returns what was
 * stored, widened back: (float)(t)v. */
FO_INLINE fo_vf fo_vstore_keep_n(fo_dtype t, void *dst, fo_vf v, int m) {
  if (t == FO_F32) {
    fo_vstore_n(t, dst, v, m);
    return v;
  }
  const fo_vh h = fo_narrow(t, v);
  if (m == FO_VL) *(fo_vh_at *)dst = h;
  else memcpy(dst, &h, (size_t)m * 2);
  return fo_widen(t, h);
}

/* ---- streaming stores --------------------------------------------------------
 * fo_vstream_f32 stores an fp32 block past the caches (a non-temporal
 * store): its line is not read from memory first and evicts nothing the
 * kernel reads again. Kernels use it for an output they never read back, in
 * calls that move too many bytes for the output to stay cached for its reader
 * anyway (fo_cpu_stream). At the baseline level, and where dst is not aligned
 * to the block's bytes, a plain store. (16-bit blocks, half a register, were
 * not faster streamed: docs/perf-notes.md, CPU v6.) The stores are weakly
 * ordered: each thread calls fo_stream_fence after its last. */
FO_INLINE void fo_vstream_f32(float *dst, fo_vf v) {
#if FO_LEVEL >= 3
  if (((uintptr_t)dst & (4 * FO_VL - 1)) == 0) {
#if FO_LEVEL >= 4
    _mm512_stream_ps(dst, (__m512)v);
#else
    _mm256_stream_ps(dst, (__m256)v);
#endif
    return;
  }
#endif
  *(fo_vf_at *)dst = v;
}

FO_INLINE void fo_stream_fence(void) {
#if FO_LEVEL >= 3
  _mm_sfence();
#endif
}

/* Whether a call that moves `bytes` (inputs read and outputs written, once
 * each) stores its write-once fp32 outputs with fo_vstream_f32: from
 * FO_STREAM_MIB MiB on, or as FUSEDOPS_CPU_STREAM says (0: never, 2: always;
 * for tuning and the tests). One copy for the library (dtype_cpu.c). */
enum { FO_STREAM_MIB = 32 };
int fo_cpu_stream(int64_t bytes);

/* ---- rows ------------------------------------------------------------------ */
/* out[j] = (float)in[j] for n elements of dtype t. */
FO_INLINE void fo_load_row(fo_dtype t, const void *in, float *out, int64_t n) {
  const char *src = (const char *)in;
  const int es = fo_dtype_size(t);
  int64_t j = 0;
  for (; j + FO_VL <= n; j += FO_VL) {
    *(fo_vf_at *)(out + j) = fo_vload(t, src + j * es);
  }
  if (j < n) {
    const fo_vf v = fo_vload_n(t, src + j * es, (int)(n - j));
    memcpy(out + j, &v, (size_t)(n - j) * 4);
  }
}

/* out[j] = in[j] rounded to dtype t, for n elements. */
FO_INLINE void fo_store_row(fo_dtype t, void *out, const float *in, int64_t n) {
  char *dst = (char *)out;
  const int es = fo_dtype_size(t);
  int64_t j = 0;
  for (; j + FO_VL <= n; j += FO_VL) fo_vstore(t, dst + j * es, *(const fo_vf_at *)(in + j));
  if (j < n) {
    fo_vf v = {0};
    memcpy(&v, in + j, (size_t)(n - j) * 4);
    fo_vstore_n(t, dst + j * es, v, (int)(n - j));
  }
}

/* An fp32 view of n elements of dtype t: the data itself when it is fp32,
 * else widened into `scratch`. */
FO_INLINE const float *fo_as_f32(fo_dtype t, const void *p, float *scratch, int64_t n) {
  if (t == FO_F32) return (const float *)p;
  fo_load_row(t, p, scratch, n);
  return scratch;
}

/* Row sums in 16 lanes at every level, so that a kernel's results are bitwise
 * the same at each (tests/test_dtype.py): column c adds into lane c % 16.
 * FO_NV registers hold the lanes; a loop over the row takes FO_STEP columns a
 * step, register k the block at j + k * FO_VL of each, then the row's last
 * blocks (fo_tail_len), register k again the k-th of them. */
enum { FO_STEP = 16, FO_NV = FO_STEP / FO_VL };

/* The width of the block at column j of a row of n columns (j < n). */
static inline int fo_tail_len(int64_t n, int64_t j) { return n - j < FO_VL ? (int)(n - j) : FO_VL; }

/* The sum of the 16 lanes, pairwise: lane k + 8 onto lane k, then k + 4, ...
 * (fo_sum's order). */
FO_INLINE float fo_sum_lanes(const fo_vf *acc) {
  fo_vf r[FO_NV];
  for (int k = 0; k < FO_NV; ++k) r[k] = acc[k];
  for (int w = FO_NV / 2; w > 0; w >>= 1)
    for (int k = 0; k < w; ++k) r[k] += r[k + w];
  float l[FO_VL];
  memcpy(l, &r[0], sizeof l);
  for (int w = FO_VL / 2; w > 0; w >>= 1)
    for (int k = 0; k < w; ++k) l[k] += l[k + w];
  return l[0];
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

/* ---- long sums ---------------------------------------------------------------
 * A sum of N terms taken one after the other loses about N roundings (a
 * row's 16 lanes: N / 16 each), so its error grows with the row. Long sums
 * are taken in blocks instead: a block (FO_SUM_BLOCK columns of a row, or a
 * few rows of column sums) is summed as before, and the blocks are added into
 * the total with Kahan's compensation, which carries the low bits each
 * addition drops into the next one: the error stays that of one block plus a
 * few roundings, however many blocks. A sum of one block is the same as
 * before, bit for bit. */
enum { FO_SUM_BLOCK = 1024 }; /* columns, a multiple of FO_STEP */

/* The end of the block of a row of n columns that starts at column j0. */
static inline int64_t fo_block_end(int64_t n, int64_t j0) { return n - j0 > FO_SUM_BLOCK ? j0 + FO_SUM_BLOCK : n; }

/* total[j] += v[j] for j < n, compensated: comp[j] holds what the last
 * addition into total[j] rounded away (total - comp is the better sum; both
 * start at 0). Where total[j] is no longer finite, comp[j] is 0: an inf would
 * turn it into NaN. */
FO_INLINE void fo_kahan_add(float *restrict total, float *restrict comp, const float *restrict v, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float y = v[j] - comp[j];
    const float t = total[j] + y;
    comp[j] = t - t == 0.0f ? (t - total[j]) - y : 0.0f;
    total[j] = t;
  }
}

/* A row's sum in 16 lanes (fo_sum_lanes) over blocks: fo_lanes_add adds a
 * block's lanes, fo_lanes_total gives the sum. */
typedef struct fo_lanes {
  float total[FO_STEP], comp[FO_STEP];
} fo_lanes;

FO_INLINE void fo_lanes_add(fo_lanes *s, const fo_vf *acc) { fo_kahan_add(s->total, s->comp, (const float *)acc, FO_STEP); }

FO_INLINE float fo_lanes_total(const fo_lanes *s) {
  fo_vf r[FO_NV];
  for (int k = 0; k < FO_NV; ++k)
    r[k] = *(const fo_vf_at *)(s->total + k * FO_VL) - *(const fo_vf_at *)(s->comp + k * FO_VL);
  return fo_sum_lanes(r);
}
