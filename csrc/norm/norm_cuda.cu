/* Residual-add + LayerNorm / RMSNorm on CUDA (math and layout: norm.h).
 *
 * Bytes: forward reads x, residual and writes y, s (4 matrices); backward
 * reads dy, s, ds and writes dx (4 matrices); weight-sized terms are noise.
 *
 * Kernels
 *   fwd_regs / bwd_regs  a team of threads per row (one warp, or one block for
 *                        wide rows) holds the row in fp32 registers: every
 *                        element is read once and written once. 16-byte vector
 *                        access; persistent grid striding over rows. bwd_regs
 *                        keeps its dweight/dbias sums in registers across all
 *                        rows it handles and writes one partial row per team.
 *   fwd_loop / bwd_loop  any width or alignment: one block per row, passes over
 *                        the row re-read from L1/L2 (s is read back after it is
 *                        written). bwd_loop keeps its dweight/dbias sums in a
 *                        partial row in global memory owned by the block.
 *   colsum               second pass: dweight/dbias = sum of the partial rows,
 *                        in a fixed order (deterministic).
 * Measured figures and the history of versions: docs/perf-notes.md. */
#include <algorithm>
#include <type_traits>

#include "norm.h"
#include "../common/cuda_utils.cuh"

namespace {
using namespace fo;

constexpr int kWarpRows = 4;  // rows per block when a warp owns a row

// Per-thread register budget of the register kernels: the forward holds one
// row array of up to 32 fp32 values per thread, the backward four arrays
// (xhat, dy, dweight and dbias sums) of up to 16. From half of that on, a block
// is capped at 512 threads, so that each thread may use 128 registers
// without spilling (ptxas -v: no spills in any instantiation).
constexpr int kFwdElems = 32, kBwdElems = 16;
constexpr int max_threads(int elems, int budget) { return elems * 2 >= budget ? 512 : 1024; }

// --- forward ------------------------------------------------------------------------------

template <class T, class S, class W, int VEC, int NV>
__global__ void __launch_bounds__(max_threads(NV * VEC, kFwdElems)) fwd_regs(const fo_norm_fwd_params p, int team) {
  __shared__ float red[2][32];
  const int tid = threadIdx.x;
  const int64_t cols = p.cols;
  const int64_t row_step = (int64_t)gridDim.x * blockDim.y;
  for (int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y; row < p.rows; row += row_step) {
    const T *x = static_cast<const T *>(p.x) + row * p.x_stride;
    const S *r = p.residual ? static_cast<const S *>(p.residual) + row * p.res_stride : nullptr;
    float v[NV][VEC];
    float sum[1] = {0.f};
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t c = ((int64_t)k * team + tid) * VEC;
      if (c < cols) {
        load_f<VEC>(x + c, v[k]);
        if (r) {
          float rv[VEC];
          load_f<VEC>(r + c, rv);
#pragma unroll
          for (int i = 0; i < VEC; ++i) v[k][i] += rv[i];
        }
        if (p.s) {
          round_to<S>(v[k]);
          store_f<VEC>(static_cast<S *>(p.s) + row * cols + c, v[k]);
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
      team_sum(sum, team, red[0]);
      mean = sum[0] / (float)cols;
    }
    float sq[1] = {0.f};
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (((int64_t)k * team + tid) * VEC < cols) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) sq[0] += (v[k][i] - mean) * (v[k][i] - mean);
      }
    }
    team_sum(sq, team, red[1]);
    const float rstd = rsqrtf(sq[0] / (float)cols + p.eps);
    T *y = static_cast<T *>(p.y) + row * cols;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t c = ((int64_t)k * team + tid) * VEC;
      if (c < cols) {
        float w[VEC], b[VEC];
        if (p.weight) load_f_ldg<VEC>(static_cast<const W *>(p.weight) + c, w);
        if (p.bias) load_f_ldg<VEC>(static_cast<const W *>(p.bias) + c, b);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          float o = (v[k][i] - mean) * rstd;
          if (p.weight) o *= w[i];
          if (p.bias) o += b[i];
          v[k][i] = o;
        }
        store_f<VEC>(y + c, v[k]);
      }
    }
    if (tid == 0) {
      if (p.mean) p.mean[row] = mean;
      p.rstd[row] = rstd;
    }
  }
}

// One block per row; the row is walked in chunks of VEC, three times for
// LayerNorm (sum, squared deviations, output), twice for RMSNorm.
template <class T, class S, class W, int VEC>
__global__ void __launch_bounds__(1024) fwd_loop(const fo_norm_fwd_params p) {
  __shared__ float red[2][32];
  const int team = blockDim.x, tid = threadIdx.x;
  const int64_t cols = p.cols;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T *x = static_cast<const T *>(p.x) + row * p.x_stride;
    const S *r = p.residual ? static_cast<const S *>(p.residual) + row * p.res_stride : nullptr;
    S *s = p.s ? static_cast<S *>(p.s) + row * cols : nullptr;
    float acc[1] = {0.f};
    for (int64_t c = (int64_t)tid * VEC; c < cols; c += (int64_t)team * VEC) {
      float v[VEC];
      load_f<VEC>(x + c, v);
      if (r) {
        float rv[VEC];
        load_f<VEC>(r + c, rv);
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] += rv[i];
      }
      if (s) {
        round_to<S>(v);
        store_f<VEC>(s + c, v);
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[0] += p.rms ? v[i] * v[i] : v[i];
    }
    // s as stored (or x itself): this thread reads back only what it wrote.
    auto load_s = [&](int64_t c, float (&v)[VEC]) {
      if (s) load_f<VEC>(s + c, v);
      else load_f<VEC>(x + c, v);
    };
    float mean = 0.f, var;
    team_sum(acc, team, red[0]);
    if (p.rms) {
      var = acc[0] / (float)cols;
    } else {
      mean = acc[0] / (float)cols;
      float sq[1] = {0.f};
      for (int64_t c = (int64_t)tid * VEC; c < cols; c += (int64_t)team * VEC) {
        float v[VEC];
        load_s(c, v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) sq[0] += (v[i] - mean) * (v[i] - mean);
      }
      team_sum(sq, team, red[1]);
      var = sq[0] / (float)cols;
    }
    const float rstd = rsqrtf(var + p.eps);
    T *y = static_cast<T *>(p.y) + row * cols;
    for (int64_t c = (int64_t)tid * VEC; c < cols; c += (int64_t)team * VEC) {
      float v[VEC], w[VEC], b[VEC];
      load_s(c, v);
      if (p.weight) load_f_ldg<VEC>(static_cast<const W *>(p.weight) + c, w);
      if (p.bias) load_f_ldg<VEC>(static_cast<const W *>(p.bias) + c, b);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        float o = (v[i] - mean) * rstd;
        if (p.weight) o *= w[i];
        if (p.bias) o += b[i];
        v[i] = o;
      }
      store_f<VEC>(y + c, v);
    }
    if (tid == 0) {
      if (p.mean) p.mean[row] = mean;
      p.rstd[row] = rstd;
    }
    __syncthreads();  // red[] is reused by the next row
  }
}

// --- backward -----------------------------------------------------------------------------

template <class T, class S, class W, int VEC, int NV>
__global__ void __launch_bounds__(max_threads(NV * VEC, kBwdElems)) bwd_regs(const fo_norm_bwd_params p, int team) {
  __shared__ float red[2][64];
  const int tid = threadIdx.x;
  const int64_t cols = p.cols;
  const bool want_w = p.dweight != nullptr, want_b = p.dbias != nullptr;
  float dw[NV][VEC], db[NV][VEC];
#pragma unroll
  for (int k = 0; k < NV; ++k)
#pragma unroll
    for (int i = 0; i < VEC; ++i) dw[k][i] = db[k][i] = 0.f;

  const int64_t row_step = (int64_t)gridDim.x * blockDim.y;
  int parity = 0;
  for (int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y; row < p.rows; row += row_step) {
    const T *dyp = static_cast<const T *>(p.dy) + row * p.dy_stride;
    const S *sp = static_cast<const S *>(p.s) + row * p.s_stride;
    const float mean = p.mean ? p.mean[row] : 0.f, rstd = p.rstd[row];
    float xhat[NV][VEC], dy[NV][VEC];
    float sums[2] = {0.f, 0.f};  // sum of g, sum of g * xhat
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t c = ((int64_t)k * team + tid) * VEC;
      if (c < cols) {
        float w[VEC];
        load_f<VEC>(sp + c, xhat[k]);
        load_f<VEC>(dyp + c, dy[k]);
        if (p.weight) load_f_ldg<VEC>(static_cast<const W *>(p.weight) + c, w);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          xhat[k][i] = (xhat[k][i] - mean) * rstd;
          const float g = p.weight ? dy[k][i] * w[i] : dy[k][i];
          sums[0] += g;
          sums[1] += g * xhat[k][i];
        }
      }
    }
    team_sum(sums, team, red[parity]);
    parity ^= 1;
    const float mean_g = p.rms ? 0.f : sums[0] / (float)cols;
    const float mean_gx = sums[1] / (float)cols;
    S *dx = static_cast<S *>(p.dx) + row * cols;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t c = ((int64_t)k * team + tid) * VEC;
      if (c < cols) {
        float w[VEC], ds[VEC], out[VEC];
        if (p.weight) load_f_ldg<VEC>(static_cast<const W *>(p.weight) + c, w);
        if (p.ds) load_f<VEC>(static_cast<const S *>(p.ds) + row * p.ds_stride + c, ds);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float g = p.weight ? dy[k][i] * w[i] : dy[k][i];
          out[i] = rstd * (g - mean_g - xhat[k][i] * mean_gx);
          if (p.ds) out[i] += ds[i];
          if (want_w) dw[k][i] += dy[k][i] * xhat[k][i];
          if (want_b) db[k][i] += dy[k][i];
        }
        store_f<VEC>(dx + c, out);
      }
    }
  }
  if (!want_w && !want_b) return;
  // One partial row per team, written even by a team that had no rows (zeros).
  const int64_t part = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t c = ((int64_t)k * team + tid) * VEC;
    if (c < cols) {
      store_f<VEC>(p.partial + part * cols + c, dw[k]);
      store_f<VEC>(p.partial + (p.parts + part) * cols + c, db[k]);
    }
  }
}

// One block per row, two passes over the row; dweight/dbias summed into the
// block's own partial row in global memory (each thread owns fixed columns,
// so no atomics). The grid never exceeds the row count: every block has a
// first row, which initialises its partial row.
template <class T, class S, class W, int VEC>
__global__ void __launch_bounds__(1024) bwd_loop(const fo_norm_bwd_params p) {
  __shared__ float red[2][64];
  const int team = blockDim.x, tid = threadIdx.x;
  const int64_t cols = p.cols;
  float *pw = p.partial ? p.partial + (int64_t)blockIdx.x * cols : nullptr;
  float *pb = p.partial ? p.partial + (p.parts + blockIdx.x) * cols : nullptr;
  int parity = 0;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const bool first = row == blockIdx.x;
    const T *dyp = static_cast<const T *>(p.dy) + row * p.dy_stride;
    const S *sp = static_cast<const S *>(p.s) + row * p.s_stride;
    const float mean = p.mean ? p.mean[row] : 0.f, rstd = p.rstd[row];
    float sums[2] = {0.f, 0.f};
    for (int64_t c = (int64_t)tid * VEC; c < cols; c += (int64_t)team * VEC) {
      float xh[VEC], dy[VEC], w[VEC];
      load_f<VEC>(sp + c, xh);
      load_f<VEC>(dyp + c, dy);
      if (p.weight) load_f_ldg<VEC>(static_cast<const W *>(p.weight) + c, w);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float g = p.weight ? dy[i] * w[i] : dy[i];
        sums[0] += g;
        sums[1] += g * (xh[i] - mean) * rstd;
      }
    }
    team_sum(sums, team, red[parity]);
    parity ^= 1;
    const float mean_g = p.rms ? 0.f : sums[0] / (float)cols;
    const float mean_gx = sums[1] / (float)cols;
    S *dx = static_cast<S *>(p.dx) + row * cols;
    for (int64_t c = (int64_t)tid * VEC; c < cols; c += (int64_t)team * VEC) {
      float xh[VEC], dy[VEC], w[VEC], ds[VEC], out[VEC];
      load_f<VEC>(sp + c, xh);
      load_f<VEC>(dyp + c, dy);
      if (p.weight) load_f_ldg<VEC>(static_cast<const W *>(p.weight) + c, w);
      if (p.ds) load_f<VEC>(static_cast<const S *>(p.ds) + row * p.ds_stride + c, ds);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        xh[i] = (xh[i] - mean) * rstd;
        const float g = p.weight ? dy[i] * w[i] : dy[i];
        out[i] = rstd * (g - mean_g - xh[i] * mean_gx);
        if (p.ds) out[i] += ds[i];
      }
      store_f<VEC>(dx + c, out);
      if (pw) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          pw[c + i] = (first ? 0.f : pw[c + i]) + dy[i] * xh[i];
          pb[c + i] = (first ? 0.f : pb[c + i]) + dy[i];
        }
      }
    }
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

// --- launch configuration -------------------------------------------------------------------

struct Config {
  int vec;   // elements per access: 16 bytes of x's dtype, or 1 (misaligned / odd widths)
  int nv;    // chunks per thread in the register kernels; 0 selects the loop kernel
  int team;  // threads per row
  int rpb;   // rows per block
  int grid;
};

int round_up32(int64_t n) { return (int)((n + 31) / 32 * 32); }

// The register kernel when the row fits its budget (`budget` fp32 values per
// thread per row array), with as many values per thread as the budget allows
// (more loads in flight per thread); else the loop kernel.
Config choose(int64_t rows, int64_t cols, int vec, bool vec_ok, int budget, int device) {
  Config c{};
  c.vec = vec_ok ? vec : 1;
  const int64_t chunks = (cols + c.vec - 1) / c.vec;
  const int max_nv = std::max(1, budget / vec);
  const int64_t team = std::max(32, round_up32((chunks + max_nv - 1) / max_nv));
  const int64_t need = (chunks + team - 1) / team;
  const int nv = need <= 1 ? 1 : need <= 2 ? 2 : need <= 4 ? 4 : 8;
  if (vec_ok && team <= max_threads(nv * vec, budget)) {
    c.team = (int)team;
    c.nv = nv;
    c.rpb = c.team == 32 ? kWarpRows : 1;
  } else {
    c.nv = 0;
    c.team = (int)std::min<int64_t>(1024, std::max<int64_t>(128, round_up32(chunks / 4)));
    c.rpb = 1;
  }
  const int per_sm = std::max(1, 2048 / (c.team * c.rpb));
  const int64_t groups = (rows + c.rpb - 1) / c.rpb;
  c.grid = (int)std::min<int64_t>(groups, (int64_t)sm_count(device) * per_sm);
  return c;
}

bool fwd_vec_ok(const fo_norm_fwd_params *p, int vec) {
  const int xs = fo_dtype_size(p->x_dtype), ss = fo_dtype_size(p->s_dtype);
  const int ws = fo_dtype_size(p->w_dtype);
  return p->cols % vec == 0 && aligned16(p->x) && aligned16(p->y) &&
         (p->x_stride * xs) % 16 == 0 && (!p->residual || (aligned16(p->residual) && (p->res_stride * ss) % 16 == 0)) &&
         (!p->s || aligned16(p->s)) && (!p->weight || aligned16(p->weight)) &&
         (!p->bias || aligned16(p->bias)) && (vec * ws) % 4 == 0;
}

bool bwd_vec_ok(const fo_norm_bwd_params *p, int vec) {
  const int xs = fo_dtype_size(p->x_dtype), ss = fo_dtype_size(p->s_dtype);
  return p->cols % vec == 0 && aligned16(p->dy) && aligned16(p->s) && aligned16(p->dx) &&
         (p->dy_stride * xs) % 16 == 0 && (p->s_stride * ss) % 16 == 0 &&
         (!p->ds || (aligned16(p->ds) && (p->ds_stride * ss) % 16 == 0)) &&
         (!p->weight || aligned16(p->weight)) && (!p->partial || aligned16(p->partial));
}

Config fwd_config(const fo_norm_fwd_params *p, int device) {
  const int vec = 16 / fo_dtype_size(p->x_dtype);
  return choose(p->rows, p->cols, vec, fwd_vec_ok(p, vec), kFwdElems, device);
}

Config bwd_config(const fo_norm_bwd_params *p, int device) {
  const int vec = 16 / fo_dtype_size(p->x_dtype);
  return choose(p->rows, p->cols, vec, bwd_vec_ok(p, vec), kBwdElems, device);
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

// Calls f(integral_constant<NV>) for the chunks-per-thread count nv, among
// the counts whose arrays fit `budget` values.
template <int VEC, int BUDGET, class F>
void with_nv(int nv, F &&f) {
  switch (nv) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: if constexpr (2 * VEC <= BUDGET) f(std::integral_constant<int, 2>{}); break;
    case 4: if constexpr (4 * VEC <= BUDGET) f(std::integral_constant<int, 4>{}); break;
    default: if constexpr (8 * VEC <= BUDGET) f(std::integral_constant<int, 8>{}); break;
  }
}

}  // namespace

extern "C" const char *fo_norm_fwd_cuda(const fo_norm_fwd_params *p, void *stream) {
  const Config c = fwd_config(p, current_device());
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  with_types(p->x_dtype, p->s_dtype, p->w_dtype, [&](auto tt, auto ts, auto tw) {
    using T = typename decltype(tt)::type;
    using S = typename decltype(ts)::type;
    using W = typename decltype(tw)::type;
    constexpr int V = 16 / sizeof(T);
    if (c.nv == 0) {
      if (c.vec == 1) fwd_loop<T, S, W, 1><<<c.grid, c.team, 0, st>>>(*p);
      else fwd_loop<T, S, W, V><<<c.grid, c.team, 0, st>>>(*p);
    } else {
      with_nv<V, kFwdElems>(c.nv, [&](auto nv) {
        fwd_regs<T, S, W, V, decltype(nv)::value><<<c.grid, dim3(c.team, c.rpb), 0, st>>>(*p, c.team);
      });
    }
  });
  return last_error();
}

extern "C" int64_t fo_norm_bwd_cuda_parts(const fo_norm_bwd_params *p, int device) {
  const Config c = bwd_config(p, device);
  return (int64_t)c.grid * c.rpb;
}

extern "C" const char *fo_norm_bwd_cuda(const fo_norm_bwd_params *p, void *stream) {
  const Config c = bwd_config(p, current_device());
  if (p->partial && p->parts != (int64_t)c.grid * c.rpb) return "partial workspace size mismatch";
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  with_types(p->x_dtype, p->s_dtype, p->w_dtype, [&](auto tt, auto ts, auto tw) {
    using T = typename decltype(tt)::type;
    using S = typename decltype(ts)::type;
    using W = typename decltype(tw)::type;
    constexpr int V = 16 / sizeof(T);
    if (c.nv == 0) {
      if (c.vec == 1) bwd_loop<T, S, W, 1><<<c.grid, c.team, 0, st>>>(*p);
      else bwd_loop<T, S, W, V><<<c.grid, c.team, 0, st>>>(*p);
    } else {
      with_nv<V, kBwdElems>(c.nv, [&](auto nv) {
        bwd_regs<T, S, W, V, decltype(nv)::value><<<c.grid, dim3(c.team, c.rpb), 0, st>>>(*p, c.team);
      });
    }
    if (p->partial) {
      dim3 grid((unsigned)((p->cols + 31) / 32), 2);
      colsum<W><<<grid, dim3(32, 8), 0, st>>>(p->partial, p->parts, p->cols,
                                               static_cast<W *>(p->dweight), static_cast<W *>(p->dbias));
    }
  });
  return last_error();
}
