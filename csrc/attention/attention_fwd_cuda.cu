// Flash attention forward on the GPU (sm_80+): FlashAttention-2's algorithm
// with tensor-core mma.sync. Math, layout and masking: attention.h.
//
// v0 (this file). One block of 4 warps per (64-query tile, batch x q head);
// each warp owns 16 query rows. Q is loaded once (cp.async into shared
// memory, then ldmatrix into registers); K and V tiles of 64 keys stream
// through shared memory with cp.async, V_j loading while S = Q K_j^T is
// computed and K_{j+1} while P V_j is. Scores, running max / sum and the
// output stay in fp32 registers (m16n8k16 accumulators); P is rounded to the
// input dtype and fed back to the next mma straight from the accumulator
// layout (no shared-memory round trip). Shared rows are 16-byte chunks XOR-
// swizzled by row so that ldmatrix reads are conflict-free.
// Head dims 64 and 128, bf16 and fp16, causal (top-left) or not, any Sq / Sk
// (zero-filled tail tiles, masked), grouped-query (kv head = h / (Hq / Hkv)),
// any 64-bit strides that are multiples of 8 elements on a 16-byte aligned
// base (the shim copies other inputs).
//
// FLOPs: 4 B Hq Sq Sk D (halved causal). Not yet measured: the first H100 run
// is the lead's (docs/perf-notes.md has the predictions). Compile check:
// tools/compile_cuda.sh "80 90".
#include "attention.h"
#include "../common/cuda_utils.cuh"
#include "attention_mma.cuh"

namespace {

using namespace fo_attn;

constexpr int kBlockM = 64;   // query rows per block (16 per warp)
constexpr int kBlockN = 64;   // keys per tile
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// ---------------------------------------------------------------- the kernel
template <int D, bool kCausal, class T>
__global__ void __launch_bounds__(kThreads) attn_fwd_kernel(const fo_attn_params p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T *sQ = reinterpret_cast<T *>(smem_raw);
  T *sK = sQ + kBlockM * D;
  T *sV = sK + kBlockN * D;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tig = lane % 4;  // mma fragment row group, thread in group
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kBlockM;
  const int64_t bh = blockIdx.y, b = bh / p.Hq, h = bh % p.Hq;
  const int64_t hk = h / (p.Hq / p.Hkv);
  const T *q = static_cast<const T *>(p.q) + b * p.q_st.batch + h * p.q_st.head + i0 * p.q_st.seq;
  const T *k = static_cast<const T *>(p.k) + b * p.k_st.batch + hk * p.k_st.head;
  const T *v = static_cast<const T *>(p.v) + b * p.v_st.batch + hk * p.v_st.head;
  const int q_rows = static_cast<int>(imin(kBlockM, p.Sq - i0));
  const int64_t kend = kCausal ? imin(p.Sk, i0 + q_rows) : p.Sk;
  const int n_tiles = static_cast<int>((kend + kBlockN - 1) / kBlockN);
  const float scale2 = p.scale * kLog2e;

  load_tile<D, kThreads>(sQ, q, p.q_st.seq, kBlockM, q_rows);
  cp_async_commit();
  if (n_tiles > 0) load_tile<D, kThreads>(sK, k, p.k_st.seq, kBlockN, static_cast<int>(imin(kBlockN, p.Sk)));
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  // Q fragments of this warp's 16 rows: D/16 k-steps of a 16x16 A operand.
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    ldmatrix_x4(qf[kk], sQ + swz<D>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));

  float o[D / 8][4];  // output accumulators: D/8 n-tiles of 16x8
#pragma unroll
  for (int t = 0; t < D / 8; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};  // running max (log2 units) of rows g, g + 8
  float l[2] = {0.f, 0.f};              // this thread's share of the running sums
  const int64_t row[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};

  for (int j = 0; j < n_tiles; ++j) {
    const int64_t j0 = static_cast<int64_t>(j) * kBlockN;
    const int k_rows = static_cast<int>(imin(kBlockN, p.Sk - j0));
    load_tile<D, kThreads>(sV, v + j0 * p.v_st.seq, p.v_st.seq, kBlockN, k_rows);
    cp_async_commit();
    cp_async_wait<1>();  // K_j has landed (V_j may still be in flight)
    __syncthreads();

    float s[kBlockN / 8][4];  // S = Q K_j^T: 8 n-tiles of 16x8
#pragma unroll
    for (int t = 0; t < kBlockN / 8; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kBlockN / 16; ++np) {
        uint32_t kb[4];  // B fragments of n-tiles 2np, 2np + 1
        ldmatrix_x4(kb, sK + swz<D>(np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                    kk * 2 + ((lane >> 3) & 1)));
        mma16816<T>(s[2 * np], qf[kk], kb[0], kb[1]);
        mma16816<T>(s[2 * np + 1], qf[kk], kb[2], kb[3]);
      }
    }
    __syncthreads();  // every warp is done with sK
    if (j + 1 < n_tiles)
      load_tile<D, kThreads>(sK, k + (j0 + kBlockN) * p.k_st.seq, p.k_st.seq, kBlockN,
                   static_cast<int>(imin(kBlockN, p.Sk - j0 - kBlockN)));
    cp_async_commit();

    // Online softmax over this tile, rows g (r = 0) and g + 8 (r = 1).
    const bool edge = j0 + kBlockN > p.Sk || (kCausal && j0 + kBlockN - 1 > i0);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int t = 0; t < kBlockN / 8; ++t)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = s[t][2 * r + e] * scale2;
          if (edge) {
            const int64_t key = j0 + t * 8 + tig * 2 + e;
            if (key >= p.Sk || (kCausal && key > row[r])) x = -INFINITY;
          }
          s[t][2 * r + e] = x;
          mx = fmaxf(mx, x);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[r], mx);
      const float shift = m_new == -INFINITY ? 0.f : m_new;  // nothing visible yet
      const float alpha = exp2_approx(m[r] - shift);
      m[r] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int t = 0; t < kBlockN / 8; ++t)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = exp2_approx(s[t][2 * r + e] - shift);
          s[t][2 * r + e] = pe;
          sum += pe;
        }
      l[r] = l[r] * alpha + sum;
#pragma unroll
      for (int t = 0; t < D / 8; ++t) {
        o[t][2 * r] *= alpha;
        o[t][2 * r + 1] *= alpha;
      }
    }

    cp_async_wait<1>();  // V_j has landed (K_{j+1} may still be in flight)
    __syncthreads();
    // O += P V_j: P from the S accumulators (C layout of two n-tiles = A layout
    // of one k-step), V_j as B through ldmatrix.trans.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint32_t pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]),
                              pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                              pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t vb[4];  // B fragments of d-tiles 2dp, 2dp + 1
        ldmatrix_x4_trans(vb, sV + swz<D>(kk * 16 + (lane & 15), dp * 2 + (lane >> 4)));
        mma16816<T>(o[2 * dp], pa, vb[0], vb[1]);
        mma16816<T>(o[2 * dp + 1], pa, vb[2], vb[3]);
      }
    }
    __syncthreads();  // every warp is done with sV before the next tile's load
  }

  // out = o / l, lse = (m + log2 l) ln 2; rows past Sq are not stored.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float lr = l[r];
    lr += __shfl_xor_sync(0xffffffffu, lr, 1);
    lr += __shfl_xor_sync(0xffffffffu, lr, 2);
    if (row[r] >= p.Sq) continue;
    const float inv = lr > 0.f ? 1.f / lr : 0.f;
    T *out = static_cast<T *>(p.out) + b * p.out_st.batch + h * p.out_st.head + row[r] * p.out_st.seq;
    store_row<D>(out, o, r, inv);
    if (tig == 0)
      p.lse[b * p.lse_st.batch + h * p.lse_st.head + row[r] * p.lse_st.seq] =
          lr > 0.f ? (m[r] + __log2f(lr)) * kLn2 : -INFINITY;
  }
}

template <int D, bool kCausal, class T>
const char *launch(const fo_attn_params &p, cudaStream_t stream) {
  constexpr size_t smem = (kBlockM + 2 * kBlockN) * D * sizeof(T);
  auto kernel = attn_fwd_kernel<D, kCausal, T>;
  if (smem > 48 * 1024 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
          cudaSuccess)
    return fo::last_error();
  const dim3 grid(static_cast<unsigned>((p.Sq + kBlockM - 1) / kBlockM),
                  static_cast<unsigned>(p.B * p.Hq));
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return fo::last_error();
}

template <int D, class T>
const char *launch_causal(const fo_attn_params &p, cudaStream_t stream) {
  return p.causal ? launch<D, true, T>(p, stream) : launch<D, false, T>(p, stream);
}

template <class T>
const char *launch_dim(const fo_attn_params &p, cudaStream_t stream) {
  switch (p.D) {
    case 64: return launch_causal<64, T>(p, stream);
    case 128: return launch_causal<128, T>(p, stream);
    default: return "fo_attn_fwd_cuda: head dim not built (64 and 128 are)";
  }
}

}  // namespace

extern "C" const char *fo_attn_fwd_cuda(const fo_attn_params *p, void *stream) {
  if (p->B * p->Hq == 0 || p->Sq == 0) return nullptr;
  if (p->B * p->Hq > 65535) return "fo_attn_fwd_cuda: batch x heads above 65535";
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p->dtype) {
    case FO_BF16: return launch_dim<__nv_bfloat16>(*p, s);
    case FO_F16: return launch_dim<__half>(*p, s);
    default: return "fo_attn_fwd_cuda: dtype not built (float16 and bfloat16 are)";
  }
}
