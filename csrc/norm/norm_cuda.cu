/* Residual-add + LayerNorm / RMSNorm on CUDA (math and layout: norm.h): the
 * launcher. norm_plan.c plans a call from its shape, dtypes, layout and the
 * device's facts; this file answers the planner's occupancy questions, maps
 * the plan to its compiled kernel (plan_kernel) and launches it once.
 *
 * Bytes: forward reads x, residual and writes y, s (4 matrices); backward
 * reads dy, s, ds and writes dx (4 matrices); weight-sized terms are noise.
 *
 * Kernels, by family (each file opens with what it is for):
 *   norm_kernels.cuh     sizes and the forward's per-chunk steps, shared
 *   norm_regs.cuh        fwd_regs: a team of threads holds the row in registers;
 *                        fwd_narrow: the same for 256-1024-wide rows of a
 *                        pre-norm transformer, the width a constant
 *   norm_misaligned.cuh  contiguous rows that allow no 16-byte access:
 *                        fwd_group (groups of rows through shared memory),
 *                        fwd_shift (a head, 16-byte chunks, a tail)
 *   norm_wide.cuh        rows no register team holds: fwd_park (half the row
 *                        parked in shared memory), fwd_pipe (rows staged ahead
 *                        by cp.async, over a cluster on sm_90), fwd_loop
 *   norm_bwd.cuh         bwd_regs, bwd_group, bwd_shift, bwd_pipe, bwd_loop with
 *                        dwdb_cols; colsum sums the partial rows in a fixed
 *                        order (deterministic)
 * The plan's rules and the measurements behind them: norm_plan.c and
 * docs/perf/norm.md. */
#include <cstdint>
#include <type_traits>

#include "norm.h"
#include "../common/cuda_utils.cuh"
#include "norm_regs.cuh"
#include "norm_misaligned.cuh"
#include "norm_wide.cuh"
#include "norm_bwd.cuh"

namespace {
using namespace fo;

// --- launch: plan (norm_plan.c), then one launch ---------------------------------------------

// Calls f(integral_constant<VEC>) for vec: a register kernel's (V, V / 2,
// V / 4 of at least 2, or 1) or, with kLoop, a loop kernel's (V, 4 for
// 16-bit T, or 1).
template <class T, bool kLoop, class F>
void with_vec(int vec, F &&f) {
  constexpr int V = 16 / sizeof(T);
  if (vec == V) f(std::integral_constant<int, V>{});
  else if (vec == 1) f(std::integral_constant<int, 1>{});
  else if constexpr (V == 8) {
    if (vec == 4) f(std::integral_constant<int, 4>{});
    else if constexpr (!kLoop) {
      if (vec == 2) f(std::integral_constant<int, 2>{});
    }
  } else if constexpr (!kLoop) {
    if (vec == 2) f(std::integral_constant<int, 2>{});
  }
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

// Calls f(integral_constant<NV>) for the chunks-per-thread count nv (a power
// of two up to MAX_NV) among the counts whose arrays fit BUDGET values, and
// returns whether it did: a plan past them has no kernel to run.
template <int VEC, int BUDGET, int MAX_NV, class F>
bool with_nv(int nv, F &&f) {
  auto run = [&](auto n) {
    constexpr int NV = decltype(n)::value;
    if constexpr (NV <= MAX_NV && NV * VEC <= BUDGET) {
      f(n);
      return true;
    }
    return false;
  };
  switch (nv) {
    case 1: return run(std::integral_constant<int, 1>{});
    case 2: return run(std::integral_constant<int, 2>{});
    case 4: return run(std::integral_constant<int, 4>{});
    case 8: return run(std::integral_constant<int, 8>{});
    case 16: return run(std::integral_constant<int, 16>{});
    default: return false;
  }
}

// fwd_narrow of width C: RB rows a block, the variant (RMSNorm, LayerNorm with
// or without bias) as a template argument.
template <class T, int C>
const void *narrow_kernel(bool rms, bool bias, int rb) {
  const int variant = rms ? 0 : bias ? 1 : 2;
  if constexpr (C == 256 || C == 512) {
    if (rb == 8) {  // (RMSNorm's is compiled at 256 only: at 512 it is not planned)
      if (variant == 0) return C == 256 ? (const void *)fwd_narrow<T, 256, true, false, 8> : nullptr;
      return variant == 1 ? (const void *)fwd_narrow<T, C, false, true, 8> : (const void *)fwd_narrow<T, C, false, false, 8>;
    }
    if (rb == 2) {
      return variant == 0 ? (const void *)fwd_narrow<T, C, true, false, 2>
             : variant == 1 ? (const void *)fwd_narrow<T, C, false, true, 2>
                            : (const void *)fwd_narrow<T, C, false, false, 2>;
    }
  }
  if (rb != 1) return nullptr;
  return variant == 0 ? (const void *)fwd_narrow<T, C, true, false, 1>
         : variant == 1 ? (const void *)fwd_narrow<T, C, false, true, 1>
                        : (const void *)fwd_narrow<T, C, false, false, 1>;
}

// fwd_narrow's kernel for the call p: 16-bit x, s and weight of one dtype.
const void *narrow_of(const fo_norm_fwd_params &p, int rb) {
  const void *k = nullptr;
  with_type(p.x_dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    if constexpr (sizeof(T) == 2) {
      switch (p.cols) {
        case 256: k = narrow_kernel<T, 256>(p.rms, p.bias, rb); break;
        case 512: k = narrow_kernel<T, 512>(p.rms, p.bias, rb); break;
        case 768: k = narrow_kernel<T, 768>(p.rms, p.bias, rb); break;
        case 1024: k = narrow_kernel<T, 1024>(p.rms, p.bias, rb); break;
      }
    }
  });
  return k;
}

// The compiled kernel a plan names for the call p (nullptr: none is compiled,
// a bug): the one map from plans to kernels, used for the occupancy queries
// the planner makes and for the launch.
template <class P>
const void *plan_kernel(const fo_norm_plan &pl, const P &p) {
  constexpr bool kFwd = std::is_same_v<P, fo_norm_fwd_params>;
  if constexpr (kFwd) {
    if (pl.kernel == FO_NORM_NARROW) return narrow_of(p, pl.rpb);
  }
  const void *k = nullptr;
  with_types(p.x_dtype, p.s_dtype, p.w_dtype, [&](auto tt, auto ts, auto tw) {
    using T = typename decltype(tt)::type;
    using S = typename decltype(ts)::type;
    using W = typename decltype(tw)::type;
    constexpr int V = 16 / sizeof(T);
    constexpr bool k16 = sizeof(T) == 2 && std::is_same_v<S, T>;  // 16-bit x and s of one dtype
    switch (pl.kernel) {
      case FO_NORM_PARK:  // the forward's alone
        if constexpr (kFwd && k16) k = (const void *)fwd_park<T, W>;
        break;
      case FO_NORM_GROUP: k = kFwd ? (const void *)fwd_group<T, S, W> : (const void *)bwd_group<T, S, W>; break;
      case FO_NORM_SHIFT:
        if constexpr (kFwd && k16) {
          if (pl.nv == 1) k = (const void *)fwd_shift<T, W, 1, true>;
          else if (pl.nv == 2) k = (const void *)fwd_shift<T, W, 2, false>;
          else if (pl.nv == 4) k = (const void *)fwd_shift<T, W, 4, false>;
        } else if constexpr (k16) {  // rows of at most 8K values: two chunks a thread hold them
          k = pl.nv == 1 ? (const void *)bwd_shift<T, W, 1> : (const void *)bwd_shift<T, W, 2>;
        }
        break;
      case FO_NORM_PIPE:
        if constexpr (kFwd)
          k = pl.cl > 1 ? (const void *)fwd_pipe<T, S, W, V, true> : (const void *)fwd_pipe<T, S, W, V, false>;
        else
          k = pl.cl > 1 ? (const void *)bwd_pipe<T, S, W, V, true> : (const void *)bwd_pipe<T, S, W, V, false>;
        break;
      case FO_NORM_LOOP:
        with_vec<T, true>(pl.vec, [&](auto v) {
          constexpr int VEC = decltype(v)::value;
          k = kFwd ? (const void *)fwd_loop<T, S, W, VEC> : (const void *)bwd_loop<T, S, W, VEC>;
        });
        break;
      case FO_NORM_REGS:
        with_vec<T, false>(pl.vec, [&](auto v) {
          constexpr int VEC = decltype(v)::value;
          if constexpr (kFwd)
            with_nv<VEC, kFwdMaxValues * V / 8, kFwdMaxChunks>(
                pl.nv, [&](auto nv) { k = (const void *)fwd_regs<T, S, W, VEC, decltype(nv)::value>; });
          else
            with_nv<VEC, kBwdMaxValues * V / 8, kBwdMaxChunks>(
                pl.nv, [&](auto nv) { k = (const void *)bwd_regs<T, S, W, VEC, decltype(nv)::value>; });
        });
        break;
    }
  });
  return k;
}

// The dynamic shared memory a kernel must be granted before it is asked
// about or launched: fwd_group's and the shift kernels' past 48 KB, every
// other kernel's whenever it takes any (some add static arrays to it).
size_t optin_bytes(const fo_norm_plan &pl, size_t smem) {
  return pl.kernel == FO_NORM_GROUP || pl.kernel == FO_NORM_SHIFT ? (smem > 48 * 1024 ? smem : 0) : smem;
}

// A launch configuration of 1-D clusters of `cl` blocks, `blocks` blocks in all.
struct ClusterLaunch {
  cudaLaunchAttribute attr[1] = {};
  cudaLaunchConfig_t cfg = {};
  ClusterLaunch(int64_t blocks, int cl, int threads, size_t smem, cudaStream_t stream) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = (unsigned)cl;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3((unsigned)blocks);
    cfg.blockDim = dim3((unsigned)threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
};

// What the planner asks of the device: the call, its direction and device.
struct Query {
  const fo_norm_fwd_params *fwd;
  const fo_norm_bwd_params *bwd;
  int device;
  const void *kernel(const fo_norm_plan *pl) const { return fwd ? plan_kernel(*pl, *fwd) : plan_kernel(*pl, *bwd); }
};

// Resident blocks an SM of the plan's kernel (the occupancy calculator, cached).
int query_blocks(void *ctx, const fo_norm_plan *pl, int threads, size_t smem) {
  const Query &q = *static_cast<const Query *>(ctx);
  const void *k = q.kernel(pl);
  if (!k) return 1;
  (void)fo::grant_smem(k, optin_bytes(*pl, smem), q.device);  // a failure shows at the launch
  return blocks_per_sm(k, threads, smem);
}

// Clusters of pl->cl blocks of the plan's kernel resident at once (at least 1; cached).
int query_clusters(void *ctx, const fo_norm_plan *pl, int threads, size_t smem) {
  const Query &q = *static_cast<const Query *>(ctx);
  const void *k = q.kernel(pl);
  if (!k) return 1;
  (void)fo::grant_smem(k, optin_bytes(*pl, smem), q.device);  // a failure shows at the launch
  thread_local RingCache<LaunchKey, int, 16> cache;
  const LaunchKey key{k, pl->cl, threads, smem};
  if (const int *n = cache.find(key)) return *n;
  if (pl->cl > 8) cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  ClusterLaunch l(pl->cl, pl->cl, threads, smem, nullptr);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, k, &l.cfg) != cudaSuccess || n < 1) {
    cudaGetLastError();
    n = 1;
  }
  cache.put(key, n);
  return n;
}

// The device's facts for the planner (each attribute queried once a device).
fo_norm_device device_facts(const Query &q) {
  fo_norm_device d{};
  d.sm_count = sm_count(q.device);
  d.smem_optin = smem_optin(q.device);
  d.gbps_per_sm = mem_gbps_per_sm(q.device);
  d.cc = compute_capability(q.device);
  d.blocks_per_sm = query_blocks;
  d.clusters = query_clusters;
  d.ctx = const_cast<Query *>(&q);
  return d;
}

// Launches the plan's kernel k(args...) on `stream`: clusters where the plan
// splits rows over them, blocks of (team, rpb) for the register kernels,
// team * rpb threads for the rest.
void launch(const void *k, const fo_norm_plan &pl, void **args, int device, cudaStream_t stream) {
  (void)fo::grant_smem(k, optin_bytes(pl, pl.smem), device);  // a failure shows at the launch
  if (pl.cl > 1) {
    if (pl.cl > 8) cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    ClusterLaunch l(pl.grid, pl.cl, pl.team, pl.smem, stream);
    cudaLaunchKernelExC(&l.cfg, k, args);
    return;
  }
  const dim3 block = pl.kernel == FO_NORM_REGS ? dim3(pl.team, pl.rpb) : dim3(pl.team * pl.rpb);
  cudaLaunchKernel(k, dim3((unsigned)pl.grid), block, args, pl.smem, stream);
}

constexpr const char *kNoKernel = "fusedops: internal error: the norm plan names a kernel that is not compiled";

}  // namespace

extern "C" const char *fo_norm_fwd_cuda(const fo_norm_fwd_params *p, void *stream) {
  const Query q{p, nullptr, current_device()};
  const fo_norm_device d = device_facts(q);
  const fo_norm_plan pl = fo_norm_fwd_plan(p, &d);
  const void *k = pl.kernel ? plan_kernel(pl, *p) : nullptr;
  if (!k) return kNoKernel;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (pl.small_l1) {  // once a kernel (dtype, variant) and device; a repeat is harmless
    static bool asked[2][3][64];
    bool &done = asked[p->x_dtype == FO_BF16][p->rms ? 0 : p->bias ? 1 : 2][q.device & 63];
    if (q.device >= 0 && q.device < 64 && !done) {
      cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
      done = true;
    }
  }
  int stages = pl.stages;
  void *args[] = {const_cast<fo_norm_fwd_params *>(p), &stages};
  launch(k, pl, args, q.device, st);
  return last_error();
}

extern "C" const char *fo_norm_bwd_cuda_plan(const fo_norm_bwd_params *p, int device, fo_norm_plan *plan) {
  const Query q{nullptr, p, device};
  const fo_norm_device d = device_facts(q);
  *plan = fo_norm_bwd_plan(p, &d);
  return plan->kernel && plan_kernel(*plan, *p) ? nullptr : kNoKernel;
}

extern "C" const char *fo_norm_bwd_cuda(const fo_norm_bwd_params *p, const fo_norm_plan *plan, void *stream) {
  const fo_norm_plan &pl = *plan;
  const void *k = pl.kernel ? plan_kernel(pl, *p) : nullptr;
  if (!k) return kNoKernel;
  const bool want = p->dweight || p->dbias;
  if (want && p->parts != pl.parts) return "fusedops: dweight/dbias workspace does not match the launch plan";
  const int device = current_device();
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  int stages = pl.stages;
  void *args[] = {const_cast<fo_norm_bwd_params *>(p), &stages};
  launch(k, pl, args, device, st);
  if (!want) return last_error();
  if (pl.kernel == FO_NORM_LOOP) {  // the partial sums over column tiles, after dx
    with_types(p->x_dtype, p->s_dtype, p->w_dtype, [&](auto tt, auto ts, auto) {
      using T = typename decltype(tt)::type;
      using S = typename decltype(ts)::type;
      with_vec<T, true>(pl.vec, [&](auto v) {
        dim3 grid((unsigned)pl.col_blocks, (unsigned)pl.parts);
        dwdb_cols<T, S, decltype(v)::value><<<grid, dim3(32, kColRows), 0, st>>>(*p, pl.rows_per_part);
      });
    });
  }
  with_type(p->w_dtype, [&](auto tw) {
    using W = typename decltype(tw)::type;
    dim3 grid((unsigned)((p->cols + 31) / 32), 2);
    colsum<W><<<grid, dim3(32, 8), 0, st>>>(p->partial, p->parts, p->cols, static_cast<W *>(p->dweight),
                                           static_cast<W *>(p->dbias));
  });
  return last_error();
}
