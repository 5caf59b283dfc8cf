// Flash attention backward on Hopper (sm_90a): the dK / dV kernel of
// attention_bwd_cuda.cu with warpgroup MMA (wgmma.mma_async), and dQ in the
// same pass, added into an fp32 accumulator by bulk reductions. Math,
// layout and masking: attention.h. fo_attn_bwd_cuda runs the delta kernel
// first (delta, lse2 = lse log2 e, the zeroed accumulator) and, where dq is
// to be deterministic, its mma.sync dQ kernel after this one.
//
// v0 (this file). One block of two warpgroups per (128-key tile, batch x kv
// head); each warpgroup owns 64 keys and keeps their dK, dV in fp32
// registers. The block walks every q head of the group and every 64-query
// tile that sees its keys (from the diagonal on when causal); Q, dO, lse2
// and delta of a tile come through shared memory in two stages (cp.async by
// every thread, mbarriers for full and empty, as in the forward). Per query
// tile, a warpgroup, all in the key-major orientation so that each product's
// result is the next one's A operand in registers:
//   S^T  = K Q^T     wgmma 64 x 64 x 16, A = K (shared, K-major), B = Q (K-major)
//   dP^T = V dO^T    likewise, A = V, B = dO
//   P^T  = exp2(S^T scale log2 e - lse2)             (masked: keys past Sk, causal)
//   dV  += P^T dO    A = P^T (registers), B = dO N-major
//   dS^T = P^T (dP^T - delta)
//   dK  += dS^T Q    A = dS^T (registers), B = Q N-major
// and, unless dq is to be deterministic, dS^T also goes to shared memory for
//   dQ   = dS K      A = dS (shared, M-major: dS^T as stored), B = K N-major,
// 64 queries x 64 columns a warpgroup: at D = 128 warpgroup w takes columns
// 64 w.. over all 128 keys (both halves of dS: a barrier of the block), at
// D = 64 all columns over its own 64 keys (the two halves add in the
// accumulator). The 64 x 64 fp32 result goes to shared memory in fragment
// order (thread-major, conflict-free float4 stores) and one thread adds it
// to the accumulator with cp.reduce.async.bulk (16 KB, one instruction; the
// accumulator keeps that order, 64 x 64 tiles, and attn_bwd_dq_tiles_kernel
// turns it into dq = scale acc). The order of those additions varies from
// run to run; deterministic = 1 takes the dQ kernel instead.
// Head dims 64 and 128, bf16 and fp16, causal (top-left) or not, any Sq / Sk,
// grouped-query, the strides of attention_bwd_cuda.cu. Built only for sm_90a
// (the kernel bodies are empty elsewhere); p->wgmma (fo_attn_wgmma_applies) picks it.
#include "attention.h"
#include "../common/cuda_utils.cuh"
#include "attention_sm90.cuh"

namespace {

using namespace fo_attn;
using fo::mbar_arrive;
using fo::mbar_init;
using fo::mbar_wait;
using fo::team_sync;

constexpr int kGroups = 2;             // warpgroups per block
constexpr int kThreads = kGroups * 128;
constexpr int kKeys = kGroups * 64;    // keys per block
constexpr int kM = 64;                 // queries per step: the scratch's row tile (fo_attn_bwd_rows)
constexpr int kAccTile = 64 * 64;      // floats of one dQ part (64 queries x 64 columns)

// Shared memory: K, V [kKeys, D]; two stages of Q, dO [kM, D] (sw128, each
// block 1024-byte aligned); two dS^T buffers [kKeys, kM]; a dQ part a
// warpgroup; two stages of lse2 and delta [kM]; the stages' mbarriers.
template <int D>
constexpr size_t kSmem = 1024 + static_cast<size_t>(2 * kKeys + 4 * kM) * D * 2 +
                         2 * kKeys * kM * 2 + kGroups * kAccTile * 4 + 4 * kM * 4 + 4 * 8;

// dS^T = P^T (dP^T - delta), in place of dP^T (a warp's rows of its
// warpgroup's 64 keys x kM queries; P^T in s, soft-capped: times the cap's
// derivative, see probabilities), delta of the step's queries from dl_s in
// shared memory.
__device__ __forceinline__ void ds_of(float (&dp)[kM / 8][4], const float (&s)[kM / 8][4], const float *dl_s) {
  const int tig = threadIdx.x % 4;
#pragma unroll
  for (int t = 0; t < kM / 8; ++t) {
    const float2 dl = *reinterpret_cast<const float2 *>(dl_s + t * 8 + tig * 2);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      dp[t][2 * r] = s[t][2 * r] * (dp[t][2 * r] - dl.x);
      dp[t][2 * r + 1] = s[t][2 * r + 1] * (dp[t][2 * r + 1] - dl.y);
    }
  }
}

template <int D, bool kCausal, bool kDq, class T>
__global__ void __launch_bounds__(kThreads, 1)
    attn_bwd_wgmma_kernel(const fo_attn_params p, const float *delta, const float *lse2, float *dq_acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T *sK = reinterpret_cast<T *>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
  T *sV = sK + kKeys * D;
  T *sQ = sV + kKeys * D;       // [2][kM, D]
  T *sdO = sQ + 2 * kM * D;     // [2][kM, D]
  T *sdS = sdO + 2 * kM * D;    // [2][kKeys, kM]: dS^T of a step, buffer it % 2
  float *sAcc = reinterpret_cast<float *>(sdS + 2 * kKeys * kM);  // [kGroups][kAccTile]
  float *sL = sAcc + kGroups * kAccTile;                           // [2][kM]: lse2
  float *sDl = sL + 2 * kM;                                        // [2][kM]: delta
  uint64_t *full = reinterpret_cast<uint64_t *>(sDl + 2 * kM), *empty = full + 2;

  const int wg = threadIdx.x / 128, wtid = threadIdx.x % 128, warp = wtid / 32, lane = threadIdx.x % 32;
  const int tig = lane % 4;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kKeys;
  const int64_t bh = blockIdx.y, b = bh / p.Hkv, hk = bh % p.Hkv, group = p.Hq / p.Hkv;
  const int64_t rows = fo_attn_bwd_rows(&p);
  const float scale2 = p.scale * kLog2e;
  const int k_rows = static_cast<int>(imin(kKeys, p.Sk - j0));

  // Work items: (q head of the group, query tile), heads outer, in order.
  const int m_first = kCausal ? static_cast<int>(j0 / kM) : 0;  // first tile with a query >= j0
  const int m_tiles = static_cast<int>(rows / kM);
  const int n_m = m_tiles > m_first ? m_tiles - m_first : 0;
  const int n_items = static_cast<int>(group) * n_m;
  // An item as (q head of the group, query tile from m_first): item it is
  // (it / n_m, it % n_m), kept as a cursor advanced a step at a time (a
  // division by n_m cost ~30 instructions a step, twice).
  struct Item {
    int hi = 0, mi = 0;
  };
  auto advance = [&](Item &x) {
    if (++x.mi == n_m) x.mi = 0, ++x.hi;
  };
  auto item_m0 = [&](const Item &x) { return static_cast<int64_t>(m_first + x.mi) * kM; };
  auto item_h = [&](const Item &x) { return hk * group + x.hi; };

  if (threadIdx.x == 0) {
    for (int st = 0; st < 2; ++st) {
      mbar_init(&full[st], kThreads);
      mbar_init(&empty[st], kThreads);  // every thread: its reads of lse2, delta too
    }
  }
  __syncthreads();

  // Item it (x) into stage it % 2, once every thread has released item it - 2:
  // Q and dO tiles, lse2 and delta (padded rows: in bounds, P = 0 there).
  auto load_item = [&](int it, const Item &x) {
    const int st = it & 1;
    if (it >= 2) mbar_wait(&empty[st], ((it >> 1) + 1) & 1);
    const int64_t h = item_h(x), m0 = item_m0(x);
    const int q_rows = static_cast<int>(imin(kM, p.Sq - m0));
    load_tile_sw128<D, kM, kThreads>(
        sQ + st * kM * D, static_cast<const T *>(p.q) + b * p.q_st.batch + h * p.q_st.head + m0 * p.q_st.seq,
        p.q_st.seq, q_rows);
    load_tile_sw128<D, kM, kThreads>(sdO + st * kM * D,
                                     static_cast<const T *>(p.dout) + b * p.dout_st.batch +
                                         h * p.dout_st.head + m0 * p.dout_st.seq,
                                     p.dout_st.seq, q_rows);
    if (threadIdx.x < 2 * kM / 4) {  // 16-byte chunks of lse2, then of delta
      const int c = threadIdx.x % (kM / 4);
      const float *src = (threadIdx.x < kM / 4 ? lse2 : delta) + (b * p.Hq + h) * rows + m0 + 4 * c;
      cp_async16((threadIdx.x < kM / 4 ? sL : sDl) + st * kM + 4 * c, src, true);
    }
    mbar_arrive_cp_async(&full[st]);
  };

  // This thread's keys (block-local): rows g and g + 8 of its warp's 16.
  int key_l[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) key_l[r] = wg * 64 + warp * 16 + lane / 4 + 8 * r;

  float dk[D / 8][4], dv[D / 8][4];
  zero(dk);
  zero(dv);

  if (n_items > 0) {
    const T *k = static_cast<const T *>(p.k) + b * p.k_st.batch + hk * p.k_st.head + j0 * p.k_st.seq;
    const T *v = static_cast<const T *>(p.v) + b * p.v_st.batch + hk * p.v_st.head + j0 * p.v_st.seq;
    load_tile_sw128<D, kKeys, kThreads>(sK, k, p.k_st.seq, k_rows);
    load_tile_sw128<D, kKeys, kThreads>(sV, v, p.v_st.seq, k_rows);
    load_item(0, Item{});  // K and V land with item 0
  }

  // Descriptors. A: this warpgroup's 64 rows of K, V (column blocks kKeys x
  // 64 apart). B: a stage's Q, dO K-major (S^T, dP^T: k-step kk = columns
  // 16 kk.., 32 bytes into the rows of column block kk / 4) or N-major (dV,
  // dK: k-step kk = rows 16 kk.., column blocks kM x 64 apart). Units of 16
  // bytes: an element offset e adds e / 8.
  const uint64_t dKa = desc128(sK + wg * 64 * 64, 16), dVa = desc128(sV + wg * 64 * 64, 16);
  const uint64_t dQk = desc128(sQ, 16), dOk = desc128(sdO, 16);
  const uint64_t dQn = desc128(sQ, kM * 64 * 2), dOn = desc128(sdO, kM * 64 * 2);
  auto kmajor = [](int kk, int rows_) { return static_cast<uint64_t>(((kk / 4) * rows_ * 64 + (kk % 4) * 16) / 8); };

  Item cur, next;  // items it and it + 1
  advance(next);
  for (int it = 0; it < n_items; ++it, advance(cur), advance(next)) {
    const int st = it & 1;
    if (it + 1 < n_items) load_item(it + 1, next);
    mbar_wait(&full[st], (it >> 1) & 1);
    fence_proxy_async();
    const uint64_t so = static_cast<uint64_t>(st * kM * D / 8);  // the stage, in descriptor units

    float s[kM / 8][4], dp[kM / 8][4];  // S^T then P^T; dP^T then dS^T: 64 keys x kM queries
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss<T, kM, 0>(s, dKa + kmajor(kk, kKeys), dQk + so + kmajor(kk, kM), kk > 0);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss<T, kM, 0>(dp, dVa + kmajor(kk, kKeys), dOk + so + kmajor(kk, kM), kk > 0);
    wgmma_commit();
    wgmma_wait<1>();  // S^T
    hold(s);

    // P^T = exp2(S^T scale2 - lse2[query]); masked: keys past Sk, and
    // (causal) key j0 + kl above query m0 + ql, i.e. kl + off > ql.
    const int64_t m0 = item_m0(cur);
    const int off = static_cast<int>(j0 - m0);
    // The mask is compiled into its own branch (edge is warp-uniform): a
    // runtime test in the element loop is if-converted, and every step paid
    // for it (as in the forward's softmax_tile).
    auto probabilities = [&](auto masked) {
#pragma unroll
      for (int t = 0; t < kM / 8; ++t) {
        const float2 l2 = *reinterpret_cast<const float2 *>(sL + st * kM + t * 8 + tig * 2);
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = fmaf(s[t][2 * r + e], scale2, -(e ? l2.y : l2.x));
            if constexpr (decltype(masked)::value)
              if (key_l[r] >= k_rows || (kCausal && key_l[r] + off > t * 8 + tig * 2 + e)) x = -INFINITY;
            s[t][2 * r + e] = exp2_approx(x);
          }
      }
    };
    if (k_rows < kKeys || (kCausal && j0 + wg * 64 + 63 > m0))
      probabilities(std::true_type{});
    else
      probabilities(std::false_type{});
    uint32_t pa[kM / 16][4];  // P^T rounded to T: wgmma A fragments, k-step kk = queries 16 kk..
    pack_a<T>(pa, s);
    hold(pa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kM / 16; ++kk) wgmma_rs<T, D, 1>(dv, pa[kk], dOn + so + kk * 16 * 64 / 8, 1);
    wgmma_commit();
    hold(dv);
    wgmma_wait<1>();  // dP^T; dV may still run
    hold(dp);

    ds_of(dp, s, sDl + st * kM);
    uint32_t da[kM / 16][4];  // dS^T rounded to T
    pack_a<T>(da, dp);
    T *sds = sdS + st * kKeys * kM;
    if constexpr (kDq) {
      // dS^T [kKeys, kM] (sw128: one 128-byte column block): fragment kk,
      // register 2 hf + r = keys key_l[r], queries 16 kk + 8 hf + 2 tig, +1.
#pragma unroll
      for (int kk = 0; kk < kM / 16; ++kk)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
          for (int r = 0; r < 2; ++r)
            *reinterpret_cast<uint32_t *>(sds + sw128<kKeys>(key_l[r], 2 * kk + hf) + tig * 2) = da[kk][2 * hf + r];
    }
    hold(da);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kM / 16; ++kk) wgmma_rs<T, D, 1>(dk, da[kk], dQn + so + kk * 16 * 64 / 8, 1);
    wgmma_commit();
    hold(dk);

    if constexpr (kDq) {
      // dQ part: rows = the 64 queries, from dS^T read M-major (k-step kk =
      // keys 16 kk.., 2048 bytes into the buffer), times K N-major.
      constexpr int kDqKeys = D == 128 ? kKeys : 64;   // keys this part sums over
      const int key0 = D == 128 ? 0 : wg * 64, cb = D == 128 ? wg : 0;  // and its column block
      fence_proxy_async();  // this thread's dS^T stores, before wgmma reads them
      if constexpr (D == 128)
        team_sync(2, kThreads);  // both halves of dS^T written
      else
        team_sync(wg, 128);
      float dq[8][4];
      const uint64_t dSa = desc128(sds + key0 * 64, 16), dKn = desc128(sK + cb * kKeys * 64 + key0 * 64, 16);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kDqKeys / 16; ++kk)
        wgmma_ss<T, 64, 1, 1>(dq, dSa + kk * 16 * 64 / 8, dKn + kk * 16 * 64 / 8, kk > 0);
      wgmma_commit();
      wgmma_wait<0>();
      hold(dq);
      hold(dk);
      hold(dv);
      // Stage the part (once the last reduction has read the buffer), then
      // one thread adds it to tile (query tile, column block cb).
      float *acc_s = sAcc + wg * kAccTile;
      if (wtid == 0) bulk_wait_read();
      team_sync(wg, 128);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        *reinterpret_cast<float4 *>(acc_s + (i * 128 + wtid) * 4) = make_float4(dq[i][0], dq[i][1], dq[i][2], dq[i][3]);
      fence_proxy_async();
      team_sync(wg, 128);
      if (wtid == 0) {
        const int64_t h = item_h(cur);
        bulk_reduce_add_f32(dq_acc + ((b * p.Hq + h) * rows + m0) * D + cb * kAccTile, acc_s, kAccTile * 4);
        bulk_commit();
      }
    } else {
      wgmma_wait<0>();
      hold(dk);
      hold(dv);
    }
    mbar_arrive(&empty[st]);
  }
  if (kDq && wtid == 0) bulk_wait();

  // Keys that no query sees (causal, j0 >= Sq) get zeros: dk, dv are still 0.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = j0 + key_l[r];
    if (key >= p.Sk) continue;
    T *dkp = static_cast<T *>(p.dk) + b * p.dk_st.batch + hk * p.dk_st.head + key * p.dk_st.seq;
    T *dvp = static_cast<T *>(p.dv) + b * p.dv_st.batch + hk * p.dv_st.head + key * p.dv_st.seq;
    store_row(dkp, dk, r, p.scale);
    store_row(dvp, dv, r, 1.f);
  }
#endif
}

// ---------------------------------------------------------------- warp-specialised (v1)
// The kernel above with one producer warpgroup beside the two consumer
// warpgroups: the producer's first thread loads K and V once and each work
// item's Q, dO (TMA boxes of 64 columns, rows past the tensor zero-filled),
// lse2 and delta (bulk copies) into a ring of kStages stages; full barriers
// count the bytes landed, empty ones an arrival a consumer thread. The
// consumers' math is the kernel above's, without load instructions; the
// producer gives its registers to them (setmaxnreg).
// kGeneral instances (fo_attn_general: windows, soft-capping, varlen): a
// block walks only the query tiles of its keys' band (SeqView::rows_lo,
// rows_hi), masks the steps the band or the sequence's end cuts, caps the
// scores and multiplies dS by the cap's derivative (softcap_grad). Varlen:
// the tensor maps cover the packed tensors; a sequence's key and query tiles
// start at its cu_seqlens rows; keys a tile reads past its sequence are
// masked and not stored, queries past it have lse2 = +inf in the scratch (P
// = 0, dS = 0) and their dQ rows are not stored.
template <int D>
struct BwdWsConfig {
  static constexpr int kConsumers = 2;  // 64 keys each
  static constexpr int kThreads = (1 + kConsumers) * 128;
  static constexpr int kStages = 2;
  // (enumerators: the host pass, which sees no kernel body, warns of unused constants)
  enum : int { kProducerRegs = 24, kConsumerRegs = 240 };
  enum : int { kBarDs = 1, kBarPart = 2 };  // named barriers: both consumers; consumer w alone (kBarPart + w)
  static constexpr size_t smem() {
    return 1024 + static_cast<size_t>(2 * kKeys + 2 * kStages * kM) * D * 2 + 2 * kKeys * kM * 2 +
           kConsumers * kAccTile * 4 + 2 * kStages * kM * 4 + (1 + 2 * kStages) * 8;
  }
};

// kCausal: the band is bounded (fo_attn_banded; causal where not kGeneral).
template <int D, bool kCausal, bool kDq, bool kGeneral, class T>
__global__ void __launch_bounds__(BwdWsConfig<D>::kThreads, 1)
    attn_bwd_ws_kernel(const __grid_constant__ fo_attn_params p, const float *delta, const float *lse2,
                       float *dq_acc, const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                       const __grid_constant__ CUtensorMap tv, const __grid_constant__ CUtensorMap tdo) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = BwdWsConfig<D>;
  constexpr int S = C::kStages;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T *sK = reinterpret_cast<T *>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
  T *sV = sK + kKeys * D;
  T *sQ = sV + kKeys * D;       // [S][kM, D]
  T *sdO = sQ + S * kM * D;     // [S][kM, D]
  T *sdS = sdO + S * kM * D;    // [2][kKeys, kM]: dS^T of a step, buffer it % 2
  float *sAcc = reinterpret_cast<float *>(sdS + 2 * kKeys * kM);  // [kConsumers][kAccTile]
  float *sL = sAcc + C::kConsumers * kAccTile;                     // [S][kM]: lse2
  float *sDl = sL + S * kM;                                        // [S][kM]: delta
  uint64_t *fullKV = reinterpret_cast<uint64_t *>(sDl + S * kM), *full = fullKV + 1, *empty = full + S;

  const int wg = threadIdx.x / 128, wtid = threadIdx.x % 128, warp = wtid / 32, lane = threadIdx.x % 32;
  const int tig = lane % 4;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kKeys;
  const int64_t bh = blockIdx.y, b = bh / p.Hkv, hk = bh % p.Hkv, group = p.Hq / p.Hkv;
  const int64_t rows = fo_attn_bwd_rows(&p);
  // Keys of the block, and its query tiles [m_first, m_tiles): general, from
  // the band (a block past its sequence returns, all of it); else as in the
  // kernel above (from the diagonal on when causal).
  int k_rows, m_first, m_tiles;
  if constexpr (kGeneral) {
    const SeqView seq(p, b);
    if (j0 >= seq.sk) return;
    k_rows = static_cast<int>(imin(kKeys, seq.sk - j0));
    const int64_t r_lo = kCausal ? seq.rows_lo(j0) : 0, r_hi = kCausal ? seq.rows_hi(j0 + k_rows) : seq.sq;
    m_first = static_cast<int>(r_lo / kM);
    m_tiles = r_hi > r_lo ? static_cast<int>((r_hi + kM - 1) / kM) : m_first;
  } else {
    k_rows = static_cast<int>(imin(kKeys, p.Sk - j0));
    m_first = kCausal ? static_cast<int>(j0 / kM) : 0;
    m_tiles = static_cast<int>(rows / kM);
  }

  // Work items as in the kernel above: (q head of the group, query tile from m_first).
  const int n_m = m_tiles > m_first ? m_tiles - m_first : 0;
  const int n_items = static_cast<int>(group) * n_m;
  struct Item {
    int hi = 0, mi = 0;
  };
  auto advance = [&](Item &x) {
    if (++x.mi == n_m) x.mi = 0, ++x.hi;
  };
  auto item_m0 = [&](const Item &x) { return static_cast<int64_t>(m_first + x.mi) * kM; };
  auto item_h = [&](const Item &x) { return hk * group + x.hi; };

  if (threadIdx.x == 0) {
    mbar_init(fullKV, 1);
    for (int st = 0; st < S; ++st) {
      mbar_init(&full[st], 1);
      mbar_init(&empty[st], C::kConsumers * 128);  // every consumer thread: its reads of lse2, delta too
    }
    fence_mbar_init();
  }
  __syncthreads();

  if (wg == 0) {  // the producer
    regs_dec<C::kProducerRegs>();
    if (warp == 0 && lane == 0 && n_items > 0) {
      // Tensor-map rows of key j0 and of query 0, and the batch entry (general: of the sequence).
      int k_row = static_cast<int>(j0), q_row0 = 0, bm = static_cast<int>(b);
      if constexpr (kGeneral) {
        const SeqView seq(p, b);
        k_row += static_cast<int>(seq.k_tok);
        q_row0 = static_cast<int>(seq.q_tok);
        bm = static_cast<int>(seq.bs);
      }
      mbar_expect_tx(fullKV, 2 * kKeys * D * sizeof(T));
#pragma unroll
      for (int cb = 0; cb < D / 64; ++cb) {
        tma_load_4d(sK + cb * kKeys * 64, &tk, fullKV, cb * 64, k_row, static_cast<int>(hk), bm);
        tma_load_4d(sV + cb * kKeys * 64, &tv, fullKV, cb * 64, k_row, static_cast<int>(hk), bm);
      }
      Item x;
      for (int it = 0; it < n_items; ++it, advance(x)) {
        const int st = it % S;
        if (it >= S) mbar_wait(&empty[st], ((it / S) & 1) ^ 1);  // item it - S is released
        mbar_expect_tx(&full[st], 2 * kM * D * sizeof(T) + 2 * kM * 4);
        const int h = static_cast<int>(item_h(x)), m0 = static_cast<int>(item_m0(x));
#pragma unroll
        for (int cb = 0; cb < D / 64; ++cb) {
          tma_load_4d(sQ + st * kM * D + cb * kM * 64, &tq, &full[st], cb * 64, q_row0 + m0, h, bm);
          tma_load_4d(sdO + st * kM * D + cb * kM * 64, &tdo, &full[st], cb * 64, q_row0 + m0, h, bm);
        }
        const int64_t row0 = (b * p.Hq + h) * rows + m0;  // the scratch is padded: whole 64-row tiles
        bulk_load(sL + st * kM, lse2 + row0, kM * 4, &full[st]);
        bulk_load(sDl + st * kM, delta + row0, kM * 4, &full[st]);
      }
    }
    return;
  }

  regs_inc<C::kConsumerRegs>();
  const int cw = wg - 1;  // this consumer: keys 64 cw.. of the block
  // Soft-capped scores are scaled as uncapped ones (softcap_scores).
  const float scale2 = p.scale * kLog2e;
  int dlo = 0, dhi = 0;  // general: the band (SeqView::dlo, dhi)
  if constexpr (kGeneral) {
    const SeqView seq(p, b);
    dlo = seq.dlo();
    dhi = seq.dhi();
  }
  int key_l[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) key_l[r] = cw * 64 + warp * 16 + lane / 4 + 8 * r;

  float dk[D / 8][4], dv[D / 8][4];
  zero(dk);
  zero(dv);

  const uint64_t dKa = desc128(sK + cw * 64 * 64, 16), dVa = desc128(sV + cw * 64 * 64, 16);
  const uint64_t dQk = desc128(sQ, 16), dOk = desc128(sdO, 16);
  const uint64_t dQn = desc128(sQ, kM * 64 * 2), dOn = desc128(sdO, kM * 64 * 2);
  auto kmajor = [](int kk, int rows_) { return static_cast<uint64_t>(((kk / 4) * rows_ * 64 + (kk % 4) * 16) / 8); };

  if (n_items > 0) mbar_wait(fullKV, 0);
  Item cur;
  for (int it = 0; it < n_items; ++it, advance(cur)) {
    const int st = it % S;
    mbar_wait(&full[st], (it / S) & 1);
    const uint64_t so = static_cast<uint64_t>(st * kM * D / 8);  // the stage, in descriptor units

    float s[kM / 8][4], dp[kM / 8][4];  // S^T then P^T; dP^T then dS^T: 64 keys x kM queries
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss<T, kM, 0>(s, dKa + kmajor(kk, kKeys), dQk + so + kmajor(kk, kM), kk > 0);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss<T, kM, 0>(dp, dVa + kmajor(kk, kKeys), dOk + so + kmajor(kk, kM), kk > 0);
    wgmma_commit();
    wgmma_wait<1>();  // S^T
    hold(s);

    const int64_t m0 = item_m0(cur);
    const int off = static_cast<int>(j0 - m0);
    if constexpr (kGeneral)
      if (p.softcap > 0.f) softcap_scores(s, p.scale, p.softcap);
    // Masked (general): key j0 + kl and query m0 + q with kl >= k_rows, or
    // kl + off - q outside the band [dlo, dhi] (SeqView). Soft-capped
    // (capped): P^T goes to pa here, as pack_a lays it out, and s keeps
    // P^T (1 - t^2), the cap's derivative taken while t = s k (tanh, from
    // softcap_scores) is at hand: no special-function op beyond the exp2.
    uint32_t pa[kM / 16][4];
    auto probabilities = [&](auto masked, auto capped) {
      const float k = p.scale / p.softcap;  // (capped only)
#pragma unroll
      for (int t = 0; t < kM / 8; ++t) {
        const float2 l2 = *reinterpret_cast<const float2 *>(sL + st * kM + t * 8 + tig * 2);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float pe[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = fmaf(s[t][2 * r + e], scale2, -(e ? l2.y : l2.x));
            if constexpr (decltype(masked)::value && kGeneral) {
              const int d = key_l[r] + off - (t * 8 + tig * 2 + e);
              if (key_l[r] >= k_rows || (kCausal && (d > dhi || d < dlo))) x = -INFINITY;
            } else if constexpr (decltype(masked)::value) {
              if (key_l[r] >= k_rows || (kCausal && key_l[r] + off > t * 8 + tig * 2 + e)) x = -INFINITY;
            }
            pe[e] = exp2_approx(x);
            if constexpr (decltype(capped)::value) {
              const float tc = s[t][2 * r + e] * k;
              s[t][2 * r + e] = pe[e] * fmaf(-tc, tc, 1.f);
            } else {
              s[t][2 * r + e] = pe[e];
            }
          }
          if constexpr (decltype(capped)::value) pa[t / 2][(t % 2) * 2 + r] = pack2<T>(pe[0], pe[1]);
        }
      }
    };
    const bool edge = kGeneral ? k_rows < kKeys || (kCausal && (off + cw * 64 + 63 > dhi || off + cw * 64 - (kM - 1) < dlo))
                               : k_rows < kKeys || (kCausal && j0 + cw * 64 + 63 > m0);
    if (kGeneral && p.softcap > 0.f) {
      if (edge)
        probabilities(std::true_type{}, std::true_type{});
      else
        probabilities(std::false_type{}, std::true_type{});
    } else {
      if (edge)
        probabilities(std::true_type{}, std::false_type{});
      else
        probabilities(std::false_type{}, std::false_type{});
      pack_a<T>(pa, s);
    }
    hold(pa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kM / 16; ++kk) wgmma_rs<T, D, 1>(dv, pa[kk], dOn + so + kk * 16 * 64 / 8, 1);
    wgmma_commit();
    hold(dv);
    wgmma_wait<1>();  // dP^T; dV may still run
    hold(dp);

    ds_of(dp, s, sDl + st * kM);
    uint32_t da[kM / 16][4];
    pack_a<T>(da, dp);
    T *sds = sdS + (it & 1) * kKeys * kM;
    if constexpr (kDq) {
#pragma unroll
      for (int kk = 0; kk < kM / 16; ++kk)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
          for (int r = 0; r < 2; ++r)
            *reinterpret_cast<uint32_t *>(sds + sw128<kKeys>(key_l[r], 2 * kk + hf) + tig * 2) = da[kk][2 * hf + r];
    }
    hold(da);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kM / 16; ++kk) wgmma_rs<T, D, 1>(dk, da[kk], dQn + so + kk * 16 * 64 / 8, 1);
    wgmma_commit();
    hold(dk);

    if constexpr (kDq) {
      constexpr int kDqKeys = D == 128 ? kKeys : 64;
      const int key0 = D == 128 ? 0 : cw * 64, cb = D == 128 ? cw : 0;
      fence_proxy_async();  // this thread's dS^T stores, before wgmma reads them
      if constexpr (D == 128)
        named_sync<C::kConsumers * 128>(C::kBarDs);  // both halves of dS^T written
      else
        named_sync<128>(C::kBarPart + cw);
      float dq[8][4];
      const uint64_t dSa = desc128(sds + key0 * 64, 16), dKn = desc128(sK + cb * kKeys * 64 + key0 * 64, 16);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kDqKeys / 16; ++kk)
        wgmma_ss<T, 64, 1, 1>(dq, dSa + kk * 16 * 64 / 8, dKn + kk * 16 * 64 / 8, kk > 0);
      wgmma_commit();
      wgmma_wait<0>();
      hold(dq);
      hold(dk);
      hold(dv);
      float *acc_s = sAcc + cw * kAccTile;
      if (wtid == 0) bulk_wait_read();
      named_sync<128>(C::kBarPart + cw);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        *reinterpret_cast<float4 *>(acc_s + (i * 128 + wtid) * 4) = make_float4(dq[i][0], dq[i][1], dq[i][2], dq[i][3]);
      fence_proxy_async();
      named_sync<128>(C::kBarPart + cw);
      if (wtid == 0) {
        const int64_t h = item_h(cur);
        bulk_reduce_add_f32(dq_acc + ((b * p.Hq + h) * rows + m0) * D + cb * kAccTile, acc_s, kAccTile * 4);
        bulk_commit();
      }
    } else {
      wgmma_wait<0>();
      hold(dk);
      hold(dv);
    }
    mbar_arrive(&empty[st]);
  }
  if (kDq && wtid == 0) bulk_wait();

  // Keys no query sees get zeros (dk, dv are still 0); keys past the sequence are not stored.
  const SeqView seq(p, b, kGeneral && p.cu_seqlens_q != nullptr, kGeneral);  // (padded: from p)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = j0 + key_l[r];
    if (key >= seq.sk) continue;
    const int64_t tok = seq.k_tok + key;
    T *dkp = static_cast<T *>(p.dk) + seq.bs * p.dk_st.batch + hk * p.dk_st.head + tok * p.dk_st.seq;
    T *dvp = static_cast<T *>(p.dv) + seq.bs * p.dv_st.batch + hk * p.dv_st.head + tok * p.dv_st.seq;
    store_row(dkp, dk, r, p.scale);
    store_row(dvp, dv, r, 1.f);
  }
#endif
}

// dq = scale * acc, rounded to T: one block a 64 x 64 tile of the
// accumulator (tile (b Hq + h) rows / 64 + query tile, then column block),
// stored in the fragment order of the kernel above: float4 i * 128 + t holds
// thread t's accumulators dq[i][0..3], i.e. rows 16 w + g and + 8 (warp w,
// lane 4 g + c) at columns 8 i + 2 c, + 1. Read in that order (coalesced),
// put in place through shared memory (rows 72 floats apart: a half-warp's
// float2 stores hit 32 distinct banks), written as 16-byte row segments.
template <int D, class T>
__global__ void __launch_bounds__(128) attn_bwd_dq_tiles_kernel(const fo_attn_params p, const float *dq_acc) {
  constexpr int kLd = 72;
  __shared__ __align__(16) float tile[64 * kLd];
  const int64_t rows = fo_attn_bwd_rows(&p), t_idx = blockIdx.x;
  const int cb = static_cast<int>(t_idx % (D / 64));
  const int64_t qt = t_idx / (D / 64), bh = qt / (rows / kM), m0 = qt % (rows / kM) * kM;
  const int64_t b = bh / p.Hq, h = bh % p.Hq;
  const SeqView seq(p, b);  // varlen: the sequence's queries and where its rows start
  const int t = threadIdx.x, r0 = t / 32 * 16 + t % 32 / 4, c0 = 2 * (t % 4);
  const float4 *src = reinterpret_cast<const float4 *>(dq_acc + t_idx * kAccTile);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float4 x = src[i * 128 + t];
    *reinterpret_cast<float2 *>(tile + r0 * kLd + 8 * i + c0) = make_float2(x.x, x.y);
    *reinterpret_cast<float2 *>(tile + (r0 + 8) * kLd + 8 * i + c0) = make_float2(x.z, x.w);
  }
  __syncthreads();
  T *dq = static_cast<T *>(p.dq) + seq.bs * p.dq_st.batch + h * p.dq_st.head + seq.q_tok * p.dq_st.seq + cb * 64;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int seg = j * 128 + t, r = seg / 8, c = seg % 8 * 8;
    if (m0 + r >= seq.sq) continue;
    const float4 lo = *reinterpret_cast<const float4 *>(tile + r * kLd + c);
    const float4 hi = *reinterpret_cast<const float4 *>(tile + r * kLd + c + 4);
    const float x[8] = {lo.x * p.scale, lo.y * p.scale, lo.z * p.scale, lo.w * p.scale,
                        hi.x * p.scale, hi.y * p.scale, hi.z * p.scale, hi.w * p.scale};
    fo::store_f<8>(dq + (m0 + r) * p.dq_st.seq + c, x);
  }
}

template <int D, bool kCausal, class T>
const char *launch(const fo_attn_params &p, cudaStream_t stream) {
  const int64_t rows = fo_attn_bwd_rows(&p);
  const float *delta = p.workspace, *lse2 = p.workspace + p.B * p.Hq * rows;
  const bool atomic = fo_attn_bwd_cuda_atomic_dq(&p);
  float *dq_acc = atomic ? p.workspace + fo_attn_bwd_cuda_dq_acc_offset(&p) : nullptr;
  const dim3 grid(static_cast<unsigned>((p.Sk + kKeys - 1) / kKeys), static_cast<unsigned>(p.B * p.Hkv));
  CUtensorMap maps[4];
  const bool general = fo_attn_general(&p);
  if (ws_wanted() && p.Sq > 0 && p.Sk > 0 && operand_map(&maps[0], p, p.q, p.q_st, false, kM) &&
      operand_map(&maps[1], p, p.k, p.k_st, true, kKeys) && operand_map(&maps[2], p, p.v, p.v_st, true, kKeys) &&
      operand_map(&maps[3], p, p.dout, p.dout_st, false, kM)) {
    using C = BwdWsConfig<D>;
    auto kernel = general ? (atomic ? attn_bwd_ws_kernel<D, kCausal, true, true, T>
                                    : attn_bwd_ws_kernel<D, kCausal, false, true, T>)
                          : (atomic ? attn_bwd_ws_kernel<D, kCausal, true, false, T>
                                    : attn_bwd_ws_kernel<D, kCausal, false, false, T>);
    if (fo::grant_smem(kernel, C::smem()) != cudaSuccess) return fo::last_error();
    kernel<<<grid, C::kThreads, C::smem(), stream>>>(p, delta, lse2, dq_acc, maps[0], maps[1], maps[2], maps[3]);
  } else if (general) {
    return "fo_attn_bwd_wgmma_cuda: a masked call whose operands no tensor map describes";
  } else {
    auto kernel = atomic ? attn_bwd_wgmma_kernel<D, kCausal, true, T> : attn_bwd_wgmma_kernel<D, kCausal, false, T>;
    if (fo::grant_smem(kernel, kSmem<D>) != cudaSuccess) return fo::last_error();
    kernel<<<grid, kThreads, kSmem<D>, stream>>>(p, delta, lse2, dq_acc);
  }
  if (const char *err = fo::last_error()) return err;
  if (!atomic) return nullptr;
  const int64_t tiles = p.B * p.Hq * (rows / kM) * (D / 64);
  if (tiles > 0x7fffffff) return "fo_attn_bwd_wgmma_cuda: batch x heads x query tiles above 2^31";
  attn_bwd_dq_tiles_kernel<D, T><<<static_cast<unsigned>(tiles), 128, 0, stream>>>(p, dq_acc);
  return fo::last_error();
}

}  // namespace

extern "C" const char *fo_attn_bwd_wgmma_cuda(const fo_attn_params *p, void *stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch_wgmma(*p, [&](auto d, auto causal, auto t) {
    return launch<decltype(d)::value, decltype(causal)::value, std::remove_pointer_t<decltype(t)>>(*p, s);
  });
}
