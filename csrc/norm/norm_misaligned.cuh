/* Forward kernels of contiguous rows that allow no 16-byte access: rows in
 * groups through shared memory (fwd_group), or shifted to 16-byte chunks (fwd_shift). */
#pragma once
#include "norm_kernels.cuh"

namespace {
using namespace fo;

// fwd_group: rows of a contiguous x (and residual) that no 8-byte access fits
// (16-bit rows of 2 mod 4 values, odd widths: access_vec's 4 bytes or one
// element a chunk), where the register kernels issue several times the
// instructions of Inductor's kernel for such rows. Whatever the
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

}  // namespace
