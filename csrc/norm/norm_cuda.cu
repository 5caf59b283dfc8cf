/* Residual-add + LayerNorm / RMSNorm on CUDA (math and layout: norm.h).
 *
 * Bytes: forward reads x, residual and writes y, s (4 matrices); backward
 * reads dy, s, ds and writes dx (4 matrices); weight-sized terms are noise.
 *
 * Kernels
 *   fwd_regs             a team of threads per row (a warp, several to a
 *                        block, or a block of up to 1024 threads) holds the row in
 *                        registers (as s is stored): every element read once and
 *                        written once, with 16-byte accesses; one row per team,
 *                        no loop.
 *   fwd_narrow           rows of 256, 512, 768 or 1024 16-bit values with a residual
 *                        and a weight: fwd_regs' work with the width a constant,
 *                        one warp a row and a block (two at 256 and 512 wide on
 *                        GPUs of an H200's bandwidth an SM), the weight loaded
 *                        late with evict_last; at 512 wide with the smallest L1.
 *   fwd_group            contiguous rows that allow no 8-byte access (16-bit rows
 *                        of 2 mod 4 values, odd widths), up to 1.5K values: a
 *                        block takes a group of rows whose bytes are a 16-byte
 *                        multiple, copied in and out of shared memory 16 bytes
 *                        at a time; a warp a row in between.
 *   fwd_shift            contiguous 16-bit rows that are not 16-byte aligned
 *                        (widths not a multiple of 8 values), past fwd_group's
 *                        rows and at 8 bytes a chunk, up to 16K values: a block a
 *                        row, a head up to the row's first 16-byte boundary and a
 *                        tail one value a thread, 16-byte chunks in registers
 *                        between them.
 *   fwd_park             rows of 16K-32K 16-bit values: a block of at most 512
 *                        threads a row, half of each thread's chunks in registers
 *                        and half parked in shared memory (cp.async), so that
 *                        two rows are in flight an SM; where its rows fill its
 *                        last wave (launch_park).
 *   fwd_pipe             rows too wide for fwd_regs (past 32K values of bf16,
 *                        16K of fp16 or with fp32 s or weight) on sm_90:
 *                        persistent clusters whose blocks each take a slice of
 *                        the row, staged through shared memory rows ahead, the
 *                        row sums exchanged through distributed shared memory.
 *   bwd_regs             the same teams on a persistent grid (sized by the
 *                        occupancy calculator); the row stays in registers as
 *                        loaded, each team sums dweight/dbias over its rows in
 *                        shared memory, and each block writes one partial row.
 *   bwd_group            fwd_group's rows for the backward, up to 438-512 values:
 *                        persistent blocks over the groups, dweight / dbias
 *                        summed a warp in shared memory.
 *   bwd_pipe             16-bit rows from 2304 values, and rows whose bwd_regs
 *                        team would pass 512 threads (from 4104 16-bit
 *                        values) or that no team holds: teams of at
 *                        most 512 threads whose rows are staged through shared
 *                        memory by cp.async, rows ahead, so that loads stay in
 *                        flight while a team reduces; past 16K values split over
 *                        a cluster on sm_90.
 *   fwd_loop / bwd_loop  any width or alignment (16 or 8 bytes a load, or one
 *                        element): one block per row, passes over
 *                        the row re-read from L1/L2 (s read back after it is
 *                        written by the same thread).
 *   dwdb_cols            with bwd_loop: dweight/dbias partial sums over a tile of
 *                        columns and a chunk of rows (reads dy and s once more).
 *   colsum               dweight/dbias = sum of the partial rows in a fixed
 *                        order: deterministic.
 * Measured figures and the history of versions: docs/perf-notes.md. */
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "norm.h"
#include "../common/cuda_utils.cuh"

namespace {
using namespace fo;

// Sizes shared with the planner (norm_plan.h), under the names the kernels use.
// Register kernels: a thread holds `values` values of each row array (NV
// chunks of VEC), within its thread cap's registers (max_threads and kin).
constexpr int kFwdMaxValues = FO_NORM_FWD_MAX_VALUES, kBwdMaxValues = FO_NORM_BWD_MAX_VALUES;
constexpr int kFwdMaxChunks = FO_NORM_FWD_MAX_CHUNKS, kBwdMaxChunks = FO_NORM_BWD_MAX_CHUNKS;
constexpr int max_threads(int values) { return FO_NORM_MAX_THREADS(values); }
constexpr int fwd_max_threads(int values, bool bf16) { return FO_NORM_FWD_MAX_THREADS(values, bf16); }
constexpr int bwd_max_threads(int values, int vec) { return FO_NORM_BWD_MAX_THREADS(values, vec); }
constexpr int sums_per_thread(int values) { return FO_NORM_SUMS_PER_THREAD(values); }
template <class T, class S, class W>
constexpr bool all_bf16 = std::is_same_v<T, __nv_bfloat16> && std::is_same_v<S, T> && std::is_same_v<W, T>;
constexpr int kMaxTeams = FO_NORM_MAX_TEAMS;
// The loop kernels: at most 512 threads a block (128 registers a thread),
// each with 16 values (two vectors of 16-bit types, four of fp32) in flight
// per step.
constexpr int kLoopThreads = FO_NORM_LOOP_THREADS;
constexpr int kShiftThreads = FO_NORM_SHIFT_THREADS;
constexpr int loop_unroll(int vec) { return vec >= 4 ? 16 / vec : 4; }

// Every kernel issues all loads of a step before its first store: the
// compiler may not move a load of x, residual, dy or ds past a store to s, y
// or dx (they could alias), so an interleaved load/store loop waits a full
// memory latency per vector (seen in SASS: LDG, STG, LDG, STG ...).

// --- forward ------------------------------------------------------------------------------

// Helpers of fwd_regs and fwd_pipe: a thread's chunks are v[k], at columns
// [col(k), col(k) + VEC) of the row, held as fp32 values (fwd_pipe) or as
// packs of s as stored (fwd_regs); value(v[k], i) reads either.
template <int N>
__device__ __forceinline__ float value(const float (&a)[N], int i) { return a[i]; }
template <class S, int N>
__device__ __forceinline__ float value(const Pack<S, N> &a, int i) { return pack_value(a, i); }

// a with kFirst, else b.
template <bool kFirst, class A, class B>
__device__ __forceinline__ const auto &pick(const A &a, const B &b) {
  if constexpr (kFirst) return a;
  else return b;
}

// Whether add_chunk adds fp16 packs as packs (add_pack): from sm_90 on. On
// sm_80 two fp16 kernels with an fp32 weight spilled 4-8 bytes with it.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kHalfPacked = true;
#else
constexpr bool kHalfPacked = false;
#endif

// One chunk of s = x + residual (x alone where there is none), rounded to S:
// two values an instruction where x and s are one 16-bit type (add_pack,
// bitwise the same sum; +1.2 % of the copy at LN 512 x 32768, level
// elsewhere: docs/perf-notes.md, v17).
template <class T, class S, int VEC>
__device__ __forceinline__ Pack<S, VEC> add_chunk(const Raw<T, VEC> &xw, const Raw<S, VEC> &rw, bool residual) {
  const Pack<T, VEC> xp = xw.pack();
  const Pack<S, VEC> rp = rw.pack();
  if constexpr (std::is_same_v<T, S> && VEC % 2 == 0 &&
                (std::is_same_v<S, __nv_bfloat16> || (std::is_same_v<S, __half> && kHalfPacked))) {
    return residual ? add_pack(xp, rp) : xp;
  }
  float v[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] = residual ? pack_value(xp, i) + pack_value(rp, i) : pack_value(xp, i);
  return to_pack<S>(v);
}

// Adds a chunk's values (rms: their squares) to acc: the first reduction's terms.
template <int VEC, class E>
__device__ __forceinline__ void add_terms(const E &e, bool rms, float &acc) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc += rms ? value(e, i) * value(e, i) : value(e, i);
}

// The sum of the squared deviations from `mean` of this thread's values.
template <int VEC, int NV, class E, class Col>
__device__ __forceinline__ float sq_dev(const E (&v)[NV], float mean, int64_t cols, Col col) {
  float sq = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if (col(k) < cols) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) sq += (value(v[k], i) - mean) * (value(v[k], i) - mean);
    }
  }
  return sq;
}

// The row's mean and rstd, for the backward; none without one (p.rstd null).
__device__ __forceinline__ void save_stats(const fo_norm_fwd_params &p, int64_t row, float mean, float rstd) {
  if (p.rstd) {
    if (p.mean) p.mean[row] = mean;
    p.rstd[row] = rstd;
  }
}

// y = (v - mean) * rstd * weight + bias, stored into row `row`; `stats`:
// this thread saves the row's mean and rstd. kPtx: as store_pack's.
template <class T, bool kPtx = true, class W, int NV, int VEC, class E, class Col>
__device__ __forceinline__ void write_y(const fo_norm_fwd_params &p, const E (&v)[NV], const Pack<W, VEC> (&w)[NV],
                                        const Pack<W, VEC> (&b)[NV], float mean, float rstd, int64_t row, Col col,
                                        bool stats) {
  T *y = static_cast<T *>(p.y) + row * p.cols;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if (col(k) < p.cols) {
      float o[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        o[i] = (value(v[k], i) - mean) * rstd;
        if (p.weight) o[i] *= pack_value(w[k], i);
        if (p.bias) o[i] += pack_value(b[k], i);
      }
      store_f<VEC, kPtx>(y + col(k), o);
    }
  }
  if (stats) save_stats(p, row, mean, rstd);
}

// weight and bias packs of this thread's chunks (L1/L2 hits after the first
// rows), before any y store; C: how they are cached (load16).
template <int C = kReadOnly, class W, int NV, int VEC, class Col>
__device__ __forceinline__ void load_wb(const fo_norm_fwd_params &p, Pack<W, VEC> (&w)[NV], Pack<W, VEC> (&b)[NV],
                                        Col col) {
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if (col(k) < p.cols) {
      if (p.weight) w[k] = load_pack<VEC, C>(static_cast<const W *>(p.weight) + col(k));
      if (p.bias) b[k] = load_pack<VEC, C>(static_cast<const W *>(p.bias) + col(k));
    }
  }
}

// Chunks k of x, and of r where it is not null, into xr[k] and rr[k]: those
// with col(k) < cols (the register kernels' guard), every load in flight at
// once. I: the kernel's column type (fwd_park's 32-bit columns stay 32-bit).
template <int VEC, int N, class T, class S, class I, class Col>
__device__ __forceinline__ void load_chunks(const T *x, const S *r, I cols, Col col, Raw<T, VEC> (&xr)[N],
                                            Raw<S, VEC> (&rr)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if (col(k) < cols) {
      xr[k] = load_raw<VEC>(x + col(k));
      if (r) rr[k] = load_raw<VEC>(r + col(k));
    }
  }
}

// A team of threads per row (a warp, eight to a block, or the whole block)
// holds the row in registers as s is stored (16-bit s: half the registers of
// fp32 values; 40 registers for 16 bf16 values a thread where fp32 copies
// took 64, and 3 blocks of 512 threads an SM instead of 2), every element
// read once and written once with 16-byte accesses (8 or 4 bytes, or one
// element, where the rows allow no more: access_vec); one row per team, no loop.
// The narrower kernels (VEC of 16-bit T: 4, 2, 1) state one block an SM at the least,
// which is the default: said outright, ptxas keeps to the thread cap's
// registers (fp16, 8 values: 38, where left to itself it squeezed into 32
// and spilled on sm_80); the 16-byte kernels' SASS stays as tuned.
template <class T, class S, class W, int VEC, int NV>
__global__ void __launch_bounds__(fwd_max_threads(NV * VEC, all_bf16<T, S, W> && VEC == 8),
                                  VEC * sizeof(T) == 16 ? 0 : 1) fwd_regs(const fo_norm_fwd_params p) {
  __shared__ float red[2][32];  // a team that is not one warp is the whole block
  const int tid = threadIdx.x, team = blockDim.x;
  const int64_t cols = p.cols;
  // This thread's columns, the same in every row: [col(k), col(k) + VEC).
  auto col = [&](int k) { return ((int64_t)k * team + tid) * VEC; };
  // One row per team, no loop: a grid-stride loop keeps addresses and
  // offsets live across rows (59 registers instead of 39 for 8 bf16 values,
  // half the occupancy; ncu), and the hardware hands out new blocks as fast.
  const int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  if (row < p.rows) {
    const T *x = static_cast<const T *>(p.x) + row * p.x_stride;
    const S *r = p.residual ? static_cast<const S *>(p.residual) + row * p.res_stride : nullptr;
    // Loads only, as raw words (Raw): every chunk's loads in flight at once.
    Raw<T, VEC> xr[NV];
    Raw<S, VEC> rr[NV];
    load_chunks(x, r, cols, col, xr, rr);
    // weight and bias: issued with the row's loads where registers allow (16
    // values a thread or fewer), so that their latency is not added after the
    // reductions; else after them (32 values: 64 registers, and they spill),
    // with evict_last (kKeep) so that the rows streaming through L1 do not
    // push them out: +0.1 to +0.4 % of the copy at 16K and 32K wide (v15).
    constexpr bool kEarlyWb = NV * VEC <= 16;
    Pack<W, VEC> w[NV], b[NV];
    if (kEarlyWb) load_wb(p, w, b, col);
    // s = x + residual as stored: the statistics are those of the rounded stream.
    // One chunk of 16-bit s: also kept as fp32 values (kF32), unpacked once
    // rather than at each of its two or three uses: +0.1 to +0.3 % of the copy
    // at 256-2048 wide (7 more registers; occupancy did not matter there).
    // That chunk is stored after the first reduction: +0.3 to +0.45 % at 2048
    // and 4096 wide (bf16, LayerNorm and RMSNorm); stored late, two or four
    // chunks a thread cost 0.1 to 1.2 % (docs/perf-notes.md, v14).
    constexpr bool kF32 = NV == 1 && sizeof(S) == 2;
    Pack<S, VEC> sv[NV];
    float fv[kF32 ? NV : 1][VEC];
    auto store_s = [&](int k) { store_pack<VEC>(static_cast<S *>(p.s) + row * cols + col(k), sv[k]); };
    float sum[1] = {0.f};  // LayerNorm: the sum; RMSNorm: the sum of squares
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (col(k) < cols) {
        sv[k] = add_chunk(xr[k], rr[k], r);
        if (p.s && !kF32) store_s(k);
        if constexpr (kF32) unpack(sv[k], fv[k]);
        add_terms<VEC>(pick<kF32>(fv[kF32 ? k : 0], sv[k]), p.rms, sum[0]);  // fv has one row without kF32
      }
    }
    const auto &vals = pick<kF32>(fv, sv);
    team_sum<true>(sum, team, red[0]);
    if (kF32 && p.s && col(0) < cols) store_s(0);
    const float mean = p.rms ? 0.f : sum[0] / (float)cols;
    float var = sum[0] / (float)cols;  // RMSNorm: the mean square
    if (!p.rms) {  // LayerNorm: the squared deviations from the mean, a second reduction
      float sq[1] = {sq_dev<VEC>(vals, mean, cols, col)};
      team_sum<true>(sq, team, red[1]);
      var = sq[0] / (float)cols;
    }
    const float rstd = rsqrtf(var + p.eps);
    if (!kEarlyWb) load_wb<kKeep>(p, w, b, col);
    write_y<T>(p, vals, w, b, mean, rstd, row, col, tid == 0);
  }
}

// Rows of 256, 512, 768 or 1024 16-bit values with a residual and a weight (a
// pre-norm transformer's call; x, s and weight of one dtype): fwd_regs' work
// in the shape Inductor compiles for such rows, with the width a constant.
// One warp a row, COLS / 256 chunks a thread, no guards; the weight and bias
// are loaded after s's sum with evict_last (kKeep), so that they stay in L1
// while the rows stream through it. Measured against fwd_regs (v12d): +0.2 to
// +0.6 % of the copy; in fwd_regs, with the width known only at run time,
// neither the shape nor the late loads gained. narrow_row is one warp's row:
// s and y stored, its mean and rstd returned.
template <class T, int COLS, bool RMS, bool BIAS>
__device__ __forceinline__ float2 narrow_row(const fo_norm_fwd_params &p, int64_t row, int lane) {
  constexpr int VEC = 8, NV = COLS / (32 * VEC);
  static_assert(NV * 32 * VEC == COLS && sizeof(T) == 2, "whole 16-bit rows");
  auto col = [&](int k) { return (k * 32 + lane) * VEC; };
  const T *x = static_cast<const T *>(p.x) + row * p.x_stride;
  const T *r = static_cast<const T *>(p.residual) + row * p.res_stride;
  Raw<T, VEC> xr[NV], rr[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    xr[k] = load_raw<VEC>(x + col(k));
    rr[k] = load_raw<VEC>(r + col(k));
  }
  // s = x + residual as stored (add_pack); the statistics are those of the
  // rounded stream. RMSNorm stores s after its reduction in the source: +0.7 %
  // of the copy at 1024 wide when it was written (v14); ptxas now issues three
  // of the four stores before the shuffles, and forcing them after measured
  // +0.1 % (v17). LayerNorm stores it here: held to after its reductions, its
  // 1024-wide kernels needed 92-96 registers (with s held as fp32 values).
  T *s = static_cast<T *>(p.s) + row * COLS;
  Pack<T, VEC> sp[NV];
  float sum[1] = {0.f};  // LayerNorm: the sum; RMSNorm: the sum of squares
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    sp[k] = add_chunk(xr[k], rr[k], true);
    if (!RMS) store_pack<VEC>(s + col(k), sp[k]);
    add_terms<VEC>(sp[k], RMS, sum[0]);
  }
  Pack<T, VEC> w[NV], b[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    w[k] = load_pack<VEC, kKeep>(static_cast<const T *>(p.weight) + col(k));
    if (BIAS) b[k] = load_pack<VEC, kKeep>(static_cast<const T *>(p.bias) + col(k));
  }
  warp_sum(sum);
  if (RMS) {
#pragma unroll
    for (int k = 0; k < NV; ++k) store_pack<VEC>(s + col(k), sp[k]);
  }
  const float mean = RMS ? 0.f : sum[0] / COLS;
  float var = sum[0] / COLS;  // RMSNorm: the mean square
  if (!RMS) {  // sq_dev's column guard is not folded away here: its SASS was 4-15 % longer
    float sq[1] = {0.f};
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int i = 0; i < VEC; ++i) sq[0] += (value(sp[k], i) - mean) * (value(sp[k], i) - mean);
    warp_sum(sq);
    var = sq[0] / COLS;
  }
  const float rstd = rsqrtf(var + p.eps);
  // s's values again from its packs (pack_value_again): bf16 RMSNorm at 1024
  // wide then takes 64 registers, not 71 (32 blocks an SM, not 28), and read
  // 0.45 % faster in the suite, level at the other widths (v20).
  T *y = static_cast<T *>(p.y) + row * COLS;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    float o[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      o[i] = (pack_value_again(sp[k], i) - mean) * rstd * pack_value(w[k], i);
      if (BIAS) o[i] += pack_value(b[k], i);
    }
    store_f<VEC>(y + col(k), o);
  }
  return make_float2(mean, rstd);
}

// fwd_narrow: RB rows a block, one a warp. RB 1: a block a row, as Inductor
// runs these rows; lane 0 stores the row's statistics (if asked for). RB 8
// (training's forward at 256 wide, and LayerNorm's at 512): the block's mean
// and rstd are gathered in shared memory and each array goes out as one
// 32-byte store, a whole sector. A block a row, storing 4 bytes a row, cost
// LayerNorm at 256 wide 2.1 % against the forward without statistics, whose
// bytes are 0.8 %; RB 8 took back 1.7 % (docs/perf-notes.md, v21). Whether the
// whole sectors or the blocks (up to 64 warps an SM at 256 wide, where blocks
// of one warp stop at 32) did it was not separated. RB 2: the forward without
// statistics at 256 and 512 wide on GPUs of more memory bandwidth an SM than
// an H100's (narrow_block_rows); it stores no statistics, and p.rstd is null.
template <class T, int COLS, bool RMS, bool BIAS, int RB>
__global__ void __launch_bounds__(32 * RB) fwd_narrow(const fo_norm_fwd_params p) {
  if constexpr (RB == 1) {
    const float2 st = narrow_row<T, COLS, RMS, BIAS>(p, blockIdx.x, threadIdx.x);
    if (threadIdx.x == 0) save_stats(p, blockIdx.x, st.x, st.y);
  } else {
    __shared__ float stats[2][RB];  // [mean, rstd][warp]
    const int warp = threadIdx.x / 32;
    const int64_t row0 = (int64_t)blockIdx.x * RB;
    if (row0 + warp < p.rows) {
      const float2 st = narrow_row<T, COLS, RMS, BIAS>(p, row0 + warp, threadIdx.x % 32);
      if (threadIdx.x % 32 == 0) {
        stats[0][warp] = st.x;
        stats[1][warp] = st.y;
      }
    }
    __syncthreads();
    const int k = threadIdx.x % RB;  // threads 0..RB-1: mean; RB..2RB-1: rstd
    if (threadIdx.x < 2 * RB && row0 + k < p.rows) {
      float *out = threadIdx.x < RB ? p.mean : p.rstd;
      if (out) out[row0 + k] = stats[threadIdx.x / RB][k];
    }
  }
}

// fwd_group: rows of a contiguous x (and residual) that no 8-byte access fits
// (16-bit rows of 2 mod 4 values, odd widths: access_vec's 4 bytes or one
// element a chunk), where the register kernels issue ~3.6x the instructions
// of Inductor's kernel (ncu at 258 wide, docs/perf-notes.md v28). Whatever the
// width, G = 16 / sizeof(T) rows of T (and of S) are a multiple of 16 bytes,
// so a block takes a group of G rows as one run of 16-byte words: x and the
// residual copied into shared memory by cp.async, a warp a row computing s
// (over the residual) and y (over x) there, element by element, and s and y
// copied out 16 bytes at a time. Only the last group's tail (fewer than G
// rows) moves an element at a time.
template <class E>
__device__ __forceinline__ void group_in(E *dst, const E *src, int n) {
  const int words = (int)(n * sizeof(E) / 16);
  const uint4 *src4 = reinterpret_cast<const uint4 *>(src);
  uint4 *dst4 = reinterpret_cast<uint4 *>(dst);
  for (int i = threadIdx.x; i < words; i += blockDim.x) cp_async16(dst4 + i, src4 + i, true);
  for (int i = words * (int)(16 / sizeof(E)) + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

template <class E>
__device__ __forceinline__ void group_out(E *dst, const E *src, int n) {
  constexpr int U = 4;  // words a thread has in flight
  const int words = (int)(n * sizeof(E) / 16);
  const uint4 *src4 = reinterpret_cast<const uint4 *>(src);
  uint4 *dst4 = reinterpret_cast<uint4 *>(dst);
  for (int i = threadIdx.x; i < words; i += U * blockDim.x) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + u * (int)blockDim.x < words) v[u] = src4[i + u * blockDim.x];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + u * (int)blockDim.x < words) store16(dst4 + i + u * blockDim.x, v[u]);
  }
  for (int i = words * (int)(16 / sizeof(E)) + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

template <class T, class S, class W>
__global__ void __launch_bounds__(32 * (16 / sizeof(T))) fwd_group(const fo_norm_fwd_params p) {
  constexpr int G = 16 / sizeof(T);
  extern __shared__ uint4 grp[];  // [G * cols] T: x, then y; [G * cols] S: residual, then s
  const int cols = (int)p.cols;
  const int64_t row0 = (int64_t)blockIdx.x * G;
  const int rows = (int)(p.rows - row0 < G ? p.rows - row0 : G), n = rows * cols;
  T *xs = reinterpret_cast<T *>(grp);
  S *ss = reinterpret_cast<S *>(grp + (int64_t)G * cols * sizeof(T) / 16);
  group_in(xs, static_cast<const T *>(p.x) + row0 * cols, n);
  if (p.residual) group_in(ss, static_cast<const S *>(p.residual) + row0 * cols, n);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < rows) {
    T *xr = xs + warp * cols;
    S *sr = ss + warp * cols;
    // s = x + residual as stored: the statistics are those of the rounded stream.
    float sum[1] = {0.f};  // LayerNorm: the sum; RMSNorm: the sum of squares
    for (int c = lane; c < cols; c += 32) {
      float v = to_f(xr[c]);
      if (p.residual) v += to_f(sr[c]);
      const S sv = from_f<S>(v);
      sr[c] = sv;
      const float f = to_f(sv);
      sum[0] += p.rms ? f * f : f;
    }
    warp_sum(sum);
    const float mean = p.rms ? 0.f : sum[0] / (float)cols;
    float var = sum[0] / (float)cols;  // RMSNorm: the mean square
    if (!p.rms) {  // LayerNorm: the squared deviations from the mean, a second reduction
      float sq[1] = {0.f};
      for (int c = lane; c < cols; c += 32) sq[0] += (to_f(sr[c]) - mean) * (to_f(sr[c]) - mean);
      warp_sum(sq);
      var = sq[0] / (float)cols;
    }
    const float rstd = rsqrtf(var + p.eps);
    const W *w = static_cast<const W *>(p.weight), *b = static_cast<const W *>(p.bias);
    for (int c = lane; c < cols; c += 32) {
      float o = (to_f(sr[c]) - mean) * rstd;
      if (w) o *= to_f(w[c]);
      if (b) o += to_f(b[c]);
      xr[c] = from_f<T>(o);
    }
    if (lane == 0) save_stats(p, row0 + warp, mean, rstd);
  }
  __syncthreads();
  group_out(static_cast<T *>(p.y) + row0 * cols, xs, n);
  if (p.s) group_out(static_cast<S *>(p.s) + row0 * cols, ss, n);
}

// fwd_shift: contiguous 16-bit rows that are not 16-byte aligned (widths not
// a multiple of 8 values), past fwd_group's 1.5K values, and those of 8-byte
// access (4 mod 8 values). Rows that follow each other with no gap in arrays
// that start 16-byte aligned are misaligned by the same bytes in x, the
// residual, s and y: each row's first h values (h < 8) up to its first 16-byte
// boundary, then whole 16-byte chunks, then a tail of fewer than 8. A block
// (the team) takes a row: its chunks in registers as fwd_regs holds them,
// moved 16 bytes at a time, and the head and tail (at most 14 values) one a
// thread. Where the register kernels read those rows 4 or 8 bytes at a time
// (or one element), and Inductor 4 bytes. The weight and bias of a chunk are
// then misaligned by h: read 4 bytes at a time (h even) or an element at a
// time, from L1 after the first rows.
template <class W>
__device__ __forceinline__ Pack<W, 8> shifted_pack(const W *w, int64_t c) {
  Pack<W, 8> pk;
  if constexpr (sizeof(W) == 2) {
    if ((reinterpret_cast<uintptr_t>(w + c) & 3) == 0) {
#pragma unroll
      for (int i = 0; i < 8; i += 2) reinterpret_cast<Pack<W, 2> *>(&pk)[i / 2] = load_pack<2>(w + c + i);
      return pk;
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) pk.v[i] = w[c + i];
  return pk;
}

// One row of fwd_shift / bwd_shift for thread tid of a team: the row starts at
// element `base` of arrays that start 16-byte aligned; h values (h < 8) up to
// its first 16-byte boundary, `chunks` 16-byte chunks of 8 values, a tail of
// fewer than 8. col(k): the column of this thread's k-th chunk, cols past the
// last (so that col(k) < cols is the guard); edge: whether it takes one of the
// head's and tail's values, the one at column ec.
template <class T>
struct ShiftedRow {
  static_assert(sizeof(T) == 2, "16-bit rows");
  int64_t cols, chunks, ec;
  int h, tid, team;
  bool edge;
  __device__ __forceinline__ ShiftedRow(int64_t base, int64_t cols_, int tid_, int team_)
      : cols(cols_), tid(tid_), team(team_) {
    const int64_t h16 = (16 - base * (int64_t)sizeof(T) % 16) % 16 / (int64_t)sizeof(T);  // values to the boundary
    h = (int)(h16 < cols ? h16 : cols);
    chunks = (cols - h) / 8;
    edge = tid < cols - chunks * 8;
    ec = tid < h ? tid : h + chunks * 8 + (tid - h);
  }
  __device__ __forceinline__ int64_t col(int k) const {
    const int64_t j = (int64_t)k * team + tid;
    return j < chunks ? h + j * 8 : cols;
  }
};

// EARLY: the weight and bias are loaded with the row, before the reductions
// (fwd_regs does so up to 16 values a thread), else after them.
template <class T, class W, int NV, bool EARLY>
__global__ void __launch_bounds__(kShiftThreads) fwd_shift(const fo_norm_fwd_params p) {
  constexpr int VEC = 8;
  static_assert(sizeof(T) == 2, "16-bit rows");
  __shared__ float red[2][32];
  const int tid = threadIdx.x, team = blockDim.x;
  const int64_t cols = p.cols, row = blockIdx.x, base = row * cols;
  const ShiftedRow<T> sr(base, cols, tid, team);
  auto col = [&](int k) { return sr.col(k); };
  const bool edge = sr.edge;
  const int64_t ec = sr.ec;
  const T *x = static_cast<const T *>(p.x) + base;
  const T *r = p.residual ? static_cast<const T *>(p.residual) + base : nullptr;
  T *s = p.s ? static_cast<T *>(p.s) + base : nullptr;
  Raw<T, VEC> xr[NV], rr[NV];
  load_chunks(x, r, cols, col, xr, rr);
  const W *w = static_cast<const W *>(p.weight), *b = static_cast<const W *>(p.bias);
  Pack<W, VEC> wp[NV], bp[NV];
  float ew = 0.f, eb = 0.f;  // the edge value's weight and bias
  auto load_params = [&](int k) {  // chunk k's; the edge value's with chunk 0
    if (col(k) < cols) {
      if (w) wp[k] = shifted_pack(w, col(k));
      if (b) bp[k] = shifted_pack(b, col(k));
    }
    if (k == 0 && edge && w) ew = to_f(w[ec]);
    if (k == 0 && edge && b) eb = to_f(b[ec]);
  };
  if (EARLY) {
#pragma unroll
    for (int k = 0; k < NV; ++k) load_params(k);
  }
  float e = 0.f;  // the edge value of s, as stored
  if (edge) {
    float v = to_f(x[ec]);
    if (r) v += to_f(r[ec]);
    const T sv = from_f<T>(v);
    if (s) s[ec] = sv;
    e = to_f(sv);
  }
  // s = x + residual as stored: the statistics are those of the rounded stream.
  Pack<T, VEC> sv[NV];
  float sum[1] = {edge ? (p.rms ? e * e : e) : 0.f};  // LayerNorm: the sum; RMSNorm: the sum of squares
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if (col(k) < cols) {
      sv[k] = add_chunk(xr[k], rr[k], r);
      if (s) store_pack<VEC>(s + col(k), sv[k]);
      add_terms<VEC>(sv[k], p.rms, sum[0]);
    }
  }
  team_sum<true>(sum, team, red[0]);
  const float mean = p.rms ? 0.f : sum[0] / (float)cols;
  float var = sum[0] / (float)cols;  // RMSNorm: the mean square
  if (!p.rms) {  // LayerNorm: the squared deviations from the mean, a second reduction
    float sq[1] = {sq_dev<VEC>(sv, mean, cols, col) + (edge ? (e - mean) * (e - mean) : 0.f)};
    team_sum<true>(sq, team, red[1]);
    var = sq[0] / (float)cols;
  }
  const float rstd = rsqrtf(var + p.eps);
  T *y = static_cast<T *>(p.y) + base;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if (!EARLY) load_params(k);  // a chunk's at a time: 64 registers at four chunks, not 107-109
    if (col(k) < cols) {
      float o[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        o[i] = (pack_value(sv[k], i) - mean) * rstd;
        if (w) o[i] *= pack_value(wp[k], i);
        if (b) o[i] += pack_value(bp[k], i);
      }
      store_f<VEC>(y + col(k), o);
    }
  }
  if (edge) {
    float o = (e - mean) * rstd;
    if (w) o *= ew;
    if (b) o += eb;
    y[ec] = from_f<T>(o);
  }
  if (tid == 0) save_stats(p, row, mean, rstd);
}

// Rows of 16K-32K 16-bit values (x and s of one dtype): a block of at most
// 512 threads a row, 64 values a thread. Half of each thread's chunks are held
// in registers as fwd_regs holds them; the other half are parked in shared
// memory: x and residual copied there by cp.async with the register chunks'
// loads, s written back over x. 64 registers and 64 KB a block, so that two
// rows are in flight an SM where fwd_regs' 1024-thread team held one.
constexpr int kParkThreads = FO_NORM_PARK_THREADS, kParkChunks = FO_NORM_PARK_CHUNKS, kParked = FO_NORM_PARKED;
template <class T, class W>
__global__ void __launch_bounds__(kParkThreads, 2) fwd_park(const fo_norm_fwd_params p) {
  constexpr int VEC = 8, NR = kParkChunks - kParked;  // NR chunks in registers
  // Its stores stay C++ assignments (no 16-byte store was split here): with
  // store_pack's inline PTX, LayerNorm at 512 x 32768 read 0.5 % slower (v15).
  constexpr bool kParkPtx = false;
  static_assert(sizeof(T) == 2, "16-bit rows");
  __shared__ float red[2][32];
  extern __shared__ uint4 park[];  // [kParked][x (then s), residual][team]
  const int tid = threadIdx.x, team = blockDim.x;
  const int cols = (int)p.cols;  // at most 32K: 32-bit columns, fewer registers
  const int64_t row = blockIdx.x;
  auto col = [&](int k) { return (k * team + tid) * VEC; };
  auto pcol = [&](int j) { return col(NR + j); };
  auto xs = [&](int j) { return park + (2 * j) * team + tid; };
  auto rs = [&](int j) { return park + (2 * j + 1) * team + tid; };
  const T *x = static_cast<const T *>(p.x) + row * p.x_stride;
  const T *r = p.residual ? static_cast<const T *>(p.residual) + row * p.res_stride : nullptr;
  T *s = p.s ? static_cast<T *>(p.s) + row * cols : nullptr;
#pragma unroll
  for (int j = 0; j < kParked; ++j) {
    if (pcol(j) < cols) {
      cp_async16(xs(j), x + pcol(j), true);
      if (r) cp_async16(rs(j), r + pcol(j), true);
    }
  }
  cp_async_commit();
  Raw<T, VEC> xr[NR], rr[NR];
  load_chunks(x, r, cols, col, xr, rr);
  // s = x + residual as stored; the statistics are those of the rounded stream.
  float sum[1] = {0.f};  // LayerNorm: the sum; RMSNorm: the sum of squares
  auto add = [&](const Raw<T, VEC> &xw, const Raw<T, VEC> &rw, int c) {
    const Pack<T, VEC> sp = add_chunk(xw, rw, r);
    if (s) store_pack<VEC, kParkPtx>(s + c, sp);
    add_terms<VEC>(sp, p.rms, sum[0]);
    return sp;
  };
  Pack<T, VEC> sv[NR];
#pragma unroll
  for (int k = 0; k < NR; ++k)
    if (col(k) < cols) sv[k] = add(xr[k], rr[k], col(k));
  cp_async_wait<0>();
#pragma unroll
  for (int j = 0; j < kParked; ++j) {
    if (pcol(j) < cols) {
      Raw<T, VEC> xw, rw;
      xw.q[0] = *xs(j);
      if (r) rw.q[0] = *rs(j);
      const Pack<T, VEC> sp = add(xw, rw, pcol(j));
      *xs(j) = reinterpret_cast<const uint4 &>(sp);  // parked again, as s
    }
  }
  team_sum<true>(sum, team, red[0]);
  const float mean = p.rms ? 0.f : sum[0] / (float)cols;
  float var = sum[0] / (float)cols;  // RMSNorm: the mean square
  if (!p.rms) {  // LayerNorm: the squared deviations from the mean, a second reduction
    Pack<T, VEC> pv[kParked];  // the parked chunks of s, read back
#pragma unroll
    for (int j = 0; j < kParked; ++j)
      if (pcol(j) < cols) pv[j] = load_pack<VEC>(reinterpret_cast<const T *>(xs(j)));
    float sq[1] = {sq_dev<VEC>(sv, mean, cols, col) + sq_dev<VEC>(pv, mean, cols, pcol)};
    team_sum<true>(sq, team, red[1]);
    var = sq[0] / (float)cols;
  }
  const float rstd = rsqrtf(var + p.eps);
  // y a chunk at a time, its weight and bias loaded with it (all at once
  // they would spill).
#pragma unroll
  for (int k = 0; k < kParkChunks; ++k) {
    auto at = [&](int) { return col(k); };
    Pack<T, VEC> v[1];
    Pack<W, VEC> w[1], b[1];
    if (k < NR) v[0] = sv[k < NR ? k : 0];
    else if (col(k) < cols) v[0] = load_pack<VEC>(reinterpret_cast<const T *>(xs(k - NR)));
    load_wb(p, w, b, at);
    write_y<T, kParkPtx>(p, v, w, b, mean, rstd, row, at, false);
  }
  if (tid == 0) save_stats(p, row, mean, rstd);
}

// The pipe kernels (fwd_pipe, bwd_pipe): persistent teams, or clusters, whose
// rows are staged through shared memory by cp.async `stages` - 1 rows ahead,
// so that loads stay in flight while a team reduces. A thread copies and reads
// back only its own chunks: the copies need no barrier, only the wait.
// Teams of at most 512 threads (128 registers each) of 2 chunks a thread: the
// stages keep the loads in flight, so the team need not be large, and
// 1024-thread teams spill.
constexpr int kPipeThreads = FO_NORM_PIPE_THREADS, kPipeChunks = FO_NORM_PIPE_CHUNKS;

// Where a pipe kernel's thread works. A block is one team; with CL the row is
// split over the cluster, one slice of `span` values a block. The thread's
// chunk k is at local(k) in a stage (32-bit: fewer registers) and at col(k)
// in the row; its unit (block, or cluster) takes rows unit, unit + units, ...
template <int NV, int VEC, bool CL>
struct PipePlace {
  int tid = threadIdx.x, team = blockDim.x, span = NV * VEC * team;
  int64_t first_col = CL ? (int64_t)cluster_rank() * span : 0;
  int64_t unit = CL ? blockIdx.x / cluster_size() : blockIdx.x;
  int64_t units = CL ? gridDim.x / cluster_size() : gridDim.x;
  __device__ int local(int k) const { return (k * team + tid) * VEC; }
  __device__ int64_t col(int k) const { return first_col + local(k); }
  // The stage after st, and the one before it (which the last row left), of `stages`.
  __device__ static int next(int st, int stages) { return st + 1 == stages ? 0 : st + 1; }
  __device__ static int prev(int st, int stages) { return st == 0 ? stages - 1 : st - 1; }
};

// fwd_regs' math on the pipe: x and residual staged; with CL the row is split
// over a cluster (slices of kPipeChunks * team * VEC columns) and its sums go
// through ClusterSum while the next rows load (clusters of fwd_regs, one row
// each, had nothing in flight during an exchange: 0.69-0.77 of the copy at
// 16K-32K wide against 0.79-0.86; removed in v11).
template <class T, class S, class W, int VEC, bool CL>
__global__ void __launch_bounds__(kPipeThreads) fwd_pipe(const fo_norm_fwd_params p, int stages) {
  constexpr int NV = kPipeChunks;
  __shared__ float red[2][32];
  __shared__ ClusterSum<1, 2> xsum;  // with CL, RMSNorm: the sum of squares
  __shared__ ClusterSum<2, 2> xmom;  // with CL, LayerNorm: the slices' moments
  if (CL) {
    xsum.init();
    xmom.init();
    cluster_arrive();
  }
  extern __shared__ float4 smem[];
  const PipePlace<NV, VEC, CL> at;
  const int tid = at.tid, team = at.team, span = at.span;
  const int64_t cols = p.cols;
  auto col = [&](int k) { return at.col(k); };  // for sq_dev and write_y
  const int stage_bytes = span * (int)(sizeof(T) + (p.residual ? sizeof(S) : 0));
  auto x_at = [&](int st) { return reinterpret_cast<T *>(reinterpret_cast<char *>(smem) + st * stage_bytes); };
  auto r_at = [&](int st) {
    return reinterpret_cast<S *>(reinterpret_cast<char *>(smem) + st * stage_bytes + span * (int)sizeof(T));
  };
  const int64_t unit = at.unit, row_step = at.units;
  auto fetch = [&](int64_t row, int st) {
    if (row < p.rows) {
      const T *x = static_cast<const T *>(p.x) + row * p.x_stride;
      const S *r = p.residual ? static_cast<const S *>(p.residual) + row * p.res_stride : nullptr;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        if (col(k) < cols) {
          cp_async_bytes<VEC * sizeof(T)>(x_at(st) + at.local(k), x + col(k));
          if (r) cp_async_bytes<VEC * sizeof(S)>(r_at(st) + at.local(k), r + col(k));
        }
      }
    }
    cp_async_commit();
  };
  for (int i = 0; i + 1 < stages; ++i) fetch(unit + i * row_step, i);
  Pack<W, VEC> w[NV], b[NV];  // the same in every row
  load_wb(p, w, b, col);
  if (CL) cluster_wait();  // every block's mbarriers are ready
  // With CL, LayerNorm takes the block's own mean (its `mine` values): its
  // slice's deviations need no exchange first, and xmom.moments takes both
  // sums at once.
  const int64_t mine = CL ? slice_count(cols, cluster_rank(), span) : cols;
  int st = 0, exchange = 0, parity = 0;  // parity: the red slice of the next team_sum
  for (int64_t row = unit; row < p.rows; row += row_step) {
    fetch(row + (stages - 1) * row_step, at.prev(st, stages));
    cp_async_wait_for(stages - 1);
    float v[NV][VEC];
    float sum[1] = {0.f};
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (col(k) < cols) {
        load_f<VEC>(x_at(st) + at.local(k), v[k]);
        if (p.residual) {
          float rv[VEC];
          load_f<VEC>(r_at(st) + at.local(k), rv);
#pragma unroll
          for (int i = 0; i < VEC; ++i) v[k][i] += rv[i];
        }
        if (p.s) {  // s as stored: the statistics are those of the rounded stream
          store_rounded<VEC>(static_cast<S *>(p.s) + row * cols + col(k), v[k]);
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) sum[0] += v[k][i];
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[k][i] = 0.f;
      }
    }
    float mean = 0.f;
    if (!p.rms) {
      team_sum<true>(sum, team, red[parity]);
      parity ^= 1;
      mean = mine > 0 ? sum[0] / (float)mine : 0.f;
    }
    float sq[1] = {sq_dev<VEC>(v, mean, cols, col)};
    team_sum<true>(sq, team, red[parity]);
    parity ^= 1;
    if (CL && p.rms) xsum.sum(sq, exchange++);
    if (CL && !p.rms) {
      float m[2] = {sum[0], sq[0]};
      xmom.moments(m, exchange++, cols, span);
      mean = m[0] / (float)cols;
      sq[0] = m[1];
    }
    const float rstd = rsqrtf(sq[0] / (float)cols + p.eps);
    write_y<T>(p, v, w, b, mean, rstd, row, col, tid == 0 && (!CL || cluster_rank() == 0));
    st = at.next(st, stages);
  }
  cp_async_wait<0>();
  if (CL) {  // no block may exit while another may still store to it
    cluster_arrive();
    cluster_wait();
  }
}

// One block per row for rows too wide for registers (or not 16-byte aligned:
// VEC = 1). The row is walked loop_unroll(VEC) vectors per thread at a time: three
// passes for LayerNorm (sum, squared deviations, output), two for RMSNorm; s
// is read back from L1/L2 by the thread that wrote it. A step's loads go
// into Raw before any is used, so that all are in flight at once.
template <class T, class S, class W, int VEC>
__global__ void __launch_bounds__(kLoopThreads) fwd_loop(const fo_norm_fwd_params p) {
  constexpr int U = loop_unroll(VEC);
  // fp32 rows keep C++ assignments for their stores, split or not: with
  // store_pack's inline PTX this kernel spilled at 128 registers, and with two
  // vectors a step instead of four its forward lost 8-10 % (v15).
  constexpr bool kPtx = sizeof(T) == 2;
  __shared__ float red[2][32];
  const int team = blockDim.x, tid = threadIdx.x;
  const int64_t cols = p.cols, step = (int64_t)team * VEC;
  int parity = 0;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T *x = static_cast<const T *>(p.x) + row * p.x_stride;
    const S *r = p.residual ? static_cast<const S *>(p.residual) + row * p.res_stride : nullptr;
    S *s = p.s ? static_cast<S *>(p.s) + row * cols : nullptr;
    // s as stored, read back by the later passes; without it (no residual,
    // norm.h), x itself, which then has s's dtype.
    const S *sx = s;
    if constexpr (std::is_same_v<S, T>) sx = s ? s : x;
    float acc[1] = {0.f};  // LayerNorm: the sum; RMSNorm: the sum of squares
#pragma unroll 1
    for (int64_t c0 = (int64_t)tid * VEC; c0 < cols; c0 += U * step) {
      Raw<T, VEC> xr[U];
      Raw<S, VEC> rr[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {  // loads only
        const int64_t c = c0 + u * step;
        if (c < cols) {
          xr[u] = load_raw<VEC>(x + c);
          if (r) rr[u] = load_raw<VEC>(r + c);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t c = c0 + u * step;
        if (c < cols) {
          const Pack<S, VEC> sp = add_chunk(xr[u], rr[u], r);
          if (s) store_pack<VEC, kPtx>(s + c, sp);
          add_terms<VEC>(sp, p.rms, acc[0]);
        }
      }
    }
    team_sum<true>(acc, team, red[parity]);
    parity ^= 1;
    const float mean = p.rms ? 0.f : acc[0] / (float)cols;
    float var = acc[0] / (float)cols;  // RMSNorm: the mean square
    if (!p.rms) {
      float sq[1] = {0.f};
#pragma unroll 1
      for (int64_t c0 = (int64_t)tid * VEC; c0 < cols; c0 += U * step) {
        Raw<S, VEC> sr[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (c0 + u * step < cols) sr[u] = load_raw<VEC>(sx + c0 + u * step);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (c0 + u * step < cols) {
            const Pack<S, VEC> sp = sr[u].pack();
#pragma unroll
            for (int i = 0; i < VEC; ++i) sq[0] += (value(sp, i) - mean) * (value(sp, i) - mean);
          }
        }
      }
      team_sum<true>(sq, team, red[parity]);
      parity ^= 1;
      var = sq[0] / (float)cols;
    }
    const float rstd = rsqrtf(var + p.eps);
    T *y = static_cast<T *>(p.y) + row * cols;
#pragma unroll 1
    for (int64_t c0 = (int64_t)tid * VEC; c0 < cols; c0 += U * step) {
      Raw<S, VEC> sr[U];
      Raw<W, VEC> wr[U], br[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {  // loads only
        const int64_t c = c0 + u * step;
        if (c < cols) {
          sr[u] = load_raw<VEC>(sx + c);
          if (p.weight) wr[u] = load_raw<VEC, kReadOnly>(static_cast<const W *>(p.weight) + c);
          if (p.bias) br[u] = load_raw<VEC, kReadOnly>(static_cast<const W *>(p.bias) + c);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t c = c0 + u * step;
        if (c < cols) {
          const Pack<S, VEC> sp = sr[u].pack();
          const Pack<W, VEC> w = wr[u].pack(), b = br[u].pack();
          float o[VEC];
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            o[i] = (value(sp, i) - mean) * rstd;
            if (p.weight) o[i] *= pack_value(w, i);
            if (p.bias) o[i] += pack_value(b, i);
          }
          store_f<VEC, kPtx>(y + c, o);
        }
      }
    }
    if (tid == 0) save_stats(p, row, mean, rstd);
  }
}

// --- backward -----------------------------------------------------------------------------

__device__ __forceinline__ float4 add4(float4 a, const float *b) {
  return make_float4(a.x + b[0], a.y + b[1], a.z + b[2], a.w + b[3]);
}
// Per row, with g = dy * w and xhat = (s - mean) * rstd:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) + ds
// (g - mean(g) first: in rows of tiny variance rstd is huge, and rstd * g
// minus rstd * mean(g) would cancel to noise.)
template <class T, class S, class W, int VEC>
__device__ __forceinline__ void grad_terms(const Pack<T, VEC> &dyv, const Pack<S, VEC> &sv, const Pack<W, VEC> &wv,
                                           int i, bool has_w, float mean, float rstd, float &dy, float &xh, float &g) {
  dy = pack_value(dyv, i);
  xh = (pack_value(sv, i) - mean) * rstd;
  g = has_w ? dy * pack_value(wv, i) : dy;
}

template <class T, class S, class W, int VEC, int NV>
__global__ void __launch_bounds__(bwd_max_threads(NV * VEC, VEC)) bwd_regs(const fo_norm_bwd_params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if constexpr (NV > 8) {  // not planned before sm_90 (bwd_max_chunks): there it spilled 8 bytes
    __trap();
    return;
  }
#endif
  __shared__ float red[kMaxTeams][2][64];
  // [blockDim.y][2][NV * VEC * team]: each team's dweight and dbias sums over
  // its rows. Shared memory rather than registers: two arrays fewer per
  // thread, and the occupancy that buys keeps more loads in flight. Every
  // column belongs to one thread of the team, so the sums need no atomics.
  // Values go in float4s: values 4q..4q+3 of thread tid (q over its NV * VEC
  // values, value j being value j % VEC of chunk j / VEC) are float4 number
  // q * team + tid, so that a warp's 16-byte accesses are contiguous (no bank
  // conflicts) and an update of 8 values is two LDS.128 + two STS.128 (ncu:
  // scalar slots left the backward issue-bound). Chunks of 1 or 2 values
  // (VEC < 4) share float4s, the last one padded with zeros.
  extern __shared__ float4 acc[];
  const int tid = threadIdx.x, team = blockDim.x;
  const int64_t cols = p.cols;
  const bool want_w = p.dweight != nullptr, want_b = p.dbias != nullptr;
  auto col = [&](int k) { return ((int64_t)k * team + tid) * VEC; };
  constexpr int Q = sums_per_thread(NV * VEC) / 4;  // float4s per thread per array
  float4 *acc_w = acc + threadIdx.y * 2 * Q * team + tid, *acc_b = acc_w + Q * team;
  if (want_w || want_b) {
#pragma unroll
    for (int q = 0; q < Q; ++q) acc_w[q * team] = acc_b[q * team] = make_float4(0.f, 0.f, 0.f, 0.f);
  }

  const int64_t row_step = (int64_t)gridDim.x * blockDim.y;
  int parity = 0;
  for (int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y; row < p.rows; row += row_step) {
    const T *dyp = static_cast<const T *>(p.dy) + row * p.dy_stride;
    const S *sp = static_cast<const S *>(p.s) + row * p.s_stride;
    const S *dsp = p.ds ? static_cast<const S *>(p.ds) + row * p.ds_stride : nullptr;
    const float mean = p.mean ? p.mean[row] : 0.f, rstd = p.rstd[row];
    // The row stays in registers as loaded (Raw: 16-bit values two to a
    // register, half the registers of fp32 values, and every chunk's loads in
    // flight at once); xhat and g are recomputed after the reduction, which
    // is cheaper than the occupancy fp32 copies would cost.
    Raw<S, VEC> sv[NV], dsv[NV];
    Raw<T, VEC> dyv[NV];
    Raw<W, VEC> w[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k) {  // loads only
      if (col(k) < cols) {
        sv[k] = load_raw<VEC>(sp + col(k));
        dyv[k] = load_raw<VEC>(dyp + col(k));
        if (dsp) dsv[k] = load_raw<VEC>(dsp + col(k));
        if (p.weight) w[k] = load_raw<VEC, kReadOnly>(static_cast<const W *>(p.weight) + col(k));
      }
    }
    float sums[2] = {0.f, 0.f};  // sum of g, sum of g * xhat
    if constexpr (VEC % 4 == 0) {
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        if (col(k) < cols) {
#pragma unroll
          for (int q = 0; q < VEC / 4; ++q) {
            float dw[4], db[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int i = 4 * q + e;
              float dy, xh, g;
              grad_terms(dyv[k].pack(), sv[k].pack(), w[k].pack(), i, p.weight, mean, rstd, dy, xh, g);
              sums[0] += g;
              sums[1] += g * xh;
              dw[e] = dy * xh;
              db[e] = dy;
            }
            const int at = (k * VEC / 4 + q) * team;
            if (want_w) acc_w[at] = add4(acc_w[at], dw);
            if (want_b) acc_b[at] = add4(acc_b[at], db);
          }
        }
      }
    } else {  // chunks of 1 or 2 values: a float4 of sums spans chunks
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        float dw[4] = {0.f, 0.f, 0.f, 0.f}, db[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = 4 * q + e, k = j / VEC;
          if (j < NV * VEC && col(k) < cols) {
            float dy, xh, g;
            grad_terms(dyv[k].pack(), sv[k].pack(), w[k].pack(), j % VEC, p.weight, mean, rstd, dy, xh, g);
            sums[0] += g;
            sums[1] += g * xh;
            dw[e] = dy * xh;
            db[e] = dy;
          }
        }
        if (want_w) acc_w[q * team] = add4(acc_w[q * team], dw);
        if (want_b) acc_b[q * team] = add4(acc_b[q * team], db);
      }
    }
    team_sum(sums, team, red[threadIdx.y][parity]);
    parity ^= 1;
    const float mean_g = p.rms ? 0.f : sums[0] / (float)cols;
    const float mean_gx = sums[1] / (float)cols;
    S *dx = static_cast<S *>(p.dx) + row * cols;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (col(k) < cols) {
        float o[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          float dy, xh, g;
          grad_terms(dyv[k].pack(), sv[k].pack(), w[k].pack(), i, p.weight, mean, rstd, dy, xh, g);
          o[i] = rstd * (g - mean_g - xh * mean_gx);
          if (dsp) o[i] += pack_value(dsv[k].pack(), i);
        }
        store_f<VEC>(dx + col(k), o);
      }
    }
  }
  if (!want_w && !want_b) return;
  // The block's partial rows: its teams' sums added in a fixed order.
  __syncthreads();
  const int nthreads = blockDim.x * blockDim.y, flat = threadIdx.y * blockDim.x + tid;
  for (int which = 0; which < 2; ++which) {
    if (!(which == 0 ? want_w : want_b)) continue;
    float *out = p.partial + ((int64_t)which * p.parts + blockIdx.x) * cols;
    const float *sums = reinterpret_cast<const float *>(acc);
    for (int64_t c = flat; c < cols; c += nthreads) {
      const int chunk = (int)(c / VEC), k = chunk / team, owner = chunk % team;
      const int j = k * VEC + (int)(c % VEC);  // the owner's value number
      const int slot = ((j / 4) * team + owner) * 4 + j % 4;
      float sum = 0.f;
      for (int t = 0; t < (int)blockDim.y; ++t) sum += sums[(t * 2 + which) * Q * team * 4 + slot];
      out[c] = sum;
    }
  }
}

// bwd_shift: fwd_shift's rows for the backward (contiguous dy, s, ds and dx,
// 16-bit, of one dtype): a head to each row's first 16-byte boundary and a
// tail one value a thread, 16-byte chunks in registers between, persistent
// blocks of one team over the rows. A thread's columns move with each row's
// head, so dweight / dbias are summed in shared memory by column ([2][cols]
// floats a block), not in bwd_regs' per-thread slots: within a row the team's
// columns are disjoint, and team_sum's barrier (a __syncwarp for one-warp
// teams) orders one row's updates before the next row's, so no atomics.
template <class T, class W, int NV>
__global__ void __launch_bounds__(kShiftThreads) bwd_shift(const fo_norm_bwd_params p) {
  constexpr int VEC = 8;
  static_assert(sizeof(T) == 2, "16-bit rows");
  __shared__ float red[2][64];
  extern __shared__ float colsums[];  // [dweight, dbias][cols]: this block's rows' sums
  const int tid = threadIdx.x, team = blockDim.x;
  const int64_t cols = p.cols;
  const bool want_w = p.dweight != nullptr, want_b = p.dbias != nullptr;
  // column c's sum at (c % 8) * L + c / 8: for a value number i of its
  // chunks, a warp's threads add into consecutive words (by column, chunks 8
  // values apart were an 8-way bank conflict)
  const int64_t L = (cols + 7) / 8;
  auto slot = [&](int64_t c) { return (c % 8) * L + c / 8; };
  float *acc_w = colsums, *acc_b = colsums + (want_w ? 8 * L : 0);
  const int64_t nsums = ((want_w ? 1 : 0) + (want_b ? 1 : 0)) * 8 * L;
  for (int64_t c = tid; c < nsums; c += team) colsums[c] = 0.f;
  __syncthreads();
  auto add_sums = [&](int64_t c, float dw, float db) {
    if (want_w) acc_w[slot(c)] += dw;
    if (want_b) acc_b[slot(c)] += db;
  };
  int parity = 0;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t base = row * cols;
    const ShiftedRow<T> sr(base, cols, tid, team);
    auto col = [&](int k) { return sr.col(k); };
    const bool edge = sr.edge;
    const int64_t ec = sr.ec;
    const T *dyp = static_cast<const T *>(p.dy) + base;
    const T *sp = static_cast<const T *>(p.s) + base;
    const T *dsp = p.ds ? static_cast<const T *>(p.ds) + base : nullptr;
    const W *w = static_cast<const W *>(p.weight);
    const float mean = p.mean ? p.mean[row] : 0.f, rstd = p.rstd[row];
    Raw<T, VEC> sv[NV], dyv[NV], dsv[NV];
    Pack<W, VEC> wv[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k) {  // loads only
      if (col(k) < cols) {
        sv[k] = load_raw<VEC>(sp + col(k));
        dyv[k] = load_raw<VEC>(dyp + col(k));
        if (dsp) dsv[k] = load_raw<VEC>(dsp + col(k));
        if (w) wv[k] = shifted_pack(w, col(k));
      }
    }
    float e_dy = 0.f, e_xh = 0.f, e_g = 0.f, e_ds = 0.f;  // the edge value's terms
    float sums[2] = {0.f, 0.f};                           // sum of g, sum of g * xhat
    if (edge) {
      e_dy = to_f(dyp[ec]);
      e_xh = (to_f(sp[ec]) - mean) * rstd;
      e_g = w ? e_dy * to_f(w[ec]) : e_dy;
      if (dsp) e_ds = to_f(dsp[ec]);
      sums[0] = e_g;
      sums[1] = e_g * e_xh;
      add_sums(ec, e_dy * e_xh, e_dy);
    }
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (col(k) < cols) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          float dy, xh, g;
          grad_terms(dyv[k].pack(), sv[k].pack(), wv[k], i, w, mean, rstd, dy, xh, g);
          sums[0] += g;
          sums[1] += g * xh;
          add_sums(col(k) + i, dy * xh, dy);
        }
      }
    }
    if (team == 32) __syncwarp();  // team_sum has no barrier for one warp
    team_sum<true>(sums, team, red[parity]);
    parity ^= 1;
    const float mean_g = p.rms ? 0.f : sums[0] / (float)cols;
    const float mean_gx = sums[1] / (float)cols;
    T *dx = static_cast<T *>(p.dx) + base;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (col(k) < cols) {
        float o[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          float dy, xh, g;
          grad_terms(dyv[k].pack(), sv[k].pack(), wv[k], i, w, mean, rstd, dy, xh, g);
          o[i] = rstd * (g - mean_g - xh * mean_gx);
          if (dsp) o[i] += pack_value(dsv[k].pack(), i);
        }
        store_f<VEC>(dx + col(k), o);
      }
    }
    if (edge) dx[ec] = from_f<T>(rstd * (e_g - mean_g - e_xh * mean_gx) + e_ds);
  }
  if (!want_w && !want_b) return;
  __syncthreads();
  for (int which = 0; which < 2; ++which) {
    if (!(which == 0 ? want_w : want_b)) continue;
    float *out = p.partial + ((int64_t)which * p.parts + blockIdx.x) * cols;
    const float *sums = which == 0 ? acc_w : acc_b;
    for (int64_t c = tid; c < cols; c += team) out[c] = sums[slot(c)];
  }
}

// bwd_group: fwd_group's groups for the backward (rows of a contiguous dy, s
// and ds that allow no 8-byte access, up to 48 KB a group with its sums):
// dy, s and ds copied in 16 bytes at a time, a warp a row computing dx over
// s's copy, dx copied out the same way. Blocks are persistent over the
// groups; each warp sums dweight / dbias over its rows in its own slice of
// shared memory, and each block writes one partial row, its warps' sums
// added in a fixed order.
template <class T, class S, class W>
__global__ void __launch_bounds__(32 * (16 / sizeof(T))) bwd_group(const fo_norm_bwd_params p) {
  constexpr int G = 16 / sizeof(T);
  // [G * cols] T: dy; [G * cols] S: s, then dx; [G * cols] S: ds (if any);
  // [G][2][cols] float: each warp's dweight and dbias sums (if wanted)
  extern __shared__ uint4 grp[];
  const int cols = (int)p.cols;
  const bool want_w = p.dweight != nullptr, want_b = p.dbias != nullptr;
  T *dys = reinterpret_cast<T *>(grp);
  S *ss = reinterpret_cast<S *>(grp + (int64_t)G * cols * sizeof(T) / 16);
  S *dss = ss + G * cols;
  float *acc = reinterpret_cast<float *>(dss + (p.ds ? G * cols : 0));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float *aw = acc + warp * 2 * cols, *ab = aw + cols;
  if (want_w || want_b)
    for (int c = lane; c < cols; c += 32) aw[c] = ab[c] = 0.f;
  const W *w = static_cast<const W *>(p.weight);
  const int64_t groups = (p.rows + G - 1) / G;
  for (int64_t grp_i = blockIdx.x; grp_i < groups; grp_i += gridDim.x) {
    const int64_t row0 = grp_i * G;
    const int rows = (int)(p.rows - row0 < G ? p.rows - row0 : G), n = rows * cols;
    __syncthreads();  // the previous group's dx is out
    group_in(dys, static_cast<const T *>(p.dy) + row0 * cols, n);
    group_in(ss, static_cast<const S *>(p.s) + row0 * cols, n);
    if (p.ds) group_in(dss, static_cast<const S *>(p.ds) + row0 * cols, n);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    if (warp < rows) {
      const int64_t row = row0 + warp;
      const float mean = p.mean ? p.mean[row] : 0.f, rstd = p.rstd[row];
      const T *dyr = dys + warp * cols;
      S *sr = ss + warp * cols;
      const S *dsr = dss + warp * cols;
      // g = dy * w, xhat = (s - mean) * rstd, as bwd_regs' grad_terms
      auto terms = [&](int c, float &dy, float &xh, float &g) {
        dy = to_f(dyr[c]);
        xh = (to_f(sr[c]) - mean) * rstd;
        g = w ? dy * to_f(w[c]) : dy;
      };
      float sums[2] = {0.f, 0.f};  // sum of g, sum of g * xhat
      for (int c = lane; c < cols; c += 32) {
        float dy, xh, g;
        terms(c, dy, xh, g);
        sums[0] += g;
        sums[1] += g * xh;
        if (want_w) aw[c] += dy * xh;
        if (want_b) ab[c] += dy;
      }
      warp_sum(sums);
      const float mean_g = p.rms ? 0.f : sums[0] / (float)cols;
      const float mean_gx = sums[1] / (float)cols;
      for (int c = lane; c < cols; c += 32) {
        float dy, xh, g;
        terms(c, dy, xh, g);
        float o = rstd * (g - mean_g - xh * mean_gx);
        if (p.ds) o += to_f(dsr[c]);
        sr[c] = from_f<S>(o);  // dx over s: this lane alone reads or writes column c of the row
      }
    }
    __syncthreads();
    group_out(static_cast<S *>(p.dx) + row0 * cols, ss, n);
  }
  if (!want_w && !want_b) return;
  __syncthreads();
  for (int which = 0; which < 2; ++which) {
    if (!(which == 0 ? want_w : want_b)) continue;
    float *out = p.partial + ((int64_t)which * p.parts + blockIdx.x) * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      float sum = 0.f;
      for (int k = 0; k < G; ++k) sum += acc[(k * 2 + which) * cols + c];
      out[c] = sum;
    }
  }
}

// bwd_regs' math on the pipe: s, dy and ds staged (bwd_regs issues a row's
// loads after the previous row's dx; at 8192 wide its 1024-thread team fills
// the multiprocessor, which then has no loads in flight while the team
// reduces). A block is one team; its dweight / dbias sums stay in registers
// (shared memory holds the stages) and are its partial rows.
// CL: the row is split over the blocks of a thread-block cluster (sm_90), one
// slice of NV * team * VEC columns a block, the row sums exchanged through
// distributed shared memory (ClusterSum) while the next rows' loads are in
// flight; the clusters are persistent, each walking rows, and each block
// writes its slice of the cluster's partial rows.
template <class T, class S, class W, int VEC, bool CL>
__global__ void __launch_bounds__(kPipeThreads) bwd_pipe(const fo_norm_bwd_params p, int stages) {
  constexpr int NV = kPipeChunks;
  __shared__ float red[2][64];
  __shared__ ClusterSum<2, 2> xsum;  // with CL: the sum of g and of g * xhat
  if (CL) {
    xsum.init();
    cluster_arrive();
  }
  extern __shared__ float4 smem[];
  const PipePlace<NV, VEC, CL> at;
  const int tid = at.tid, team = at.team, span = at.span;
  const int64_t cols = p.cols;
  const bool want_w = p.dweight != nullptr, want_b = p.dbias != nullptr;
  // A stage: s, dy and ds (when given), `span` values each.
  const int stage_bytes = span * (int)(sizeof(S) + sizeof(T) + (p.ds ? sizeof(S) : 0));
  char *const own = reinterpret_cast<char *>(smem);
  auto s_at = [&](int st) { return reinterpret_cast<S *>(own + st * stage_bytes); };
  auto dy_at = [&](int st) { return reinterpret_cast<T *>(own + st * stage_bytes + span * (int)sizeof(S)); };
  auto ds_at = [&](int st) {
    return reinterpret_cast<S *>(own + st * stage_bytes + span * (int)(sizeof(S) + sizeof(T)));
  };
  const int64_t unit = at.unit, row_step = at.units;
  // Row `row`, when there is one, into stage st: one commit group either way.
  auto fetch = [&](int64_t row, int st) {
    if (row < p.rows) {
      const S *sp = static_cast<const S *>(p.s) + row * p.s_stride;
      const T *dyp = static_cast<const T *>(p.dy) + row * p.dy_stride;
      const S *dsp = p.ds ? static_cast<const S *>(p.ds) + row * p.ds_stride : nullptr;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        if (at.col(k) < cols) {
          cp_async_bytes<VEC * sizeof(S)>(s_at(st) + at.local(k), sp + at.col(k));
          cp_async_bytes<VEC * sizeof(T)>(dy_at(st) + at.local(k), dyp + at.col(k));
          if (dsp) cp_async_bytes<VEC * sizeof(S)>(ds_at(st) + at.local(k), dsp + at.col(k));
        }
      }
    }
    cp_async_commit();
  };
  for (int i = 0; i + 1 < stages; ++i) fetch(unit + i * row_step, i);

  Pack<W, VEC> w[NV];  // the same in every row
  float dw[NV][VEC], db[NV][VEC];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if (p.weight && at.col(k) < cols) w[k] = load_pack<VEC, kReadOnly>(static_cast<const W *>(p.weight) + at.col(k));
#pragma unroll
    for (int i = 0; i < VEC; ++i) dw[k][i] = db[k][i] = 0.f;
  }
  float mean = 0.f, rstd = 0.f;
  if (unit < p.rows) {
    mean = p.mean ? p.mean[unit] : 0.f;
    rstd = p.rstd[unit];
  }
  if (CL) cluster_wait();  // every block's mbarriers are ready
  int st = 0, parity = 0, exchange = 0;
  for (int64_t row = unit; row < p.rows; row += row_step) {
    fetch(row + (stages - 1) * row_step, at.prev(st, stages));
    const int64_t next = row + row_step;  // its statistics arrive during this row
    float next_mean = 0.f, next_rstd = 0.f;
    if (next < p.rows) {
      next_mean = p.mean ? p.mean[next] : 0.f;
      next_rstd = p.rstd[next];
    }
    cp_async_wait_for(stages - 1);  // this row's group has landed
    float sums[2] = {0.f, 0.f};  // sum of g, sum of g * xhat
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (at.col(k) < cols) {
        const Pack<S, VEC> sv = load_pack<VEC>(s_at(st) + at.local(k));
        const Pack<T, VEC> dyv = load_pack<VEC>(dy_at(st) + at.local(k));
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          float dy, xh, g;
          grad_terms(dyv, sv, w[k], i, p.weight, mean, rstd, dy, xh, g);
          sums[0] += g;
          sums[1] += g * xh;
          dw[k][i] += dy * xh;
          db[k][i] += dy;
        }
      }
    }
    team_sum<true>(sums, team, red[parity]);
    parity ^= 1;
    if (CL) xsum.sum(sums, exchange++);
    const float mean_g = p.rms ? 0.f : sums[0] / (float)cols;
    const float mean_gx = sums[1] / (float)cols;
    S *dx = static_cast<S *>(p.dx) + row * cols;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (at.col(k) < cols) {
        // s and dy read again: registers across the reduction are what spills
        const Pack<S, VEC> sv = load_pack<VEC>(s_at(st) + at.local(k));
        const Pack<T, VEC> dyv = load_pack<VEC>(dy_at(st) + at.local(k));
        Pack<S, VEC> dsv;
        if (p.ds) dsv = load_pack<VEC>(ds_at(st) + at.local(k));
        float o[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          float dy, xh, g;
          grad_terms(dyv, sv, w[k], i, p.weight, mean, rstd, dy, xh, g);
          o[i] = rstd * (g - mean_g - xh * mean_gx);
          if (p.ds) o[i] += pack_value(dsv, i);
        }
        store_f<VEC>(dx + at.col(k), o);
      }
    }
    mean = next_mean;
    rstd = next_rstd;
    st = at.next(st, stages);
  }
  cp_async_wait<0>();  // the empty groups past the last row
  if (CL) {  // no block may exit while another may still store to it
    cluster_arrive();
    cluster_wait();
  }
  if (!want_w && !want_b) return;
  // The block's partial rows (its slice of them, with CL): a block is one
  // team, so they are its threads' sums as they stand.
  for (int which = 0; which < 2; ++which) {
    if (!(which == 0 ? want_w : want_b)) continue;
    float *out = p.partial + ((int64_t)which * p.parts + unit) * cols;
#pragma unroll
    for (int k = 0; k < NV; ++k)
      if (at.col(k) < cols) store_f<VEC>(out + at.col(k), which == 0 ? dw[k] : db[k]);
  }
}

// dx only, any width: one block per row, two passes over the row (sums, then
// dx); the second re-reads dy and s, from L1/L2 where the row still is.
template <class T, class S, class W, int VEC>
__global__ void __launch_bounds__(kLoopThreads) bwd_loop(const fo_norm_bwd_params p) {
  constexpr int U = loop_unroll(VEC);
  __shared__ float red[2][64];
  const int team = blockDim.x, tid = threadIdx.x;
  const int64_t cols = p.cols, step = (int64_t)team * VEC;
  int parity = 0;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T *dyp = static_cast<const T *>(p.dy) + row * p.dy_stride;
    const S *sp = static_cast<const S *>(p.s) + row * p.s_stride;
    const S *dsp = p.ds ? static_cast<const S *>(p.ds) + row * p.ds_stride : nullptr;
    const float mean = p.mean ? p.mean[row] : 0.f, rstd = p.rstd[row];
    float sums[2] = {0.f, 0.f};
    for (int64_t c0 = (int64_t)tid * VEC; c0 < cols; c0 += U * step) {
      float xh[U][VEC], dy[U][VEC];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t c = c0 + u * step;
        if (c < cols) {
          load_f<VEC>(sp + c, xh[u]);
          load_f<VEC>(dyp + c, dy[u]);
          float w[VEC];
          if (p.weight) load_f<VEC, kReadOnly>(static_cast<const W *>(p.weight) + c, w);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float g = p.weight ? dy[u][i] * w[i] : dy[u][i];
            sums[0] += g;
            sums[1] += g * (xh[u][i] - mean) * rstd;
          }
        }
      }
    }
    team_sum<true>(sums, team, red[parity]);
    parity ^= 1;
    const float mean_g = p.rms ? 0.f : sums[0] / (float)cols;
    const float mean_gx = sums[1] / (float)cols;
    S *dx = static_cast<S *>(p.dx) + row * cols;
    for (int64_t c0 = (int64_t)tid * VEC; c0 < cols; c0 += U * step) {
      float xh[U][VEC], dy[U][VEC], ds[U][VEC];
#pragma unroll
      for (int u = 0; u < U; ++u) {  // loads only
        const int64_t c = c0 + u * step;
        if (c < cols) {
          load_f<VEC>(sp + c, xh[u]);
          load_f<VEC>(dyp + c, dy[u]);
          if (dsp) load_f<VEC>(dsp + c, ds[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t c = c0 + u * step;
        if (c < cols) {
          float w[VEC];
          if (p.weight) load_f<VEC, kReadOnly>(static_cast<const W *>(p.weight) + c, w);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float g = p.weight ? dy[u][i] * w[i] : dy[u][i];
            const float o = rstd * (g - mean_g - (xh[u][i] - mean) * rstd * mean_gx);
            dy[u][i] = dsp ? o + ds[u][i] : o;
          }
          store_f<VEC>(dx + c, dy[u]);
        }
      }
    }
  }
}

// dweight / dbias partial sums for bwd_loop: block (bx, by) sums columns
// [bx*32*VEC, +32*VEC) over row chunk by; a warp reads 32 consecutive
// vectors of one row. Partial row by of the workspace.
constexpr int kColRows = FO_NORM_COL_ROWS;  // blockDim.y
template <class T, class S, int VEC>
__global__ void __launch_bounds__(32 * kColRows) dwdb_cols(const fo_norm_bwd_params p, int64_t rows_per_part) {
  __shared__ float red[2][kColRows][32 * VEC + 1];
  const int64_t c = ((int64_t)blockIdx.x * 32 + threadIdx.x) * VEC;
  const int64_t r0 = blockIdx.y * rows_per_part, r1 = min(p.rows, r0 + rows_per_part);
  float dw[VEC], db[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) dw[i] = db[i] = 0.f;
  if (c < p.cols) {
    for (int64_t row = r0 + threadIdx.y; row < r1; row += kColRows) {
      const float mean = p.mean ? p.mean[row] : 0.f, rstd = p.rstd[row];
      float s[VEC], dy[VEC];
      load_f<VEC>(static_cast<const S *>(p.s) + row * p.s_stride + c, s);
      load_f<VEC>(static_cast<const T *>(p.dy) + row * p.dy_stride + c, dy);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        dw[i] += dy[i] * (s[i] - mean) * rstd;
        db[i] += dy[i];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    red[0][threadIdx.y][threadIdx.x * VEC + i] = dw[i];
    red[1][threadIdx.y][threadIdx.x * VEC + i] = db[i];
  }
  __syncthreads();
  // 256 threads write the block's 2 x 32*VEC sums, each a fixed-order column sum.
  for (int j = threadIdx.y * 32 + threadIdx.x; j < 2 * 32 * VEC; j += 32 * kColRows) {
    const int which = j / (32 * VEC), col = j % (32 * VEC);
    const int64_t cc = (int64_t)blockIdx.x * 32 * VEC + col;
    if (cc >= p.cols) continue;
    float sum = 0.f;
    for (int t = 0; t < kColRows; ++t) sum += red[which][t][col];
    p.partial[((int64_t)which * p.parts + blockIdx.y) * p.cols + cc] = sum;
  }
}

// dweight (blockIdx.y == 0) / dbias (1) = column sums of the partial rows.
template <class W>
__global__ void colsum(const float *partial, int64_t parts, int64_t cols, W *dw, W *db) {
  __shared__ float red[8][33];
  const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x;
  W *out = blockIdx.y == 0 ? dw : db;
  if (out == nullptr) return;  // uniform per block
  const float *src = partial + (int64_t)blockIdx.y * parts * cols;
  float s = 0.f;
  if (c < cols)
    for (int64_t t = threadIdx.y; t < parts; t += 8) s += src[t * cols + c];
  red[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    for (int k = 1; k < 8; ++k) s += red[k][threadIdx.x];
    out[c] = from_f<W>(s);
  }
}

// --- launch: plan (norm_plan.c), then one launch ---------------------------------------------

// Calls f(integral_constant<VEC>) for vec: a register kernel's (V, V / 2,
// V / 4 of at least 2, or 1) or, with kLoop, a loop kernel's (V, 4 for
// 16-bit T, or 1).
template <class T, bool kLoop, class F>
void with_vec(int vec, F &&f) {
  constexpr int V = 16 / sizeof(T);
  if (vec == V) f(std::integral_constant<int, V>{});
  else if (vec == 1) f(std::integral_constant<int, 1>{});
  else if constexpr (V == 8) {
    if (vec == 4) f(std::integral_constant<int, 4>{});
    else if constexpr (!kLoop) {
      if (vec == 2) f(std::integral_constant<int, 2>{});
    }
  } else if constexpr (!kLoop) {
    if (vec == 2) f(std::integral_constant<int, 2>{});
  }
}

// Calls f(Tag<T>, Tag<S>, Tag<W>) for the (x, s, weight) dtypes: s and weight
// are each x's dtype or fp32.
template <class F>
void with_types(fo_dtype xt, fo_dtype st, fo_dtype wt, F &&f) {
  with_type(xt, [&](auto tt) {
    using T = typename decltype(tt)::type;
    if (st == xt && wt == xt) f(tt, Tag<T>{}, Tag<T>{});
    else if (st == xt) f(tt, Tag<T>{}, Tag<float>{});
    else if (wt == xt) f(tt, Tag<float>{}, Tag<T>{});
    else f(tt, Tag<float>{}, Tag<float>{});
  });
}

// Calls f(integral_constant<NV>) for the chunks-per-thread count nv (a power
// of two up to MAX_NV) among the counts whose arrays fit BUDGET values, and
// returns whether it did: a plan past them has no kernel to run.
template <int VEC, int BUDGET, int MAX_NV, class F>
bool with_nv(int nv, F &&f) {
  auto run = [&](auto n) {
    constexpr int NV = decltype(n)::value;
    if constexpr (NV <= MAX_NV && NV * VEC <= BUDGET) {
      f(n);
      return true;
    }
    return false;
  };
  switch (nv) {
    case 1: return run(std::integral_constant<int, 1>{});
    case 2: return run(std::integral_constant<int, 2>{});
    case 4: return run(std::integral_constant<int, 4>{});
    case 8: return run(std::integral_constant<int, 8>{});
    case 16: return run(std::integral_constant<int, 16>{});
    default: return false;
  }
}

// The compiled kernel a plan names for the call p (nullptr: none is compiled,
// a bug): the one map from plans to kernels, used for the occupancy queries
// the planner makes and for the launch.
template <class T, int C>
const void *narrow_kernel(bool rms, bool bias, int rb) {
  const int variant = rms ? 0 : bias ? 1 : 2;
  if constexpr (C == 256 || C == 512) {
    if (rb == 8) {  // (RMSNorm's is compiled at 256 only: at 512 it is not planned)
      if (variant == 0) return C == 256 ? (const void *)fwd_narrow<T, 256, true, false, 8> : nullptr;
      return variant == 1 ? (const void *)fwd_narrow<T, C, false, true, 8> : (const void *)fwd_narrow<T, C, false, false, 8>;
    }
    if (rb == 2) {
      return variant == 0 ? (const void *)fwd_narrow<T, C, true, false, 2>
             : variant == 1 ? (const void *)fwd_narrow<T, C, false, true, 2>
                            : (const void *)fwd_narrow<T, C, false, false, 2>;
    }
  }
  if (rb != 1) return nullptr;
  return variant == 0 ? (const void *)fwd_narrow<T, C, true, false, 1>
         : variant == 1 ? (const void *)fwd_narrow<T, C, false, true, 1>
                        : (const void *)fwd_narrow<T, C, false, false, 1>;
}

// fwd_narrow's kernel for the call p: 16-bit x, s and weight of one dtype.
const void *narrow_of(const fo_norm_fwd_params &p, int rb) {
  const void *k = nullptr;
  with_type(p.x_dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    if constexpr (sizeof(T) == 2) {
      switch (p.cols) {
        case 256: k = narrow_kernel<T, 256>(p.rms, p.bias, rb); break;
        case 512: k = narrow_kernel<T, 512>(p.rms, p.bias, rb); break;
        case 768: k = narrow_kernel<T, 768>(p.rms, p.bias, rb); break;
        case 1024: k = narrow_kernel<T, 1024>(p.rms, p.bias, rb); break;
      }
    }
  });
  return k;
}

template <class P>
const void *plan_kernel(const fo_norm_plan &pl, const P &p) {
  constexpr bool kFwd = std::is_same_v<P, fo_norm_fwd_params>;
  if constexpr (kFwd) {
    if (pl.kernel == FO_NORM_NARROW) return narrow_of(p, pl.rpb);
  }
  const void *k = nullptr;
  with_types(p.x_dtype, p.s_dtype, p.w_dtype, [&](auto tt, auto ts, auto tw) {
    using T = typename decltype(tt)::type;
    using S = typename decltype(ts)::type;
    using W = typename decltype(tw)::type;
    constexpr int V = 16 / sizeof(T);
    constexpr bool k16 = sizeof(T) == 2 && std::is_same_v<S, T>;  // 16-bit x and s of one dtype
    switch (pl.kernel) {
      case FO_NORM_PARK:  // the forward's alone
        if constexpr (kFwd && k16) k = (const void *)fwd_park<T, W>;
        break;
      case FO_NORM_GROUP: k = kFwd ? (const void *)fwd_group<T, S, W> : (const void *)bwd_group<T, S, W>; break;
      case FO_NORM_SHIFT:
        if constexpr (kFwd && k16) {
          if (pl.nv == 1) k = (const void *)fwd_shift<T, W, 1, true>;
          else if (pl.nv == 2) k = (const void *)fwd_shift<T, W, 2, false>;
          else if (pl.nv == 4) k = (const void *)fwd_shift<T, W, 4, false>;
        } else if constexpr (k16) {  // rows of at most 8K values: two chunks a thread hold them
          k = pl.nv == 1 ? (const void *)bwd_shift<T, W, 1> : (const void *)bwd_shift<T, W, 2>;
        }
        break;
      case FO_NORM_PIPE:
        if constexpr (kFwd)
          k = pl.cl > 1 ? (const void *)fwd_pipe<T, S, W, V, true> : (const void *)fwd_pipe<T, S, W, V, false>;
        else
          k = pl.cl > 1 ? (const void *)bwd_pipe<T, S, W, V, true> : (const void *)bwd_pipe<T, S, W, V, false>;
        break;
      case FO_NORM_LOOP:
        with_vec<T, true>(pl.vec, [&](auto v) {
          constexpr int VEC = decltype(v)::value;
          k = kFwd ? (const void *)fwd_loop<T, S, W, VEC> : (const void *)bwd_loop<T, S, W, VEC>;
        });
        break;
      case FO_NORM_REGS:
        with_vec<T, false>(pl.vec, [&](auto v) {
          constexpr int VEC = decltype(v)::value;
          if constexpr (kFwd)
            with_nv<VEC, kFwdMaxValues * V / 8, kFwdMaxChunks>(
                pl.nv, [&](auto nv) { k = (const void *)fwd_regs<T, S, W, VEC, decltype(nv)::value>; });
          else
            with_nv<VEC, kBwdMaxValues * V / 8, kBwdMaxChunks>(
                pl.nv, [&](auto nv) { k = (const void *)bwd_regs<T, S, W, VEC, decltype(nv)::value>; });
        });
        break;
    }
  });
  return k;
}

// The dynamic shared memory a kernel must be granted before it is asked
// about or launched: fwd_group's and the shift kernels' past 48 KB, every
// other kernel's whenever it takes any (some add static arrays to it).
size_t optin_bytes(const fo_norm_plan &pl, size_t smem) {
  return pl.kernel == FO_NORM_GROUP || pl.kernel == FO_NORM_SHIFT ? (smem > 48 * 1024 ? smem : 0) : smem;
}

// Lets `kernel` take `smem` bytes of dynamic shared memory on `device` (past
// 48 KB of static and dynamic shared memory a kernel must ask first): the
// first call for a kernel and device grants it all a block may opt in to,
// and later calls are a look-up. One value, the most: the attribute is the
// kernel's, not the thread's, and granting each call its own bytes let a
// call on one thread (autograd's) lower the limit under a launch on another,
// which then failed with "invalid argument".
void allow_smem(const void *kernel, size_t smem, int device) {
  thread_local RingCache<LaunchKey, bool, 32> cache;  // a kernel and device granted
  const LaunchKey key{kernel, device, 0, 0};
  if (smem == 0 || cache.find(key)) return;
  cudaFuncAttributes a{};
  if (cudaFuncGetAttributes(&a, kernel) != cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           smem_optin(device) - (int)a.sharedSizeBytes) != cudaSuccess)
    return;  // the error stays for last_error(), after the launch
  cache.put(key, true);
}

// A launch configuration of 1-D clusters of `cl` blocks, `blocks` blocks in all.
struct ClusterLaunch {
  cudaLaunchAttribute attr[1] = {};
  cudaLaunchConfig_t cfg = {};
  ClusterLaunch(int64_t blocks, int cl, int threads, size_t smem, cudaStream_t stream) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = (unsigned)cl;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3((unsigned)blocks);
    cfg.blockDim = dim3((unsigned)threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
};

// What the planner asks of the device: the call, its direction and device.
struct Query {
  const fo_norm_fwd_params *fwd;
  const fo_norm_bwd_params *bwd;
  int device;
  const void *kernel(const fo_norm_plan *pl) const { return fwd ? plan_kernel(*pl, *fwd) : plan_kernel(*pl, *bwd); }
};

// Resident blocks an SM of the plan's kernel (the occupancy calculator, cached).
int query_blocks(void *ctx, const fo_norm_plan *pl, int threads, size_t smem) {
  const Query &q = *static_cast<const Query *>(ctx);
  const void *k = q.kernel(pl);
  if (!k) return 1;
  allow_smem(k, optin_bytes(*pl, smem), q.device);
  return blocks_per_sm(k, threads, smem);
}

// Clusters of pl->cl blocks of the plan's kernel resident at once (at least 1; cached).
int query_clusters(void *ctx, const fo_norm_plan *pl, int threads, size_t smem) {
  const Query &q = *static_cast<const Query *>(ctx);
  const void *k = q.kernel(pl);
  if (!k) return 1;
  allow_smem(k, optin_bytes(*pl, smem), q.device);
  thread_local RingCache<LaunchKey, int, 16> cache;
  const LaunchKey key{k, pl->cl, threads, smem};
  if (const int *n = cache.find(key)) return *n;
  if (pl->cl > 8) cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  ClusterLaunch l(pl->cl, pl->cl, threads, smem, nullptr);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, k, &l.cfg) != cudaSuccess || n < 1) {
    cudaGetLastError();
    n = 1;
  }
  cache.put(key, n);
  return n;
}

// The device's facts for the planner (each attribute queried once a device).
fo_norm_device device_facts(const Query &q) {
  fo_norm_device d{};
  d.sm_count = sm_count(q.device);
  d.smem_optin = smem_optin(q.device);
  d.gbps_per_sm = mem_gbps_per_sm(q.device);
  d.cc = compute_capability(q.device);
  d.blocks_per_sm = query_blocks;
  d.clusters = query_clusters;
  d.ctx = const_cast<Query *>(&q);
  return d;
}

// Launches the plan's kernel k(args...) on `stream`: clusters where the plan
// splits rows over them, blocks of (team, rpb) for the register kernels,
// team * rpb threads for the rest.
void launch(const void *k, const fo_norm_plan &pl, void **args, int device, cudaStream_t stream) {
  allow_smem(k, optin_bytes(pl, pl.smem), device);
  if (pl.cl > 1) {
    if (pl.cl > 8) cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    ClusterLaunch l(pl.grid, pl.cl, pl.team, pl.smem, stream);
    cudaLaunchKernelExC(&l.cfg, k, args);
    return;
  }
  const dim3 block = pl.kernel == FO_NORM_REGS ? dim3(pl.team, pl.rpb) : dim3(pl.team * pl.rpb);
  cudaLaunchKernel(k, dim3((unsigned)pl.grid), block, args, pl.smem, stream);
}

constexpr const char *kNoKernel = "fusedops: internal error: the norm plan names a kernel that is not compiled";

}  // namespace

extern "C" const char *fo_norm_fwd_cuda(const fo_norm_fwd_params *p, void *stream) {
  const Query q{p, nullptr, current_device()};
  const fo_norm_device d = device_facts(q);
  const fo_norm_plan pl = fo_norm_fwd_plan(p, &d);
  const void *k = pl.kernel ? plan_kernel(pl, *p) : nullptr;
  if (!k) return kNoKernel;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (pl.small_l1) {  // once a kernel (dtype, variant) and device; a repeat is harmless
    static bool asked[2][3][64];
    bool &done = asked[p->x_dtype == FO_BF16][p->rms ? 0 : p->bias ? 1 : 2][q.device & 63];
    if (q.device >= 0 && q.device < 64 && !done) {
      cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
      done = true;
    }
  }
  int stages = pl.stages;
  void *args[] = {const_cast<fo_norm_fwd_params *>(p), &stages};
  launch(k, pl, args, q.device, st);
  return last_error();
}

extern "C" const char *fo_norm_bwd_cuda_plan(const fo_norm_bwd_params *p, int device, fo_norm_plan *plan) {
  const Query q{nullptr, p, device};
  const fo_norm_device d = device_facts(q);
  *plan = fo_norm_bwd_plan(p, &d);
  return plan->kernel && plan_kernel(*plan, *p) ? nullptr : kNoKernel;
}

extern "C" const char *fo_norm_bwd_cuda(const fo_norm_bwd_params *p, const fo_norm_plan *plan, void *stream) {
  const fo_norm_plan &pl = *plan;
  const void *k = pl.kernel ? plan_kernel(pl, *p) : nullptr;
  if (!k) return kNoKernel;
  const bool want = p->dweight || p->dbias;
  if (want && p->parts != pl.parts) return "fusedops: dweight/dbias workspace does not match the launch plan";
  const int device = current_device();
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  int stages = pl.stages;
  void *args[] = {const_cast<fo_norm_bwd_params *>(p), &stages};
  launch(k, pl, args, device, st);
  if (!want) return last_error();
  if (pl.kernel == FO_NORM_LOOP) {  // the partial sums over column tiles, after dx
    with_types(p->x_dtype, p->s_dtype, p->w_dtype, [&](auto tt, auto ts, auto) {
      using T = typename decltype(tt)::type;
      using S = typename decltype(ts)::type;
      with_vec<T, true>(pl.vec, [&](auto v) {
        dim3 grid((unsigned)pl.col_blocks, (unsigned)pl.parts);
        dwdb_cols<T, S, decltype(v)::value><<<grid, dim3(32, kColRows), 0, st>>>(*p, pl.rows_per_part);
      });
    });
  }
  with_type(p->w_dtype, [&](auto tw) {
    using W = typename decltype(tw)::type;
    dim3 grid((unsigned)((p->cols + 31) / 32), 2);
    colsum<W><<<grid, dim3(32, 8), 0, st>>>(p->partial, p->parts, p->cols, static_cast<W *>(p->dweight),
                                           static_cast<W *>(p->dbias));
  });
  return last_error();
}
