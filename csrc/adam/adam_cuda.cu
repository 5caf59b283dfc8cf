/* Multi-tensor Adam / AdamW on CUDA (math and layout: adam.h).
 *
 * Bytes: read p, g, m, v and write p, m, v once each: 28 bytes a parameter for
 * fp32 (the ANCHORS.md count); 14 for 16-bit params and states; with an fp32
 * master copy of a 16-bit param, read g (2), master, m, v (12) and write
 * master, m, v (12) and the rounded param (2): 28. amsgrad adds 2x the state
 * size (read and write vmax).
 *
 * Kernels
 *   adam_kernel  a grid over every tensor of the launch at once: the tensors
 *                are cut into tiles of kThreads x per elements (the last tile
 *                of a tensor may be short), and a block walks its tiles
 *                (every grid-th tile: a persistent grid, or one block a
 *                tile) in increasing order with a cursor over the tensor
 *                table, so it finds each tile's tensor in O(1) and
 *                recomputes the
 *                per-tensor scalars (bias corrections from the step count on
 *                the device, lr from the device when given) only when the
 *                tensor changes. Each thread updates `per` elements a tile
 *                with 16-byte accesses (fp32 arrays of a 16-bit group as
 *                32-byte packs), either from registers (all a tile's loads
 *                issued before any store) or, in the ring shape, from a ring
 *                of tiles in shared memory that cp.async (each thread its
 *                own elements) fills several tiles ahead;
 *                tensors whose pointers are not all 16-byte aligned, and the
 *                ragged end of a tensor, take a scalar path.
 *   adam_count   steps[i] += 1 for the tensors of the launch, after adam_kernel
 *                (which reads the old count and uses count + 1), so no block
 *                ever sees another's increment. Neither kernel does anything
 *                when *found_inf != 0.
 * The launch plan (plan_for: the shape, and a persistent grid or one block a
 * tile) is computed from the dtypes and the GPU; the tuning knob adam_plan
 * (common/tune.h) forces one, for tests and probes.
 * The tensor table travels as a kernel argument (within the 4 KB every
 * architecture takes): up to kMaxTensors tensors a launch, more tensors mean a
 * few launches. No device allocation, no host sync: CUDA-graph capturable.
 * Measured figures and the history of versions: docs/perf/adam.md. */
#include <cstdint>
#include <type_traits>
#include <utility>

#include "adam.h"
#include "../common/cuda_utils.cuh"
#include "../common/tune.h"

namespace {
using namespace fo;

constexpr int kMaxTensors = 56;
constexpr int kThreads = 256;

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
// The whole argument list (the table, the hyperparameters and the tile count)
// must stay within the 4 KB kernel-parameter limit of every architecture we
// build for.
static_assert(sizeof(Table) + sizeof(fo_adam_params) + 16 <= 4096, "kernel arguments over 4 KB");

// ---------------------------------------------------------------- the plan
// A kernel's compile-time shape. per: elements a thread updates a tile.
// stages 0: the tile's loads into registers, then its update and stores (the
// next tile's loads wait for this tile's stores to be issued). stages S > 0:
// a block keeps S tiles in flight through a ring in shared memory, each
// thread copying its own elements by cp.async S - 1 tiles ahead of the one it
// updates, so that loads stay in flight through the update and the stores
// (no barrier: a thread reads back only what it copied).
struct Shape {
  int per, stages;
};
constexpr Shape kShapes[] = {{16, 0}, {8, 6}};
constexpr int kNumShapes = sizeof(kShapes) / sizeof(kShapes[0]);
constexpr int kRegs = 0, kRing = 1;

// A launch plan: the kernel's shape, and its grid: persistent (as many blocks
// as fit on the GPU at once, each taking every grid-th tile, so the blocks
// sweep memory side by side) or one block a tile (the hardware hands tiles
// out in order as blocks finish).
struct Plan {
  int shape;
  bool persistent;
};

// fp32 params, and 16-bit ones with an fp32 master copy, on SMs of more
// bandwidth each than an H100's (bandwidth_rich_sms) take the ring, which
// keeps loads in flight through the update and the stores (the register
// shape's next loads wait behind its stores). Elsewhere the registers:
// fp32 one block a tile; 16-bit groups the persistent grid, since one block
// a tile repeats a block's table walk and coefficients every tile. The knob
// adam_plan (common/tune.h) forces a plan: 1 registers on the persistent
// grid, 2 registers one block a tile, 3 the ring. Where the ring cannot be
// used, fo_adam_cuda takes the registers on the same grid. Figures:
// docs/perf/adam.md.
Plan plan_for(bool f32, bool master, int device) {
  switch (fo_tuning.adam_plan) {
    case 1: return Plan{kRegs, true};
    case 2: return Plan{kRegs, false};
    case 3: return Plan{kRing, true};
    default: break;
  }
  if ((f32 || master) && bandwidth_rich_sms(device)) return Plan{kRing, true};
  return Plan{kRegs, !f32};
}

// ---------------------------------------------------------------- device code
template <class T>
__device__ __forceinline__ T *at(void *base, int64_t off) {
  return static_cast<T *>(base) + off;
}

// The tensor of the launch holding a tile; tiles are asked for in increasing
// order, so a block finds each in O(1) over its walk.
struct Cursor {
  int i = -1;              // the tensor
  int64_t lo = 0, hi = 0;  // its tiles: [lo, hi)
  __device__ __forceinline__ void seek(const Table &t, int64_t tile, int64_t tile_elems) {
    while (tile >= hi && i + 1 < t.n) {
      ++i;
      lo = hi;
      hi += (t.numel[i] + tile_elems - 1) / tile_elems;
    }
  }
};

// Per-tensor scalars, from the step count on the device and lr.
__device__ __forceinline__ fo_adam_coef coef_of(const Table &t, int i, const fo_adam_params &a, double lr,
                                                float scale) {
  return fo_adam_coef_make(&a, (double)*t.step[i] + 1.0, lr, scale);
}

// Elements [first, first + count) of tensor i (bounds-checked against its
// numel), one at a time: the ragged end of a tensor and tensors whose
// pointers are not all 16-byte aligned. P, S, MASTER as update_tile.
template <class P, class S, bool MASTER, int VEC, int U>
__device__ __forceinline__ void update_scalar(const Table &t, int i, int64_t base, const fo_adam_coef &c) {
  const int64_t n = t.numel[i];
  const bool ams = c.amsgrad;
#pragma unroll 1
  for (int u = 0; u < U; ++u) {
#pragma unroll 1
    for (int k = 0; k < VEC; ++k) {
      const int64_t e = base + ((int64_t)u * kThreads + threadIdx.x) * VEC + k;
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

// 16 bytes of the narrowest type: the elements one thread moves together.
template <class P, class S>
constexpr int vec_of() {
  return (sizeof(P) == 4 && sizeof(S) == 4) ? 4 : 8;
}

// The update of VEC elements in registers, then their stores (in the order
// they were read: p, m, v, vmax; with a master copy the master before the
// rounded param).
template <class P, class S, bool MASTER, int VEC>
__device__ __forceinline__ void update_store(const Table &t, int i, int64_t e, const fo_adam_coef &c,
                                             float (&p)[VEC], const float (&g)[VEC], float (&m)[VEC],
                                             float (&v)[VEC], float (&x)[VEC]) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) fo_adam_update(&c, &p[k], g[k], &m[k], &v[k], &x[k]);
  if (MASTER) store_f<VEC>(t.master[i] + e, p);
  store_f<VEC>(at<P>(t.p[i], e), p);
  store_f<VEC>(at<S>(t.m[i], e), m);
  store_f<VEC>(at<S>(t.v[i], e), v);
  if (c.amsgrad) store_f<VEC>(at<S>(t.vmax[i], e), x);
}

// One tile of tensor i from registers: elements [base, base + tile) (fewer
// at its end), all loads issued before any update or store. P: param dtype;
// S: state dtype; MASTER: an fp32 master copy is the param's value, the param
// is only written.
template <class P, class S, bool MASTER, int PER>
__device__ __forceinline__ void update_tile(const Table &t, int i, int64_t base, const fo_adam_coef &c) {
  constexpr int VEC = vec_of<P, S>();
  constexpr int U = PER / VEC;
  constexpr int64_t kTile = (int64_t)kThreads * PER;
  auto first = [&](int u) { return base + ((int64_t)u * kThreads + threadIdx.x) * VEC; };
  if (!(t.vec[i] && base + kTile <= t.numel[i])) return update_scalar<P, S, MASTER, VEC, U>(t, i, base, c);
  float p[U][VEC], g[U][VEC], m[U][VEC], v[U][VEC], x[U][VEC];
#pragma unroll
  for (int u = 0; u < U; ++u) {  // loads only
    const int64_t e = first(u);
    if (MASTER) load_f<VEC>(t.master[i] + e, p[u]);
    else load_f<VEC>(at<P>(t.p[i], e), p[u]);
    load_f<VEC, kReadOnly>(static_cast<const P *>(t.g[i]) + e, g[u]);
    load_f<VEC>(at<S>(t.m[i], e), m[u]);
    load_f<VEC>(at<S>(t.v[i], e), v[u]);
    if (c.amsgrad) load_f<VEC>(at<S>(t.vmax[i], e), x[u]);
  }
#pragma unroll
  for (int u = 0; u < U; ++u) update_store<P, S, MASTER>(t, i, first(u), c, p[u], g[u], m[u], v[u], x[u]);
}

// Shared memory of one stage of a staged kernel: a tile of each array read
// (the param or its master copy, g, m, v, and vmax with amsgrad), each laid
// out as in global memory.
template <class P, class S, bool MASTER>
__host__ __device__ constexpr int64_t stage_bytes(int per, bool ams) {
  return (int64_t)kThreads * per *
         ((MASTER ? 4 : (int64_t)sizeof(P)) + (int64_t)sizeof(P) + (2 + (ams ? 1 : 0)) * (int64_t)sizeof(S));
}

// Tiles blockIdx.x, blockIdx.x + gridDim.x, ... of the launch's `tiles`.
template <class P, class S, bool MASTER, int SH>
__global__ void __launch_bounds__(kThreads) adam_kernel(const Table t, const fo_adam_params a, int64_t tiles) {
  constexpr Shape sh = kShapes[SH];
  constexpr int PER = sh.per, STAGES = sh.stages;
  constexpr int64_t kTile = (int64_t)kThreads * PER;
  if (a.found_inf && *a.found_inf != 0.f) return;
  const double lr = a.lr_ptr ? (double)*a.lr_ptr : a.lr;
  const float scale = a.grad_scale ? *a.grad_scale : 1.f;
  const int64_t first = blockIdx.x, step = gridDim.x;
  Cursor cur;
  int ci = -1;  // the tensor whose scalars c holds
  fo_adam_coef c;
  if constexpr (STAGES == 0) {
    for (int64_t tile = first; tile < tiles; tile += step) {
      cur.seek(t, tile, kTile);
      if (cur.i != ci) c = coef_of(t, ci = cur.i, a, lr, scale);
      update_tile<P, S, MASTER, PER>(t, cur.i, (tile - cur.lo) * kTile, c);
    }
  } else {
    constexpr int VEC = vec_of<P, S>(), U = PER / VEC;
    using PL = std::conditional_t<MASTER, float, P>;  // the param's value as read
    extern __shared__ uint4 smem_words[];
    char *const smem = reinterpret_cast<char *>(smem_words);
    const bool ams = a.amsgrad;
    // Offsets in a stage of each array's tile, and of this thread's u-th
    // vector within an array of elements of `size` bytes.
    const int64_t off_g = kTile * sizeof(PL), off_m = off_g + kTile * sizeof(P), off_v = off_m + kTile * sizeof(S),
                  off_x = off_v + kTile * sizeof(S);
    const int64_t stage = stage_bytes<P, S, MASTER>(PER, ams);
    auto slot = [&](int u, int size) { return ((int64_t)u * kThreads + threadIdx.x) * VEC * size; };
    auto full = [&](int i, int64_t base) { return t.vec[i] && base + kTile <= t.numel[i]; };
    Cursor ahead;
    // Tile `tile` (or none, past the block's end) into stage s: each thread
    // copies its own slots, and commits one group either way, so that group
    // k is always the block's k-th tile.
    auto issue = [&](int64_t tile, int s) {
      if (tile < tiles) {
        ahead.seek(t, tile, kTile);
        const int i = ahead.i;
        const int64_t base = (tile - ahead.lo) * kTile;
        char *st = smem + s * stage;
        if (full(i, base)) {
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int64_t e = base + ((int64_t)u * kThreads + threadIdx.x) * VEC;
            const void *pl = MASTER ? (const void *)(t.master[i] + e) : (const void *)at<P>(t.p[i], e);
            cp_async_bytes<VEC * sizeof(PL)>(st + slot(u, sizeof(PL)), pl);
            cp_async_bytes<VEC * sizeof(P)>(st + off_g + slot(u, sizeof(P)), static_cast<const P *>(t.g[i]) + e);
            cp_async_bytes<VEC * sizeof(S)>(st + off_m + slot(u, sizeof(S)), at<S>(t.m[i], e));
            cp_async_bytes<VEC * sizeof(S)>(st + off_v + slot(u, sizeof(S)), at<S>(t.v[i], e));
            if (ams) cp_async_bytes<VEC * sizeof(S)>(st + off_x + slot(u, sizeof(S)), at<S>(t.vmax[i], e));
          }
        }
      }
      cp_async_commit();
    };
    int64_t next = first;
#pragma unroll 1
    for (int s = 0; s < STAGES - 1; ++s, next += step) issue(next, s);
    int j = 0;
#pragma unroll 1
    for (int64_t tile = first; tile < tiles; tile += step, next += step, ++j) {
      // Stage (j - 1) % STAGES takes the tile STAGES - 1 ahead: this thread
      // read its part of that stage in the previous iteration, and those
      // values were used (stored) before this point.
      issue(next, (j + STAGES - 1) % STAGES);
      cp_async_wait<STAGES - 1>();  // this tile's group has landed
      cur.seek(t, tile, kTile);
      const int i = cur.i;
      if (i != ci) c = coef_of(t, ci = i, a, lr, scale);
      const int64_t base = (tile - cur.lo) * kTile;
      if (!full(i, base)) {
        update_scalar<P, S, MASTER, VEC, U>(t, i, base, c);
        continue;
      }
      const char *st = smem + (j % STAGES) * stage;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float p[VEC], g[VEC], m[VEC], v[VEC], x[VEC];
        load_f<VEC>(reinterpret_cast<const PL *>(st + slot(u, sizeof(PL))), p);
        load_f<VEC>(reinterpret_cast<const P *>(st + off_g + slot(u, sizeof(P))), g);
        load_f<VEC>(reinterpret_cast<const S *>(st + off_m + slot(u, sizeof(S))), m);
        load_f<VEC>(reinterpret_cast<const S *>(st + off_v + slot(u, sizeof(S))), v);
        if (ams) load_f<VEC>(reinterpret_cast<const S *>(st + off_x + slot(u, sizeof(S))), x);
        const int64_t e = base + ((int64_t)u * kThreads + threadIdx.x) * VEC;
        update_store<P, S, MASTER>(t, i, e, c, p, g, m, v, x);
      }
    }
    cp_async_wait<0>();
  }
}

__global__ void adam_count(const Table t, const float *found_inf) {
  if (found_inf && *found_inf != 0.f) return;
  for (int i = threadIdx.x; i < t.n; i += blockDim.x) *t.step[i] += 1.f;
}

using Kernel = void (*)(const Table, const fo_adam_params, int64_t);

// The kernel of shape SH for the group's dtypes, and its shared memory a
// block (0 for the register shape).
struct Pick {
  Kernel kernel;
  int64_t smem;
};
template <class P, class S, bool MASTER, int SH>
Pick pick_kernel(bool ams) {
  return Pick{adam_kernel<P, S, MASTER, SH>, kShapes[SH].stages * stage_bytes<P, S, MASTER>(kShapes[SH].per, ams)};
}
template <int SH>
Pick pick_shape(fo_dtype param, fo_dtype state, bool master, bool ams) {
  return with_type(param, [&](auto tag) -> Pick {
    using P = typename decltype(tag)::type;
    if constexpr (std::is_same_v<P, float>) return pick_kernel<float, float, false, SH>(ams);
    else if (master) return pick_kernel<P, float, true, SH>(ams);
    else if (state == FO_F32) return pick_kernel<P, float, false, SH>(ams);
    else return pick_kernel<P, P, false, SH>(ams);
  });
}
template <int... SH>
Pick pick(int shape, fo_dtype param, fo_dtype state, bool master, bool ams, std::integer_sequence<int, SH...>) {
  Pick out{nullptr, 0};
  ((shape == SH ? (void)(out = pick_shape<SH>(param, state, master, ams)) : (void)0), ...);
  return out;
}

}  // namespace

extern "C" const char *fo_adam_cuda(const fo_adam_params *a, void *stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const bool master = a->masters != nullptr;
  const bool f32 = a->param_dtype == FO_F32 && !master;
  const int device = current_device();
  const Plan plan = plan_for(f32, master, device);
  const auto shapes = std::make_integer_sequence<int, kNumShapes>{};
  Pick k = pick(plan.shape, a->param_dtype, a->state_dtype, master, a->amsgrad, shapes);
  int shape = plan.shape;
  // A ring too large for this GPU's shared memory (amsgrad adds an array to
  // each stage): the register shape instead, on the same grid.
  if (k.smem > smem_optin(device)) {
    shape = kRegs;
    k = pick(shape, a->param_dtype, a->state_dtype, master, a->amsgrad, shapes);
  }
  if (grant_smem(k.kernel, (size_t)k.smem) != cudaSuccess) return last_error();
  const int64_t tile_elems = (int64_t)kThreads * kShapes[shape].per;
  const int64_t grid_cap =
      plan.persistent ? (int64_t)sm_count(device) * blocks_per_sm(k.kernel, kThreads, (size_t)k.smem) : INT32_MAX;
  for (int64_t i0 = 0; i0 < a->ntensors; i0 += kMaxTensors) {
    Table t{};
    t.n = (int)(a->ntensors - i0 < kMaxTensors ? a->ntensors - i0 : kMaxTensors);
    int64_t tiles = 0;
    for (int j = 0; j < t.n; ++j) {
      const int64_t i = i0 + j;
      t.numel[j] = a->numels[i];
      t.p[j] = a->params[i];
      t.g[j] = a->grads[i];
      t.m[j] = a->exp_avgs[i];
      t.v[j] = a->exp_avg_sqs[i];
      t.vmax[j] = a->amsgrad ? a->max_exp_avg_sqs[i] : nullptr;
      t.master[j] = master ? a->masters[i] : nullptr;
      t.step[j] = a->steps[i];
      t.vec[j] = aligned16(t.p[j]) && aligned16(t.g[j]) && aligned16(t.m[j]) && aligned16(t.v[j]) &&
                 (!t.vmax[j] || aligned16(t.vmax[j])) && (!t.master[j] || aligned16(t.master[j]));
      tiles += (t.numel[j] + tile_elems - 1) / tile_elems;
    }
    if (tiles > 0) {
      const int grid = (int)(tiles < grid_cap ? tiles : grid_cap);
      k.kernel<<<grid, kThreads, (size_t)k.smem, stream>>>(t, *a, tiles);
    }
    adam_count<<<1, 64, 0, stream>>>(t, a->found_inf);
  }
  return last_error();
}
