/* Cross-entropy on CUDA (math and layout: xent.h).
 *
 * Bytes: the forward reads the logits once (and a target and writes two
 * floats a row); the backward reads them once and writes their gradient; the
 * fused pass reads a row twice and writes the gradient over it. A block
 * takes a row: 16-byte vectors where the vocab, the row strides and the
 * pointers allow it, consecutive threads on consecutive vectors. The fused
 * pass wants its second read served by L2, which holds a few hundred rows
 * of a large vocabulary, not the thousand that eight blocks an SM keep in
 * flight: on 16-bit logits in 16-byte vectors it runs blocks of
 * kFusedThreads (two an SM at 32 registers a thread: the same threads an SM,
 * a quarter of the rows in flight), and its second loop walks the row
 * backwards, from what the first loop read last (docs/linear-cross-entropy.md).
 * Each thread keeps an online max and sum of exponentials (rescaled when
 * its max grows), the block combines them in a fixed order (deterministic;
 * the fused pass's order differs from the forward's where a row has more
 * vectors than kThreads: equal within rounding, not bitwise). At vocab
 * 32000 a row is 64 KB of bf16: the grid of rows is many waves, so no
 * persistent grid or cross-block split is needed. */
#include <math.h>

#include <algorithm>

#include "../common/cuda_utils.cuh"
#include "xent.h"

namespace {
using namespace fo;

constexpr int kThreads = 256;
constexpr int kFusedThreads = 1024;
constexpr float kLog2e = 1.4426950408889634f;

// s e^(m - M) for a partial (m, s) joining a total whose max is M; exactly s
// when m == M (both -inf included: no -inf - -inf).
__device__ __forceinline__ float rescale(float m, float s, float M) {
  return m == M ? s : s * exp2f((m - M) * kLog2e);
}

// (m, s) and the plain sum zs over the block of THREADS; every thread gets
// the result.
template <int THREADS>
__device__ __forceinline__ void block_lse(float &m, float &s, float &zs) {
  __shared__ float sm[THREADS / 32], ss[THREADS / 32], sz[THREADS / 32];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    const float M = fmaxf(m, m2);
    s = rescale(m, s, M) + rescale(m2, s2, M);
    m = M;
    zs += __shfl_xor_sync(0xffffffffu, zs, o);
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    sm[warp] = m;
    ss[warp] = s;
    sz[warp] = zs;
  }
  __syncthreads();
  m = sm[0];
  s = ss[0];
  zs = sz[0];
#pragma unroll
  for (int w = 1; w < THREADS / 32; ++w) {
    const float M = fmaxf(m, sm[w]);
    s = rescale(m, s, M) + rescale(sm[w], ss[w], M);
    m = M;
    zs += sz[w];
  }
}

// The logit as the loss sees it (xent.h): soft-capped or as it is.
__device__ __forceinline__ float cap(const fo_xent_params &p, float x) {
  return p.softcap > 0.f ? p.softcap * tanhf(x * (1.f / p.softcap)) : x;
}

// FWD: loss and lse of the row; BWD: its gradient, from the lse just computed
// (FWD too: the fused pass, which may write over the logits, and runs its
// gradient loop backwards) or the saved one. THREADS a block (a row).
template <class T, int VEC, bool FWD, bool BWD, int THREADS = kThreads>
__global__ void __launch_bounds__(THREADS, THREADS == kFusedThreads ? 2 : 1) xent_kernel(const fo_xent_params p,
                                                                                   const float *count_in) {
  constexpr int64_t kStep = (int64_t)THREADS * VEC;
  const int64_t r = blockIdx.x;
  const T *x = static_cast<const T *>(p.logits) + r * p.x_stride;
  const int64_t t = fo_xent_class(&p, r);
  T *dx = BWD ? static_cast<T *>(p.dlogits) + r * p.d_stride : nullptr;
  if (BWD && t < 0) {  // ignored: loss 0, no gradient, nothing to read
    if (FWD && threadIdx.x == 0) {
      p.loss[r] = 0.f;
      if (p.lse) p.lse[r] = NAN;
    }
    float zero[VEC] = {};
    for (int64_t j = (int64_t)threadIdx.x * VEC; j < p.vocab; j += kStep) store_f<VEC>(dx + j, zero);
    return;
  }
  float lse;
  if constexpr (FWD) {
    float m = -INFINITY, s = 0.f, zs = 0.f;
    int nan = 0;
    for (int64_t j = (int64_t)threadIdx.x * VEC; j < p.vocab; j += kStep) {
      float v[VEC];
      load_f<VEC>(x + j, v);
#pragma unroll
      for (int e = 0; e < VEC; ++e) v[e] = cap(p, v[e]);
      float mv = v[0];
#pragma unroll
      for (int e = 1; e < VEC; ++e) mv = fmaxf(mv, v[e]);  // NaNs skipped: counted in `nan`
      if (mv > m) {
        s = rescale(m, s, mv);
        m = mv;
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        nan |= v[e] != v[e];
        s += v[e] == -INFINITY ? 0.f : exp2f((v[e] - m) * kLog2e);
        zs += v[e];
      }
    }
    nan = __syncthreads_or(nan);
    block_lse<THREADS>(m, s, zs);
    // As the CPU kernel, so that the loss is torch's: NaN if any logit is NaN
    // or +inf; -inf if all are -inf.
    lse = nan || m == INFINITY ? NAN : m == -INFINITY ? m : m + logf(s);
    if (threadIdx.x == 0) {
      if (p.lse) p.lse[r] = lse;
      p.loss[r] = t < 0 ? 0.f : t < p.vocab ? fo_xent_loss(&p, lse, cap(p, to_f(x[t])), zs) : NAN;
    }
    if constexpr (BWD) __syncthreads();  // x[t] read before the gradient may overwrite it
  } else {
    lse = p.lse_in[r];
  }
  if constexpr (BWD) {
    // (no smoothing: no g * 0 term, which an infinite g would make NaN)
    const float g = fo_xent_dloss(&p, count_in, r), gs = p.smoothing == 0.f ? 0.f : g * p.smoothing / (float)p.vocab;
    const float gt = p.smoothing == 0.f ? g : g * (1.f - p.smoothing);
    const float lse2 = lse * kLog2e, ic = p.softcap > 0.f ? 1.f / p.softcap : 0.f;
    // This thread's vectors j0, j0 + kStep, ...: in the fused pass from the
    // last down (the ones the first loop read last are likeliest in L2).
    const int64_t j0 = (int64_t)threadIdx.x * VEC;
    int64_t j = j0;
    if constexpr (FWD) j = j0 < p.vocab ? j0 + (p.vocab - 1 - j0) / kStep * kStep : -1;
    for (; FWD ? j >= j0 : j < p.vocab; j += FWD ? -kStep : kStep) {
      float v[VEC];
      load_f<VEC>(x + j, v);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float z = cap(p, v[e]);
        v[e] = g * exp2f(z * kLog2e - lse2) - gs - (j + e == t ? gt : 0.f);
        if (p.softcap > 0.f) v[e] *= 1.f - (z * ic) * (z * ic);
      }
      store_f<VEC>(dx + j, v);
    }
  }
}

// total and count from the rows' losses (xent.h): one block, each thread a
// strided share of the rows in double, combined in a fixed order.
constexpr int kReduceThreads = 1024;

__global__ void __launch_bounds__(kReduceThreads) reduce_rows(const fo_xent_params p, const fo_xent_reduce red) {
  __shared__ double ssum[kReduceThreads / 32];
  __shared__ long long scount[kReduceThreads / 32];
  double sum = 0.0;
  long long n = 0;
  for (int64_t r = threadIdx.x; r < p.rows; r += kReduceThreads) {
    sum += p.loss[r];
    n += fo_xent_class(&p, r) >= 0;
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
    n += __shfl_xor_sync(0xffffffffu, n, o);
  }
  if (threadIdx.x % 32 == 0) {
    ssum[threadIdx.x / 32] = sum;
    scount[threadIdx.x / 32] = n;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kReduceThreads / 32; ++w) {
      sum += ssum[w];
      n += scount[w];
    }
    *red.count = (float)n;
    *red.total = (float)(red.mean ? sum / (double)n : sum);  // a mean of no rows: NaN, as torch's
  }
}

// The widest vector (at most 16 bytes) that the vocab, the row strides and
// the pointers are multiples of.
int vec_width(const fo_xent_params &p, bool bwd, int esize) {
  for (int vec = 16 / esize; vec > 1; vec /= 2) {
    const bool ok = p.vocab % vec == 0 && p.x_stride % vec == 0 &&
                    reinterpret_cast<uintptr_t>(p.logits) % (vec * esize) == 0 &&
                    (!bwd || (p.d_stride % vec == 0 && reinterpret_cast<uintptr_t>(p.dlogits) % (vec * esize) == 0));
    if (ok) return vec;
  }
  return 1;
}

template <bool FWD, bool BWD>
const char *launch(const fo_xent_params *p, const fo_xent_reduce *red, void *stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (FWD && !BWD && red && red->total) {  // the rows, then their reduction
    if (const char *err = launch<true, false>(p, nullptr, stream)) return err;
    reduce_rows<<<1, kReduceThreads, 0, s>>>(*p, *red);
    return last_error();
  }
  const float *count_in = red ? red->count_in : nullptr;
  if (p->rows == 0) return nullptr;
  if (p->rows > 0x7FFFFFFF) return "more than 2^31 - 1 rows";
  with_type(p->dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kMax = 16 / sizeof(T);
    const int vec = vec_width(*p, BWD, sizeof(T));
    const dim3 grid((unsigned)p->rows);
    // The fused pass on 16-byte vectors of a 16-bit type in big blocks (the
    // header); the rest as they were (fp32 and the narrow paths spill at 32
    // registers on sm_80).
    constexpr int kBig = FWD && BWD && sizeof(T) == 2 ? kFusedThreads : kThreads;
    if (vec == kMax) xent_kernel<T, kMax, FWD, BWD, kBig><<<grid, kBig, 0, s>>>(*p, count_in);
    else if (vec >= 2) xent_kernel<T, 2, FWD, BWD><<<grid, kThreads, 0, s>>>(*p, count_in);
    else xent_kernel<T, 1, FWD, BWD><<<grid, kThreads, 0, s>>>(*p, count_in);
  });
  return last_error();
}

// grad *= *dloss, grid-stride over VEC-value vectors; every block returns at
// once where *dloss is 1 (xent.h).
template <class T, int VEC>
__global__ void __launch_bounds__(kThreads) scale_kernel(const fo_xent_scale_params p) {
  const float s = *p.dloss;
  if (s == 1.f) return;
  T *x = static_cast<T *>(p.grad);
  const int64_t step = (int64_t)gridDim.x * kThreads * VEC;
  for (int64_t i = ((int64_t)blockIdx.x * kThreads + threadIdx.x) * VEC; i < p.n; i += step) {
    if (i + VEC <= p.n) {
      float v[VEC];
      load_f<VEC>(x + i, v);
#pragma unroll
      for (int e = 0; e < VEC; ++e) v[e] *= s;
      store_f<VEC>(x + i, v);
    } else {
      for (int64_t j = i; j < p.n; ++j) x[j] = from_f<T>(to_f(x[j]) * s);
    }
  }
}

// Enough blocks to fill any GPU several times over; the rest by grid stride.
constexpr int64_t kScaleBlocks = 4096;

}  // namespace

extern "C" const char *fo_xent_scale_cuda(const fo_xent_scale_params *p, void *stream) {
  if (p->n == 0) return nullptr;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  with_type(p->dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = aligned16(p->grad);
    const int64_t per = (int64_t)kThreads * (vec ? kVec : 1);
    const dim3 grid((unsigned)std::min<int64_t>((p->n + per - 1) / per, kScaleBlocks));
    if (vec) scale_kernel<T, kVec><<<grid, kThreads, 0, s>>>(*p);
    else scale_kernel<T, 1><<<grid, kThreads, 0, s>>>(*p);
  });
  return last_error();
}

extern "C" const char *fo_xent_fwd_cuda(const fo_xent_params *p, const fo_xent_reduce *red, void *stream) {
  return launch<true, false>(p, red, stream);
}
extern "C" const char *fo_xent_bwd_cuda(const fo_xent_params *p, const fo_xent_reduce *red, void *stream) {
  return launch<false, true>(p, red, stream);
}
extern "C" const char *fo_xent_fwd_bwd_cuda(const fo_xent_params *p, void *stream) { return launch<true, true>(p, nullptr, stream); }
