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
// and other GPUs take the mma.sync kernel; FUSEDOPS_ATTN_WGMMA=0 forces it,
// =1 this v0 kernel in place of the warp-specialised v1 below (for
// comparison; v1 also falls back to v0 where TMA cannot describe a layout).
// Windows beyond causal, soft-capping and varlen: v1 only (its kGeneral
// instances); where v1 cannot take such a call, the mma.sync kernel does
// (fo_attn_wgmma_applies).
// Measured: docs/perf-notes.md (forward v3, v4).
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
    softmax_tile<N, kCausal, true>(s, m, l, alpha, row_l, edge, k_rows, static_cast<int>(j0 - i0), blk.dlo,
                                   blk.dhi, scale2);
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

// ---------------------------------------------------------------- warp-specialised (v1)
// One producer warpgroup and kConsumers consumer warpgroups a block (a
// kBlockM-query tile of one (batch, q head); the grid of FwdBlock). The
// producer's first thread loads Q, then K_j, V_j into a ring of kStages
// stages with the tensor memory accelerator (TMA: one instruction a
// 64-column box, the 128-byte swizzle applied by the copy engine, rows past
// the tensor zero-filled); the full barriers count the bytes landed, the
// empty ones an arrival a consumer warp. The consumers run the pipeline of
// the v0 kernel above with no load instructions, and take turns to issue
// their products (named barriers kBarSched + w, round robin): one's softmax
// runs while another's products own the tensor cores. The producer gives its
// registers to the consumers (setmaxnreg).
// kGeneral instances (fo_attn_general: windows, soft-capping, varlen) walk
// only the key tiles of the block's band (FwdBlock: SeqView's rule), mask the
// tiles the band or the sequence's end cuts, cap the scores before the
// softmax. Varlen: the tensor maps cover the packed tensors, a sequence's
// tiles start at its cu_seqlens rows; rows a tile reads past its sequence
// (the next sequence's, or zeros past the tensor) are masked as keys and not
// stored as queries (store_out_row's predicated stores).
template <int D, bool kMasked>
struct WsConfig {
  // 64 query rows each. At head dim 64 a tile's products are half as long
  // against the same softmax: a third consumer keeps the tensor cores fed
  // (masked instances, causal or general, keep two: their masked branch does
  // not fit 160 registers).
  static constexpr int kConsumers = D == 64 && !kMasked ? 3 : 2;
  static constexpr int kThreads = (1 + kConsumers) * 128;
  static constexpr int kBlockM = kConsumers * 64;
  static constexpr int kBlockN = 128;
  static constexpr int kStages = 2;
  // (enumerators: the host pass, which sees no kernel body, warns of unused constants)
  enum : int { kProducerRegs = 24, kConsumerRegs = kConsumers == 2 ? 240 : 160 };
  enum : int { kBarSched = 1 };  // named barriers kBarSched + consumer
  static constexpr size_t smem() {
    return 1024 + static_cast<size_t>(kBlockM + 2 * kStages * kBlockN) * D * 2 + (1 + 4 * kStages) * 8;
  }
};

// kCausal: the band is bounded (fo_attn_banded; causal where not kGeneral).
template <int D, bool kCausal, bool kGeneral, class T>
__global__ void __launch_bounds__(WsConfig<D, kCausal || kGeneral>::kThreads, 1)
    attn_fwd_ws_kernel(const __grid_constant__ fo_attn_params p, const __grid_constant__ CUtensorMap tq,
                       const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = WsConfig<D, kCausal || kGeneral>;
  constexpr int N = C::kBlockN, S = C::kStages, M = C::kBlockM, K = C::kConsumers;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T *sQ = reinterpret_cast<T *>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
  T *sK = sQ + M * D;      // S stages of [N, D], D / 64 column blocks each
  T *sV = sK + S * N * D;  // likewise
  uint64_t *fullQ = reinterpret_cast<uint64_t *>(sV + S * N * D);
  uint64_t *fullK = fullQ + 1, *fullV = fullK + S, *emptyK = fullV + S, *emptyV = emptyK + S;

  const int wg = threadIdx.x / 128, warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
  const FwdBlock<T, M, N, kCausal, kGeneral> blk(p);
  if (kGeneral && blk.q_rows <= 0) return;  // past its sequence (varlen): the whole block
  const int n_tiles = blk.n_tiles;
  if (threadIdx.x == 0) {
    mbar_init(fullQ, 1);
    for (int st = 0; st < S; ++st) {
      mbar_init(&fullK[st], 1);
      mbar_init(&fullV[st], 1);
      mbar_init(&emptyK[st], K * 4);
      mbar_init(&emptyV[st], K * 4);
    }
    fence_mbar_init();
  }
  __syncthreads();

  if (wg == 0) {  // the producer
    regs_dec<C::kProducerRegs>();
    if (warp == 0 && lane == 0 && n_tiles > 0) {
      const int h = static_cast<int>(blk.h);
      const int hk = h / static_cast<int>(p.Hq / p.Hkv);
      // Tensor-map rows of the block's first query and first key tile, and its batch entry.
      int b = static_cast<int>(blk.b), q_row = static_cast<int>(blk.i0), k_row = 0;
      if constexpr (kGeneral) {
        const SeqView seq(p, blk.b);
        b = static_cast<int>(seq.bs);
        q_row += static_cast<int>(seq.q_tok);
        k_row = static_cast<int>(seq.k_tok) + blk.j_first * N;
      }
      mbar_expect_tx(fullQ, M * D * sizeof(T));
#pragma unroll
      for (int cb = 0; cb < D / 64; ++cb) tma_load_4d(sQ + cb * M * 64, &tq, fullQ, cb * 64, q_row, h, b);
      for (int j = 0; j < n_tiles; ++j) {
        const int st = j % S;
        const uint32_t phase = (j / S) & 1;
        if (j >= S) mbar_wait(&emptyK[st], phase ^ 1);  // tile j - S is released
        mbar_expect_tx(&fullK[st], N * D * sizeof(T));
#pragma unroll
        for (int cb = 0; cb < D / 64; ++cb)
          tma_load_4d(sK + st * N * D + cb * N * 64, &tk, &fullK[st], cb * 64, k_row + j * N, hk, b);
        if (j >= S) mbar_wait(&emptyV[st], phase ^ 1);
        mbar_expect_tx(&fullV[st], N * D * sizeof(T));
#pragma unroll
        for (int cb = 0; cb < D / 64; ++cb)
          tma_load_4d(sV + st * N * D + cb * N * 64, &tv, &fullV[st], cb * 64, k_row + j * N, hk, b);
      }
    }
    return;
  }

  regs_inc<C::kConsumerRegs>();
  const int cw = wg - 1;  // this consumer: query rows 64 cw.. of the block
  const int64_t i0 = blk.i0;
  // Soft-capped scores are scaled as uncapped ones (softcap_scores).
  const float scale2 = p.scale * kLog2e;
  const int off0 = blk.j_first * N - static_cast<int>(i0);  // kGeneral: key tile j_first's offset from row 0
  auto landed = [&](uint64_t *full, int j) { mbar_wait(&full[j % S], (j / S) & 1); };
  auto release = [&](uint64_t *empty, int j) {
    if (lane == 0) mbar_arrive(&empty[j % S]);
  };
  // Turns: a consumer issues its products between sched_wait and sched_pass,
  // then passes the turn to the next; consumer 0 takes the first, and the
  // last consumer's last turn passes to no one.
  auto sched_wait = [&] { named_sync<256>(C::kBarSched + cw); };
  auto sched_pass = [&] { named_arrive<256>(C::kBarSched + (cw + 1) % K); };

  const uint64_t dQ = desc128(sQ + cw * 64 * 64, 16), dK0 = desc128(sK, 16);
  const uint64_t dV0 = desc128(sV, N * 64 * 2);
  auto issue_s = [&](float (&s)[N / 8][4], int j) {
    const uint64_t dK = dK0 + (j % S) * (N * D / 8);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss<T, N, 0>(s, dQ + ((kk / 4) * M * 64 + (kk % 4) * 16) / 8,
                        dK + ((kk / 4) * N * 64 + (kk % 4) * 16) / 8, kk > 0);
  };

  float m[2], l[2], alpha[2];
  int row_l[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
    row_l[r] = cw * 64 + warp * 16 + lane / 4 + 8 * r;
  }
  // kGeneral: scores of a tile the band or the sequence's end cuts to -inf
  // where masked: key kl of the tile (off = its start - i0) is seen by
  // block-local row r iff kl < k_rows and dlo <= kl + off - r <= dhi (the
  // element test of softmax_tile_as, as bounds on kl a row).
  auto mask_band = [&](float (&s)[N / 8][4], const int (&row)[2], int k_rows, int off) {
    const int tig = threadIdx.x % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int lo = blk.dlo + row[r] - off - 2 * tig, d_hi = blk.dhi + row[r] - off + 1;
      const int hi = (d_hi < k_rows ? d_hi : k_rows) - 2 * tig;  // this thread's kl - 2 tig in [lo, hi)
#pragma unroll
      for (int t = 0; t < N / 8; ++t)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (t * 8 + e < lo || t * 8 + e >= hi) s[t][2 * r + e] = -INFINITY;
    }
  };
  auto softmax = [&](float (&s)[N / 8][4], int j) {
    if constexpr (kGeneral) {
      // Key tile j_first + j: rem keys from its start to the sequence's end.
      const int off = off0 + j * N, rem = blk.k_rem - j * N;
      if (p.softcap > 0.f) softcap_scores(s, p.scale, p.softcap);
      if (blk.edge(off, rem, cw * 64, cw * 64 + 64)) mask_band(s, row_l, rem < N ? rem : N, off);
      softmax_tile_as<N, kCausal, true, false>(s, m, l, alpha, row_l, N, off, blk.dlo, blk.dhi, scale2);
    } else {
      const int64_t j0 = static_cast<int64_t>(j) * N;
      const int k_rows = static_cast<int>(imin(N, p.Sk - j0));
      const bool edge = k_rows < N || (kCausal && j0 + N - 1 > i0 + cw * 64);
      softmax_tile<N, kCausal, true>(s, m, l, alpha, row_l, edge, k_rows, static_cast<int>(j0 - i0), blk.dlo,
                                     blk.dhi, scale2);
    }
  };

  float o[D / 8][4];
  zero(o);
  float s[N / 8][4];
  uint32_t pa[N / 16][4];
  auto issue_pv = [&](int j) {
    scale_rows(o, alpha);
    const uint64_t dV = dV0 + (j % S) * (N * D / 8);
    hold(o);
    hold(pa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) wgmma_rs<T, D, 1>(o, pa[kk], dV + kk * 16 * 64 / 8, 1);
    wgmma_commit();
    hold(o);
  };

  if (n_tiles > 0) {
    if (cw == K - 1) sched_pass();
    landed(fullQ, 0);
    landed(fullK, 0);
    sched_wait();
    wgmma_fence();
    issue_s(s, 0);
    wgmma_commit();
    sched_pass();
    wgmma_wait<0>();
    hold(s);
    release(emptyK, 0);
    softmax(s, 0);
    pack_a<T>(pa, s);
    for (int j = 0; j + 1 < n_tiles; ++j) {
      landed(fullK, j + 1);
      sched_wait();
      hold(s);
      wgmma_fence();
      issue_s(s, j + 1);
      wgmma_commit();
      hold(s);
      landed(fullV, j);
      issue_pv(j);
      sched_pass();
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
    landed(fullV, n_tiles - 1);
    sched_wait();
    issue_pv(n_tiles - 1);
    if (cw != K - 1) sched_pass();
    wgmma_wait<0>();
    hold(o);
  }

  // kGeneral: the block's addresses asked again (its out, lse pointers are
  // not kept live across the loop: registers).
  const FwdBlock<T, M, N, kCausal, kGeneral> fin = kGeneral ? FwdBlock<T, M, N, kCausal, kGeneral>(p) : blk;
#pragma unroll
  for (int r = 0; r < 2; ++r) store_out_row<D, T>(p, fin, row_l[r], o, r, m[r], l[r]);
#endif
}

template <int D, bool kCausal, bool kGeneral, class T>
const char *launch_ws(const fo_attn_params &p, const CUtensorMap (&maps)[3], cudaStream_t stream) {
  using C = WsConfig<D, kCausal || kGeneral>;
  auto kernel = attn_fwd_ws_kernel<D, kCausal, kGeneral, T>;
  if (fo::grant_smem(kernel, C::smem()) != cudaSuccess) return fo::last_error();
  const dim3 grid(static_cast<unsigned>((p.Sq + C::kBlockM - 1) / C::kBlockM), static_cast<unsigned>(p.B * p.Hq));
  kernel<<<grid, C::kThreads, C::smem(), stream>>>(p, maps[0], maps[1], maps[2]);
  return fo::last_error();
}

template <int D, bool kCausal, class T>
const char *launch(const fo_attn_params &p, cudaStream_t stream) {
  auto kernel = attn_fwd_wgmma_kernel<D, kCausal, T>;
  if (fo::grant_smem(kernel, kSmem<D>) != cudaSuccess) return fo::last_error();
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
  if (fo::compute_capability(fo::current_device()) != 90) return 0;  // the sm_90a cubin runs on 9.0 only
  // Windows other than causal, soft-capping and varlen: the warp-specialised
  // kernels alone carry them, so only where tensor maps describe every
  // operand the call's kernels read (dout: the backward); else the mma.sync kernels.
  if (fo_attn_general(p)) {
    CUtensorMap m;
    return ws_wanted() && operand_map(&m, *p, p->q, p->q_st, false, 64) &&
           operand_map(&m, *p, p->k, p->k_st, true, 64) && operand_map(&m, *p, p->v, p->v_st, true, 64) &&
           (p->dout == nullptr || operand_map(&m, *p, p->dout, p->dout_st, false, 64));
  }
  return 1;
}

extern "C" const char *fo_attn_fwd_wgmma_cuda(const fo_attn_params *p, void *stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  CUtensorMap maps[3];
  const bool general = fo_attn_general(p);
  // The query tile: three consumers' rows at head dim 64 with no mask, two otherwise (WsConfig).
  const int rows_m = p->D == 64 && !p->causal && !general ? WsConfig<64, false>::kBlockM : WsConfig<128, false>::kBlockM;
  if (ws_wanted() && p->Sk > 0 && operand_map(&maps[0], *p, p->q, p->q_st, false, rows_m) &&
      operand_map(&maps[1], *p, p->k, p->k_st, true, WsConfig<128, false>::kBlockN) &&
      operand_map(&maps[2], *p, p->v, p->v_st, true, WsConfig<128, false>::kBlockN))
    return dispatch_wgmma(*p, [&](auto d, auto causal, auto t) {
      constexpr int kD = decltype(d)::value;
      constexpr bool kCausal = decltype(causal)::value;
      using T = std::remove_pointer_t<decltype(t)>;
      return general ? launch_ws<kD, kCausal, true, T>(*p, maps, s) : launch_ws<kD, kCausal, false, T>(*p, maps, s);
    });
  if (general) return "fo_attn_fwd_wgmma_cuda: a masked call whose operands no tensor map describes";
  return dispatch_wgmma(*p, [&](auto d, auto causal, auto t) {
    return launch<decltype(d)::value, decltype(causal)::value, std::remove_pointer_t<decltype(t)>>(*p, s);
  });
}
