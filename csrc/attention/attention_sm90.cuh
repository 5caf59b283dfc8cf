// Hopper (sm_90a) building blocks shared by the wgmma attention kernels
// (attention_fwd_wgmma_cuda.cu, attention_bwd_wgmma_cuda.cu): tiles in
// wgmma's 128-byte-swizzled shared layout, filled by cp.async; matrix
// descriptors over them; wgmma fences, commits and waits; the async-proxy
// fence; bulk reductions from shared to global memory. The wrappers of
// wgmma.mma_async itself are generated: wgmma.cuh.
#pragma once
#include <cuda.h>  // CUtensorMap and its enums (the driver is reached through the runtime)
#include <stdlib.h>

#include "attention_mma.cuh"
#include "wgmma.cuh"

namespace fo_attn {

// A [kRows, D] tile as D / 64 column blocks of [kRows, 64]: 128-byte rows,
// 16-byte chunk c of row r at chunk c ^ (r mod 8) (wgmma's 128-byte swizzle;
// every block starts on a 1024-byte boundary). Element offset of chunk c
// (0 .. D/8 - 1) of row r:
template <int kRows>
__device__ __forceinline__ int sw128(int r, int c) {
  return (c >> 3) * kRows * 64 + r * 64 + (((c & 7) ^ (r & 7)) << 3);
}

// A thread's share of copying a [kRows, D] tile from global memory into
// shared (sw128) with the block's kThreads threads: chunk c = t % (D/8) of
// rows r0 = t / (D/8), r0 + kStep, ... Its chunk, the row's swizzle (row
// mod 8 stays fixed) and so its shared offset pattern are the same for every
// row, and the global address advances by a fixed stride: a few instructions
// a copy. Callers walking a sequence of tiles (K, V by key tile) keep the
// address of their first chunk and add a tile's stride, rather than
// recomputing it from the tile's base.
template <int D, int kRows, int kThreads>
struct Sw128Share {
  static constexpr int kChunks = D / 8, kStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kRows % kStep == 0 && kStep % 8 == 0, "tile shape");
  int r0 = threadIdx.x / kChunks, c = threadIdx.x % kChunks;

  // This thread's first chunk of a tile whose row 0 is at base.
  template <class T>
  __device__ __forceinline__ const T *first(const T *base, int64_t row_stride) const {
    return base + r0 * row_stride + c * 8;
  }
  // The tile whose thread-first chunk is at src into sm; rows >= valid_rows
  // zero-filled (their source address: safe, any readable one).
  template <class T>
  __device__ __forceinline__ void copy(T *sm, const T *src, int64_t row_stride, int valid_rows,
                                       const T *safe) const {
    T *dst = sm + sw128<kRows>(r0, c);
    if (valid_rows >= kRows) {  // every tile but a tail (warp-uniform): no row tests
#pragma unroll
      for (int i = 0; i < kRows / kStep; ++i) cp_async16(dst + i * kStep * 64, src + i * kStep * row_stride, true);
    } else {
#pragma unroll
      for (int i = 0; i < kRows / kStep; ++i) {
        const bool ok = r0 + i * kStep < valid_rows;
        cp_async16(dst + i * kStep * 64, ok ? src + i * kStep * row_stride : safe, ok);
      }
    }
  }
};

// rows x D tile from global (row i at base + i * row_stride) into shared
// (sw128), rows >= valid_rows zero-filled, by the block's kThreads threads.
template <int D, int kRows, int kThreads, class T>
__device__ __forceinline__ void load_tile_sw128(T *sm, const T *base, int64_t row_stride,
                                                int valid_rows) {
  const Sw128Share<D, kRows, kThreads> share;
  share.copy(sm, share.first(base, row_stride), row_stride, valid_rows, base);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Shared-memory matrix descriptor, 128-byte swizzle. lbo: byte distance
// between 64-element column blocks where the operand spans several along its
// contiguous dimension (an N-major B, an M-major A); sbo: between 8-row
// groups (1024). An offset of e elements inside a tile adds e * 2 / 16 to
// the start-address field (no carry: shared addresses stay below 256 KB).
__device__ __forceinline__ uint64_t desc128(const void *p, uint32_t lbo) {
  const uint64_t a = smem_addr(p);
  return ((a & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending of this warpgroup's committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Ties registers (accumulators, or the A fragments of P) to the point where
// it stands, so that the compiler neither reads them before wgmma_wait nor
// writes them after the issue.
template <class E, int NT>
__device__ __forceinline__ void hold(E (&d)[NT][4]) {
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (std::is_same_v<E, float>)
        asm volatile("" : "+f"(d[t][e]));
      else
        asm volatile("" : "+r"(d[t][e]));
    }
}
// Arrives on bar once every cp.async this thread has issued so far has landed.
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t *bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Orders this thread's generic-proxy shared-memory accesses (cp.async
// landings, plain stores) before later async-proxy ones (wgmma operand
// reads, bulk copies), once the threads have met at a barrier.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// dst[0, bytes) += src[0, bytes) in fp32, asynchronously (one thread issues;
// bytes a multiple of 16, both 16-byte aligned). Completion: bulk_commit,
// then bulk_wait_read (src may be overwritten) or bulk_wait (done).
__device__ __forceinline__ void bulk_reduce_add_f32(float *dst, const float *src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// --- warp specialisation: TMA loads, register reallocation, named barriers
// Arrives on bar (count one arrival) and adds `bytes` to the transactions its
// phase waits for; the TMA copies that name bar complete them.
__device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
// The box of a 4-D tensor map at coordinates (c0 innermost .. c3) into shared
// memory at dst (1024-byte aligned for the 128-byte swizzle); completion is
// counted in bytes on bar. Elements outside the tensor arrive as zeros.
__device__ __forceinline__ void tma_load_4d(void *dst, const void *map, uint64_t *bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(smem_addr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
      : "memory");
}
// bytes (a multiple of 16; both addresses 16-byte aligned) from global into
// shared memory, completion counted in bytes on bar.
__device__ __forceinline__ void bulk_load(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
// A warpgroup gives up registers (the producer) or takes them (the
// consumers); every thread of the warpgroup executes it.
template <int kRegs>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
// Named barrier `id` (1..15; 0 is __syncthreads) of kCount threads: sync
// waits for all of them, arrive counts this thread and goes on.
template <int kCount>
__device__ __forceinline__ void named_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kCount) : "memory");
}
template <int kCount>
__device__ __forceinline__ void named_arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kCount) : "memory");
}
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
#endif

using EncodeTiled = CUresult (*)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                 const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled, through the runtime (no link to libcuda).
inline EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void *f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

// A [B, S, H, D] operand (strides st, unit stride along D) as a 4-D tensor
// map, D innermost, read in boxes of 64 columns x `rows` rows with the
// 128-byte swizzle. False where TMA cannot describe it (a zero stride, a
// stride not a multiple of 16 bytes): the caller takes another kernel.
inline bool tensor_map(CUtensorMap *map, const void *base, fo_dtype dtype, int64_t B, int64_t S, int64_t H,
                int64_t D, fo_attn_strides st, int rows) {
  const EncodeTiled encode = encode_tiled();
  if (!encode) return false;
  const int64_t dims[4] = {D, S, H, B}, strides[3] = {st.seq, st.head, st.batch};
  cuuint64_t gdim[4], gstride[3];
  for (int i = 0; i < 4; ++i) {
    if (dims[i] < 1 || dims[i] > (int64_t{1} << 32)) return false;
    gdim[i] = static_cast<cuuint64_t>(dims[i]);
  }
  for (int i = 0; i < 3; ++i) {
    const int64_t s = dims[i + 1] == 1 ? 8 : strides[i];  // a stride never taken: any valid one
    if (s <= 0 || s % 8 != 0 || s >= (int64_t{1} << 39)) return false;
    gstride[i] = static_cast<cuuint64_t>(s) * 2;
  }
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(rows), 1, 1}, unit[4] = {1, 1, 1, 1};
  return encode(map, dtype == FO_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                const_cast<void *>(base), gdim, gstride, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The tensor map of one operand of p: q-shaped (q, dout) or, keys, k-shaped
// (k, v), read in boxes of `rows` rows: [B, S, H, D], or in varlen the packed
// [total, H, D] as one batch entry, a sequence's tiles starting at its
// cu_seqlens row (the kernels mask what a tile reads past its sequence and
// never store it).
inline bool operand_map(CUtensorMap *map, const fo_attn_params &p, const void *base, fo_attn_strides st, bool keys,
                        int rows) {
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int64_t S = varlen ? (keys ? p.total_k : p.total_q) : (keys ? p.Sk : p.Sq);
  if (S >= (int64_t{1} << 31)) return false;  // the kernels' row coordinates are int
  return tensor_map(map, base, p.dtype, varlen ? 1 : p.B, S, keys ? p.Hkv : p.Hq, p.D, st, rows);
}

// Whether the warp-specialised kernels take a Hopper call: yes unless the
// environment sets FUSEDOPS_ATTN_WGMMA=1, which keeps the kernels before them
// (v0 of attention_{fwd,bwd}_wgmma_cuda.cu), for comparison.
inline bool ws_wanted() {
  const char *e = getenv("FUSEDOPS_ATTN_WGMMA");
  return !(e && e[0] == '1');
}

// fo_attn::dispatch for the head dims the wgmma kernels are built for.
template <class F>
const char *dispatch_wgmma(const fo_attn_params &p, F &&f) {
  return dispatch(p, [&](auto d, auto causal, auto t) -> const char * {
    if constexpr (decltype(d)::value == 64 || decltype(d)::value == 128)
      return f(d, causal, t);
    else
      return "fo_attn_wgmma: head dim not built (64 and 128 are)";
  });
}

}  // namespace fo_attn
