/* Attention (flash attention): the C interface between the kernels
 * (attention_cpu.c, attention_*_cuda.cu) and the registration shim
 * (attention_ops.cpp).
 *
 *   forward:  s = scale * q k^T (masked),  lse = logsumexp_j s,  out = softmax(s) v
 *   backward: p = exp(s - lse), delta = rowsum(dout * out), dv = p^T dout,
 *             ds = p * (dout v^T - delta), dq = scale * ds k, dk = scale * ds^T q
 *
 * Layout: q, out, dout, dq are [B, Sq, Hq, D]; k, v, dk, dv are [B, Sk, Hkv, D];
 * each read or written through 64-bit element strides for batch, seq and head,
 * unit stride along D (so (B, S, H, D) tensors and transposed (B, H, S, D) views
 * alike). lse is fp32 [B, Hq, Sq] (natural log), strides for batch, head, seq.
 * Grouped-query attention: q head h reads k/v head h / (Hq / Hkv).
 *
 * Masks: query i of a sequence of sq queries and sk keys sees the keys j with
 *   i + diag - window_left <= j <= i + diag + window_right,   0 <= j < sk
 * (a negative window side is unbounded). diag is 0 in the padded layout (the
 * top-left alignment of torch's scaled_dot_product_attention(is_causal=True):
 * query i sees keys j <= i, for Sq != Sk too) and sk - sq within a varlen
 * sequence (FlashAttention's bottom-right alignment). causal is window_right
 * = 0; the shim folds it in, so kernels read the window only (fo_attn_keys).
 * A row with no visible key has out = 0 and lse = -inf, as torch gives.
 * softcap > 0 replaces each scaled score s by softcap tanh(s / softcap).
 *
 * Varlen (cu_seqlens_q != NULL): B sequences packed along the seq dimension;
 * sequence b has queries cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 and keys
 * likewise from cu_seqlens_k (int32, on q's device); Sq, Sk are the longest
 * sequence's lengths; batch strides are unused; lse is [Hq, total_q]
 * (lse_st.head = total_q, lse_st.seq = 1) and each sequence's rows start at
 * its cu_seqlens_q entry there too. All math is fp32; inputs and outputs
 * share one dtype. */
#pragma once
#include "../common/fo_types.h"

#ifdef __CUDACC__
#define FO_ATTN_HD __host__ __device__ /* the kernels use the row padding too */
#else
#define FO_ATTN_HD
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fo_attn_strides {
  int64_t batch, seq, head; /* in elements */
} fo_attn_strides;

typedef struct fo_attn_params {
  int64_t B, Hq, Hkv, Sq, Sk, D;
  const void *q, *k, *v;     /* inputs of both directions */
  void *out;                 /* written by the forward, read by the backward */
  float *lse;                /* [B, Hq, Sq] fp32: likewise */
  const void *dout;          /* backward only: [B, Sq, Hq, D] */
  void *dq, *dk, *dv;        /* backward only: written */
  fo_attn_strides q_st, k_st, v_st, out_st, dout_st, dq_st, dk_st, dv_st;
  fo_attn_strides lse_st;    /* .seq is the stride along Sq, .head along Hq */
  float *workspace;          /* backward: fp32 scratch, size from fo_attn_bwd_*_workspace */
  int64_t splits;            /* backward (CPU): key-tile splits, fo_attn_bwd_cpu_splits() */
  float scale;
  int causal;                /* window_left < 0 && window_right == 0: the kernels' causal case */
  int64_t window_left, window_right; /* set by the shim (causal folded in); -1: unbounded */
  float softcap;             /* 0: none */
  const int32_t *cu_seqlens_q, *cu_seqlens_k; /* varlen: B + 1 offsets each; NULL: padded */
  int64_t total_q, total_k;  /* varlen: the rows of q and of k, v (the tensor maps' extent) */
  int deterministic;         /* backward: bitwise-repeatable gradients */
  int wgmma;                 /* CUDA: the Hopper kernels take the call; the shim sets it once
                                (fo_attn_wgmma_applies), so that the backward's workspace size
                                and its launches agree */
  fo_dtype dtype;
} fo_attn_params;

/* Whether any window side is bounded (causal included). */
FO_ATTN_HD static inline int fo_attn_banded(const fo_attn_params *p) {
  return p->window_left >= 0 || p->window_right >= 0;
}
/* Whether a call has more than the padded layout with no mask or a causal
 * one: a window beyond causal, soft-capping or varlen (kernels that keep
 * separate instances for those ask here). */
FO_ATTN_HD static inline int fo_attn_general(const fo_attn_params *p) {
  return p->window_left >= 0 || p->window_right > 0 || p->softcap > 0.f || p->cu_seqlens_q != NULL;
}
/* The keys [*lo, *hi) that query i of a sequence of sq queries and sk keys
 * sees (*lo >= *hi: none): the rule above, for kernels and planners alike. */
FO_ATTN_HD static inline void fo_attn_keys(const fo_attn_params *p, int64_t i, int64_t sq, int64_t sk,
                                           int64_t *lo, int64_t *hi) {
  const int64_t c = i + (p->cu_seqlens_q ? sk - sq : 0);
  *lo = p->window_left >= 0 && c - p->window_left > 0 ? c - p->window_left : 0;
  *hi = p->window_right >= 0 && c + p->window_right + 1 < sk ? c + p->window_right + 1 : sk;
}

/* CPU (attention_cpu.c): C11 + OpenMP, tiled online softmax, O(S) extra memory.
 * Always deterministic for a given thread count; with p->deterministic set
 * the results do not depend on the thread count either. Each returns NULL,
 * or FO_CPU_OOM. */
const char *fo_attn_fwd_cpu(const fo_attn_params *p);
/* The backward splits the key tiles of each (batch, kv head) into this many
 * groups, each summing its own fp32 dq partial; the partials are then added
 * in a fixed order. */
int64_t fo_attn_bwd_cpu_splits(const fo_attn_params *p);
/* The (q head, query) rows of a CPU call: B Hq Sq, or Hq total_q in varlen
 * (the CPU reads cu_seqlens_q in host memory). */
static inline int64_t fo_attn_cpu_rows(const fo_attn_params *p) {
  return p->cu_seqlens_q ? p->Hq * p->cu_seqlens_q[p->B] : p->B * p->Hq * p->Sq;
}
/* Floats of p->workspace the CPU backward needs with p->splits set. */
static inline int64_t fo_attn_bwd_cpu_workspace(const fo_attn_params *p) {
  return (p->splits * p->D + 1) * fo_attn_cpu_rows(p);
}
const char *fo_attn_bwd_cpu(const fo_attn_params *p);

/* CUDA (attention_fwd_cuda.cu, attention_bwd_cuda.cu). Launch on `stream` (a
 * cudaStream_t); return NULL on success or a static message naming the error.
 * The backward adds dq with fp32 atomics where fo_attn_bwd_cuda_atomic_dq. */
const char *fo_attn_fwd_cuda(const fo_attn_params *p, void *stream);
/* Whether the Hopper kernels (attention_*_wgmma_cuda.cu) can take p: head dim
 * 64 or 128 on the current device if it is a 9.0 GPU, in a build with sm_90a
 * code, unless the environment sets FUSEDOPS_ATTN_WGMMA=0 (read at every
 * call). The shim asks once a call and sets p->wgmma; the forward takes it
 * where scale > 0 as well. Among them, the warp-specialised kernels (TMA
 * loads) take every call whose layout a tensor map can describe, unless
 * FUSEDOPS_ATTN_WGMMA=1 (attention_sm90.cuh, ws_wanted). Windows beyond
 * causal, soft-capping and varlen only those (the others have no masks):
 * where tensor maps describe q, k, v (and dout, when set). */
int fo_attn_wgmma_applies(const fo_attn_params *p);
const char *fo_attn_fwd_wgmma_cuda(const fo_attn_params *p, void *stream);
/* Whether the CUDA backward adds dq with fp32 atomics (mma.sync kernel) or
 * bulk reductions (wgmma kernel) instead of its deterministic dq kernel:
 * only where that is faster (mma.sync: head dims up to 64, measured equal at
 * 128; wgmma: 64 and 128; docs/perf-notes.md) and determinism is not asked
 * for; on the mma.sync kernel, only calls with no window beyond causal,
 * soft-capping or varlen (those take the dq kernel: its atomic pass's
 * registers have no room for them). */
static inline int fo_attn_bwd_cuda_atomic_dq(const fo_attn_params *p) {
  return !p->deterministic && (p->wgmma || (!fo_attn_general(p) && p->D <= 64));
}
/* The backward's per-row scratch has Sq rounded up to 64 rows (the wgmma
 * kernel's query tile) for each (batch, q head). */
FO_ATTN_HD static inline int64_t fo_attn_bwd_rows(const fo_attn_params *p) { return (p->Sq + 63) & ~(int64_t)63; }
/* Floats of p->workspace the CUDA backward needs: delta = rowsum(dout * out)
 * and lse2 = lse log2(e) (+inf on the padding rows), [B, Hq, rows] each;
 * with atomic dq, then the fp32 dq accumulator, B Hq rows D floats (rows x D
 * per (batch, q head) for the mma.sync kernel; 64 x 64 tiles in the wgmma
 * kernel's fragment order for it). */
static inline int64_t fo_attn_bwd_cuda_dq_acc_offset(const fo_attn_params *p) {
  return 2 * p->B * p->Hq * fo_attn_bwd_rows(p);
}
static inline int64_t fo_attn_bwd_cuda_workspace(const fo_attn_params *p) {
  return fo_attn_bwd_cuda_dq_acc_offset(p) +
         (fo_attn_bwd_cuda_atomic_dq(p) ? p->B * p->Hq * fo_attn_bwd_rows(p) * p->D : 0);
}
/* The Hopper dK, dV kernel (and dq, where atomic), launched by
 * fo_attn_bwd_cuda after the delta kernel where p->wgmma. */
const char *fo_attn_bwd_wgmma_cuda(const fo_attn_params *p, void *stream);
const char *fo_attn_bwd_cuda(const fo_attn_params *p, void *stream);

#ifdef __cplusplus
}
#endif
