// Flash attention forward on Hopper (sm_90a): the algorithm of
// attention_fwd_cuda.cu with warpgroup MMA (wgmma.mma_async) in place of
// mma.sync. Math, layout and masking: attention.h.
//
// v0 (this file). One block of two warpgroups per (128-query tile, batch x q
// head); each warpgroup owns 64 query rows. K and V tiles of kBlockN keys go
// through shared memory in two stages (cp.async by every thread; mbarriers
// say when a stage has landed and when every warp is done with it, so there
// is no block-wide barrier and the warpgroups drift apart: one's softmax runs
// beside the other's products). Both products read their B operand straight
// from shared memory (descriptors over the 128-byte-swizzled layout wgmma
// expects; no ldmatrix, no per-warp copies of K / V fragments):
//   S = Q K_j^T   wgmma 64 x kBlockN x 16, A = Q from shared memory (K-major),
//   O += P V_j    wgmma 64 x D x 16, A = P from registers (the S accumulators
//                 rounded to the dtype: their layout is wgmma's A fragment),
//                 B = V N-major (transposed by the descriptor).
// Online softmax between them in fp32 registers, as in the mma.sync kernel.
// Head dims 64 and 128 (a multiple of 64: the swizzle atom is 64 elements
// wide), bf16 and fp16, causal (top-left) or not, any Sq / Sk, grouped-query,
// the strides of attention_fwd_cuda.cu, softmax scale > 0. Other head dims
// and other GPUs take the mma.sync kernel; FUSEDOPS_ATTN_WGMMA=0 forces it
// (for comparison). Measured on the H100: docs/perf-notes.md (forward v3).
//
// Built only for sm_90a (setup.py turns arch 9.0 into 9.0a and defines
// FUSEDOPS_SM90A); for other archs the kernel body is empty, and
// fo_attn_fwd_cuda takes it only where p->wgmma (a 9.0 GPU, a build with 9.0a) and scale > 0.
#include <stdlib.h>

#include "attention.h"
#include "../common/cuda_utils.cuh"
#include "attention_sm90.cuh"

namespace {

using namespace fo_attn;
using fo::mbar_arrive;
using fo::mbar_init;
using fo::mbar_wait;

constexpr int kGroups = 2;                // warpgroups per block
constexpr int kThreads = kGroups * 128;
constexpr int kBlockM = kGroups * 64;     // query rows per block
// Keys per tile, and blocks an SM holds: at D = 64 the softmax is half the
// work of a tile (as much exp2 per key, half the products), so two blocks of
// 64-key tiles (at most 128 registers a thread) share an SM and each block's
// softmax runs beside the other's products.
template <int D>
constexpr int kBlockN = D == 64 ? 64 : 128;
template <int D>
constexpr int kMinBlocks = D == 64 ? 2 : 1;
template <int D>
constexpr size_t kSmem = 1024 + static_cast<size_t>(kBlockM + 4 * kBlockN<D>) * D * 2 + 8 * 8;

// ---------------------------------------------------------------- the kernel

template <int D, bool kCausal, class T>
__global__ void __launch_bounds__(kThreads, kMinBlocks<D>) attn_fwd_wgmma_kernel(const fo_attn_params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int N = kBlockN<D>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T *sQ = reinterpret_cast<T *>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
  T *sK = sQ + kBlockM * D;  // two stages of [N, D]: K_j in stage j % 2
  T *sV = sK + 2 * N * D;    // likewise for V_j
  // Per stage: full (every thread's copies of the tile have landed: one
  // cp.async arrival a thread) and empty (every warp is done reading it).
  uint64_t *bars = reinterpret_cast<uint64_t *>(sV + 2 * N * D);
  uint64_t *fullK = bars, *fullV = bars + 2, *emptyK = bars + 4, *emptyV = bars + 6;

  const int wg = threadIdx.x / 128, warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
  const FwdBlock<T, kBlockM, N, kCausal> blk(p);
  const int64_t i0 = blk.i0;
  const T *k = blk.k, *v = blk.v;
  const int n_tiles = blk.n_tiles;
  const float scale2 = p.scale * kLog2e;

  if (threadIdx.x == 0) {
    for (int st = 0; st < 2; ++st) {
      mbar_init(&fullK[st], kThreads);
      mbar_init(&fullV[st], kThreads);
      mbar_init(&emptyK[st], kThreads / 32);
      mbar_init(&emptyV[st], kThreads / 32);
    }
  }
  __syncthreads();

  auto rows_of = [&](int j) { return static_cast<int>(imin(N, p.Sk - static_cast<int64_t>(j) * N)); };
  // Tile loads: every thread copies its share and arrives on the stage's
  // full barrier when its copies land. A stage is refilled once every warp
  // has released the tile two before (its empty barrier).
  // This thread's chunks of K_j and V_j: from its first chunk of tile 0, j tiles on.
  const Sw128Share<D, N, kThreads> share;
  const T *k_first = share.first(k, p.k_st.seq), *v_first = share.first(v, p.v_st.seq);
  const int64_t k_tile = N * p.k_st.seq, v_tile = N * p.v_st.seq;
  auto load_k = [&](int j) {
    if (j >= 2) mbar_wait(&emptyK[j & 1], ((j >> 1) + 1) & 1);
    share.copy(sK + (j & 1) * N * D, k_first + j * k_tile, p.k_st.seq, rows_of(j), k);
    mbar_arrive_cp_async(&fullK[j & 1]);
  };
  auto load_v = [&](int j) {
    if (j >= 2) mbar_wait(&emptyV[j & 1], ((j >> 1) + 1) & 1);
    share.copy(sV + (j & 1) * N * D, v_first + j * v_tile, p.v_st.seq, rows_of(j), v);
    mbar_arrive_cp_async(&fullV[j & 1]);
  };
  auto landed = [&](uint64_t *full, int j) {
    mbar_wait(&full[j & 1], (j >> 1) & 1);
    fence_proxy_async();
  };
  auto release = [&](uint64_t *empty, int j) {
    if (lane == 0) mbar_arrive(&empty[j & 1]);
  };
  // S = Q K_j^T, issued: k-step kk reads columns 16 kk.. of Q and K, 32
  // bytes into the 128-byte rows of column block kk / 4.
  const T *sQg = sQ + wg * 64 * 64;  // this warpgroup's rows (column block 0)
  // Descriptors of the tiles' starts; an offset of e elements inside a tile
  // adds e * 2 / 16 to the start-address field (no carry: shared addresses
  // stay below 256 KB).
  const uint64_t dQ = desc128(sQg, 16), dK0 = desc128(sK, 16);
  const uint64_t dV0 = desc128(sV, N * 64 * 2);
  auto issue_s = [&](float (&s)[N / 8][4], int j) {
    const uint64_t dK = dK0 + (j & 1) * (N * D / 8);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss<T, N, 0>(s, dQ + ((kk / 4) * kBlockM * 64 + (kk % 4) * 16) / 8,
                        dK + ((kk / 4) * N * 64 + (kk % 4) * 16) / 8, kk > 0);
  };

  float m[2], l[2], alpha[2];  // rows g and g + 8 of the warp: running max (log2 units), partial sums
  int row_l[2];                // block-local row
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
    row_l[r] = wg * 64 + warp * 16 + lane / 4 + 8 * r;
  }
  auto softmax = [&](float (&s)[N / 8][4], int j) {
    const int64_t j0 = static_cast<int64_t>(j) * N;
    const int k_rows = rows_of(j);
    const bool edge = k_rows < N || (kCausal && j0 + N - 1 > i0 + wg * 64);
    softmax_tile<N, kCausal, true>(s, m, l, alpha, row_l, edge, k_rows, static_cast<int>(j0 - i0), scale2);
  };

  float o[D / 8][4];  // this warpgroup's 64 x D output, mma C layout per warp
  zero(o);
  float s[N / 8][4];
  uint32_t pa[N / 16][4];  // P_j rounded to T: wgmma's A fragments, k-step kk = keys 16 kk..
  // O = alpha_j O + P_j V_j, issued: k-step kk = keys 16 kk.., rows 16 kk..
  // of V (2048 bytes into each column block); V N-major, its column blocks
  // N * 128 bytes apart.
  auto issue_pv = [&](int j) {
    scale_rows(o, alpha);
    const uint64_t dV = dV0 + (j & 1) * (N * D / 8);
    hold(o);
    hold(pa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk)
      wgmma_rs<T, D, 1>(o, pa[kk], dV + kk * 16 * 64 / 8, 1);
    wgmma_commit();
    hold(o);
  };

  // Pipeline. Step j issues S_{j+1} = Q K_{j+1}^T, then the loads of K_{j+2}
  // and V_{j+1}, then O += P_j V_j, and computes the softmax of S_{j+1}.
  // No barrier of the block: the two warpgroups drift apart, so that one's
  // softmax runs beside the other's products. Prologue: Q, K_0, V_0, K_1,
  // then S_0 and its softmax.
  load_tile_sw128<D, kBlockM, kThreads>(sQ, blk.q, p.q_st.seq, blk.q_rows);
  if (n_tiles > 0) load_k(0), load_v(0);
  if (n_tiles > 1) load_k(1);
  if (n_tiles > 0) {
    landed(fullK, 0);  // Q came with K_0
    wgmma_fence();
    issue_s(s, 0);
    wgmma_commit();
    wgmma_wait<0>();
    hold(s);
    release(emptyK, 0);
    softmax(s, 0);  // alpha = 0 times the zero output
    pack_a<T>(pa, s);
  }
  for (int j = 0; j + 1 < n_tiles; ++j) {
    landed(fullK, j + 1);
    hold(s);
    wgmma_fence();
    issue_s(s, j + 1);
    wgmma_commit();
    hold(s);
    if (j + 2 < n_tiles) load_k(j + 2);
    load_v(j + 1);
    landed(fullV, j);
    issue_pv(j);
    wgmma_wait<1>();  // S_{j+1}; P_j V_j may still run
    hold(s);
    release(emptyK, j + 1);
    softmax(s, j + 1);
    hold(s);
    wgmma_wait<0>();
    hold(o);
    hold(pa);
    release(emptyV, j);
    pack_a<T>(pa, s);
  }
  if (n_tiles > 0) {
    landed(fullV, n_tiles - 1);
    issue_pv(n_tiles - 1);
    wgmma_wait<0>();
    hold(o);
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) store_out_row<D, T>(p, blk, row_l[r], o, r, m[r], l[r]);
#endif
}

template <int D, bool kCausal, class T>
const char *launch(const fo_attn_params &p, cudaStream_t stream) {
  auto kernel = attn_fwd_wgmma_kernel<D, kCausal, T>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmem<D>) !=
      cudaSuccess)
    return fo::last_error();
  const dim3 grid(static_cast<unsigned>((p.Sq + kBlockM - 1) / kBlockM),
                  static_cast<unsigned>(p.B * p.Hq));
  kernel<<<grid, kThreads, kSmem<D>, stream>>>(p);
  return fo::last_error();
}

}  // namespace

extern "C" int fo_attn_wgmma_applies(const fo_attn_params *p) {
#ifndef FUSEDOPS_SM90A
  return 0;  // no sm_90a code in this build (setup.py defines it with arch 9.0a)
#endif
  if (p->D != 64 && p->D != 128) return 0;
  const char *e = getenv("FUSEDOPS_ATTN_WGMMA");
  if (e && e[0] == '0') return 0;
  return fo::compute_capability(fo::current_device()) == 90;  // the sm_90a cubin runs on 9.0 only
}

extern "C" const char *fo_attn_fwd_wgmma_cuda(const fo_attn_params *p, void *stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch_wgmma(*p, [&](auto d, auto causal, auto t) {
    return launch<decltype(d)::value, decltype(causal)::value, std::remove_pointer_t<decltype(t)>>(*p, s);
  });
}
