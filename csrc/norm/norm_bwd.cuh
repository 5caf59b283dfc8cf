/* The backward's kernels, one for each forward family (registers, misaligned,
 * wide rows), and dweight / dbias from their partial rows (dwdb_cols, colsum). */
#pragma once
#include "norm_misaligned.cuh"
#include "norm_wide.cuh"

namespace {
using namespace fo;

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

}  // namespace
