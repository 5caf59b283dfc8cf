/* Register kernels of the forward: a team of threads holds each row in
 * registers, every element read once and written once (fwd_regs, fwd_narrow). */
#pragma once
#include "norm_kernels.cuh"

namespace {
using namespace fo;

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
  // offsets live across rows (more registers, less occupancy), and the
  // hardware hands out new blocks as fast.
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
    // push them out.
    constexpr bool kEarlyWb = NV * VEC <= 16;
    Pack<W, VEC> w[NV], b[NV];
    if (kEarlyWb) load_wb(p, w, b, col);
    // s = x + residual as stored: the statistics are those of the rounded stream.
    // One chunk of 16-bit s: also kept as fp32 values (kF32), unpacked once
    // rather than at each of its two or three uses, and stored after the first
    // reduction; more chunks a thread store s at once (stored late, they lost).
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
// while the rows stream through it. It leads fwd_regs at these widths; in
// fwd_regs, with the width known only at run time, neither the shape nor the
// late loads gained. narrow_row is one warp's row:
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
  // rounded stream. RMSNorm stores s after its reduction in the source (ptxas
  // moves most stores before the shuffles; forcing them after gained nothing).
  // LayerNorm stores it here: held to after its reductions, its 1024-wide
  // kernels needed many more registers (with s held as fp32 values).
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
  if (!RMS) {  // not sq_dev: its column guard is not folded away here, and the SASS grew
    float sq[1] = {0.f};
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int i = 0; i < VEC; ++i) sq[0] += (value(sp[k], i) - mean) * (value(sp[k], i) - mean);
    warp_sum(sq);
    var = sq[0] / COLS;
  }
  const float rstd = rsqrtf(var + p.eps);
  // s's values again from its packs (pack_value_again): fewer registers at
  // 1024 wide, so more blocks an SM.
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
// 32-byte store, a whole sector: a block a row, storing 4 bytes a row, cost
// far more than the statistics' bytes. RB 2: the forward without statistics
// at 256 and 512 wide on bandwidth-rich SMs (norm_plan.c, narrow_rows); it
// stores no statistics, and p.rstd is null.
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

}  // namespace
