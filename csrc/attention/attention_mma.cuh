// Tensor-core building blocks shared by the attention kernels
// (attention_fwd_cuda.cu, attention_bwd_cuda.cu): cp.async tile loads into
// XOR-swizzled shared memory, ldmatrix, mma.sync m16n8k16 with fp32
// accumulators, packing fp32 pairs to bf16 / fp16.
//
// Fragment layouts (PTX ISA, mma.m16n8k16, 16-bit A/B): a thread with lane
// = 4 g + t holds C/D elements (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1) of
// a 16x8 tile; the A fragment of a 16x16 tile is its four 8x8 quarters
// (rows 0-7 / 8-15 x cols 0-7 / 8-15, column-major over quarters) with the
// same (g, 2t) pairs. The C fragments of two adjacent 16x8 n-tiles are hence
// exactly the A fragment of one 16x16 k-step: a product's result feeds the
// next mma from registers.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <climits>

#include <type_traits>

#include "attention.h"
#include "../common/cuda_utils.cuh"

namespace fo_attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

// ---------------------------------------------------------------- PTX wrappers

using fo::smem_addr;

using fo::cp_async16;
using fo::cp_async_commit;
using fo::cp_async_wait;

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// c += a (16x16, row) * b (16x8, col), fp32 accumulators.
template <class T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ float exp2_approx(float x) {  // ex2.approx: 2 ulp; exp2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two floats rounded to T, packed as one 32-bit register (lo = a).
template <class T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  uint32_t r;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    r = *reinterpret_cast<uint32_t *>(&h);
  } else {
    __half2 h = __floats2half2_rn(a, b);
    r = *reinterpret_cast<uint32_t *>(&h);
  }
  return r;
}

// The fp32 accumulators of a warp's 16 x N tile (mma C layout), rounded to
// T, as the A fragments of N / 16 k-steps (a[kk]: columns 16 kk..): a
// product's result as the next product's A operand, without shared memory.
template <class T, int NT>
__device__ __forceinline__ void pack_a(uint32_t (&a)[NT / 2][4], const float (&c)[NT][4]) {
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    a[kk][0] = pack2<T>(c[2 * kk][0], c[2 * kk][1]);
    a[kk][1] = pack2<T>(c[2 * kk][2], c[2 * kk][3]);
    a[kk][2] = pack2<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[kk][3] = pack2<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
  }
}

// Element offset of 16-byte chunk c of row r in a [rows, D] shared tile,
// chunks XOR-swizzled so that the 8 row addresses of one ldmatrix (8
// consecutive rows, one chunk) land in 8 different 16-byte bank groups.
// D/8 chunks a row: a multiple of 8 (D = 64, 128) XORs by r mod 8; 4 or 12
// (D = 32, 96) start a row at bank group 4r mod 8, so (r >> 1) mod 4 on the
// low two chunk bits (staying inside the row) makes the 8 groups distinct.
template <int D>
__device__ __forceinline__ int swz(int r, int c) {
  constexpr int kChunks = D / 8;
  static_assert(kChunks % 4 == 0, "head dim: a multiple of 32");
  if constexpr (kChunks % 8 == 0)
    return r * D + ((c ^ (r & 7)) << 3);
  else
    return r * D + ((c ^ ((r >> 1) & 3)) << 3);
}

// rows x D tile from global (row i at base + i * row_stride) into shared,
// 16-byte cp.async per chunk; rows >= valid_rows are zero-filled.
template <int D, int kThreads, class T>
__device__ __forceinline__ void load_tile(T *sm, const T *base, int64_t row_stride, int rows,
                                          int valid_rows) {
  constexpr int kChunks = D / 8;
  for (int idx = threadIdx.x; idx < rows * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const bool ok = r < valid_rows;
    const T *src = ok ? base + r * row_stride + c * 8 : base;
    cp_async16(sm + swz<D>(r, c), src, ok);
  }
}

// ---------------------------------------------------------------- fragments and tile products
// Shared tiles are row-major [rows, D] and swizzled (swz). A warp's operands:
//   ld_a:       A fragment of rows r0..r0+15, k-step kk (columns 16kk..16kk+15).
//   ld_b:       B fragments of n-tiles n0..n0+7 and n0+8..n0+15, k-step kk, from a
//               tile whose rows are n (B^T: K in Q K^T).
//   ld_b_trans: B fragments of n-tiles 16dp..+7 and 16dp+8..+15 (columns of the
//               tile), k rows k0..k0+15 (B itself: V in P V).
template <int D, class T>
__device__ __forceinline__ void ld_a(uint32_t (&a)[4], const T *sm, int r0, int kk) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x4(a, sm + swz<D>(r0 + (lane & 15), kk * 2 + (lane >> 4)));
}
template <int D, class T>
__device__ __forceinline__ void ld_b(uint32_t (&b)[4], const T *sm, int n0, int kk) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x4(b, sm + swz<D>(n0 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
}
template <int D, class T>
__device__ __forceinline__ void ld_b_trans(uint32_t (&b)[4], const T *sm, int k0, int dp) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x4_trans(b, sm + swz<D>(k0 + (lane & 15), dp * 2 + (lane >> 4)));
}

template <int NT>
__device__ __forceinline__ void zero(float (&acc)[NT][4]) {
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
}
template <int MT, int NT>
__device__ __forceinline__ void zero(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) zero(acc[mt]);
}

// A warp's products on MT stacked 16-row tiles (rows r0 + 16 mt + ...): each
// B fragment read from shared memory feeds MT mma, so shared-memory traffic
// per FLOP falls as 1 / MT (at MT = 1 an SM cannot keep mma.sync busy).

// acc[mt] (16 x N) += a[mt] B for one k-step kk: a[mt] the A fragments of
// the step, B = the N rows of sB [N, D] (columns 16kk..16kk+15).
template <int D, int N, int MT, class T>
__device__ __forceinline__ void mma_kstep(float (&acc)[MT][N / 8][4], const uint32_t (&a)[MT][4],
                                          const T *sB, int kk) {
#pragma unroll
  for (int np = 0; np < N / 16; ++np) {
    uint32_t b[4];
    ld_b<D>(b, sB, np * 16, kk);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      mma16816<T>(acc[mt][2 * np], a[mt], b[0], b[1]);
      mma16816<T>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
    }
  }
}

// acc[mt] (16 x N) += A B^T: A = rows r0 + 16 mt .. + 15 of sA [.., D], B =
// the N rows of sB [N, D]. (S = Q K^T, dP = dO V^T and their transposes.)
template <int D, int N, int MT, class T>
__device__ __forceinline__ void gemm_abt(float (&acc)[MT][N / 8][4], const T *sA, int r0,
                                         const T *sB) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ld_a<D>(a[mt], sA, r0 + 16 * mt, kk);
    mma_kstep<D, N>(acc, a, sB, kk);
  }
}

// The same with A already in registers (a[kk][mt]: ld_a fragments).
template <int D, int N, int MT, class T>
__device__ __forceinline__ void gemm_abt_reg(float (&acc)[MT][N / 8][4],
                                             const uint32_t (&a)[D / 16][MT][4], const T *sB) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) mma_kstep<D, N>(acc, a[kk], sB, kk);
}

// acc[mt] (16 x 8 NT) += P[mt] B: P (16 x N) from fp32 accumulators (rounded
// to T), B = columns [16 dp0, 16 dp0 + 8 NT) of sB [N, D] (all of them: NT =
// D / 8, dp0 = 0). (O = P V, dV = P^T dO, dK = dS^T Q, dQ = dS K.)
template <int D, int N, int MT, int NT, class T>
__device__ __forceinline__ void gemm_pb(float (&acc)[MT][NT][4], const float (&pm)[MT][N / 8][4],
                                        const T *sB, int dp0 = 0) {
  static_assert(NT % 2 == 0 && NT <= D / 8, "gemm_pb: columns");
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      a[mt][0] = pack2<T>(pm[mt][2 * kk][0], pm[mt][2 * kk][1]);
      a[mt][1] = pack2<T>(pm[mt][2 * kk][2], pm[mt][2 * kk][3]);
      a[mt][2] = pack2<T>(pm[mt][2 * kk + 1][0], pm[mt][2 * kk + 1][1]);
      a[mt][3] = pack2<T>(pm[mt][2 * kk + 1][2], pm[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < NT / 2; ++dp) {
      uint32_t b[4];
      ld_b_trans<D>(b, sB, kk * 16, dp0 + dp);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma16816<T>(acc[mt][2 * dp], a[mt], b[0], b[1]);
        mma16816<T>(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// Row r (0: g, 1: g + 8) of a warp's 16 x 8 NT fp32 accumulator tile, times
// mul, rounded to T and stored to dst[0, 8 NT) as 32-bit element pairs.
template <int NT, class T>
__device__ __forceinline__ void store_row(T *dst, const float (&acc)[NT][4], int r, float mul) {
  const int tig = threadIdx.x & 3;
#pragma unroll
  for (int t = 0; t < NT; ++t)
    *reinterpret_cast<uint32_t *>(dst + t * 8 + tig * 2) =
        pack2<T>(acc[t][2 * r] * mul, acc[t][2 * r + 1] * mul);
}

// ---------------------------------------------------------------- the forward's pieces
// Shared by the forward kernels (attention_fwd_cuda.cu, mma.sync, and
// attention_fwd_wgmma_cuda.cu, Hopper).

// The sequence of batch entry b as the kernels see it (attention.h): its
// lengths, where its rows start in the tensors, and the band of key - query
// offsets its queries see. Addresses: base + bs * batch stride + (tok0 + row)
// * seq stride + head * head stride; bs = b in the padded layout and 0 in
// varlen, where the rows start at the cu_seqlens entries instead.
struct SeqView {
  static constexpr int64_t kFar = int64_t(1) << 40;  // an unbounded window side
  int64_t bs, q_tok, k_tok, sq, sk;
  int64_t dmin, dmax;  // key j is seen by query i iff dmin <= j - i <= dmax (and 0 <= j < sk)
  // varlen: p.cu_seqlens_q != nullptr, or a constant false where a kernel's
  // instance is for the padded layout only (the compiler drops the rest).
  // general = false: the band is causal's (for the instances of no mask or
  // a causal one, which read it only when causal), a constant.
  __device__ __forceinline__ SeqView(const fo_attn_params &p, int64_t b) : SeqView(p, b, p.cu_seqlens_q != nullptr) {}
  __device__ __forceinline__ SeqView(const fo_attn_params &p, int64_t b, bool varlen, bool general = true) {
    if (varlen) {
      bs = 0;
      q_tok = p.cu_seqlens_q[b];
      k_tok = p.cu_seqlens_k[b];
      sq = p.cu_seqlens_q[b + 1] - q_tok;
      sk = p.cu_seqlens_k[b + 1] - k_tok;
    } else {
      bs = b;
      q_tok = k_tok = 0;
      sq = p.Sq;
      sk = p.Sk;
    }
    const int64_t diag = varlen ? sk - sq : 0;
    dmin = general && p.window_left >= 0 ? diag - p.window_left : -kFar;
    dmax = !general ? 0 : p.window_right >= 0 ? diag + p.window_right : kFar;
  }
  // The keys [lo, hi) some query of rows [r0, r1) sees (lo >= hi: none).
  __device__ __forceinline__ int64_t keys_lo(int64_t r0) const { return r0 + dmin > 0 ? r0 + dmin : 0; }
  __device__ __forceinline__ int64_t keys_hi(int64_t r1) const { return imin(sk, r1 + dmax); }
  // The queries [lo, hi) that see some key of [j0, j1).
  __device__ __forceinline__ int64_t rows_lo(int64_t j0) const { return j0 - dmax > 0 ? j0 - dmax : 0; }
  __device__ __forceinline__ int64_t rows_hi(int64_t j1) const { return imin(sq, j1 - dmin); }
  // Whether every query of [r0, r1) sees every key of [j0, j1) that exists.
  __device__ __forceinline__ bool inside(int64_t r0, int64_t r1, int64_t j0, int64_t j1) const {
    return j1 - 1 - r0 <= dmax && j0 - (r1 - 1) >= dmin;
  }
  // The band as the element masks test it: kl + off - row against
  // [dlo, dhi], clamped into int (a sequence is shorter than 2^30).
  // general = false: an instance for no mask or causal only, whose band is
  // a constant the compiler folds into the tests (INT_MIN: no test).
  __device__ __forceinline__ int dlo(bool general = true) const {
    return general ? static_cast<int>(dmin < -(1 << 30) ? -(1 << 30) : dmin) : INT_MIN;
  }
  __device__ __forceinline__ int dhi(bool general = true) const {
    return general ? static_cast<int>(dmax > (1 << 30) ? (1 << 30) : dmax) : 0;
  }
};

// Block (blockIdx.x, blockIdx.y) of a forward grid: kBlockM query rows from
// i0 of (batch b, q head h), walking n_tiles key tiles of kBlockN from key
// j_first * kBlockN (kBanded: only the tiles the rows' band reaches; else
// all of them). q_rows <= 0: the block is past its sequence (varlen) and has
// nothing to do. Banded: the last query tiles see the most keys (causal);
// launching them first leaves light blocks, not heavy ones, for the tail.
// kGeneral: windows, varlen and soft-capping read from p; otherwise the
// block is of the padded layout with no mask or a causal one.
template <class T, int kBlockM, int kBlockN, bool kBanded, bool kGeneral_ = false>
struct FwdBlock {
  static constexpr bool kGeneral = kGeneral_;
  int64_t i0, b, h;
  const T *q, *k, *v;  // q at row i0; k, v at key 0 of kv head h / (Hq / Hkv)
  T *out;              // out at row i0
  float *lse;          // lse at row i0
  int q_rows, n_tiles, j_first;
  int k_rem;           // keys from the first tile's start to the sequence's end
  int dlo, dhi;        // the band (SeqView::dlo, dhi)
  __device__ __forceinline__ explicit FwdBlock(const fo_attn_params &p) {
    i0 = static_cast<int64_t>(kBanded ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * kBlockM;
    const int64_t bh = blockIdx.y, hk = bh % p.Hq / (p.Hq / p.Hkv);
    b = bh / p.Hq;
    h = bh % p.Hq;
    const SeqView seq(p, b, kGeneral && p.cu_seqlens_q != nullptr, kGeneral);
    q = static_cast<const T *>(p.q) + seq.bs * p.q_st.batch + h * p.q_st.head + (seq.q_tok + i0) * p.q_st.seq;
    k = static_cast<const T *>(p.k) + seq.bs * p.k_st.batch + hk * p.k_st.head + seq.k_tok * p.k_st.seq;
    v = static_cast<const T *>(p.v) + seq.bs * p.v_st.batch + hk * p.v_st.head + seq.k_tok * p.v_st.seq;
    out = static_cast<T *>(p.out) + seq.bs * p.out_st.batch + h * p.out_st.head + (seq.q_tok + i0) * p.out_st.seq;
    lse = p.lse + seq.bs * p.lse_st.batch + h * p.lse_st.head + (seq.q_tok + i0) * p.lse_st.seq;
    q_rows = static_cast<int>(imin(kBlockM, seq.sq - i0));
    const int64_t lo = kBanded ? seq.keys_lo(i0) : 0, hi = kBanded ? seq.keys_hi(i0 + q_rows) : seq.sk;
    j_first = static_cast<int>(lo / kBlockN);
    n_tiles = q_rows > 0 && hi > lo ? static_cast<int>((hi + kBlockN - 1) / kBlockN) - j_first : 0;
    k_rem = static_cast<int>(seq.sk - static_cast<int64_t>(j_first) * kBlockN);
    dlo = seq.dlo(kGeneral);
    dhi = seq.dhi(kGeneral);
  }
  // Whether a key tile needs the element mask for the block-local rows [r0,
  // r1): keys past the sequence (rem: keys from the tile's start to its
  // end), or (banded) a key - query offset outside the band (off = j0 - i0).
  __device__ __forceinline__ bool edge(int off, int rem, int r0, int r1) const {
    return rem < kBlockN || (kBanded && (off + kBlockN - 1 - r0 > dhi || (kGeneral && off - (r1 - 1) < dlo)));
  }
};

// 1 / d for d >= 1 by Newton's iteration on the FMA pipe: an integer seed
// (relative error < 0.11), then three steps (each squares the error) to
// within an ulp. Soft-capping's second special-function op (rcp beside its
// exp2 and the softmax's) would make the special-function unit the
// bottleneck of a tile's softmax.
__device__ __forceinline__ float rcp_newton(float d) {
  float r = __int_as_float(0x7EF311C3 - __float_as_int(d));
#pragma unroll
  for (int i = 0; i < 3; ++i) r = fmaf(r, fmaf(-d, r, 1.f), r);
  return r;
}

// tanh(x k) / k for |x k| <= 1, on the FMA pipe: x (1 + y^2 P(y^2)), y = x k,
// P the minimax fit of (tanh y - y) / y^3 on [0, 1] (degree 5 in y^2); the
// fp32 evaluation is within 2e-7 of tanh, relative (3 ulp).
__device__ __forceinline__ float tanh_small_over(float x, float k) {
  const float y = x * k, w = y * y;
  float q = 1.0582604e-3f;
  q = fmaf(q, w, -6.2593282e-3f);
  q = fmaf(q, w, 2.0359749e-2f);
  q = fmaf(q, w, -5.3498704e-2f);
  q = fmaf(q, w, 1.3326409e-1f);
  q = fmaf(q, w, -3.3332986e-1f);
  return fmaf(x * w, q, x);
}

// Scores s (a warp's accumulators) to u = tanh(s k) / k, k = scale / softcap,
// in place: the caller scales u as it scales uncapped scores, and scale u =
// softcap tanh(s scale / softcap) is the capped score. Where every |s k| of
// the warp is at most 1 (scaled scores within the cap: the usual case), the
// odd polynomial above, with no special-function op (the softmax's exp2 is
// the tile's one); else tanh(y) = 1 - 2 / (e^2y + 1) from ex2.approx and
// rcp_newton, accurate to a few ulp. (tanh.approx's 2^-11 would move a
// capped logit of 50 by 0.02.) The branch is warp-uniform.
template <int NT, int MR>
__device__ __forceinline__ void softcap_scores(float (&s)[NT][MR], float scale, float softcap) {
  const float k = scale / softcap;
  float amax = 0.f;  // (a NaN is skipped here and stays NaN in either branch)
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < MR; ++e) amax = fmaxf(amax, fabsf(s[t][e]));
  if (__all_sync(0xffffffffu, amax * fabsf(k) <= 1.f)) {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < MR; ++e) s[t][e] = tanh_small_over(s[t][e], k);
  } else {
    const float k2 = 2.f * kLog2e * k, inv_k = softcap / scale;
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < MR; ++e) {
        const float x = s[t][e] * k2;
        const float z = exp2_approx(x > 126.f ? 126.f : x);
        s[t][e] = inv_k * fmaf(-2.f, rcp_newton(z + 1.f), 1.f);
      }
  }
}

// The backward's factor d(capped score) / d(scaled score) = 1 - t^2, t =
// tanh, from the probability pe = exp2(capped log2 e - lse2) of the score
// (the capped score itself is not kept: registers); 0 where pe = 0, whose
// gradient is 0 anyway.
__device__ __forceinline__ float softcap_grad(float pe, float lse2, float softcap) {
  const float t = (__log2f(pe) + lse2) * (kLn2 / softcap);
  return pe > 0.f ? 1.f - t * t : 0.f;
}

// Online softmax over one key tile (keys j0.., k_rows of them valid) of a
// warp's 16-row S accumulators, rows g and g + 8 (block-local row_l): mask
// (keys past the sequence; banded: key - row outside [dlo, dhi], key - row
// = kl + off - row_l, off = j0 - i0)
// where edge says the tile needs it, new running max m (log2 units),
// p = exp2(s scale2 - m) in place, running sums l (this thread's share).
// alpha: the factor each row's output accumulators are to be multiplied by.
// kFoldScale (scale2 > 0 only): the max is taken on the raw scores and the
// scale goes into exp2's argument, one FFMA an element instead of a multiply
// and a subtraction. kEdge: the mask is compiled in (softmax_tile below picks).
template <int N, bool kBanded, bool kFoldScale, bool kEdge>
__device__ __forceinline__ void softmax_tile_as(float (&s)[N / 8][4], float (&m)[2], float (&l)[2],
                                                float (&alpha)[2], const int (&row_l)[2], int k_rows,
                                                int off, int dlo, int dhi, float scale2) {
  const int tig = threadIdx.x % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int t = 0; t < N / 8; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x = kFoldScale ? s[t][2 * r + e] : s[t][2 * r + e] * scale2;
        if constexpr (kEdge) {
          const int kl = t * 8 + tig * 2 + e;
          const int d = kl + off - row_l[r];
          if (kl >= k_rows || (kBanded && (d > dhi || d < dlo))) x = -INFINITY;
        }
        s[t][2 * r + e] = x;
        mx = fmaxf(mx, x);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[r], kFoldScale ? mx * scale2 : mx);
    const float shift = m_new == -INFINITY ? 0.f : m_new;  // nothing visible yet
    alpha[r] = exp2_approx(m[r] - shift);
    m[r] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int t = 0; t < N / 8; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = s[t][2 * r + e];
        const float pe = exp2_approx(kFoldScale ? fmaf(x, scale2, -shift) : x - shift);
        s[t][2 * r + e] = pe;
        sum += pe;
      }
    l[r] = l[r] * alpha[r] + sum;
  }
}

// The same, with the mask compiled only into the branch for tiles that need
// it (edge: warp-uniform). A runtime test inside the element loop was
// if-converted by nvcc: every tile computed the mask's predicates (the causal
// wgmma forward's loop at D = 64: 615 instructions against 485 without causal).
template <int N, bool kBanded, bool kFoldScale>
__device__ __forceinline__ void softmax_tile(float (&s)[N / 8][4], float (&m)[2], float (&l)[2],
                                             float (&alpha)[2], const int (&row_l)[2], bool edge,
                                             int k_rows, int off, int dlo, int dhi, float scale2) {
  if (edge)
    softmax_tile_as<N, kBanded, kFoldScale, true>(s, m, l, alpha, row_l, k_rows, off, dlo, dhi, scale2);
  else
    softmax_tile_as<N, kBanded, kFoldScale, false>(s, m, l, alpha, row_l, k_rows, off, dlo, dhi, scale2);
}

// Rows g and g + 8 of a warp's 16-row accumulator tile times alpha[0], alpha[1].
template <int NT>
__device__ __forceinline__ void scale_rows(float (&acc)[NT][4], const float (&alpha)[2]) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    acc[t][0] *= alpha[0];
    acc[t][1] *= alpha[0];
    acc[t][2] *= alpha[1];
    acc[t][3] *= alpha[1];
  }
}

// Row r (0: g, 1: g + 8) of a warp's 16 x D output tile o, block-local row
// row_l: out = o / l, lse = (m + log2 l) ln 2, l summed here over the row's
// four threads (every lane must call). Rows past the sequence are not stored. l = 0:
// no key seen (out 0, lse -inf); a NaN l stays NaN in out and lse, as in
// eager softmax (attention_cpu.c).
template <int D, class T, class Block>
__device__ __forceinline__ void store_out_row(const fo_attn_params &p, const Block &blk, int row_l,
                                              const float (&o)[D / 8][4], int r, float m, float l) {
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (row_l >= blk.q_rows) return;
  const float inv = l != 0.f ? 1.f / l : 0.f;
  // (The padded layout's addresses from p: fewer registers live across the loop.)
  const int64_t row = blk.i0 + row_l;
  T *out = Block::kGeneral ? blk.out + row_l * p.out_st.seq
                           : static_cast<T *>(p.out) + blk.b * p.out_st.batch + blk.h * p.out_st.head + row * p.out_st.seq;
  float *lse = Block::kGeneral ? blk.lse + row_l * p.lse_st.seq
                               : p.lse + blk.b * p.lse_st.batch + blk.h * p.lse_st.head + row * p.lse_st.seq;
  store_row(out, o, r, inv);
  if (threadIdx.x % 4 == 0) *lse = l != 0.f ? (m + __log2f(l)) * kLn2 : -INFINITY;
}

// ---------------------------------------------------------------- host dispatch

// Calls f(std::integral_constant<int, D>{}, std::bool_constant<banded>{}, (T *)nullptr)
// for p's head dim, whether a window side is bounded (fo_attn_banded: causal
// included) and dtype, the combinations the kernels are built for; an error
// message for any other.
template <class F>
const char *dispatch(const fo_attn_params &p, F &&f) {
  auto causal = [&](auto d, auto t) -> const char * {
    return fo_attn_banded(&p) ? f(d, std::true_type{}, t) : f(d, std::false_type{}, t);
  };
  auto dim = [&](auto t) -> const char * {
    switch (p.D) {
      case 32: return causal(std::integral_constant<int, 32>{}, t);
      case 64: return causal(std::integral_constant<int, 64>{}, t);
      case 96: return causal(std::integral_constant<int, 96>{}, t);
      case 128: return causal(std::integral_constant<int, 128>{}, t);
      case 256: return causal(std::integral_constant<int, 256>{}, t);
      default: return "fo_attn_cuda: head dim not built (32, 64, 96, 128 and 256 are)";
    }
  };
  switch (p.dtype) {
    case FO_BF16: return dim(static_cast<__nv_bfloat16 *>(nullptr));
    case FO_F16: return dim(static_cast<__half *>(nullptr));
    default: return "fo_attn_cuda: dtype not built (float16 and bfloat16 are)";
  }
}

}  // namespace fo_attn
