/* What every norm kernel shares: the sizes the plans keep to, and the
 * forward's steps on a thread's chunks (load, add, sum, normalise, store). */
#pragma once
#include <type_traits>

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
// bitwise the same sum, fewer instructions a value).
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

}  // namespace
