// Flash attention forward on the GPU (sm_80+): FlashAttention-2's algorithm
// with tensor-core mma.sync. Math, layout and masking: attention.h.
//
// v1 (this file). One block of 4 warps per (128-query tile, batch x q head);
// each warp owns 32 query rows as two stacked 16-row mma tiles, so that every
// K / V fragment read from shared memory (ldmatrix) feeds two mma (v0 gave a
// warp 16 rows: ~16 FLOP per shared byte, shared-memory bound at 0.6 of the
// SDPA flash backend). Q is loaded once (cp.async) and, at D <= 64, held in
// registers; at D = 128 it is re-read per key tile (the 32 x 128 output
// accumulators leave no room). K and V tiles (64 keys; 32 at D = 128, for
// registers) stream through shared memory with cp.async, V_j loading while
// S = Q K_j^T is computed and K_{j+1} while P V_j is. Scores, running max /
// sum and the output stay in fp32 registers; P is rounded to the input dtype
// and fed to the next mma straight from the accumulator layout. Shared rows
// are 16-byte chunks XOR-swizzled by row (conflict-free ldmatrix).
// Head dims 32, 64, 96, 128 and 256, bf16 and fp16, any window (causal
// included: key tiles outside a block's band are skipped), soft-capping,
// padded or varlen sequences, any Sq / Sk
// (zero-filled tail tiles, masked), grouped-query (kv head = h / (Hq / Hkv)),
// any 64-bit strides that are multiples of 8 elements on a 16-byte aligned
// base (the shim copies other inputs).
//
// FLOPs: 4 B Hq Sq Sk D (halved causal). Measured on the H100: docs/perf-notes.md
// (v0: 0.58-0.67 of SDPA's flash backend). Compile check: tools/ci/compile_cuda.sh "80 90".
#include "attention.h"
#include "../common/cuda_utils.cuh"
#include "attention_mma.cuh"

namespace {

using namespace fo_attn;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
// 16-row m-tiles a warp: two (32 query rows, 128 a block), or one at D = 256
// where 32 x 256 output accumulators would take 256 registers a thread.
template <int D>
constexpr int kMT = D <= 128 ? 2 : 1;
template <int D>
constexpr int kBlockM = kWarps * 16 * kMT<D>;
// Keys per tile: 64, or 32 at D = 128 where the 32 x 128 output accumulators
// leave no room for a 32 x 64 score tile (ptxas spilled it). At D = 256 a
// warp's 16 x 256 outputs take what 32 x 128 take at D = 128, and 64 keys'
// scores what 32 take there; shared memory: 96 KB, inside the 99 KB an
// sm_86 / sm_89 block may have.
template <int D, bool kGeneral>
constexpr int kBlockN = D <= 64 ? 64 : D == 96 ? (kGeneral ? 32 : 64) : D <= 128 ? 32 : 64;

// ---------------------------------------------------------------- the kernel
// kGeneral: windows, varlen and soft-capping read from p (FwdBlock); those
// instances re-read Q for every key tile, the registers going to their state.
template <int D, bool kBanded, bool kGeneral, class T>
__global__ void __launch_bounds__(kThreads) attn_fwd_kernel(const fo_attn_params p) {
  // Q fragments stay in registers at D = 64; at D = 128 they would push the
  // 32 x 128 output accumulators past 255 registers (at D = 256 the 16 x 256
  // ones), so they are re-read from shared memory for every key tile.
  constexpr bool kQRegs = D <= 64 && !kGeneral;
  constexpr int MT = kMT<D>, BM = kBlockM<D>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T *sQ = reinterpret_cast<T *>(smem_raw);
  T *sK = sQ + BM * D;
  T *sV = sK + kBlockN<D, kGeneral> * D;

  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;  // g: mma fragment row group
  const FwdBlock<T, BM, kBlockN<D, kGeneral>, kBanded, kGeneral> blk(p);
  if (blk.q_rows <= 0) return;  // past its sequence (varlen)
  constexpr int N = kBlockN<D, kGeneral>;
  // Soft-capped scores are scaled as uncapped ones (softcap_scores).
  const bool capped = kGeneral && p.softcap > 0.f;
  const float scale2 = p.scale * kLog2e;
  const T *k = blk.k, *v = blk.v;
  const int64_t i0 = blk.i0;
  const int n_tiles = blk.n_tiles;
  auto tile0 = [&](int j) { return static_cast<int64_t>(blk.j_first + j) * N; };
  auto rows_of = [&](int j) {  // keys of tile j (the padded layout's from p)
    if constexpr (kGeneral) return blk.k_rem - j * N < N ? blk.k_rem - j * N : N;
    else return static_cast<int>(imin(N, p.Sk - tile0(j)));
  };

  load_tile<D, kThreads>(sQ, blk.q, p.q_st.seq, BM, blk.q_rows);
  cp_async_commit();
  if (n_tiles > 0) load_tile<D, kThreads>(sK, k + tile0(0) * p.k_st.seq, p.k_st.seq, N, rows_of(0));
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  // This warp's rows: warp * 32 + 16 mt + g + 8 r (block-local).
  uint32_t qf[kQRegs ? D / 16 : 1][kQRegs ? MT : 1][4];
  if constexpr (kQRegs) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ld_a<D>(qf[kk][mt], sQ, warp * 16 * MT + 16 * mt, kk);
  }

  float o[MT][D / 8][4];  // output accumulators
  zero(o);
  float m[MT][2], l[MT][2];  // running max (log2 units), this thread's share of the sums
  int row_l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m[mt][r] = -INFINITY;
      l[mt][r] = 0.f;
      row_l[mt][r] = warp * 16 * MT + 16 * mt + g + 8 * r;
    }

  for (int j = 0; j < n_tiles; ++j) {
    const int64_t j0 = tile0(j);
    const int k_rows = rows_of(j), off = static_cast<int>(j0 - i0);
    load_tile<D, kThreads>(sV, v + j0 * p.v_st.seq, p.v_st.seq, N, k_rows);
    cp_async_commit();
    cp_async_wait<1>();  // K_j has landed (V_j may still be in flight)
    __syncthreads();

    float s[MT][N / 8][4];  // S = Q K_j^T
    zero(s);
    if constexpr (kQRegs)
      gemm_abt_reg<D, N>(s, qf, sK);
    else
      gemm_abt<D, N>(s, sQ, warp * 16 * MT, sK);
    __syncthreads();  // every warp is done with sK
    if (j + 1 < n_tiles) load_tile<D, kThreads>(sK, k + (j0 + N) * p.k_st.seq, p.k_st.seq, N, rows_of(j + 1));
    cp_async_commit();
    if (capped)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) softcap_scores(s[mt], p.scale, p.softcap);

    // Online softmax over this tile, the mask compiled only into the branch
    // for the tiles that need it (softmax_tile).
    auto softmax = [&](auto masked) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float alpha[2];
        softmax_tile_as<N, kBanded, false, decltype(masked)::value>(s[mt], m[mt], l[mt], alpha, row_l[mt], k_rows,
                                                                     off, blk.dlo, blk.dhi, scale2);
        scale_rows(o[mt], alpha);
      }
    };
    if (blk.edge(off, blk.k_rem - j * N, 0, BM))
      softmax(std::true_type{});
    else
      softmax(std::false_type{});

    cp_async_wait<1>();  // V_j has landed (K_{j+1} may still be in flight)
    __syncthreads();
    gemm_pb<D, N>(o, s, sV);  // O += P V_j, P straight from the S accumulators
    __syncthreads();  // every warp is done with sV before the next tile's load
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) store_out_row<D, T>(p, blk, row_l[mt][r], o[mt], r, m[mt][r], l[mt][r]);
}

template <int D, bool kBanded, bool kGeneral, class T>
const char *launch(const fo_attn_params &p, cudaStream_t stream) {
  constexpr size_t smem = (kBlockM<D> + 2 * kBlockN<D, kGeneral>) * D * sizeof(T);
  auto kernel = attn_fwd_kernel<D, kBanded, kGeneral, T>;
  if (fo::grant_smem(kernel, smem) != cudaSuccess) return fo::last_error();
  const dim3 grid(static_cast<unsigned>((p.Sq + kBlockM<D> - 1) / kBlockM<D>),
                  static_cast<unsigned>(p.B * p.Hq));
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return fo::last_error();
}

}  // namespace

extern "C" const char *fo_attn_fwd_cuda(const fo_attn_params *p, void *stream) {
  if (p->B * p->Hq == 0 || p->Sq == 0) return nullptr;
  if (p->B * p->Hq > 65535) return "fo_attn_fwd_cuda: batch x heads above 65535";
  // scale > 0: the wgmma forward takes the row max of the raw scores (softmax_tile's kFoldScale).
  if (p->wgmma && p->scale > 0.f) return fo_attn_fwd_wgmma_cuda(p, stream);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return fo_attn::dispatch(*p, [&](auto d, auto banded, auto t) {
    constexpr int kD = decltype(d)::value;
    constexpr bool kBanded = decltype(banded)::value;
    using T = std::remove_pointer_t<decltype(t)>;
    return fo_attn_general(p) ? launch<kD, kBanded, true, T>(*p, s) : launch<kD, kBanded, false, T>(*p, s);
  });
}
