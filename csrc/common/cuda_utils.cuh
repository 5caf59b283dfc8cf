// CUDA helpers shared by every op's kernels: fp32 <-> storage dtype,
// 16-byte vector load/store of a chunk, team (warp or block) sums, device
// properties, and the dtype dispatch that turns fo_dtype tags into types.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include <type_traits>

#include "fo_types.h"

namespace fo {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// N elements of T moved as one unit: 16-byte aligned when it is 16 bytes or
// more (a 32-byte pack is two 16-byte accesses), naturally aligned otherwise.
template <class T, int N>
struct alignas(sizeof(T) * N >= 16 ? 16 : sizeof(T) * N) Pack {
  T v[N];
};

// Raw pack load / store. Packs of 16 or 32 bytes go through uint4 so that
// they are always single 16-byte instructions (LDG.128 / STG.128); with a
// struct copy the compiler sometimes splits a store into four 4-byte ones.
// How a load is cached (kReadOnly and kKeep only for arrays the kernel never
// writes: the compiler may move those loads past any store):
//   kPlain     the default;
//   kReadOnly  the read-only (non-coherent) path;
//   kKeep      evict_last in L1 and L2, so that a small array read by every
//              row (a norm's weight) stays in L1 while the rows stream
//              through it (how Triton loads such arrays).
enum Cache : int { kPlain = 0, kReadOnly = 1, kKeep = 2 };
template <int kCache>
__device__ __forceinline__ uint4 load16(const uint4 *p) {
  if constexpr (kCache == kKeep) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    return __ldg(p);  // no cache policies before sm_80
#else
    uint4 v;
    uint64_t policy;
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    asm("ld.global.L1::evict_last.L2::cache_hint.v4.b32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "l"(policy));
    return v;
#endif
  } else if constexpr (kCache == kReadOnly) {
    return __ldg(p);
  } else {
    return *p;
  }
}
template <int N, int kCache = kPlain, class T>
__device__ __forceinline__ Pack<T, N> load_pack(const T *p) {
  Pack<T, N> pk;
  if constexpr (sizeof(pk) % 16 == 0) {
#pragma unroll
    for (int j = 0; j < (int)(sizeof(pk) / 16); ++j)
      reinterpret_cast<uint4 *>(&pk)[j] = load16<kCache>(reinterpret_cast<const uint4 *>(p) + j);
  } else {
    pk = *reinterpret_cast<const Pack<T, N> *>(p);
  }
  return pk;
}

// A pack's bytes as 32-bit words (packs of 16 bytes or more), loaded and
// kept untouched until pack() is asked for. Loads of 16-bit Packs in a guard
// get split into halves (PRMT) inside it, and so wait there for the data: the
// next chunk's loads issued only after this chunk's had landed (SASS).
// Smaller packs (one element: misaligned rows) are held as they are.
template <class T, int N, bool kWords = sizeof(T) * N % 16 == 0>
struct Raw {
  uint4 q[sizeof(T) * N / 16];
  __device__ __forceinline__ Pack<T, N> pack() const {
    Pack<T, N> pk;
#pragma unroll
    for (int j = 0; j < (int)(sizeof(pk) / 16); ++j) reinterpret_cast<uint4 *>(&pk)[j] = q[j];
    return pk;
  }
};
template <class T, int N>
struct Raw<T, N, false> {
  Pack<T, N> p;
  __device__ __forceinline__ Pack<T, N> pack() const { return p; }
};
template <int N, int kCache = kPlain, class T>
__device__ __forceinline__ Raw<T, N> load_raw(const T *p) {
  Raw<T, N> r;
  if constexpr (sizeof(T) * N % 16 == 0) {
#pragma unroll
    for (int j = 0; j < (int)(sizeof(r) / 16); ++j) r.q[j] = load16<kCache>(reinterpret_cast<const uint4 *>(p) + j);
  } else {
    r.p = load_pack<N, kCache>(p);
  }
  return r;
}

// One 16-byte store to global memory, as a plain (weak) st.global in inline
// PTX, with a memory clobber so that the compiler orders it as it ordered the
// assignment. (Not __stwb: ptxas makes its st.global.wb a strong store,
// STG.E.128.STRONG.SM, which measured slower: docs/perf/norm.md.)
__device__ __forceinline__ void store16(uint4 *p, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// A pack stored to global memory (with kPtx, global only: st.global). With
// kPtx (the default) packs of 8 bytes and of 16 or more go out as one vector
// store each (STG.64 / STG.128) in inline PTX. Assigned as uint4 or uint2,
// NVVM split some of them into 32-bit stores, four STG.E a 16-byte pack (so
// already in the PTX): half the stores of fwd_regs' 32-value kernels, a
// quarter to all of swiglu's backward (docs/perf-notes.md, v15). !kPtx keeps
// the assignment, for the kernels where the inline PTX measured slower or
// spilled; tools/ci/ptx_stores.py (CI) names any split store left.
template <int N, bool kPtx = true, class T>
__device__ __forceinline__ void store_pack(T *p, const Pack<T, N> &pk) {
  if constexpr (sizeof(pk) % 16 == 0) {
#pragma unroll
    for (int j = 0; j < (int)(sizeof(pk) / 16); ++j) {
      const uint4 v = reinterpret_cast<const uint4 *>(&pk)[j];
      if constexpr (kPtx) store16(reinterpret_cast<uint4 *>(p) + j, v);
      else reinterpret_cast<uint4 *>(p)[j] = v;
    }
  } else if constexpr (kPtx && sizeof(pk) == 8) {
    const uint2 v = *reinterpret_cast<const uint2 *>(&pk);
    asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
  } else {
    *reinterpret_cast<Pack<T, N> *>(p) = pk;
  }
}

// Value i of a pack as fp32. bf16 pairs are read as 32-bit words: the low
// value shifted up, the high one masked (one instruction each; a bf16
// element took an extract and a shift).
template <class T, int N>
__device__ __forceinline__ float pack_value(const Pack<T, N> &pk, int i) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
    const uint32_t w = reinterpret_cast<const uint32_t *>(&pk)[i / 2];
    return __uint_as_float(i % 2 ? w & 0xffff0000u : w << 16);
  } else {
    return to_f(pk.v[i]);
  }
}

// pack_value(pk, i) again, by another instruction (bf16 pairs: PRMT, not a
// shift or a mask), for a pass that comes after pk's values were unpacked
// once: ptxas then keeps the packed word live rather than every float it
// unpacked before (one register for two values). Other types: pack_value.
template <class T, int N>
__device__ __forceinline__ float pack_value_again(const Pack<T, N> &pk, int i) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
    const uint32_t w = reinterpret_cast<const uint32_t *>(&pk)[i / 2];
    return __uint_as_float(__byte_perm(w, 0u, i % 2 ? 0x3254 : 0x1054));  // w's high / low half, over zeros
  } else {
    return pack_value(pk, i);
  }
}

template <int N, class T>
__device__ __forceinline__ void unpack(const Pack<T, N> &pk, float (&out)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = pack_value(pk, i);
}

template <int N, int kCache = kPlain, class T>
__device__ __forceinline__ void load_f(const T *p, float (&out)[N]) {
  unpack(load_pack<N, kCache>(p), out);
}

// v rounded to T. 16-bit types convert two values an instruction
// (F2FP.PACK_AB), where one at a time took a conversion each and a PRMT a pair.
template <class T, int N>
__device__ __forceinline__ Pack<T, N> to_pack(const float (&v)[N]) {
  Pack<T, N> pk;
  if constexpr (N % 2 == 0 && std::is_same_v<T, __nv_bfloat16>) {
#pragma unroll
    for (int i = 0; i < N; i += 2)
      reinterpret_cast<__nv_bfloat162 *>(&pk)[i / 2] = __floats2bfloat162_rn(v[i], v[i + 1]);
  } else if constexpr (N % 2 == 0 && std::is_same_v<T, __half>) {
#pragma unroll
    for (int i = 0; i < N; i += 2) reinterpret_cast<__half2 *>(&pk)[i / 2] = __floats2half2_rn(v[i], v[i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) pk.v[i] = from_f<T>(v[i]);
  }
  return pk;
}

// a + b rounded to T, for packs of a 16-bit T: two values an instruction
// (HADD2; before sm_90 an FMA by one), where unpacking both, adding in fp32
// and rounding took seven instructions a pair. One rounding of the exact sum
// is bitwise what rounding the fp32 sum gives (eager's arithmetic): that sum
// is exact unless the exponents differ by more than 16 (bf16) or 13 (fp16),
// and then the smaller value is too small to move the rounding either way.
template <class T, int N>
__device__ __forceinline__ Pack<T, N> add_pack(const Pack<T, N> &a, const Pack<T, N> &b) {
  static_assert(sizeof(T) == 2 && N % 2 == 0, "pairs of a 16-bit type");
  using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  Pack<T, N> out;
#pragma unroll
  for (int i = 0; i < N / 2; ++i)
    reinterpret_cast<T2 *>(&out)[i] =
        __hadd2_rn(reinterpret_cast<const T2 *>(&a)[i], reinterpret_cast<const T2 *>(&b)[i]);
  return out;
}

template <int N, bool kPtx = true, class T>
__device__ __forceinline__ void store_f(T *p, const float (&in)[N]) {
  store_pack<N, kPtx>(p, to_pack<T>(in));
}

// Stores v as T and leaves in v what was stored (the values rounded to T):
// one conversion each way, where rounding first and converting again to
// store converted twice.
template <int N, class T>
__device__ __forceinline__ void store_rounded(T *p, float (&v)[N]) {
  const Pack<T, N> pk = to_pack<T>(v);
  store_pack<N>(p, pk);
  unpack(pk, v);
}

template <int K>
__device__ __forceinline__ void warp_sum(float (&v)[K]) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], off);
}

// Barrier among the `threads` threads of team `id` (named barrier id + 1; 0 is
// __syncthreads). A block holds at most 15 teams.
__device__ __forceinline__ void team_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id + 1), "r"(threads) : "memory");
}

// Sum K values over a team of `team` threads (a multiple of 32) that is row
// threadIdx.y of the block. A team of 32 is one warp and needs no shared
// memory; a larger team uses red[0..32*K) (its own slice) and a barrier: its
// named barrier, or with kWholeBlock (the team is the whole block:
// blockDim.y == 1) barrier 0. A run-time barrier id makes ptxas reserve all
// 16 named barriers for every block, and that caps the blocks an SM holds
// (4 on sm_90, ncu "Block Limit Barriers"); barrier 0 alone does not.
// Every thread gets the sum, added in the same order on every thread:
// deterministic. Callers alternate between two `red` slices on successive
// calls, so that no thread overwrites values another still reads.
template <bool kWholeBlock = false, int K>
__device__ __forceinline__ void team_sum(float (&v)[K], int team, float *red) {
  warp_sum(v);
  if (team == 32) return;
  const int lane = threadIdx.x & 31, nwarps = team >> 5;
  if (lane == 0)
#pragma unroll
    for (int k = 0; k < K; ++k) red[k * 32 + (threadIdx.x >> 5)] = v[k];
  if (kWholeBlock) __syncthreads();
  else team_sync(threadIdx.y, team);
  // Each group of `lanes` lanes (nwarps rounded up to a power of two) reads
  // the warps' sums and adds them by an xor butterfly: one shared-memory
  // read a value, where a loop over the warps' sums took nwarps.
  const int lanes = 1 << (32 - __clz(nwarps - 1)), w = lane & (lanes - 1);
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = w < nwarps ? red[k * 32 + w] : 0.f;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    if (off < lanes)
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], off);
}

// --- shared-memory addresses and mbarriers ------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// cp.async (sm_80 and up): 16 bytes global -> shared without a register,
// zeros when !valid; completion in groups (commit_group), waited for as "at
// most N groups still in flight". The memory clobbers keep the compiler from
// moving shared-memory reads or writes across them: a thread that reads back
// its own copies needs no barrier, only the wait.
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// BYTES (a multiple of 16) global -> shared by cp.async.
template <int BYTES>
__device__ __forceinline__ void cp_async_bytes(void *dst, const void *src) {
  static_assert(BYTES % 16 == 0, "cp.async moves 16-byte pieces");
#pragma unroll
  for (int j = 0; j < BYTES / 16; ++j)
    cp_async16(static_cast<char *>(dst) + 16 * j, static_cast<const char *>(src) + 16 * j, true);
}
// cp_async_wait for a count known only at run time (0 to 3).
__device__ __forceinline__ void cp_async_wait_for(int pending) {
  switch (pending) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    default: cp_async_wait<3>(); break;
  }
}

// mbarriers (8 bytes of shared memory each; sm_90 and up: the waits use
// try_wait.parity). Below sm_90 they trap: the host launches no kernel that
// uses them there.
__device__ __forceinline__ void mbar_init(uint64_t *bar, int count) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
#else
  __trap();
#endif
}
// Waits for the completion of bar's phase of parity `parity` (0 for its first).
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
#if __CUDA_ARCH__ >= 900
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
#else
  __trap();
#endif
}

// --- thread-block clusters (sm_90 and up) -------------------------------------------------
// A row too wide for one block's registers is split across the blocks of a
// cluster, which exchange their partial sums through distributed shared
// memory. The helpers compile on every architecture and trap below sm_90,
// where the host never launches a cluster.
__device__ __forceinline__ int cluster_size() {
#if __CUDA_ARCH__ >= 900
  int n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return n;
#else
  return 1;
#endif
}

__device__ __forceinline__ int cluster_rank() {
#if __CUDA_ARCH__ >= 900
  int r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
#else
  return 0;
#endif
}

// Cluster barrier, split: every thread of every block arrives, then waits
// for all the others. The arrive is relaxed: it publishes none of the
// thread's memory writes (a release arrive would first wait for every global
// store the thread has in flight; the data goes through mbarriers instead).
__device__ __forceinline__ void cluster_arrive() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#else
  __trap();
#endif
}

// The values of a row of `cols` that slice `rank` holds, where slices of
// `span` values split it in rank order: [rank * span, (rank + 1) * span)
// within [0, cols), so 0 for a slice past the row's end.
__device__ __forceinline__ int64_t slice_count(int64_t cols, int rank, int span) {
  const int64_t left = cols - (int64_t)rank * span;
  return left <= 0 ? 0 : left < span ? left : span;
}

// Sums of K floats over the blocks of a cluster (or, with moments(), a row's
// sum and squared deviations from its slices'), passed by asynchronous
// stores into every block's shared memory (st.async), each completing on the
// receiver's mbarrier, so that no block waits on a barrier of the whole
// cluster, nor for its global stores to drain, per exchange. NBUF exchanges
// may be under way at once, each in its own buffer and mbarrier; exchange e
// uses buffer e % NBUF. Protocol: init() by every thread at the start, then
// cluster_arrive(), and cluster_wait() before the first exchange; every block
// makes the same sequence of sum() / moments() calls; cluster_arrive() + cluster_wait()
// before exit (no block may leave while a store to it is under way). Reuse
// of a buffer is safe when, between two exchanges of the same buffer, the
// block's threads meet at a block barrier (every caller's row reduction has
// one): a block's store for exchange e + NBUF follows its receipt of every
// block's exchange e + 1, and so every block's reads of exchange e.
template <int K, int NBUF>
struct ClusterSum {
  static constexpr int kMaxBlocks = 16;
  uint64_t bar[NBUF];
  float slot[NBUF][kMaxBlocks][K];

  __device__ __forceinline__ void init() {
#if __CUDA_ARCH__ >= 900
    if (threadIdx.x == 0 && threadIdx.y == 0) {
      for (int b = 0; b < NBUF; ++b) mbar_init(&bar[b], 1);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
#endif
  }

  // v: this block's sums (the same on every thread); on return, the cluster's,
  // added in rank order by an xor butterfly: the same bits on every thread of
  // every block. e: the exchange's number, counted from 0 by every block.
  __device__ __forceinline__ void sum(float (&v)[K], int e) {
    const int b = send_wait(v, e), lane = threadIdx.x & 31, n = cluster_size();
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = lane < n ? slot[b][lane][k] : 0.f;
    warp_sum(v);
  }

  // A row's first two moments from slices of `span` values a block (rank r
  // holds columns [r * span, (r + 1) * span) of `cols`; some may hold none).
  // v: this block's (sum, squared deviations from its own slice's mean), the
  // same on every thread; on return the row's (sum, squared deviations from
  // the row's mean), by the pairwise combination of Chan, Golub and LeVeque:
  // the slices' squared deviations plus each slice's count times its mean's
  // squared distance from the row's. One exchange where the sum and then the
  // deviations from the row's mean took two, and no cancellation (the row's
  // sum of squares less its squared sum would lose what a large mean hides).
  // The same bits on every thread of every block, as sum().
  __device__ __forceinline__ void moments(float (&v)[K], int e, int64_t cols, int span) {
    static_assert(K == 2, "a sum and a sum of squared deviations");
    const int b = send_wait(v, e), lane = threadIdx.x & 31, n = cluster_size();
    const float count = lane < n ? (float)slice_count(cols, lane, span) : 0.f;
    const float part = count > 0.f ? slot[b][lane][0] : 0.f;
    float total[1] = {part};
    warp_sum(total);
    const float mean = total[0] / (float)cols, d = count > 0.f ? part / count - mean : 0.f;
    float sq[1] = {count > 0.f ? slot[b][lane][1] + count * d * d : 0.f};
    warp_sum(sq);
    v[0] = total[0];
    v[1] = sq[0];
  }

 private:
  // Exchange e: v to this block's slot in every block of the cluster; returns
  // the buffer once every block's values have arrived here.
  __device__ __forceinline__ int send_wait(const float (&v)[K], int e) {
#if __CUDA_ARCH__ >= 900
    const int b = e % NBUF, n = cluster_size();
    const uint32_t phase = (uint32_t)(e / NBUF) & 1u;
    const uint32_t bar_a = smem_addr(&bar[b]);
    if (threadIdx.x == 0 && threadIdx.y == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_a), "r"(n * K * 4)
                   : "memory");
      const uint32_t mine = smem_addr(&slot[b][cluster_rank()][0]);
      for (int r = 0; r < n; ++r) {
        uint32_t dst, rbar;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(dst) : "r"(mine), "r"(r));
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rbar) : "r"(bar_a), "r"(r));
        if constexpr (K == 1)
          asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
                       ::"r"(dst), "f"(v[0]), "r"(rbar) : "memory");
        else
          asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
                       ::"r"(dst), "f"(v[0]), "f"(v[1]), "r"(rbar) : "memory");
      }
    }
    mbar_wait(&bar[b], phase);
    return b;
#else
    __trap();
    return 0;
#endif
  }
};
static_assert(sizeof(uint64_t) == 8, "mbarrier is 8 bytes");

// Attribute A of `device` (cached per device), or `fallback` where the
// device number is out of range, the driver fails or the value is below LO.
// One int a device (0: not asked yet; -1: no value; else the value - LO + 1),
// so that threads that race to fill it write the same word.
template <cudaDeviceAttr A, int LO = 1>
int device_attr(int device, int fallback) {
  static int cache[64];
  if (device < 0 || device >= 64) return fallback;
  if (!cache[device]) {
    int v = 0;
    cache[device] = cudaDeviceGetAttribute(&v, A, device) == cudaSuccess && v >= LO ? v - LO + 1 : -1;
  }
  return cache[device] > 0 ? cache[device] + LO - 1 : fallback;
}

inline int sm_count(int device) { return device_attr<cudaDevAttrMultiProcessorCount>(device, 132); }

// The memory bandwidth an SM has to itself, in GB/s, from the device's
// memory clock and bus width (0 where the driver does not say): 25 on an
// H100 SXM (3.35 TB/s over 132 SMs), 36 on an H200 (4.8 TB/s). Plans that
// differ between such GPUs key on it.
inline int mem_gbps_per_sm(int device) {
  const int khz = device_attr<cudaDevAttrMemoryClockRate>(device, 0);
  const int bits = device_attr<cudaDevAttrGlobalMemoryBusWidth>(device, 0);
  return (int)(2.0 * khz * 1e3 * bits / 8 / 1e9 / sm_count(device) + 0.5);  // double data rate: two transfers a clock
}

// Whether the device's SMs have more memory bandwidth each than an H100's
// (25 GB/s an SM): over 30, as an H200's (36). The streaming plans that
// differ between the two key on this one test; no GPU between the two was
// measured, so 30 is a guess between two points.
inline bool bandwidth_rich_sms(int device) { return mem_gbps_per_sm(device) > 30; }

// The most shared memory one block may opt in to (cached): 227 KB on an
// H100, 163 KB on an A100.
inline int smem_optin(int device) {
  return device_attr<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device, 48 * 1024);
}

// Compute capability of `device` as 10 * major + minor (cached; 0 where the
// driver does not say).
inline int compute_capability(int device) {
  const int major = device_attr<cudaDevAttrComputeCapabilityMajor>(device, 0);
  const int minor = device_attr<cudaDevAttrComputeCapabilityMinor, 0>(device, -1);  // 9.0's minor is 0
  return major > 0 && minor >= 0 ? 10 * major + minor : 0;
}

inline int current_device() {
  int d = 0;
  cudaGetDevice(&d);
  return d;
}

// A per-thread cache of the last N answers of a host query (an occupancy,
// an attribute set): keys compared with ==, a miss taking the slot after the
// last one taken, so that once full the oldest entry goes first. Zero-
// initialised, so a thread_local one needs no guard.
template <class Key, class Val, int N>
struct RingCache {
  struct Entry { Key key; Val val; };
  Entry e[N]{};
  int used = 0, next = 0;  // entries filled; the one the next miss takes
  const Val *find(const Key &k) const {
    for (int i = 0; i < used; ++i)
      if (e[i].key == k) return &e[i].val;
    return nullptr;
  }
  void put(const Key &k, const Val &v) {
    e[next] = {k, v};
    next = (next + 1) % N;
    used = used < N ? used + 1 : N;
  }
};

// A kernel with the launch settings a host query depends on: RingCache's key.
struct LaunchKey {
  const void *kernel;
  int a, b;  // e.g. threads a block, cluster size, device
  size_t smem;
  bool operator==(const LaunchKey &o) const {
    return kernel == o.kernel && a == o.a && b == o.b && smem == o.smem;
  }
};

// Resident blocks per multiprocessor of `kernel` at this block size and
// dynamic shared memory, from the occupancy calculator (cached per thread).
template <class K>
int blocks_per_sm(K *kernel, int threads, size_t smem) {
  thread_local RingCache<LaunchKey, int, 64> cache;
  const LaunchKey key{(const void *)kernel, threads, 0, smem};
  if (const int *n = cache.find(key)) return *n;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess || n < 1)
    n = 1;
  cache.put(key, n);
  return n;
}

// Lets `kernel` take `smem` bytes of dynamic shared memory on `device`: past
// 48 KB of static and dynamic shared memory together a kernel must ask first,
// so any nonzero request asks (a kernel's static bytes count against the 48).
// The first call for a kernel and device (on this thread) sets the attribute,
// later calls are a look-up (a cudaFuncSetAttribute each call cost about as
// much host time as the launch). The most a block may have, not `smem`: the
// attribute is the kernel's, not the thread's, and a smaller grant for one
// call would fail a larger launch of the kernel on another.
template <class K>
cudaError_t grant_smem(K *kernel, size_t smem, int device = current_device()) {
  if (smem == 0) return cudaSuccess;
  thread_local RingCache<LaunchKey, bool, 32> granted;
  const LaunchKey key{(const void *)kernel, device, 0, 0};
  if (granted.find(key)) return cudaSuccess;
  cudaFuncAttributes a{};
  cudaError_t e = cudaFuncGetAttributes(&a, kernel);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             smem_optin(device) - (int)a.sharedSizeBytes);
  if (e == cudaSuccess) granted.put(key, true);
  return e;
}

inline bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <class T> struct Tag { using type = T; };

// Calls f(Tag<T>{}) for the storage type of fo_dtype t.
template <class F>
decltype(auto) with_type(fo_dtype t, F &&f) {
  switch (t) {
    case FO_F16: return f(Tag<__half>{});
    case FO_BF16: return f(Tag<__nv_bfloat16>{});
    default: return f(Tag<float>{});
  }
}

inline const char *last_error() {
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace fo
