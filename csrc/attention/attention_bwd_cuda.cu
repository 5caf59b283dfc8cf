// Flash attention backward on the GPU (sm_80+): FlashAttention-2's algorithm
// with tensor-core mma.sync. Math, layout and masking: attention.h.
//
//  1. delta = rowsum(dout * out) in fp32 and lse2 = lse log2(e), D / 8
//     threads a row, into the workspace (which also zeroes the row's fp32 dQ
//     accumulator on the atomic paths).
//  2. dK, dV: one block of 4 warps per (key tile, batch x kv head); each warp
//     owns 16 MT keys (MT m-tiles, Cfg) and keeps their dK, dV in fp32
//     registers. The block walks every q head of its group and every query
//     tile that sees the keys (from the diagonal on when causal), in a fixed
//     order: Q and dO tiles (and their lse, delta) double-buffered through
//     shared memory with cp.async. Per pass of kSub queries, all in the
//     transposed (key-major) orientation so that each product stays in
//     registers:
//       S^T = K Q^T, P^T = exp2(S^T scale log2e - lse log2e), dV += P^T dO,
//       dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q.
//     Atomic dQ (v2, FA2's scheme; deterministic = 0 and D <= 64, where it
//     pays: fo_attn_bwd_cuda_atomic_dq): dS^T also goes to shared memory
//     and the block adds dQ += dS K for the pass into an fp32 accumulator
//     with atomics (the order of those additions varies between runs); a
//     last pass rounds dq = scale * acc to the dtype. Five tile products.
//  3. Otherwise no atomics: dQ by its own kernel instead, one block
//     per (query tile, batch x q head), 16 MT rows a warp, K/V tiles
//     double-buffered: S = Q K^T, P, dP = dO V^T, dS, dQ += dS K. Seven tile
//     products (S and dP computed in both kernels), bitwise repeatable.
// v0: every warp 16 rows, dQ kernel always; v1: 32 rows a warp at D = 64,
// where the accumulators leave room (at D = 128 they do not); v2: atomics.
// On Hopper (p->wgmma, fo_attn_wgmma_applies: D = 64 and 128 on a 9.0 GPU) step 2, dQ
// included unless deterministic, is attention_bwd_wgmma_cuda.cu instead.
// Head dims 32, 64, 96, 128 and 256, bf16 and fp16, any window (causal included),
// soft-capping, padded or varlen sequences, any Sq / Sk,
// grouped-query, 64-bit strides that are multiples of 8 elements on a
// 16-byte aligned base (the shim copies other inputs); dq, dk, dv are written
// dense by the shim's allocation (32-bit stores of element pairs).
//
// FLOPs: 2.5 x the forward's (five products). Measured on the H100:
// docs/perf-notes.md. Compile check: tools/ci/compile_cuda.sh "80 90".
#include "attention.h"
#include "../common/cuda_utils.cuh"
#include "attention_mma.cuh"

namespace {

using namespace fo_attn;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// Tile shapes by head dim. A warp owns MT stacked 16-row m-tiles of its
// kernel's accumulators (dK and dV; dQ): each B fragment read from shared
// memory then feeds MT mma. The fp32 accumulators bound MT and the tiles
// beside them (every shape here is the largest that ptxas kept out of local
// memory on sm_80 and sm_90): at D = 128 the dK, dV of 16 keys already take
// 128 registers, so MT = 1 there. At D = 256 they would take 256: a dK/dV
// block owns half the columns (kCols; gridDim.z = 2 halves), computing S^T
// and dP^T over all of D as the other half's block does (1.5x the FLOPs of
// one block for both). Tiles at D = 256 keep shared memory within the 99 KB
// an sm_86 / sm_89 block may have.
template <int D>
struct Cfg {
  static constexpr int kMTk = D <= 64 ? 2 : 1;      // dK/dV: key m-tiles per warp
  static constexpr int kKeys = kWarps * 16 * kMTk;  // keys per dK/dV block
  static constexpr int kCols = D <= 128 ? D : D / 2;  // dK/dV columns per block
  static constexpr int kQTile = D <= 128 ? 64 : 16; // query tile the dK/dV block streams
  static constexpr int kSub = D <= 64 ? 16 : D <= 128 ? 32 : 16;  // queries per pass over a query tile
  static constexpr int kSubDq = 16;                 // the same with dQ in the pass (atomic path)
  static constexpr int kSubUnroll = D <= 64 ? 1 : 2;  // passes unrolled (more spilled; 1 with dQ)
  static constexpr int kMTq = D <= 64 ? 2 : 1;      // dQ: query m-tiles per warp
  static constexpr int kRows = kWarps * 16 * kMTq;  // query rows per dQ block
  static constexpr int kKTile = D <= 64 ? 32 : D <= 128 ? 64 : 16;  // keys per dQ key tile
};

// ---------------------------------------------------------------- 1. delta
// A row of the padded scratch (fo_attn_bwd_rows a (batch, q head)) to a
// group of kRowThreads threads, a power of two >= D / 8: thread c of the
// group takes elements 8c..8c+7 (16-byte loads and stores).
constexpr int kRowBlock = 256;
template <int D>
constexpr int kRowThreads = D <= 32 ? 4 : D <= 64 ? 8 : D <= 128 ? 16 : 32;
template <int D>
__device__ __forceinline__ int64_t group_row() {
  return static_cast<int64_t>(blockIdx.x) * (kRowBlock / kRowThreads<D>) + threadIdx.x / kRowThreads<D>;
}
template <int D>
unsigned row_blocks(int64_t rows) {
  constexpr int kRows = kRowBlock / kRowThreads<D>;
  return static_cast<unsigned>((rows + kRows - 1) / kRows);
}

// delta = rowsum(dout * out), lse2 = lse log2(e), and zeroes the row's D
// floats of the fp32 dQ accumulator when there is one (dq_acc). Padding
// rows: delta 0, lse2 +inf.
template <int D, class T>
__global__ void __launch_bounds__(kRowBlock) attn_bwd_delta_kernel(const fo_attn_params p, float *delta,
                                                                   float *lse2, float *dq_acc) {
  constexpr int kG = kRowThreads<D>;
  const int c = threadIdx.x % kG;
  const int64_t rows = fo_attn_bwd_rows(&p), row = group_row<D>();
  const bool valid = row < p.B * p.Hq * rows;  // no early return: the group's shuffles need every lane
  const int64_t i = row % rows, bh = row / rows, b = bh / p.Hq, h = bh % p.Hq;
  const SeqView seq(p, valid ? b : 0);
  const int64_t tok = seq.q_tok + i;
  const bool live = valid && i < seq.sq;
  float acc = 0.f;
  if (live && c < D / 8) {
    float x[8], y[8];
    fo::load_f<8>(static_cast<const T *>(p.out) + seq.bs * p.out_st.batch + h * p.out_st.head + tok * p.out_st.seq + 8 * c, x);
    fo::load_f<8>(static_cast<const T *>(p.dout) + seq.bs * p.dout_st.batch + h * p.dout_st.head + tok * p.dout_st.seq + 8 * c, y);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = fmaf(x[e], y[e], acc);
  }
#pragma unroll
  for (int off = kG / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (!valid) return;
  if (dq_acc != nullptr && c < D / 8) {
    float4 *z = reinterpret_cast<float4 *>(dq_acc + row * D + 8 * c);
    z[0] = z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (c == 0) {
    // A row that saw no key (lse -inf) contributes nothing, as a padding row.
    const float l = live ? p.lse[seq.bs * p.lse_st.batch + h * p.lse_st.head + tok * p.lse_st.seq] : -INFINITY;
    delta[row] = acc;  // row = (b Hq + h) rows + i
    lse2[row] = l == -INFINITY ? INFINITY : l * kLog2e;
  }
}

// dq = scale * dq_acc, rounded to T (the mma.sync atomic path's last step).
template <int D, class T>
__global__ void __launch_bounds__(kRowBlock) attn_bwd_dq_convert_kernel(const fo_attn_params p,
                                                                        const float *dq_acc) {
  const int c = threadIdx.x % kRowThreads<D>;
  const int64_t rows = fo_attn_bwd_rows(&p), row = group_row<D>();
  if (row >= p.B * p.Hq * rows || c >= D / 8) return;
  const int64_t i = row % rows, bh = row / rows, b = bh / p.Hq, h = bh % p.Hq;
  const SeqView seq(p, b);
  if (i >= seq.sq) return;
  const float4 *src = reinterpret_cast<const float4 *>(dq_acc + row * D + 8 * c);
  const float4 lo = src[0], hi = src[1];
  const float x[8] = {lo.x * p.scale, lo.y * p.scale, lo.z * p.scale, lo.w * p.scale,
                      hi.x * p.scale, hi.y * p.scale, hi.z * p.scale, hi.w * p.scale};
  fo::store_f<8>(static_cast<T *>(p.dq) + seq.bs * p.dq_st.batch + h * p.dq_st.head + (seq.q_tok + i) * p.dq_st.seq + 8 * c, x);
}

// ---------------------------------------------------------------- 2. dK, dV
// dS^T of one pass in shared memory, [keys][kSub queries] as T: 16-byte
// chunks XOR-swizzled so that the 8 rows an ldmatrix reads (and the 8 rows a
// warp's stores hit) fall in 8 different bank groups.
template <int kSub>
__device__ __forceinline__ int ds_swz(int r, int c) {
  constexpr int kC = kSub / 8, kRowsPerLine = 8 / kC;
  return r * kSub + ((c ^ ((r / kRowsPerLine) % kC)) << 3);
}

// dq_acc[q0 + .., :] += dS (kSub queries x kKeys) K (kKeys x D), fp32 atomics;
// dS^T from sds ([kKeys][kSub], ds_swz), K from sK. Warp w takes columns
// [w kDW, (w + 1) kDW) for all kSub queries. acc: this pass's first row.
template <int D, int kKeys, int kSub, class T>
__device__ __forceinline__ void dq_part(const T *sds, const T *sK, int64_t q0, int64_t Sq,
                                        float *acc) {
  // Columns a warp: a quarter of D, at least one ldmatrix's 16 (D = 32: two
  // warps do the pass's dQ, two wait at the next barrier).
  constexpr int kDW = D / kWarps >= 16 ? D / kWarps : 16;
  static_assert(kDW % 16 == 0 && D % kDW == 0, "dq_part: head dim");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tig = lane % 4;
  if (warp >= D / kDW) return;
  // One 16-query m-tile at a time: 16 kDW / 32 accumulators a thread (beside
  // the dK, dV ones; two m-tiles at once spilled at D = 128).
#pragma unroll
  for (int mt = 0; mt < kSub / 16; ++mt) {
    float dq[kDW / 8][4];
    zero(dq);
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      // A = dS: rows queries, k keys; stored transposed, so ldmatrix.trans with
      // matrix i at keys 16kk + 8(i >> 1), queries 16mt + 8(i & 1).
      uint32_t a[4];
      ldmatrix_x4_trans(a, sds + ds_swz<kSub>(kk * 16 + (lane & 7) + ((lane >> 4) << 3),
                                              2 * mt + ((lane >> 3) & 1)));
#pragma unroll
      for (int dp = 0; dp < kDW / 16; ++dp) {
        uint32_t bf[4];
        ld_b_trans<D>(bf, sK, kk * 16, warp * (kDW / 16) + dp);
        mma16816<T>(dq[2 * dp], a, bf[0], bf[1]);
        mma16816<T>(dq[2 * dp + 1], a, bf[2], bf[3]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int ql = 16 * mt + g + 8 * r;
      if (q0 + ql >= Sq) continue;
#pragma unroll
      for (int nt = 0; nt < kDW / 8; ++nt) {
        float *dst = acc + static_cast<int64_t>(ql) * D + warp * kDW + nt * 8 + tig * 2;
#if __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float2 *>(dst), make_float2(dq[nt][2 * r], dq[nt][2 * r + 1]));
#else
        atomicAdd(dst, dq[nt][2 * r]);
        atomicAdd(dst + 1, dq[nt][2 * r + 1]);
#endif
      }
    }
  }
}

// kDq: also dQ, by fp32 atomics into dq_acc (FA2's scheme: five tile products
// in all, but the order of the additions varies from run to run).
// kGeneral: windows, varlen and soft-capping are read from p; otherwise the
// instance is for the padded layout, no mask or causal only, no
// soft-capping (their state would cost those registers), and
// passes of kSub queries (kGeneral: kSubDq's fewer, for the same reason).
template <int D, bool kBanded, bool kDq, bool kGeneral, class T>
__global__ void __launch_bounds__(kThreads) attn_bwd_dkdv_kernel(const fo_attn_params p,
                                                                 const float *delta, const float *lse2,
                                                                 float *dq_acc, int64_t rows) {
  using C = Cfg<D>;
  constexpr int MT = C::kMTk, kKeys = C::kKeys, kQTile = C::kQTile;
  constexpr int kSub = kDq || kGeneral ? C::kSubDq : C::kSub, kCols = C::kCols;
  static_assert(!kDq || kCols == D, "attn_bwd_dkdv_kernel: dQ in the pass needs all of D");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T *sK = reinterpret_cast<T *>(smem_raw);
  T *sV = sK + kKeys * D;
  T *sQ = sV + kKeys * D;         // [2][kQTile * D]
  T *sdO = sQ + 2 * kQTile * D;   // [2][kQTile * D]
  float *sL = reinterpret_cast<float *>(sdO + 2 * kQTile * D);  // [2][kQTile]: lse log2e
  float *sDl = sL + 2 * kQTile;                                  // [2][kQTile]: delta
  T *sdS = reinterpret_cast<T *>(sDl + 2 * kQTile);  // kDq: [2][kKeys * kSub], dS^T of a pass

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tig = lane % 4;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kKeys;
  const int64_t bh = blockIdx.y, b = bh / p.Hkv, hk = bh % p.Hkv;
  // kGeneral: the sequence's values the item loop needs, in 32-bit registers
  // (lengths and token offsets fit: attention.h); the stores at the end ask
  // again. Otherwise the padded layout's, from p.
  int bs = 0, q_tok = 0, sq = 0, k_rows, dlo = 0, dhi = 0;
  int64_t m_first, m_tiles;
  const T *k, *v;
  if constexpr (kGeneral) {
    const SeqView seq(p, b);
    if (j0 >= seq.sk) return;  // past its sequence (varlen)
    bs = static_cast<int>(seq.bs);
    q_tok = static_cast<int>(seq.q_tok);
    sq = static_cast<int>(seq.sq);
    k_rows = static_cast<int>(imin(kKeys, seq.sk - j0));
    dlo = seq.dlo();
    dhi = seq.dhi();
    // Banded: only the query tiles that see a key of this block.
    const int64_t r_lo = kBanded ? seq.rows_lo(j0) : 0, r_hi = kBanded ? seq.rows_hi(j0 + k_rows) : seq.sq;
    m_first = r_lo / kQTile;
    m_tiles = r_hi > r_lo ? (r_hi + kQTile - 1) / kQTile : m_first;
    k = static_cast<const T *>(p.k) + seq.bs * p.k_st.batch + hk * p.k_st.head + (seq.k_tok + j0) * p.k_st.seq;
    v = static_cast<const T *>(p.v) + seq.bs * p.v_st.batch + hk * p.v_st.head + (seq.k_tok + j0) * p.v_st.seq;
  } else {
    k = static_cast<const T *>(p.k) + b * p.k_st.batch + hk * p.k_st.head + j0 * p.k_st.seq;
    v = static_cast<const T *>(p.v) + b * p.v_st.batch + hk * p.v_st.head + j0 * p.v_st.seq;
    k_rows = static_cast<int>(imin(kKeys, p.Sk - j0));
    m_first = kBanded ? j0 / kQTile : 0;  // causal: the first tile with a query >= j0
    m_tiles = (p.Sq + kQTile - 1) / kQTile;
  }
  // This block's dK, dV columns: [c0, c0 + kCols) (a constant 0 where it has all).
  const int c0 = kCols == D ? 0 : static_cast<int>(blockIdx.z) * kCols;
  const int64_t group = p.Hq / p.Hkv;
  // Soft-capped scores are scaled as uncapped ones (softcap_scores).
  const bool capped = kGeneral && p.softcap > 0.f;
  const float scale2 = p.scale * kLog2e;
  auto seq_len = [&]() -> int64_t { return kGeneral ? sq : p.Sq; };
  auto batch_of = [&]() -> int64_t { return kGeneral ? bs : b; };  // the batch index of the strides

  load_tile<D, kThreads>(sK, k, p.k_st.seq, kKeys, k_rows);
  load_tile<D, kThreads>(sV, v, p.v_st.seq, kKeys, k_rows);
  cp_async_commit();

  // Work items: (q head of the group, query tile), heads outer, in order.
  const int64_t n_m = m_tiles > m_first ? m_tiles - m_first : 0;
  const int64_t n_items = group * n_m;

  auto item_m0 = [&](int64_t it) { return (m_first + it % n_m) * kQTile; };
  auto item_h = [&](int64_t it) { return hk * group + it / n_m; };
  auto prefetch = [&](int64_t it, int stage) {
    const int64_t h = item_h(it), m0 = item_m0(it);
    const int q_rows = static_cast<int>(imin(kQTile, seq_len() - m0));
    const T *q = static_cast<const T *>(p.q) + batch_of() * p.q_st.batch + h * p.q_st.head + (q_tok + m0) * p.q_st.seq;
    const T *dout = static_cast<const T *>(p.dout) + batch_of() * p.dout_st.batch + h * p.dout_st.head +
                    (q_tok + m0) * p.dout_st.seq;
    load_tile<D, kThreads>(sQ + stage * kQTile * D, q, p.q_st.seq, kQTile, q_rows);
    load_tile<D, kThreads>(sdO + stage * kQTile * D, dout, p.dout_st.seq, kQTile, q_rows);
    // Rows past the sequence: lse2 +inf makes P = 0, delta 0 keeps dS = 0
    // (their Q, dO are zeros); so do the delta kernel's padding rows.
    for (int r = threadIdx.x; r < kQTile; r += kThreads) {
      const bool ok = r < q_rows;
      const float l2 = kGeneral ? lse2[(b * p.Hq + h) * rows + m0 + r]
                                : p.lse[b * p.lse_st.batch + h * p.lse_st.head + (m0 + r) * p.lse_st.seq] * kLog2e;
      sL[stage * kQTile + r] = ok ? l2 : INFINITY;
      sDl[stage * kQTile + r] = ok ? delta[(b * p.Hq + h) * rows + m0 + r] : 0.f;
    }
  };
  if (n_items > 0) prefetch(0, 0);
  cp_async_commit();

  float dk[MT][kCols / 8][4], dv[MT][kCols / 8][4];
  zero(dk);
  zero(dv);
  const int key0 = warp * 16 * MT;  // this warp's first key, from j0
  int key_l[MT][2];                 // this thread's keys, from j0
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) key_l[mt][r] = key0 + 16 * mt + g + 8 * r;

  int pass = 0;  // passes so far: kDq alternates the two dS^T buffers
  for (int64_t it = 0; it < n_items; ++it) {
    const int stage = static_cast<int>(it & 1);
    if (it + 1 < n_items) prefetch(it + 1, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();  // item it (and K, V) have landed
    __syncthreads();
    const int64_t m0 = item_m0(it), h = item_h(it);
    // The query tile in passes of kSub queries: the S^T and dP^T of a whole
    // tile beside the dK, dV accumulators would pass 255 registers.
#pragma unroll (kDq || kGeneral ? 1 : C::kSubUnroll)
    for (int sub = 0; sub < kQTile / kSub; ++sub) {
      const int64_t q0 = m0 + sub * kSub;
      if (q0 >= seq_len()) break;  // a tail tile's empty part (the same for every thread)
      const T *q_s = sQ + (stage * kQTile + sub * kSub) * D;  // 8-row aligned: same swizzle
      const T *do_s = sdO + (stage * kQTile + sub * kSub) * D;
      const float *l_s = sL + stage * kQTile + sub * kSub, *dl_s = sDl + stage * kQTile + sub * kSub;

      float pt[MT][kSub / 8][4];  // S^T, then P^T: this warp's keys x kSub queries
      zero(pt);
      gemm_abt<D, kSub>(pt, sK, key0, q_s);
      if (capped)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) softcap_scores(pt[mt], p.scale, p.softcap);
      // Banded: key j0 + kl is masked for query q0 + ql when kl + (j0 - q0) - ql
      // is outside [dlo, dhi]. (A branch without the mask for the passes
      // inside the band, as in softmax_tile, made the causal kernel with dQ
      // spill: kept predicated.)
      const int off = static_cast<int>(j0 - q0);
      const bool diag = kBanded && (kGeneral ? off + kKeys - 1 > dhi || off - (kSub - 1) < dlo : j0 + kKeys - 1 > q0);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < kSub / 8; ++t)
#pragma unroll
          for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int ql = t * 8 + tig * 2 + e;
              float x = pt[mt][t][2 * r + e] * scale2 - l_s[ql];
              const int d = key_l[mt][r] + off - ql;
              if (diag && (kGeneral ? d > dhi || d < dlo : d > 0)) x = -INFINITY;
              pt[mt][t][2 * r + e] = exp2_approx(x);
            }
      gemm_pb<D, kSub>(dv, pt, do_s, c0 / 16);  // dV += P^T dO

      float ds[MT][kSub / 8][4];  // dP^T, then dS^T
      zero(ds);
      gemm_abt<D, kSub>(ds, sV, key0, do_s);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < kSub / 8; ++t)
#pragma unroll
          for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int ql = t * 8 + tig * 2 + e;
              const float pe = pt[mt][t][2 * r + e];
              ds[mt][t][2 * r + e] = pe * (ds[mt][t][2 * r + e] - dl_s[ql]) *
                                     (capped ? softcap_grad(pe, l_s[ql], p.softcap) : 1.f);
            }
      if constexpr (kDq) {
        T *sds = sdS + (pass & 1) * kKeys * kSub;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int t = 0; t < kSub / 8; ++t)
#pragma unroll
            for (int r = 0; r < 2; ++r)
              *reinterpret_cast<uint32_t *>(sds + ds_swz<kSub>(key_l[mt][r], t) + tig * 2) =
                  pack2<T>(ds[mt][t][2 * r], ds[mt][t][2 * r + 1]);
      }
      gemm_pb<D, kSub>(dk, ds, q_s, c0 / 16);  // dK += dS^T Q (scaled at the store)
      if constexpr (kDq) {
        // The buffer written two passes ago was last read before the barrier
        // of the previous pass: one barrier a pass orders both.
        __syncthreads();
        dq_part<D, kKeys, kSub>(sdS + (pass & 1) * kKeys * kSub, sK, q0, seq_len(),
                                dq_acc + ((b * p.Hq + h) * rows + q0) * D);
        ++pass;
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  cp_async_wait<0>();

  // Keys that no query sees (outside every query's band) get zeros: dk, dv are still 0.
  const SeqView seq(p, b, kGeneral && p.cu_seqlens_q != nullptr, kGeneral);  // (padded: from p)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t key = j0 + key_l[mt][r];
      if (key >= seq.sk) continue;
      const int64_t tok = seq.k_tok + key;
      T *dkp = static_cast<T *>(p.dk) + seq.bs * p.dk_st.batch + hk * p.dk_st.head + tok * p.dk_st.seq + c0;
      T *dvp = static_cast<T *>(p.dv) + seq.bs * p.dv_st.batch + hk * p.dv_st.head + tok * p.dv_st.seq + c0;
      store_row(dkp, dk[mt], r, p.scale);
      store_row(dvp, dv[mt], r, 1.f);
    }
}

// ---------------------------------------------------------------- 3. dQ
// kGeneral as for the dK, dV kernel.
template <int D, bool kBanded, bool kGeneral, class T>
__global__ void __launch_bounds__(kThreads) attn_bwd_dq_kernel(const fo_attn_params p, const float *delta,
                                                               const float *lse2, int64_t rows) {
  using C = Cfg<D>;
  constexpr int MT = C::kMTq, kRows = C::kRows, kKTile = C::kKTile;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T *sQ = reinterpret_cast<T *>(smem_raw);
  T *sdO = sQ + kRows * D;
  T *sK = sdO + kRows * D;       // [2][kKTile * D]
  T *sV = sK + 2 * kKTile * D;   // [2][kKTile * D]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tig = lane % 4;
  // Banded: heavy (late) query tiles first, as in the forward.
  const int64_t i0 = static_cast<int64_t>(kBanded ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * kRows;
  const int64_t bh = blockIdx.y, b = bh / p.Hq, h = bh % p.Hq;
  const int64_t hk = h / (p.Hq / p.Hkv);
  const SeqView seq(p, b, kGeneral && p.cu_seqlens_q != nullptr, kGeneral);
  if (i0 >= seq.sq) return;  // past its sequence (varlen)
  const bool capped = kGeneral && p.softcap > 0.f;  // scaled as uncapped scores (softcap_scores)
  const float scale2 = p.scale * kLog2e;
  const int dlo = seq.dlo(kGeneral), dhi = seq.dhi(kGeneral);

  const T *q = static_cast<const T *>(p.q) + seq.bs * p.q_st.batch + h * p.q_st.head + (seq.q_tok + i0) * p.q_st.seq;
  const T *dout = static_cast<const T *>(p.dout) + seq.bs * p.dout_st.batch + h * p.dout_st.head +
                  (seq.q_tok + i0) * p.dout_st.seq;
  const T *k = static_cast<const T *>(p.k) + seq.bs * p.k_st.batch + hk * p.k_st.head + seq.k_tok * p.k_st.seq;
  const T *v = static_cast<const T *>(p.v) + seq.bs * p.v_st.batch + hk * p.v_st.head + seq.k_tok * p.v_st.seq;
  const int q_rows = static_cast<int>(imin(kRows, seq.sq - i0));
  const int64_t klo = kBanded ? seq.keys_lo(i0) : 0, khi = kBanded ? seq.keys_hi(i0 + q_rows) : seq.sk;
  const int j_first = static_cast<int>(klo / kKTile);
  const int n_tiles = khi > klo ? static_cast<int>((khi + kKTile - 1) / kKTile) - j_first : 0;

  load_tile<D, kThreads>(sQ, q, p.q_st.seq, kRows, q_rows);
  load_tile<D, kThreads>(sdO, dout, p.dout_st.seq, kRows, q_rows);
  cp_async_commit();
  auto prefetch = [&](int j, int stage) {
    const int64_t j0 = static_cast<int64_t>(j_first + j) * kKTile;
    const int rows = static_cast<int>(imin(kKTile, seq.sk - j0));
    load_tile<D, kThreads>(sK + stage * kKTile * D, k + j0 * p.k_st.seq, p.k_st.seq, kKTile, rows);
    load_tile<D, kThreads>(sV + stage * kKTile * D, v + j0 * p.v_st.seq, p.v_st.seq, kKTile, rows);
  };
  if (n_tiles > 0) prefetch(0, 0);
  cp_async_commit();

  // This thread's rows (warp * 16 MT + 16 mt + g + 8 r): lse2 and delta, as
  // the delta kernel wrote them; rows past the sequence get lse2 +inf (P = 0)
  // and delta 0, and are not stored.
  const int row0 = warp * 16 * MT;
  int row_l[MT][2];
  float l2[MT][2], dl[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_l[mt][r] = row0 + 16 * mt + g + 8 * r;
      const int64_t i = i0 + row_l[mt][r];
      const bool ok = i < seq.sq;
      const float l = kGeneral ? lse2[(b * p.Hq + h) * rows + i]
                               : p.lse[b * p.lse_st.batch + h * p.lse_st.head + i * p.lse_st.seq] * kLog2e;
      l2[mt][r] = ok ? l : INFINITY;
      dl[mt][r] = ok ? delta[(b * p.Hq + h) * rows + i] : 0.f;
    }

  float dq[MT][D / 8][4];
  zero(dq);
  for (int j = 0; j < n_tiles; ++j) {
    const int stage = j & 1;
    if (j + 1 < n_tiles) prefetch(j + 1, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();  // Q, dO and tile j have landed
    __syncthreads();
    const T *k_s = sK + stage * kKTile * D, *v_s = sV + stage * kKTile * D;
    const int64_t j0 = static_cast<int64_t>(j_first + j) * kKTile;

    float s[MT][kKTile / 8][4];  // S, then P: this warp's queries x kKTile keys
    zero(s);
    gemm_abt<D, kKTile>(s, sQ, row0, k_s);
    if (capped)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) softcap_scores(s[mt], p.scale, p.softcap);
    float ds[MT][kKTile / 8][4];  // dP, then dS
    zero(ds);
    gemm_abt<D, kKTile>(ds, sdO, row0, v_s);

    const int k_lim = static_cast<int>(imin(kKTile, seq.sk - j0));  // keys past it: none
    const int off = static_cast<int>(j0 - i0);
    auto scores_grad = [&](auto masked) {  // the mask only where a tile needs it
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < kKTile / 8; ++t)
#pragma unroll
          for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int kl = t * 8 + tig * 2 + e;
              float x = s[mt][t][2 * r + e] * scale2 - l2[mt][r];
              if constexpr (decltype(masked)::value) {
                const int d = kl + off - row_l[mt][r];
                if (kl >= k_lim || (kBanded && (d > dhi || d < dlo))) x = -INFINITY;
              }
              const float pe = exp2_approx(x);
              ds[mt][t][2 * r + e] = pe * (ds[mt][t][2 * r + e] - dl[mt][r]) *
                                     (capped ? softcap_grad(pe, l2[mt][r], p.softcap) : 1.f);
            }
    };
    if (k_lim < kKTile || (kBanded && (kGeneral ? !seq.inside(i0, i0 + kRows, j0, j0 + kKTile) : j0 + kKTile - 1 > i0)))
      scores_grad(std::true_type{});
    else
      scores_grad(std::false_type{});
    gemm_pb<D, kKTile>(dq, ds, k_s);  // dQ += dS K (scaled at the store)
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = i0 + row_l[mt][r];
      if (i >= seq.sq) continue;
      T *dqp = static_cast<T *>(p.dq) + seq.bs * p.dq_st.batch + h * p.dq_st.head + (seq.q_tok + i) * p.dq_st.seq;
      store_row(dqp, dq[mt], r, p.scale);
    }
}

// ---------------------------------------------------------------- launchers
template <class K>
const char *allow_smem(K *kernel, size_t smem) {
  return fo::grant_smem(kernel, smem) != cudaSuccess ? fo::last_error() : nullptr;
}

template <int D, bool kBanded, class T>
const char *launch(const fo_attn_params &p, cudaStream_t stream) {
  using C = Cfg<D>;
  const int64_t rows = fo_attn_bwd_rows(&p);  // a (batch, q head)'s rows of scratch
  float *delta = p.workspace, *lse2 = p.workspace + p.B * p.Hq * rows;
  const bool atomic = fo_attn_bwd_cuda_atomic_dq(&p);
  float *dq_acc = atomic ? p.workspace + fo_attn_bwd_cuda_dq_acc_offset(&p) : nullptr;
  attn_bwd_delta_kernel<D, T><<<row_blocks<D>(p.B * p.Hq * rows), kRowBlock, 0, stream>>>(p, delta, lse2, dq_acc);
  if (const char *e = fo::last_error()) return e;

  const dim3 grid_kv(static_cast<unsigned>((p.Sk + C::kKeys - 1) / C::kKeys),
                     static_cast<unsigned>(p.B * p.Hkv), D / C::kCols);
  constexpr size_t smem_kv =
      (2 * C::kKeys + 4 * C::kQTile) * D * sizeof(T) + 4 * C::kQTile * sizeof(float);
  // Windows, varlen and soft-capping have their own dK, dV instances (kGeneral).
  auto with_general = [&](auto launch_kv) {
    return fo_attn_general(&p) ? launch_kv(std::true_type{}) : launch_kv(std::false_type{});
  };
  if (p.wgmma) {  // dK, dV (and an atomic dq) on Hopper
    if (const char *e = fo_attn_bwd_wgmma_cuda(&p, stream)) return e;
    if (atomic) return nullptr;
  } else if (!atomic) {
    if (const char *e = with_general([&](auto general) {
          auto dkdv = attn_bwd_dkdv_kernel<D, kBanded, false, decltype(general)::value, T>;
          if (const char *e = allow_smem(dkdv, smem_kv)) return e;
          dkdv<<<grid_kv, kThreads, smem_kv, stream>>>(p, delta, lse2, nullptr, rows);
          return fo::last_error();
        }))
      return e;
  } else {
    constexpr size_t smem_kvq = smem_kv + 2 * C::kKeys * C::kSubDq * sizeof(T);
    // Only instantiated where this branch can be taken (D <= 64; never general).
    auto dkdv = attn_bwd_dkdv_kernel<D, kBanded, (D <= 64), false, T>;
    if (const char *e = allow_smem(dkdv, smem_kvq)) return e;
    dkdv<<<grid_kv, kThreads, smem_kvq, stream>>>(p, delta, lse2, dq_acc, rows);
    if (const char *e = fo::last_error()) return e;
    attn_bwd_dq_convert_kernel<D, T><<<row_blocks<D>(p.B * p.Hq * rows), kRowBlock, 0, stream>>>(p, dq_acc);
    return fo::last_error();
  }
  constexpr size_t smem_q = (2 * C::kRows + 4 * C::kKTile) * D * sizeof(T);
  const dim3 grid_q(static_cast<unsigned>((p.Sq + C::kRows - 1) / C::kRows),
                    static_cast<unsigned>(p.B * p.Hq));
  return with_general([&](auto general) {
    auto dqk = attn_bwd_dq_kernel<D, kBanded, decltype(general)::value, T>;
    if (const char *e = allow_smem(dqk, smem_q)) return e;
    dqk<<<grid_q, kThreads, smem_q, stream>>>(p, delta, lse2, rows);
    return fo::last_error();
  });
}

}  // namespace

extern "C" const char *fo_attn_bwd_cuda(const fo_attn_params *p, void *stream) {
  if (p->B * p->Hq == 0 || p->Sq == 0 || p->Sk == 0) return nullptr;  // the shim fills those
  if (p->B * p->Hq > 65535) return "fo_attn_bwd_cuda: batch x heads above 65535";
  if (p->workspace == nullptr) return "fo_attn_bwd_cuda: no workspace";
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return fo_attn::dispatch(*p, [&](auto d, auto causal, auto t) {
    return launch<decltype(d)::value, decltype(causal)::value, std::remove_pointer_t<decltype(t)>>(*p, s);
  });
}
