/* Multi-tensor Adam / AdamW on CUDA (math and layout: adam.h).
 *
 * Bytes: read p, g, m, v and write p, m, v once each: 28 bytes a parameter for
 * fp32 (the ANCHORS.md count); 14 for 16-bit params and states; with an fp32
 * master copy of a 16-bit param, read g (2), master, m, v (12) and write
 * master, m, v (12) and the rounded param (2): 28. amsgrad adds 2x the state
 * size (read and write vmax).
 *
 * Kernels
 *   adam_tiles   a grid over every tensor of the launch at once: the tensors
 *                are cut into tiles of kTile elements (the last tile of a
 *                tensor may be short), one block a tile for fp32 params, else a
 *                persistent grid (block_per_tile): tile k goes to block k % grid, and a
 *                block walks its tiles in increasing order with a cursor over
 *                the tensor table, so it finds each tile's tensor in O(1) and
 *                recomputes the per-tensor scalars (bias corrections from the
 *                step count on the device, lr from the device when given) only
 *                when the tensor changes. Each thread updates per_thread()
 *                elements a tile, all loads issued before any store, with
 *                16-byte accesses (fp32 arrays of a 16-bit group as 32-byte
 *                packs); tensors whose pointers are not all 16-byte aligned,
 *                and the ragged end of a tensor, take a scalar path.
 *   adam_count   steps[i] += 1 for the tensors of the launch, after adam_tiles
 *                (which reads the old count and uses count + 1), so no block
 *                ever sees another's increment. Neither kernel does anything
 *                when *found_inf != 0.
 * The tensor table travels as a kernel argument (within the 4 KB every
 * architecture takes): up to kMaxTensors tensors a launch, more tensors mean a
 * few launches. No device allocation, no host sync: CUDA-graph capturable.
 * Measured figures and the history of versions: docs/perf-notes.md. */
#include <cstdint>
#include <type_traits>

#include "adam.h"
#include "../common/cuda_utils.cuh"
#include "../common/tune.h"

namespace {
using namespace fo;

constexpr int kMaxTensors = 56;
constexpr int kThreads = 256;
// Elements a thread updates per tile by default (per_thread picks).
constexpr int kPerThread = 16;

struct Table {
  int n;  // tensors in this launch
  int64_t numel[kMaxTensors];
  void *p[kMaxTensors];
  const void *g[kMaxTensors];
  void *m[kMaxTensors];
  void *v[kMaxTensors];
  void *vmax[kMaxTensors];  // NULL without amsgrad
  float *master[kMaxTensors];  // NULL without master weights
  float *step[kMaxTensors];
  bool vec[kMaxTensors];  // every pointer of the tensor 16-byte aligned
};
// The whole argument list (the table and the hyperparameters) must stay within
// the 4 KB kernel-parameter limit of every architecture we build for.
static_assert(sizeof(Table) + sizeof(fo_adam_params) <= 4096, "kernel arguments over 4 KB");

template <class T>
__device__ __forceinline__ T *at(void *base, int64_t off) {
  return static_cast<T *>(base) + off;
}

// One tile of tensor i: elements [base, base + kTile) (fewer at its end).
// P: param dtype; S: state dtype; MASTER: an fp32 master copy is the param's
// value, the param is only written.
template <class P, class S, bool MASTER, int PER>
__device__ __forceinline__ void update_tile(const Table &t, int i, int64_t base, const fo_adam_coef &c) {
  constexpr int VEC = (sizeof(P) == 4 && sizeof(S) == 4) ? 4 : 8;  // 16 bytes of the narrowest type
  constexpr int U = PER / VEC;
  constexpr int64_t kTile = (int64_t)kThreads * PER;
  const int64_t n = t.numel[i];
  auto first = [&](int u) { return base + ((int64_t)u * kThreads + threadIdx.x) * VEC; };
  const bool ams = c.amsgrad;

  if (t.vec[i] && base + kTile <= n) {
    float p[U][VEC], g[U][VEC], m[U][VEC], v[U][VEC], x[U][VEC];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // loads only
      const int64_t e = first(u);
      if (MASTER) load_f<VEC>(t.master[i] + e, p[u]);
      else load_f<VEC>(at<P>(t.p[i], e), p[u]);
      load_f<VEC, kReadOnly>(static_cast<const P *>(t.g[i]) + e, g[u]);
      load_f<VEC>(at<S>(t.m[i], e), m[u]);
      load_f<VEC>(at<S>(t.v[i], e), v[u]);
      if (ams) load_f<VEC>(at<S>(t.vmax[i], e), x[u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < VEC; ++k) fo_adam_update(&c, &p[u][k], g[u][k], &m[u][k], &v[u][k], &x[u][k]);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t e = first(u);
      if (MASTER) store_f<VEC>(t.master[i] + e, p[u]);
      store_f<VEC>(at<P>(t.p[i], e), p[u]);
      store_f<VEC>(at<S>(t.m[i], e), m[u]);
      store_f<VEC>(at<S>(t.v[i], e), v[u]);
      if (ams) store_f<VEC>(at<S>(t.vmax[i], e), x[u]);
    }
    return;
  }
  // Scalar path: the same elements one at a time, bounds-checked.
#pragma unroll 1
  for (int u = 0; u < U; ++u) {
#pragma unroll 1
    for (int k = 0; k < VEC; ++k) {
      const int64_t e = first(u) + k;
      if (e >= n) break;
      float p = MASTER ? t.master[i][e] : to_f(*at<P>(t.p[i], e));
      float m = to_f(*at<S>(t.m[i], e)), v = to_f(*at<S>(t.v[i], e));
      float x = ams ? to_f(*at<S>(t.vmax[i], e)) : 0.f;
      fo_adam_update(&c, &p, to_f(static_cast<const P *>(t.g[i])[e]), &m, &v, &x);
      if (MASTER) t.master[i][e] = p;
      *at<P>(t.p[i], e) = from_f<P>(p);
      *at<S>(t.m[i], e) = from_f<S>(m);
      *at<S>(t.v[i], e) = from_f<S>(v);
      if (ams) *at<S>(t.vmax[i], e) = from_f<S>(x);
    }
  }
}

template <class P, class S, bool MASTER, int PER>
__global__ void __launch_bounds__(kThreads) adam_tiles(const Table t, const fo_adam_params a) {
  constexpr int64_t kTile = (int64_t)kThreads * PER;
  if (a.found_inf && *a.found_inf != 0.f) return;
  const double lr = a.lr_ptr ? (double)*a.lr_ptr : a.lr;
  const float scale = a.grad_scale ? *a.grad_scale : 1.f;
  int i = -1;         // the tensor of the current tile
  int64_t lo = 0, hi = 0;  // its tiles: [lo, hi)
  fo_adam_coef c;
  for (int64_t tile = blockIdx.x;; tile += gridDim.x) {
    if (tile >= hi) {  // block-uniform: advance to the tensor holding `tile`
      do {
        if (++i >= t.n) return;
        lo = hi;
        hi += (t.numel[i] + kTile - 1) / kTile;
      } while (tile >= hi);
      c = fo_adam_coef_make(&a, (double)*t.step[i] + 1.0, lr, scale);
    }
    update_tile<P, S, MASTER, PER>(t, i, (tile - lo) * kTile, c);
  }
}

__global__ void adam_count(const Table t, const float *found_inf) {
  if (found_inf && *found_inf != 0.f) return;
  for (int i = threadIdx.x; i < t.n; i += blockDim.x) *t.step[i] += 1.f;
}

using Kernel = void (*)(const Table, const fo_adam_params);

// Elements a thread updates a tile: 32 for fp32 params on SMs of more
// bandwidth (bandwidth_rich_sms: more bytes in flight a thread), else 16.
// The tuning knob adam_per_thread (common/tune.h) = 8, 16 or 32 overrides.
int per_thread(bool f32, int device) {
  const int n = fo_tuning.adam_per_thread;
  const int forced = n == 8 || n == 16 || n == 32 ? n : 0;
  return forced ? forced : f32 && bandwidth_rich_sms(device) ? 32 : kPerThread;
}

// How blocks take tiles. fp32 params (no master copy) on an H100-like GPU:
// one block a tile, the hardware handing tiles out in order as blocks
// finish. Everything else: the persistent grid, since one block a tile
// repeats a block's table walk and coefficients every tile, and on SMs of
// more bandwidth fp32 gains from it too (docs/perf-notes.md has the
// figures). The tuning knob adam_grid (common/tune.h) = 1 (a block a tile)
// or 2 (persistent) overrides.
bool block_per_tile(bool f32, int device) {
  const int v = fo_tuning.adam_grid;
  return v == 0 ? f32 && !bandwidth_rich_sms(device) : v == 1;
}

template <int PER>
Kernel pick_per(fo_dtype param, fo_dtype state, bool master) {
  return with_type(param, [&](auto tag) -> Kernel {
    using P = typename decltype(tag)::type;
    if constexpr (std::is_same_v<P, float>) return adam_tiles<float, float, false, PER>;
    else if (master) return adam_tiles<P, float, true, PER>;
    else if (state == FO_F32) return adam_tiles<P, float, false, PER>;
    else return adam_tiles<P, P, false, PER>;
  });
}

}  // namespace

extern "C" const char *fo_adam_cuda(const fo_adam_params *a, void *stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const bool master = a->masters != nullptr;
  const bool f32 = a->param_dtype == FO_F32 && !master;
  const int device = current_device();
  const int per = per_thread(f32, device);
  const int64_t tile_elems = (int64_t)kThreads * per;
  const Kernel kernel = per == 8    ? pick_per<8>(a->param_dtype, a->state_dtype, master)
                        : per == 32 ? pick_per<32>(a->param_dtype, a->state_dtype, master)
                                    : pick_per<kPerThread>(a->param_dtype, a->state_dtype, master);
  const int64_t grid_cap = block_per_tile(f32, device) ? INT32_MAX
                                                       : sm_count(device) * blocks_per_sm(kernel, kThreads, 0);
  for (int64_t i0 = 0; i0 < a->ntensors; i0 += kMaxTensors) {
    Table t{};
    t.n = (int)(a->ntensors - i0 < kMaxTensors ? a->ntensors - i0 : kMaxTensors);
    int64_t tiles = 0;
    for (int k = 0; k < t.n; ++k) {
      const int64_t i = i0 + k;
      t.numel[k] = a->numels[i];
      t.p[k] = a->params[i];
      t.g[k] = a->grads[i];
      t.m[k] = a->exp_avgs[i];
      t.v[k] = a->exp_avg_sqs[i];
      t.vmax[k] = a->amsgrad ? a->max_exp_avg_sqs[i] : nullptr;
      t.master[k] = master ? a->masters[i] : nullptr;
      t.step[k] = a->steps[i];
      t.vec[k] = aligned16(t.p[k]) && aligned16(t.g[k]) && aligned16(t.m[k]) && aligned16(t.v[k]) &&
                 (!t.vmax[k] || aligned16(t.vmax[k])) && (!t.master[k] || aligned16(t.master[k]));
      tiles += (t.numel[k] + tile_elems - 1) / tile_elems;
    }
    if (tiles > 0) {
      const int grid = (int)(tiles < grid_cap ? tiles : grid_cap);
      kernel<<<grid, kThreads, 0, stream>>>(t, *a);
    }
    adam_count<<<1, 64, 0, stream>>>(t, a->found_inf);
  }
  return last_error();
}
