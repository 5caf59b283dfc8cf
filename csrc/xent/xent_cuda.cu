/* Cross-entropy on CUDA (math and layout: xent.h).
 *
 * Bytes: the forward reads the logits once (and a target and writes two
 * floats a row); the backward reads them once and writes their gradient.
 * A block of kThreads takes a row: 16-byte vectors where the vocab, the row
 * stride and the pointers allow it, consecutive threads on consecutive
 * vectors. Each thread keeps an online max and sum of exponentials (rescaled
 * when its max grows), the block combines them in a fixed order
 * (deterministic). At vocab 32000 a row is 64 KB of bf16: the grid of rows is
 * many waves, so no persistent grid or cross-block split is needed. */
#include <math.h>

#include "../common/cuda_utils.cuh"
#include "xent.h"

namespace {
using namespace fo;

constexpr int kThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;

// s e^(m - M) for a partial (m, s) joining a total whose max is M; exactly s
// when m == M (both -inf included: no -inf - -inf).
__device__ __forceinline__ float rescale(float m, float s, float M) {
  return m == M ? s : s * exp2f((m - M) * kLog2e);
}

// (m, s) over the block; every thread gets the result.
__device__ __forceinline__ void block_lse(float &m, float &s) {
  __shared__ float sm[kThreads / 32], ss[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    const float M = fmaxf(m, m2);
    s = rescale(m, s, M) + rescale(m2, s2, M);
    m = M;
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  m = sm[0];
  s = ss[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) {
    const float M = fmaxf(m, sm[w]);
    s = rescale(m, s, M) + rescale(sm[w], ss[w], M);
    m = M;
  }
}

template <class T, int VEC>
__global__ void __launch_bounds__(kThreads) xent_fwd_kernel(const fo_xent_params p) {
  const int64_t r = blockIdx.x;
  const T *x = static_cast<const T *>(p.logits) + r * p.x_stride;
  float m = -INFINITY, s = 0.f;
  int nan = 0;
  for (int64_t j = (int64_t)threadIdx.x * VEC; j < p.vocab; j += kThreads * VEC) {
    float v[VEC];
    load_f<VEC>(x + j, v);
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
    }
  }
  nan = __syncthreads_or(nan);
  block_lse(m, s);
  if (threadIdx.x == 0) {
    // As the CPU kernel, so that the loss is torch's: NaN if any logit is NaN
    // or +inf; -inf if all are -inf.
    const float lse = nan || m == INFINITY ? NAN : m == -INFINITY ? m : m + logf(s);
    const int64_t t = fo_xent_class(&p, r);
    p.lse[r] = lse;
    p.loss[r] = t < 0 ? 0.f : t < p.vocab ? lse - to_f(x[t]) : NAN;
  }
}

template <class T, int VEC>
__global__ void __launch_bounds__(kThreads) xent_bwd_kernel(const fo_xent_params p) {
  const int64_t r = blockIdx.x;
  const T *x = static_cast<const T *>(p.logits) + r * p.x_stride;
  T *dx = static_cast<T *>(p.dlogits) + r * p.vocab;
  const int64_t t = fo_xent_class(&p, r);
  const float g = t < 0 ? 0.f : p.dloss[r * p.g_stride], lse2 = p.lse_in[r] * kLog2e;
  for (int64_t j = (int64_t)threadIdx.x * VEC; j < p.vocab; j += kThreads * VEC) {
    float v[VEC];
    load_f<VEC>(x + j, v);
#pragma unroll
    for (int e = 0; e < VEC; ++e) v[e] = g * exp2f(v[e] * kLog2e - lse2) - (j + e == t ? g : 0.f);
    store_f<VEC>(dx + j, v);
  }
}

// The widest vector (at most 16 bytes) that the vocab, the row stride and
// the pointers are multiples of.
int vec_width(const fo_xent_params &p, bool bwd, int esize) {
  for (int vec = 16 / esize; vec > 1; vec /= 2) {
    const bool ok = p.vocab % vec == 0 && p.x_stride % vec == 0 &&
                    reinterpret_cast<uintptr_t>(p.logits) % (vec * esize) == 0 &&
                    (!bwd || reinterpret_cast<uintptr_t>(p.dlogits) % (vec * esize) == 0);
    if (ok) return vec;
  }
  return 1;
}

template <bool BWD>
const char *launch(const fo_xent_params *p, void *stream) {
  if (p->rows == 0) return nullptr;
  if (p->rows > 0x7FFFFFFF) return "more than 2^31 - 1 rows";
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  with_type(p->dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kMax = 16 / sizeof(T);
    const int vec = vec_width(*p, BWD, sizeof(T));
    const dim3 grid((unsigned)p->rows);
    if (vec == kMax) {
      if constexpr (BWD) xent_bwd_kernel<T, kMax><<<grid, kThreads, 0, s>>>(*p);
      else xent_fwd_kernel<T, kMax><<<grid, kThreads, 0, s>>>(*p);
    } else if (vec >= 2) {
      if constexpr (BWD) xent_bwd_kernel<T, 2><<<grid, kThreads, 0, s>>>(*p);
      else xent_fwd_kernel<T, 2><<<grid, kThreads, 0, s>>>(*p);
    } else {
      if constexpr (BWD) xent_bwd_kernel<T, 1><<<grid, kThreads, 0, s>>>(*p);
      else xent_fwd_kernel<T, 1><<<grid, kThreads, 0, s>>>(*p);
    }
  });
  return last_error();
}

}  // namespace

extern "C" const char *fo_xent_fwd_cuda(const fo_xent_params *p, void *stream) { return launch<false>(p, stream); }
extern "C" const char *fo_xent_bwd_cuda(const fo_xent_params *p, void *stream) { return launch<true>(p, stream); }
