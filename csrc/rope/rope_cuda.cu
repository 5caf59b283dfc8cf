/* RoPE on CUDA (math and layout: rope.h).
 *
 * Bytes: reads q, k and writes their rotated copies (4 tensors of q's and
 * k's size); cos and sin, a row per position shared by every head, come from
 * L1 / L2.
 *
 * Kernel: a block per position (batch, seq), grid-stride over positions; its
 * threads walk the (tensor, head, chunk) items of that position, a chunk
 * being VEC columns of the first half and the same VEC of the second (16
 * bytes each when the head dim, pointers and strides allow, 1 element
 * otherwise). Both halves are loaded before either is stored. The only
 * divisions are a 64-bit one per position and a 32-bit one per item. */
#include "../common/cuda_utils.cuh"

#define FO_ROPE_MATH
#define FO_ROPE_FN __device__ __forceinline__
#include "rope.h"

namespace {
using namespace fo;

constexpr int kThreads = 256;

template <class T, int VEC>
__global__ void __launch_bounds__(kThreads) rope_kernel(const fo_rope_params p, int nchunk, int items) {
  const int64_t half = p.dim / 2, npos = p.batch * p.seq;
  const T *cos = static_cast<const T *>(p.cos), *sin = static_cast<const T *>(p.sin);
  for (int64_t pos = blockIdx.x; pos < npos; pos += gridDim.x) {
    const int64_t b = pos / p.seq, s = pos - b * p.seq;
    const T *cr = cos + b * p.cb + s * p.cs, *sr = sin + b * p.sb + s * p.ss;
    for (int i = threadIdx.x; i < items; i += blockDim.x) {
      const int hh = i / nchunk, j = (i - hh * nchunk) * VEC;
      const bool second = hh >= p.t[0].heads;  // q's heads first, then k's
      const fo_rope_tensor &t = second ? p.t[1] : p.t[0];
      const int64_t h = second ? hh - p.t[0].heads : hh;
      const T *x = static_cast<const T *>(t.x) + b * t.xb + h * t.xh + s * t.xs + j;
      T *o = static_cast<T *>(t.out) + b * t.ob + h * t.oh + s * t.os + j;
      float x1[VEC], x2[VEC], c1[VEC], c2[VEC], s1[VEC], s2[VEC], y1[VEC], y2[VEC];
      load_f<VEC>(x, x1);
      load_f<VEC>(x + half, x2);
      load_f<VEC, kReadOnly>(cr + j, c1);
      load_f<VEC, kReadOnly>(cr + j + half, c2);
      load_f<VEC, kReadOnly>(sr + j, s1);
      load_f<VEC, kReadOnly>(sr + j + half, s2);
#pragma unroll
      for (int e = 0; e < VEC; ++e) fo_rope_pair(x1[e], x2[e], c1[e], c2[e], s1[e], s2[e], p.inverse, &y1[e], &y2[e]);
      store_f<VEC>(o, y1);
      store_f<VEC>(o + half, y2);
    }
  }
}

// The widest vector (elements) that every pointer, stride and the half-row allow.
int vec_width(const fo_rope_params &p, int esize) {
  for (int vec = 16 / esize; vec > 1; vec /= 2) {
    bool ok = (p.dim / 2) % vec == 0 && p.cb % vec == 0 && p.cs % vec == 0 && p.sb % vec == 0 &&
              p.ss % vec == 0 && reinterpret_cast<uintptr_t>(p.cos) % (vec * esize) == 0 &&
              reinterpret_cast<uintptr_t>(p.sin) % (vec * esize) == 0;
    for (int k = 0; k < p.n_tensors; ++k) {
      const fo_rope_tensor &t = p.t[k];
      ok = ok && t.xb % vec == 0 && t.xh % vec == 0 && t.xs % vec == 0 && t.ob % vec == 0 &&
           t.oh % vec == 0 && t.os % vec == 0 && reinterpret_cast<uintptr_t>(t.x) % (vec * esize) == 0 &&
           reinterpret_cast<uintptr_t>(t.out) % (vec * esize) == 0;
    }
    if (ok) return vec;
  }
  return 1;
}

template <class T, int VEC>
void launch_vec(const fo_rope_params &p, cudaStream_t stream) {
  const int nchunk = (int)(p.dim / 2 / VEC);
  const int items = (int)((p.t[0].heads + (p.n_tensors > 1 ? p.t[1].heads : 0)) * nchunk);
  const int threads = items >= kThreads ? kThreads : (items + 31) / 32 * 32;
  const int64_t npos = p.batch * p.seq;
  const unsigned blocks = (unsigned)(npos < 0x7FFFFFFF ? npos : 0x7FFFFFFF);
  rope_kernel<T, VEC><<<blocks, threads, 0, stream>>>(p, nchunk, items);
}

}  // namespace

extern "C" const char *fo_rope_cuda(const fo_rope_params *p, void *stream) {
  if (p->batch == 0 || p->seq == 0 || p->dim == 0) return nullptr;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  fo_rope_params q = *p;
  if (q.n_tensors < 2) q.t[1] = fo_rope_tensor{};  // heads 0: never selected
  with_type(q.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kMax = 16 / sizeof(T);
    const int vec = vec_width(q, sizeof(T));
    if (vec == kMax) launch_vec<T, kMax>(q, s);
    else if (vec >= 2) launch_vec<T, 2>(q, s);
    else launch_vec<T, 1>(q, s);
  });
  return last_error();
}
