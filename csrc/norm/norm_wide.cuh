/* Forward kernels of rows too wide for a register team: half parked in shared
 * memory (fwd_park), staged rows ahead (fwd_pipe, over a cluster), or looped (fwd_loop). */
#pragma once
#include "norm_kernels.cuh"

namespace {
using namespace fo;

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
  // Its stores stay C++ assignments (no 16-byte store was split here):
  // store_pack's inline PTX read slower.
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
// each, had nothing in flight during an exchange, and lost).
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
  // vectors a step instead of four it lost.
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

}  // namespace
