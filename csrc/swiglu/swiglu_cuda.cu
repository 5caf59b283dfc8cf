/* SwiGLU / GeGLU on CUDA (math and layout: swiglu.h).
 *
 * Bytes: forward reads gate, up and writes out (3 matrices); backward reads
 * dout, gate, up and writes dgate, dup (5 matrices; 6 when it writes out too).
 * Nothing else is touched.
 *
 * Kernel: the matrix as a flat list of VEC-element vectors (16 bytes when the
 * width, the pointers and the row strides allow it; narrower otherwise), each
 * thread taking U of them spaced a block apart, so that a warp's accesses are
 * contiguous and every load of a thread is issued before its first store (the
 * compiler may not move a load past a store that could alias it). A vector's
 * row and column come from one integer division (32-bit whenever the matrix
 * has fewer than 2^32 vectors) and its row through the row map. No shared
 * memory, no persistent grid: one block per blockDim * U vectors.
 * Measured figures: docs/perf-notes.md. */

#include "../common/cuda_utils.cuh"
#include "../common/tune.h"

#define FO_GLU_MATH
#define FO_GLU_FN __device__ __forceinline__
#define FO_GLU_EXP(x) __expf(x)
#define FO_GLU_RCP(x) __fdividef(1.f, (x))
#include "swiglu.h"

namespace {
using namespace fo;

constexpr int kThreads = 256;
// U, vectors per thread, forward and backward: the tuning knobs
// glu_fwd_vectors and glu_bwd_vectors (common/tune.h; 1, 2, or 4 for 3 or 4),
// set in-process by tools/probes/glu_tune.py.
int vectors_per_thread(bool bwd) { return bwd ? fo_tuning.glu_bwd_vectors : fo_tuning.glu_fwd_vectors; }

// Element offset of row r (swiglu.h, fo_glu_rows).
template <class I>
__device__ __forceinline__ int64_t row_off(const fo_glu_rows &m, I r) {
  if ((int64_t)r < m.inner) return (int64_t)r * m.stride;
  const I inner = (I)m.inner, q = r / inner;
  return (int64_t)q * m.outer + (int64_t)(r - q * inner) * m.stride;
}

// One kernel for both directions: BWD reads dout, gate, up and writes dgate,
// dup (and out, when given); the forward reads gate, up and writes out.
template <bool BWD, class T, int VEC, int U, class I, int GELU>
__global__ void __launch_bounds__(kThreads) glu_kernel(const fo_glu_params p, I nvec, I cvec) {
  constexpr int NIN = BWD ? 3 : 2;
  const T *in[3] = {static_cast<const T *>(p.gate), static_cast<const T *>(p.up),
                    static_cast<const T *>(p.dout)};
  const fo_glu_rows *maps[3] = {&p.gate_rows, &p.up_rows, &p.dout_rows};
  const I v0 = (I)blockIdx.x * (kThreads * U) + threadIdx.x;
  Pack<T, VEC> x[NIN][U];  // gate, up (, dout), as loaded: half the registers of fp32
  I row[U], col[U];
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const I v = v0 + (I)(k * kThreads);
    row[k] = v / cvec;
    col[k] = (v - row[k] * cvec) * VEC;
    if (v < nvec)
#pragma unroll
      for (int a = 0; a < NIN; ++a) x[a][k] = load_pack<VEC>(in[a] + row_off(*maps[a], row[k]) + col[k]);
  }
#pragma unroll
  for (int k = 0; k < U; ++k) {
    if (v0 + (I)(k * kThreads) >= nvec) break;
    const int64_t o = (int64_t)row[k] * p.out_stride + col[k];
    float g[VEC], u[VEC];
    unpack(x[0][k], g);
    unpack(x[1][k], u);
    if constexpr (BWD) {
      float d[VEC];
      unpack(x[2][k], d);
      if (p.out) {  // the forward's output too, for the caller's next matmul
        float h[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) h[i] = fo_glu_fwd(g[i], u[i], GELU);
        store_f<VEC>(static_cast<T *>(p.out) + (int64_t)row[k] * p.h_stride + col[k], h);
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) fo_glu_bwd(d[i], g[i], u[i], GELU, &g[i], &u[i]);
      store_f<VEC>(static_cast<T *>(p.dgate) + o, g);
      store_f<VEC>(static_cast<T *>(p.dup) + o, u);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) g[i] = fo_glu_fwd(g[i], u[i], GELU);
      store_f<VEC>(static_cast<T *>(p.out) + o, g);
    }
  }
}

// The widest vector (at most 16 bytes) that the width, every pointer and
// every row stride of the call are multiples of.
int vec_width(const fo_glu_params &p, bool bwd, int esize) {
  const void *ptrs[] = {p.gate, p.up, bwd ? p.dout : p.out, p.dgate, p.dup, p.out};
  const fo_glu_rows *maps[] = {&p.gate_rows, &p.up_rows, bwd ? &p.dout_rows : nullptr};
  for (int vec = 16 / esize; vec > 1; vec /= 2) {
    bool ok = p.cols % vec == 0 && p.out_stride % vec == 0 && (!bwd || !p.out || p.h_stride % vec == 0);
    for (const void *q : ptrs) ok = ok && reinterpret_cast<uintptr_t>(q) % (vec * esize) == 0;
    for (const fo_glu_rows *m : maps)
      ok = ok && (!m || (m->stride % vec == 0 && (m->inner >= p.rows || m->outer % vec == 0)));
    if (ok) return vec;
  }
  return 1;
}

template <bool BWD, class T, int VEC, class I, int GELU, int U>
void launch_u(const fo_glu_params &p, cudaStream_t stream) {
  const I cvec = (I)(p.cols / VEC), nvec = (I)p.rows * cvec;
  const unsigned blocks = (unsigned)((nvec + (I)(kThreads * U) - 1) / (I)(kThreads * U));
  glu_kernel<BWD, T, VEC, U, I, GELU><<<blocks, kThreads, 0, stream>>>(p, nvec, cvec);
}

template <bool BWD, class T, int VEC, class I, int GELU>
void launch_one(const fo_glu_params &p, cudaStream_t stream) {
  switch (vectors_per_thread(BWD)) {
    case 1: return launch_u<BWD, T, VEC, I, GELU, 1>(p, stream);
    case 2: return launch_u<BWD, T, VEC, I, GELU, 2>(p, stream);
    default: return launch_u<BWD, T, VEC, I, GELU, 4>(p, stream);
  }
}

template <bool BWD, class T, int VEC>
void launch_vec(const fo_glu_params &p, cudaStream_t stream) {
  // 32-bit indices unless the vectors (and one block past them) overflow them.
  const bool wide = (uint64_t)p.rows * (uint64_t)(p.cols / VEC) + kThreads * 4 > 0xFFFFFFFFull;
  const bool gelu = p.act == FO_GLU_GELU_TANH;
  if (wide)
    gelu ? launch_one<BWD, T, VEC, uint64_t, 1>(p, stream) : launch_one<BWD, T, VEC, uint64_t, 0>(p, stream);
  else
    gelu ? launch_one<BWD, T, VEC, uint32_t, 1>(p, stream) : launch_one<BWD, T, VEC, uint32_t, 0>(p, stream);
}

template <bool BWD>
const char *launch(const fo_glu_params *p, void *stream) {
  if (p->rows == 0 || p->cols == 0) return nullptr;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  with_type(p->dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kMax = 16 / sizeof(T);
    const int vec = vec_width(*p, BWD, sizeof(T));
    if (vec == kMax) launch_vec<BWD, T, kMax>(*p, s);
    else if (vec >= 2) launch_vec<BWD, T, 2>(*p, s);
    else launch_vec<BWD, T, 1>(*p, s);
  });
  return last_error();
}

}  // namespace

extern "C" const char *fo_glu_fwd_cuda(const fo_glu_params *p, void *stream) {
  return launch<false>(p, stream);
}

extern "C" const char *fo_glu_bwd_cuda(const fo_glu_params *p, void *stream) {
  return launch<true>(p, stream);
}
