/* Flash attention on the CPU: C11 + OpenMP, the tiled online-softmax
 * algorithm of FlashAttention-2 with fp32 tiles in per-thread scratch. Math,
 * layout and masking: attention.h.
 *
 * Forward: one task per (sequence, q head, tile of BQ queries), K/V streamed
 * in tiles of BK keys: only the keys some query of the tile sees (the window
 * of attention.h's fo_attn_keys; causal is its window_right = 0); running max
 * and sum per row, the output rescaled as the max grows.
 * Backward: a pass for delta = rowsum(dout * out); then one task per
 * (sequence, kv head, split): the split's key tiles one after the other, dk/dv
 * summed in the tile over every q head of the group and every query tile that
 * sees it, dq tiles added into the split's own fp32 partial; last, the
 * partials added in split order. No atomics, no S x S matrix: extra memory is
 * the partials (splits x |dq| in fp32, splits = 1 when sequences x kv heads
 * fills the threads).
 * A sequence is a batch entry (padded layout) or one of the packed sequences
 * (varlen): tiles never cross it, so packed documents cost the sum of their
 * own squares. Soft-capping maps each scaled score s to cap tanh(s / cap)
 * before the softmax; the backward multiplies dS by its derivative 1 - tanh^2.
 *
 * FLOPs: 4 B Hq Sq Sk D forward (halved when causal), 2.5x that backward
 * (the five tile products; S is recomputed). Every product of the fp32 tiles
 * goes through one register-blocked kernel (gemm_tile: 8 x 32 blocks with
 * AVX-512, 4 x 16 with AVX2); the softmax loops run on vectors of the
 * level's width (vf: 16 or 8 floats); bf16 inputs with D a multiple of 32
 * take bf16 tiles whose products run on AVX512-BF16 (gemm_bf16, level 5) or
 * on AMX tiles (fo_amx_gemm, level 6, cpu_amx.h). exp is a polynomial exp2 so that the
 * softmax loops vectorise too. Measured: docs/perf/log/attention.md. */
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

#include "attention.h"
#include "../common/cpu_dtype.h"
#include "../common/cpu_scratch.h"
#include "../common/cpu_amx.h"

/* -std=c11 turns floating-point contraction off; the tile products want FMA.
 * The vector code is written out (vf below); the SLP vectoriser only got in
 * its way (it packed the four A values of gemm_tile into one register and
 * shuffled them back out). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=fast", "no-tree-slp-vectorize")
/* The vf helpers below pass vectors by value; they are static inline,
 * so the ABI that this warns about never applies. */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

enum { BQ = 64, BK = 64 }; /* query and key tile sizes */
/* The AMX tiles (cpu_amx.h) in this copy: the v4 one, where the compiler builds them. */
#define ATTN_AMX (FO_LEVEL >= 4 && FO_AMX)
#define LOG2E 1.4426950408889634f

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

static inline const void *elem(const void *base, fo_dtype t, int64_t off) {
  return (const char *)base + off * fo_dtype_size(t);
}

/* VL floats as one value (GNU C vector extension): sixteen in the v4 copy
 * (one AVX-512 register), eight below (one AVX register in the v3 copy, two
 * SSE ones in the baseline). aligned(4): loads and stores need no alignment. */
#if FO_LEVEL >= 4
enum { VL = 16 };
#define VF_LANES {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#else
enum { VL = 8 };
#define VF_LANES {0, 1, 2, 3, 4, 5, 6, 7}
#endif
typedef float vf __attribute__((vector_size(4 * VL), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * VL), aligned(4)));

FO_INLINE vf vf_load(const float *p) { return *(const vf *)p; }
FO_INLINE void vf_store(float *p, vf v) { *(vf *)p = v; }
FO_INLINE vf vf_splat(float x) { return (vf){0} + x; } /* one broadcast (not -0: it gives +0) */
FO_INLINE vf vf_select(vi mask, vf a, vf b) { /* mask ? a : b, lane-wise */
  return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}
FO_INLINE vi vf_iota(int64_t c0) { return (vi)VF_LANES + (int32_t)c0; }
FO_INLINE float vf_hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < VL; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
/* The lanes summed in halves: lane k + VL/2 onto lane k, and so on down. */
FO_INLINE float vf_hsum(vf v) {
  for (int w = VL / 2; w > 0; w /= 2)
    for (int k = 0; k < w; ++k) v[k] += v[k + w];
  return v[0];
}

/* 2^f on [0, 1): a degree-5 polynomial (relative error 1.5e-7), highest
 * coefficient first. */
static const float exp2_poly[6] = {0.0018762329f, 0.0089925844f, 0.055823606f, 0.24015453f, 0.69315296f, 1.0f};

/* 2^x lane-wise: exp2_poly of f = x - floor(x), times 2^floor(x); -inf gives
 * 0, NaN stays NaN, large x a huge value or inf (vf_tanh's case). The v4 copy
 * scales by vscalefps (subnormal below -126, 0 from -200 on; x is clamped to
 * [-200, 128] so that +-inf makes no inf - inf); below v4 by the exponent
 * bits, 0 below -126, x clamped to 127. */
FO_INLINE vf vf_exp2(vf x) {
#if FO_LEVEL >= 4
  /* on a NaN in its second operand, max and min return it */
  const __m512 xc = _mm512_min_ps(_mm512_set1_ps(128.0f), _mm512_max_ps(_mm512_set1_ps(-200.0f), (__m512)x));
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const vf f = (vf)_mm512_sub_ps(xc, n);
  vf q = vf_splat(exp2_poly[0]);
  for (int i = 1; i < 6; ++i) q = q * f + exp2_poly[i];
  return (vf)_mm512_scalef_ps((__m512)q, n);
#else
  const vi under = x < vf_splat(-126.0f);
  vf xc = vf_select(under, vf_splat(-126.0f), x);
  xc = vf_select(xc > vf_splat(127.0f), vf_splat(127.0f), xc);
  const vi t = __builtin_convertvector(xc + 127.0f, vi); /* floor(xc) + 127: xc + 127 >= 1 */
  const vf f = xc - __builtin_convertvector(t - 127, vf);
  vf p = vf_splat(exp2_poly[0]);
  for (int i = 1; i < 6; ++i) p = p * f + exp2_poly[i];
  return vf_select(under, vf_splat(0.0f), p * (vf)(t << 23));
#endif
}

FO_INLINE float exp2_scalar(float x) { return vf_exp2(vf_splat(x))[0]; }

/* tanh lane-wise (relative error a few 1e-7): below |x| = 0.625 Cephes'
 * odd polynomial (1 - 2 / (e^2x + 1) would lose the small values to
 * cancellation), above it 1 - 2 / (e^{2|x|} + 1) with x's sign (exp2 saturates
 * at 2^127: +-1 for large |x| and inf); NaN stays NaN. */
FO_INLINE vf vf_tanh(vf x) {
  const vi sign = (vi)x & (int32_t)0x80000000;
  const vf a = (vf)((vi)x ^ sign), z = x * x;
  const vf poly =
      ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z + 1.33314422036e-1f) * z -
       3.33332819422e-1f) * z * x + x;
  const vf big = (vf)((vi)(1.0f - 2.0f / (vf_exp2(a * (2.0f * LOG2E)) + 1.0f)) | sign);
  return vf_select(x == x, vf_select(a < 0.625f, poly, big), x);
}

/* Scores in log2 units (the softmax runs on exp2) from raw products q.k:
 * s scale log2e, or soft-capped, cap tanh(s scale / cap) log2e. *t gets the
 * tanh (the backward's derivative 1 - t^2) where capped. */
FO_INLINE vf log2_scores(const fo_attn_params *p, vf raw, vf *t) {
  if (p->softcap > 0.0f) {
    *t = vf_tanh(raw * (p->scale / p->softcap));
    return *t * (p->softcap * LOG2E);
  }
  return raw * (p->scale * LOG2E);
}

/* One RB x (CV VL) block of C (RB <= 8, CV <= 2) in RB CV registers across
 * the K loop: per k, CV loads of B and RB broadcasts of A (each folded into
 * its FMAs at v4), RB CV FMAs. Constant RB and CV unroll it into registers. */
FO_INLINE void gemm_block(int RB, int CV, int64_t K, const float *a, int64_t rsa, int64_t csa,
                          const float *restrict b, int64_t ldb, float *restrict c, int64_t ldc, int accumulate) {
  vf acc[8][2];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < CV; ++v) acc[r][v] = accumulate ? vf_load(c + r * ldc + VL * v) : vf_splat(0.0f);
  for (int64_t k = 0; k < K; ++k, a += csa, b += ldb) {
    vf bv[2];
#pragma GCC unroll 2
    for (int v = 0; v < CV; ++v) bv[v] = vf_load(b + VL * v);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const float ar = a[r * rsa]; /* scalar * vector: one broadcast */
#pragma GCC unroll 2
      for (int v = 0; v < CV; ++v) acc[r][v] += ar * bv[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < CV; ++v) vf_store(c + r * ldc + VL * v, acc[r][v]);
}

/* C[M, N] (+)= A[M, K] B[K, N]: A element (i, k) at A[i * rsa + k * csa], so
 * that A may be a transposed tile; B and C row-major. M a multiple of 4, N of
 * 16; K any. Blocks of C stay in registers across the K loop: 8 x 32 with
 * AVX-512 (16 of its 32 registers), 4 x 16 below (8 of 16); 4 rows or 16
 * columns at the edges. */
FO_INLINE void gemm_tile(int64_t M, int64_t N, int64_t K, const float *A, int64_t rsa, int64_t csa,
                         const float *restrict B, int64_t ldb, float *restrict C, int64_t ldc, int accumulate) {
  enum { ROWS = VL == 16 ? 8 : 4 };
  for (int64_t i = 0; i < M;) {
    const int rb = M - i >= ROWS ? ROWS : 4;
    for (int64_t j = 0; j < N;) {
      const int cv = N - j >= 2 * VL ? 2 : 1;
      const float *a = A + i * rsa, *b = B + j;
      float *c = C + i * ldc + j;
      if (rb == ROWS && cv == 2) gemm_block(ROWS, 2, K, a, rsa, csa, b, ldb, c, ldc, accumulate);
      else if (rb == ROWS) gemm_block(ROWS, 1, K, a, rsa, csa, b, ldb, c, ldc, accumulate);
      else if (cv == 2) gemm_block(4, 2, K, a, rsa, csa, b, ldb, c, ldc, accumulate);
      else gemm_block(4, 1, K, a, rsa, csa, b, ldb, c, ldc, accumulate);
      j += VL * cv;
    }
    i += rb;
  }
}

/* n rows of a [.., D] operand into an fp32 tile [rows, ld] (row r at r * ld),
 * widened from dtype t; columns D..ld keep what they hold (zeros from calloc). */
FO_INLINE void load_rows(fo_dtype t, const void *base, int64_t row0_off, int64_t row_stride,
                             int64_t n, int64_t D, float *tile, int64_t ld) {
  for (int64_t r = 0; r < n; ++r)
    fo_load_row(t, elem(base, t, row0_off + r * row_stride), tile + r * ld, D);
}

/* The same, transposed: tile[d * ld + r] = row r, column d. tmp: D floats. */
FO_INLINE void load_rows_t(fo_dtype t, const void *base, int64_t row0_off,
                               int64_t row_stride, int64_t n, int64_t D, float *tile, int64_t ld,
                               float *tmp) {
  for (int64_t r = 0; r < n; ++r) {
    fo_load_row(t, elem(base, t, row0_off + r * row_stride), tmp, D);
    for (int64_t d = 0; d < D; ++d) tile[d * ld + r] = tmp[d];
  }
}

static inline int64_t q_off(const fo_attn_strides *s, int64_t b, int64_t i, int64_t h) {
  return b * s->batch + i * s->seq + h * s->head;
}

/* ------------------------------------------------------ sequences, masks */

/* Sequence b of a call: padded, batch entry b (Sq queries, Sk keys);
 * varlen, packed sequence b. Its query i is row q0 + i of batch entry bb of
 * the tensors (bb: 0 in varlen, where batch strides are unused), key j row
 * k0 + j. Masks (fo_attn_keys) count i and j from the sequence's start. */
typedef struct seq_t {
  int64_t b, bb, q0, k0, sq, sk;
} seq_t;

static inline seq_t seq_of(const fo_attn_params *p, int64_t b) {
  if (!p->cu_seqlens_q) return (seq_t){b, b, 0, 0, p->Sq, p->Sk};
  const int32_t *cq = p->cu_seqlens_q, *ck = p->cu_seqlens_k;
  return (seq_t){b, 0, cq[b], ck[b], cq[b + 1] - cq[b], ck[b + 1] - ck[b]};
}

/* first[b], b <= B: over the sequences before b, the sum of heads x (their
 * keys, or queries, in tiles of `tile`): a call's tasks of (head, tile),
 * sequence by sequence (first[B]: the count), or with tile 2, offsets of
 * pairs. NULL: out of memory. */
static int64_t *seq_prefix(const fo_attn_params *p, int keys, int64_t tile, int64_t heads) {
  int64_t *first = malloc(sizeof(int64_t) * (size_t)(p->B + 1));
  if (!first) return NULL;
  first[0] = 0;
  for (int64_t b = 0; b < p->B; ++b) {
    const seq_t s = seq_of(p, b);
    first[b + 1] = first[b] + heads * (((keys ? s.sk : s.sq) + tile - 1) / tile);
  }
  return first;
}

/* Task `task` of seq_prefix(p, keys, tile, heads): its sequence *s, head *h
 * and tile *t (the last b with first[b] <= task, found by bisection). */
static void task_of(const fo_attn_params *p, const int64_t *first, int keys, int64_t tile, int64_t task, seq_t *s,
                    int64_t *h, int64_t *t) {
  int64_t a = 0, b = p->B - 1;
  while (a < b) {
    const int64_t m = a + (b - a + 1) / 2;
    if (first[m] <= task) a = m; else b = m - 1;
  }
  *s = seq_of(p, a);
  const int64_t tiles = ((keys ? s->sk : s->sq) + tile - 1) / tile;
  *t = (task - first[a]) % tiles, *h = (task - first[a]) / tiles;
}

/* Rows of each (batch entry, q head) in the backward's scratch (delta, the
 * dq partials): Sq, or total_q in varlen (attention.h, fo_attn_cpu_rows). */
static inline int64_t head_rows(const fo_attn_params *p) {
  return p->cu_seqlens_q ? p->cu_seqlens_q[p->B] : p->Sq;
}
static inline int64_t scratch_row(const fo_attn_params *p, const seq_t *s, int64_t h, int64_t i) {
  return (s->bb * p->Hq + h) * head_rows(p) + s->q0 + i;
}
static inline float *lse_at(const fo_attn_params *p, const seq_t *s, int64_t h, int64_t i) {
  return p->lse + s->bb * p->lse_st.batch + h * p->lse_st.head + (s->q0 + i) * p->lse_st.seq;
}

/* The keys each of the n rows of a query tile (queries i0.. of s) sees,
 * [lo[r], hi[r]) (none: lo = hi = 0; so too rows n..BQ, which the tiles
 * compute on padding), and those of the whole tile: [*jlo, *jhi) the keys
 * some row sees (*jhi <= *jlo: none), [*all_lo, *all_hi) those every row sees. */
typedef struct tile_keys {
  int32_t lo[BQ], hi[BQ];
  int64_t jlo, jhi, all_lo, all_hi;
} tile_keys;

static void keys_of_rows(const fo_attn_params *p, const seq_t *s, int64_t i0, int64_t n, tile_keys *tk) {
  tk->jlo = s->sk, tk->jhi = 0, tk->all_lo = 0, tk->all_hi = s->sk;
  for (int64_t r = 0; r < BQ; ++r) {
    int64_t lo = 0, hi = 0;
    if (r < n) fo_attn_keys(p, i0 + r, s->sq, s->sk, &lo, &hi);
    if (hi <= lo) lo = hi = 0;
    tk->lo[r] = (int32_t)lo, tk->hi[r] = (int32_t)hi;
    if (r >= n) continue;
    if (lo < hi) tk->jlo = lo < tk->jlo ? lo : tk->jlo, tk->jhi = hi > tk->jhi ? hi : tk->jhi;
    tk->all_lo = lo > tk->all_lo ? lo : tk->all_lo, tk->all_hi = hi < tk->all_hi ? hi : tk->all_hi;
  }
}

/* Lanes c..c+VL-1 of a key tile of nk keys starting at key j0 that row r
 * sees (none past nk); whole: every row sees every key of the tile. */
FO_INLINE vi visible_lanes(const tile_keys *tk, int64_t r, int64_t j0, int64_t c, int64_t nk, int whole) {
  const vi col = vf_iota(c), in_tile = col < (int32_t)nk;
  if (whole) return in_tile;
  const vi key = col + (int32_t)j0;
  return in_tile & (key >= tk->lo[r]) & (key < tk->hi[r]);
}

/* The queries [*ilo, *ihi) of s whose keys (fo_attn_keys: both ends
 * non-decreasing in the query) reach past j0 and start before j1: every
 * query that sees a key of [j0, j1), found by bisection so that the mask rule
 * stays in fo_attn_keys alone. */
static void queries_of_keys(const fo_attn_params *p, const seq_t *s, int64_t j0, int64_t j1, int64_t *ilo,
                            int64_t *ihi) {
  int64_t a = 0, b = s->sq, lo, hi;
  while (a < b) { /* the first query whose keys end after j0 */
    const int64_t m = a + (b - a) / 2;
    fo_attn_keys(p, m, s->sq, s->sk, &lo, &hi);
    if (hi > j0) b = m; else a = m + 1;
  }
  *ilo = a, b = s->sq;
  while (a < b) { /* the first query whose keys start at j1 or later */
    const int64_t m = a + (b - a) / 2;
    fo_attn_keys(p, m, s->sq, s->sk, &lo, &hi);
    if (lo >= j1) b = m; else a = m + 1;
  }
  *ihi = a;
}

/* ---------------------------------------------------------------- forward */

/* A query tile's first n rows before its first key tile: o [n, ldo] zero,
 * running max -inf, sums 0. */
FO_INLINE void start_rows(int64_t n, float *o, int64_t ldo, float *m, float *l) {
  memset(o, 0, sizeof(float) * (size_t)(n * ldo));
  for (int64_t r = 0; r < n; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
}

/* One key tile (keys j0.., nk of them) of the online softmax over rows
 * [0, mq) of a query tile: s [mq, BK] the raw fp32 products q.k (nk rounded
 * up to 16 of them read; masked: keys past nk and those a row does not see,
 * tk), replaced by p = exp2(score - m); m, l the running max (log2 units) and
 * sum of each row; o [mq, ldo] the output rows, rescaled as the max grows. */
FO_INLINE void softmax_rows(const fo_attn_params *p, const tile_keys *tk, int64_t j0, int64_t mq, int64_t nk,
                            float *s_tile, float *m, float *l, float *o_tile, int64_t ldo) {
  const int64_t nk16 = round_up(nk, 16);
  for (int64_t r = 0; r < mq; ++r) {
    float *s = s_tile + r * BK;
    vf mx = vf_splat(-INFINITY), t;
    for (int64_t c = 0; c < nk16; c += VL) {
      const vi vis = visible_lanes(tk, r, j0, c, nk, 0);
      const vf x = vf_select(vis, log2_scores(p, vf_load(s + c), &t), vf_splat(-INFINITY));
      vf_store(s + c, x);
      mx = vf_select(x > mx, x, mx);
    }
    const float m_tile = vf_hmax(mx);
    const float m_new = m_tile > m[r] ? m_tile : m[r];
    const float shift = m_new == -INFINITY ? 0.0f : m_new; /* nothing visible yet */
    const float alpha = exp2_scalar(m[r] - shift);
    vf acc = vf_splat(0.0f);
    for (int64_t c = 0; c < nk16; c += VL) {
      const vf e = vf_exp2(vf_load(s + c) - shift);
      vf_store(s + c, e);
      acc += e;
    }
    l[r] = l[r] * alpha + vf_hsum(acc);
    m[r] = m_new;
    if (alpha != 1.0f) {
      float *o = o_tile + r * ldo;
      for (int64_t d = 0; d < ldo; ++d) o[d] *= alpha;
    }
  }
}

/* Rows [0, nq) of a finished query tile (queries i0.. of s, head h):
 * out = o / l, lse = (m + log2 l) ln 2. l = 0: no key seen (out 0, lse -inf).
 * A NaN l (a NaN or an inf - inf among the scores) stays NaN in out and lse,
 * as in eager softmax, so that the backward's P = exp(s - lse) is NaN too. */
FO_INLINE void store_rows(const fo_attn_params *p, const seq_t *s, int64_t h, int64_t i0, int64_t nq,
                          const float *m, const float *l, float *o_tile, int64_t ldo) {
  const fo_dtype t = p->dtype;
  for (int64_t r = 0; r < nq; ++r) {
    const float inv = l[r] != 0.0f ? 1.0f / l[r] : 0.0f;
    float *o = o_tile + r * ldo;
    for (int64_t d = 0; d < p->D; ++d) o[d] *= inv;
    fo_store_row(t, (char *)p->out + q_off(&p->out_st, s->bb, s->q0 + i0 + r, h) * fo_dtype_size(t), o, p->D);
    *lse_at(p, s, h, i0 + r) = l[r] != 0.0f ? (m[r] + log2f(l[r])) / LOG2E : -INFINITY;
  }
}


typedef struct fwd_scratch {
  float *q, *o;  /* [BQ, Dp] */
  float *kt;     /* [Dp, BK]: K tile transposed */
  float *v;      /* [BK, Dp] */
  float *s;      /* [BQ, BK]: scores, then probabilities */
  float *tmp;    /* [Dp] */
  float m[BQ], l[BQ];
  tile_keys keys;
} fwd_scratch;

/* One tile of BQ query rows (queries i0.. of s, head h). */
static void fwd_tile(const fo_attn_params *p, const seq_t *s, int64_t h, int64_t i0, fwd_scratch *w) {
  const fo_dtype t = p->dtype;
  const int64_t D = p->D, Dp = round_up(D, 16), hk = h / (p->Hq / p->Hkv);
  const int64_t nq = min64(BQ, s->sq - i0), mq = round_up(nq, 4);
  load_rows(t, p->q, q_off(&p->q_st, s->bb, s->q0 + i0, h), p->q_st.seq, nq, D, w->q, Dp);
  start_rows(mq, w->o, Dp, w->m, w->l);
  keys_of_rows(p, s, i0, nq, &w->keys);
  for (int64_t j0 = w->keys.jlo; j0 < w->keys.jhi; j0 += BK) {
    const int64_t nk = min64(BK, w->keys.jhi - j0), nk16 = round_up(nk, 16);
    load_rows_t(t, p->k, q_off(&p->k_st, s->bb, s->k0 + j0, hk), p->k_st.seq, nk, D, w->kt, BK, w->tmp);
    load_rows(t, p->v, q_off(&p->v_st, s->bb, s->k0 + j0, hk), p->v_st.seq, nk, D, w->v, Dp);
    gemm_tile(mq, nk16, Dp, w->q, Dp, 1, w->kt, BK, w->s, BK, 0);
    softmax_rows(p, &w->keys, j0, mq, nk, w->s, w->m, w->l, w->o, Dp);
    gemm_tile(mq, Dp, nk, w->s, BK, 1, w->v, Dp, w->o, Dp, 1);
  }
  store_rows(p, s, h, i0, nq, w->m, w->l, w->o, Dp);
}

/* A thread's scratch is one zeroed block of 4-byte words (floats, or pairs of
 * bf16), handed out in order. The *_scratch_init functions below take each of
 * their arrays twice: from an empty carver, which only counts the words, then
 * from a block of that size; so each array's size is written once. */
typedef struct carver {
  uint32_t *base; /* NULL: counting */
  int64_t used;   /* words */
} carver;

static void *take(carver *c, int64_t words) {
  void *at = c->base ? (void *)(c->base + c->used) : NULL;
  c->used += words;
  return at;
}

/* After the counting pass: allocates the block and asks for the filling pass
 * (1); after that one, or when the allocation fails, 0. */
static int carve_again(carver *c) {
  if (c->base) return 0;
  c->base = calloc((size_t)c->used, sizeof(uint32_t));
  c->used = 0;
  return c->base != NULL;
}

/* The block a thread's scratch lies in (NULL: out of memory); free() it. */
static uint32_t *fwd_scratch_init(fwd_scratch *w, int64_t Dp) {
  carver c = {NULL, 0};
  do {
    w->q = take(&c, BQ * Dp);
    w->o = take(&c, BQ * Dp);
    w->kt = take(&c, Dp * BK);
    w->v = take(&c, BK * Dp);
    w->s = take(&c, BQ * BK);
    w->tmp = take(&c, Dp);
  } while (carve_again(&c));
  return c.base;
}

#if FO_LEVEL >= 4
/* ------------------------------------------ forward, bf16 with AVX512-BF16
 * At level FO_ISA_V4_BF16, bf16 inputs with D a multiple of 32 take these
 * tiles: the two products run on vdpbf16ps (each fp32 lane adds the products
 * of one pair of bf16 elements: twice the FLOPs of an fp32 FMA a cycle),
 * reading K and V in place or as bf16 pairs, never widened to fp32. Scores,
 * softmax and the output stay fp32; P is rounded to bf16 for P V, as the GPU
 * kernels do. The scores are computed transposed (S^T = K Q^T), so that the
 * query tile, packed once, is the vector operand and the softmax runs across
 * 16 queries a vector. */

/* The bf16 tiles' functions: the v4 copy's ISA plus AVX512-BF16. */
#define FO_TARGET_V4_BF16 __attribute__((target("avx512bf16")))

/* A pair of bf16 read at any 2-byte alignment (a row of an odd stride). */
typedef uint32_t pair_u __attribute__((aligned(2), may_alias));

/* One RB x 32 block of C (RB <= 8) in 2 RB registers across the K2 loop: per
 * pair p, two loads of B, RB broadcasts of A, 2 RB vdpbf16ps. */
FO_TARGET_V4_BF16 static inline __attribute__((always_inline)) void
gemm_bf16_block(int RB, int64_t K2, const pair_u *a, int64_t rsa, int64_t csa, const uint32_t *b, int64_t ldb,
                float *c, int64_t ldc, int accumulate) {
  __m512 acc[8][2];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    acc[r][0] = accumulate ? _mm512_loadu_ps(c + r * ldc) : _mm512_setzero_ps();
    acc[r][1] = accumulate ? _mm512_loadu_ps(c + r * ldc + 16) : _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K2; ++k, a += csa, b += ldb) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + 16);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m512bh ar = (__m512bh)_mm512_set1_epi32((int)a[r * rsa]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    _mm512_storeu_ps(c + r * ldc, acc[r][0]);
    _mm512_storeu_ps(c + r * ldc + 16, acc[r][1]);
  }
}

/* C[M, N] (+)= A B in fp32 from bf16 pairs: A element (i, p), the pair of
 * columns 2p, 2p + 1 of row i, at A[i * rsa + p * csa]; B row p (the pair of
 * rows 2p, 2p + 1) at B + p * ldb, 32-bit pairs, C row-major. M a multiple of
 * 4, N of 32. Blocks of 8 x 32 (4 x 32 at the edge) stay in registers. */
FO_TARGET_V4_BF16 static inline void gemm_bf16(int64_t M, int64_t N, int64_t K2, const pair_u *A,
                                               int64_t rsa, int64_t csa, const uint32_t *B, int64_t ldb,
                                               float *C, int64_t ldc, int accumulate) {
  for (int64_t i = 0; i < M;) {
    const int rb = M - i >= 8 ? 8 : 4;
    for (int64_t j = 0; j < N; j += 32) {
      if (rb == 8) gemm_bf16_block(8, K2, A + i * rsa, rsa, csa, B + j, ldb, C + i * ldc + j, ldc, accumulate);
      else gemm_bf16_block(4, K2, A + i * rsa, rsa, csa, B + j, ldb, C + i * ldc + j, ldc, accumulate);
    }
    i += rb;
  }
}

/* 16 pairs (x[c], y[c]) of 16-bit values, x in the low half: x, y 32 bytes. */
FO_TARGET_V4_BF16 static inline __m512i pairs16(__m256i x, __m256i y) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(x), _mm512_slli_epi32(_mm512_cvtepu16_epi32(y), 16));
}

/* dst[p * ld + r] = pair p (along D) of row r, n rows from base + off0, rows
 * stride apart (bf16 elements). */
FO_TARGET_V4_BF16 static inline void pack_pairs_t(uint32_t *dst, int64_t ld, const uint16_t *base,
                                                  int64_t off0, int64_t stride, int64_t n, int64_t D2) {
  for (int64_t r = 0; r < n; ++r) {
    const pair_u *row = (const pair_u *)(base + off0 + r * stride);
    for (int64_t pp = 0; pp < D2; ++pp) dst[pp * ld + r] = row[pp];
  }
}

/* dst[c] = (a[c], b[c]) for n (a multiple of 16) bf16 columns; b NULL: zeros. */
FO_TARGET_V4_BF16 static inline void pack_rows2(uint32_t *dst, const uint16_t *a, const uint16_t *b, int64_t n) {
  for (int64_t c = 0; c < n; c += 16) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)(a + c));
    const __m256i y = b ? _mm256_loadu_si256((const __m256i *)(b + c)) : _mm256_setzero_si256();
    _mm512_storeu_si512(dst + c, pairs16(x, y));
  }
}

/* The same from fp32 rows, rounded to bf16. */
FO_TARGET_V4_BF16 static inline void pack_rows2_f32(uint32_t *dst, const float *a, const float *b, int64_t n) {
  for (int64_t c = 0; c < n; c += 16) {
    const __m256i x = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(a + c));
    const __m256i y = b ? (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(b + c)) : _mm256_setzero_si256();
    _mm512_storeu_si512(dst + c, pairs16(x, y));
  }
}

/* An fp32 row rounded to bf16 in place order: pairs of adjacent columns, n a
 * multiple of 32. */
FO_TARGET_V4_BF16 static inline void pack_row_f32(uint32_t *dst, const float *src, int64_t n) {
  for (int64_t c = 0; c < n; c += 32)
    _mm512_storeu_si512(dst + c / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + c + 16),
                                                                   _mm512_loadu_ps(src + c)));
}

/* A tile's rows as pairs along D for a product's A operand: in place where
 * every row of the rounded-up count exists and rows are a whole number of
 * pairs apart, else copied into pad (zeros past n). *rs: the row stride in pairs. */
FO_TARGET_V4_BF16 static inline const pair_u *rows_as_pairs(const uint16_t *base, const fo_attn_strides *st,
                                                            int64_t b, int64_t i0, int64_t h, int64_t n,
                                                            int64_t m, int64_t D, uint32_t *pad, int64_t *rs) {
  if (n == m && !(st->seq & 1)) {
    *rs = st->seq / 2;
    return (const pair_u *)(base + q_off(st, b, i0, h));
  }
  memset(pad, 0, sizeof(uint32_t) * (size_t)(m * D / 2));
  for (int64_t r = 0; r < n; ++r) memcpy(pad + r * D / 2, base + q_off(st, b, i0 + r, h), (size_t)D * 2);
  *rs = D / 2;
  return (const pair_u *)pad;
}

typedef struct fwd_scratch_bf16 {
  uint32_t *qt;   /* [D/2, BQ]: Q^T pairs, pair p of query i at qt[p * BQ + i] (zeros past nq) */
  uint32_t *k;    /* [BK, D/2]: a tail tile's K rows (zeros past nk); full tiles are read in place */
  uint32_t *v;    /* [BK/2, D]: V pairs, keys 2p, 2p + 1 of column d at v[p * D + d] */
  uint32_t *pt;   /* [BK/2, BQ]: P^T pairs rounded to bf16, keys 2p, 2p + 1 of query i */
  float *st;      /* [BK, BQ]: S^T, then P^T */
  float *o;       /* [BQ, D] */
  float m[BQ], l[BQ], alpha[BQ];
  tile_keys keys;
} fwd_scratch_bf16;

static uint32_t *fwd_scratch_bf16_init(fwd_scratch_bf16 *w, int64_t D) {
  carver c = {NULL, 0};
  do {
    w->qt = take(&c, D / 2 * BQ);
    w->k = take(&c, BK * D / 2);
    w->v = take(&c, BK / 2 * D);
    w->pt = take(&c, BK / 2 * BQ);
    w->st = take(&c, BK * BQ);
    w->o = take(&c, BQ * D);
  } while (carve_again(&c));
  return c.base;
}

FO_TARGET_V4_BF16 static void fwd_tile_bf16(const fo_attn_params *p, const seq_t *s, int64_t h, int64_t i0,
                                            fwd_scratch_bf16 *w) {
  const int64_t D = p->D, D2 = D / 2, hk = h / (p->Hq / p->Hkv);
  const int64_t nq = min64(BQ, s->sq - i0), mq = round_up(nq, 4), nq32 = round_up(nq, 32);
  const uint16_t *q = (const uint16_t *)p->q, *kb = (const uint16_t *)p->k, *vb = (const uint16_t *)p->v;
  const tile_keys *tk = &w->keys;
  /* Q^T pairs (queries past nq: zeros) */
  memset(w->qt, 0, sizeof(uint32_t) * (size_t)(D2 * BQ));
  pack_pairs_t(w->qt, BQ, q, q_off(&p->q_st, s->bb, s->q0 + i0, h), p->q_st.seq, nq, D2);
  start_rows(BQ, w->o, D, w->m, w->l);
  keys_of_rows(p, s, i0, nq, &w->keys);
  for (int64_t j0 = tk->jlo; j0 < tk->jhi; j0 += BK) {
    const int64_t nk = min64(BK, tk->jhi - j0), mk = round_up(nk, 4), nk2 = (nk + 1) / 2;
    /* every row sees every key of the tile: no mask */
    const int whole = tk->all_lo <= j0 && j0 + nk <= tk->all_hi;
    /* S^T = K Q^T: K rows in place, or (a tail tile) copied and zero-padded to mk */
    int64_t krs;
    const pair_u *krows = rows_as_pairs(kb, &p->k_st, s->bb, s->k0 + j0, hk, nk, mk, D, w->k, &krs);
    gemm_bf16(mk, nq32, D2, krows, krs, 1, w->qt, BQ, w->st, BQ, 0);
    /* online softmax down the key rows, VL queries a vector */
    for (int64_t i = 0; i < nq32; i += VL) {
      const vi lo = *(const vi *)(tk->lo + i), hi = *(const vi *)(tk->hi + i); /* each lane's keys */
      vf mx = vf_splat(-INFINITY), t;
      for (int64_t c = 0; c < nk; ++c) {
        vf x = log2_scores(p, vf_load(w->st + c * BQ + i), &t);
        if (!whole) x = vf_select((lo <= (int32_t)(j0 + c)) & (hi > (int32_t)(j0 + c)), x, vf_splat(-INFINITY));
        vf_store(w->st + c * BQ + i, x);
        mx = vf_select(x > mx, x, mx);
      }
    const vf m_old = vf_load(w->m + i), m_new = vf_select(mx > m_old, mx, m_old);
      const vf shift = vf_select(m_new == vf_splat(-INFINITY), vf_splat(0.0f), m_new);
      vf_store(w->alpha + i, vf_exp2(m_old - shift));
      vf_store(w->m + i, m_new);
      vf sum = vf_splat(0.0f);
      for (int64_t c = 0; c < nk; ++c) {
        const vf e = vf_exp2(vf_load(w->st + c * BQ + i) - shift);
        vf_store(w->st + c * BQ + i, e);
        sum += e;
      }
      vf_store(w->l + i, vf_load(w->l + i) * vf_load(w->alpha + i) + sum);
    }
    for (int64_t i = 0; i < mq; ++i)
      if (w->alpha[i] != 1.0f)
        for (int64_t d = 0; d < D; ++d) w->o[i * D + d] *= w->alpha[i];
    /* P^T and V as bf16 pairs of keys (an odd last key paired with zeros) */
    for (int64_t pp = 0; pp < nk2; ++pp) {
      const int two = 2 * pp + 1 < nk;
      pack_rows2_f32(w->pt + pp * BQ, w->st + 2 * pp * BQ, two ? w->st + (2 * pp + 1) * BQ : NULL, nq32);
      pack_rows2(w->v + pp * D, vb + q_off(&p->v_st, s->bb, s->k0 + j0 + 2 * pp, hk),
                 two ? vb + q_off(&p->v_st, s->bb, s->k0 + j0 + 2 * pp + 1, hk) : NULL, D);
    }
    /* O += P V: A(i, p) = P^T pair p of query i */
    gemm_bf16(mq, D, nk2, (const pair_u *)w->pt, 1, BQ, w->v, D, w->o, D, 1);
  }
  store_rows(p, s, h, i0, nq, w->m, w->l, w->o, D);
}
#endif

/* For the AMX tiles: a call's keys (forward: K^T and V) or queries
 * (backward: Q^T and dO^T) packed once, in parallel, into the layouts of the
 * products that read them (pack_all): for each sequence s and head, D x
 * packed_len(s) words at packed_at. */
enum { PACK_ROWS = 64 }; /* keys or queries a packing task */
/* Words added to every packed row: rows a power of two of 4 KiB apart (1024
 * keys) would all fall in one set of the L1 cache, which a tile's 16 rows
 * then overflow. */
enum { PACK_PAD = 32 };
typedef struct packed_amx {
  int64_t *first; /* seq_prefix(p, keys, 2, 2): the even lengths of the sequences before b */
  int64_t *tasks; /* seq_prefix(p, keys, PACK_ROWS, heads) */
  uint32_t *buf;
  int64_t heads;
  int keys;
} packed_amx;

/* The words a packed sequence takes for each element of D: its K^T row (a
 * word a key), or its Q^T and dO^T rows (a word a pair of queries, each);
 * its keys or queries rounded up to even, plus PACK_PAD. */
static inline int64_t packed_len(const seq_t *s, int keys) { return round_up(keys ? s->sk : s->sq, 2) + PACK_PAD; }

/* 0: out of memory (packed_free frees what was had). */
static inline int packed_init(packed_amx *pk, const fo_attn_params *p, int keys) {
  pk->keys = keys, pk->heads = keys ? p->Hkv : p->Hq;
  pk->first = seq_prefix(p, keys, 2, 2);
  pk->tasks = seq_prefix(p, keys, PACK_ROWS, pk->heads);
  pk->buf = pk->first ? malloc(sizeof(uint32_t) * (size_t)((pk->first[p->B] + PACK_PAD * p->B) * pk->heads * p->D))
                      : NULL;
  return pk->tasks && pk->buf;
}

static inline void packed_free(packed_amx *pk) { free(pk->first), free(pk->tasks), free(pk->buf); }

static inline uint32_t *packed_at(const packed_amx *pk, const fo_attn_params *p, const seq_t *s, int64_t h) {
  return pk->buf + ((pk->first[s->b] + PACK_PAD * s->b) * pk->heads + h * packed_len(s, pk->keys)) * p->D;
}

#if ATTN_AMX
/* ------------------------------------------------ forward, bf16 on AMX tiles
 * At level FO_ISA_AMX the bf16 tiles' products run on AMX (fo_amx_gemm,
 * cpu_amx.h: 16 x 16 fp32 tiles), whose A operand holds its pairs along the
 * product's inner dimension, read in place: S = Q K^T with Q rows read in
 * place, a row-wise online softmax on 16 lanes (softmax_amx) that writes P
 * as bf16 pairs of keys, O += P V. Their B operands, K^T pairs along D and V
 * pairs of keys, are packed once a call for every sequence and kv head
 * (pack_keys), so that a key tile starting at any even key reads them in
 * place. With the products this cheap the softmax is most of the time: it
 * writes no fp32 P, and its key tiles are twice as wide (BKA). */
#define FO_TARGET_AMX __attribute__((target("avx512bf16,amx-tile,amx-bf16")))

/* The AMX forward's key tile: twice the others', so that each row's work per
 * tile (its max and sum reductions, the rescaling) spreads over more keys,
 * now that the products cost less than the softmax. */
enum { BKA = 128 };

/* vf_exp2 on the AMX code's __m512. */
FO_TARGET_AMX static inline __m512 exp2_16(__m512 x) { return (__m512)vf_exp2((vf)x); }

/* log2_scores on 16 lanes (the v4 copy's vf). */
FO_TARGET_AMX static inline __m512 log2_scores16(const fo_attn_params *p, __m512 raw, __m512 *t) {
  vf tv = vf_splat(0.0f);
  const vf x = log2_scores(p, (vf)raw, &tv);
  *t = (__m512)tv;
  return (__m512)x;
}

/* 16 floats rounded to bf16. */
FO_TARGET_AMX static inline __m256i bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

/* visible_lanes as the AMX code's mask register. */
FO_TARGET_AMX static inline __mmask16 visible16(const tile_keys *tk, int64_t r, int64_t j0, int64_t c, int64_t nk,
                                                int whole) {
  return _mm512_movepi32_mask((__m512i)visible_lanes(tk, r, j0, c, nk, whole));
}

/* Keys j0.. (n of them, j0 even) of sequence s, kv head hk, packed at dst =
 * packed_at: K^T pairs [D/2, lk] (key j at column j), then V pairs of keys
 * [lk/2, D] (an odd last key paired with zeros); lk = packed_len. */
FO_TARGET_AMX static void pack_keys(const fo_attn_params *p, const seq_t *s, int64_t hk, int64_t j0, int64_t n,
                                    uint32_t *dst) {
  const int64_t D = p->D, lk = packed_len(s, 1);
  const uint16_t *k = (const uint16_t *)p->k, *v = (const uint16_t *)p->v;
  uint32_t *vp = dst + D / 2 * lk;
  pack_pairs_t(dst + j0, lk, k, q_off(&p->k_st, s->bb, s->k0 + j0, hk), p->k_st.seq, n, D / 2);
  for (int64_t j = j0; j < j0 + n; j += 2)
    pack_rows2(vp + j / 2 * D, v + q_off(&p->v_st, s->bb, s->k0 + j, hk),
               j + 1 < s->sk ? v + q_off(&p->v_st, s->bb, s->k0 + j + 1, hk) : NULL, D);
}

/* Queries i0.. (n of them, i0 even) of sequence s, q head h, packed at dst =
 * packed_at: Q^T, then dO^T, each [D, lq] pairs of queries (queries 2c,
 * 2c + 1 at column c; an odd last one paired with zeros), lq = packed_len / 2. */
FO_TARGET_AMX static void pack_queries(const fo_attn_params *p, const seq_t *s, int64_t h, int64_t i0, int64_t n,
                                       uint32_t *dst) {
  const int64_t D = p->D, lq = packed_len(s, 0) / 2;
  const uint16_t *src[2] = {(const uint16_t *)p->q, (const uint16_t *)p->dout};
  const fo_attn_strides *st[2] = {&p->q_st, &p->dout_st};
  for (int x = 0; x < 2; ++x)
    for (int64_t i = i0; i < i0 + n; i += 2) {
      const uint16_t *a = src[x] + q_off(st[x], s->bb, s->q0 + i, h);
      const uint16_t *b = i + 1 < s->sq ? src[x] + q_off(st[x], s->bb, s->q0 + i + 1, h) : NULL;
      uint32_t *col = dst + x * D * lq + i / 2;
      for (int64_t d = 0; d < D; ++d) col[d * lq] = (uint32_t)a[d] | (uint32_t)(b ? b[d] : 0) << 16;
    }
}

/* Packs pk (inside the parallel region: a worksharing loop, every thread calls it). */
FO_TARGET_AMX static void pack_all(const fo_attn_params *p, const packed_amx *pk) {
#pragma omp for schedule(dynamic)
  for (int64_t task = 0; task < pk->tasks[p->B]; ++task) {
    seq_t s;
    int64_t h, t;
    task_of(p, pk->tasks, pk->keys, PACK_ROWS, task, &s, &h, &t);
    const int64_t r0 = t * PACK_ROWS, n = min64(PACK_ROWS, (pk->keys ? s.sk : s.sq) - r0);
    uint32_t *dst = packed_at(pk, p, &s, h);
    if (pk->keys) pack_keys(p, &s, h, r0, n, dst);
    else pack_queries(p, &s, h, r0, n, dst);
  }
}

/* The online softmax of rows [0, nq) of a query tile against the key tile
 * j0.. (nk keys) for the AMX forward, on 16 lanes: s [nq, BKA] the raw
 * products q.k (masked: keys past nk, and those a row does not see unless
 * every row sees the whole tile), replaced by the scores; P = exp2(score - m)
 * into pa [nq, BKA/2] as bf16 pairs of keys (0 from nk up to nk rounded to
 * 32), never as fp32; m, l and the output rows o [nq, ldo] as in
 * softmax_rows, the new maxima and the rescaling factors 16 rows a vector. */
FO_TARGET_AMX static void softmax_amx(const fo_attn_params *p, const tile_keys *tk, int64_t j0, int64_t nq,
                                      int64_t nk, float *s_tile, uint32_t *pa, float *m, float *l, float *o_tile,
                                      int64_t ldo) {
  const int64_t nk32 = round_up(nk, 32);
  const int whole = tk->all_lo <= j0 && j0 + nk <= tk->all_hi;
  float mt[BQ], shift[BQ], alpha[BQ];
  for (int64_t r = 0; r < nq; ++r) {
    float *s = s_tile + r * BKA;
    __m512 mx = _mm512_set1_ps(-INFINITY), t;
    for (int64_t c = 0; c < nk32; c += 16) {
      const __m512 x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), visible16(tk, r, j0, c, nk, whole),
                                          log2_scores16(p, _mm512_loadu_ps(s + c), &t));
      _mm512_storeu_ps(s + c, x);
      mx = _mm512_max_ps(x, mx); /* a NaN score is never the max: max returns its second operand */
    }
    mt[r] = _mm512_reduce_max_ps(mx);
  }
  for (int64_t r0 = 0; r0 < nq; r0 += 16) {
    const __mmask16 k = nq - r0 >= 16 ? 0xFFFF : (__mmask16)((1u << (nq - r0)) - 1);
    const __m512 m_old = _mm512_maskz_loadu_ps(k, m + r0);
    const __m512 m_new = _mm512_max_ps(_mm512_maskz_loadu_ps(k, mt + r0), m_old);
    /* nothing visible yet: no shift */
    const __m512 sh = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                                         _mm512_setzero_ps());
    _mm512_mask_storeu_ps(m + r0, k, m_new);
    _mm512_mask_storeu_ps(shift + r0, k, sh);
    _mm512_mask_storeu_ps(alpha + r0, k, exp2_16(_mm512_sub_ps(m_old, sh)));
  }
  for (int64_t r = 0; r < nq; ++r) {
    const float *s = s_tile + r * BKA;
    const __m512 sh = _mm512_set1_ps(shift[r]);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < nk32; c += 32) {
      const __m512 e0 = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(s + c), sh));
      const __m512 e1 = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(s + c + 16), sh));
      acc = _mm512_add_ps(acc, _mm512_add_ps(e0, e1));
      _mm512_storeu_si512(pa + r * (BKA / 2) + c / 2, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(acc);
    if (alpha[r] != 1.0f) {
      float *o = o_tile + r * ldo;
      for (int64_t d = 0; d < ldo; ++d) o[d] *= alpha[r];
    }
  }
}

typedef struct fwd_scratch_amx {
  uint32_t *qa; /* [BQ, D/2]: Q rows, where an odd row stride keeps them from being read in place */
  uint32_t *pa; /* [BQ, BKA/2]: P rows as bf16 pairs of keys */
  float *s;     /* [BQ, BKA]: the products q.k, then the scores */
  float *o;     /* [BQ, D] */
  fo_amx_stage *stage;
  float m[BQ], l[BQ];
  tile_keys keys;
} fwd_scratch_amx;

static uint32_t *fwd_scratch_amx_init(fwd_scratch_amx *w, int64_t D) {
  carver c = {NULL, 0};
  do {
    w->qa = take(&c, BQ * D / 2);
    w->pa = take(&c, BQ * BKA / 2);
    w->s = take(&c, BQ * BKA);
    w->o = take(&c, BQ * D);
    w->stage = take(&c, sizeof(fo_amx_stage) / 4);
  } while (carve_again(&c));
  return c.base;
}

/* One tile of BQ query rows (queries i0.. of s, head h) against the keys of
 * its kv head packed at kv (pack_keys). */
FO_TARGET_AMX static void fwd_tile_amx(const fo_attn_params *p, const seq_t *s, int64_t h, int64_t i0,
                                       const uint32_t *kv, fwd_scratch_amx *w) {
  const int64_t D = p->D, D2 = D / 2, lk = packed_len(s, 1), nq = min64(BQ, s->sq - i0);
  const tile_keys *tk = &w->keys;
  const uint32_t *kt = kv, *vp = kv + D2 * lk;
  int64_t qrs;
  const pair_u *qa = rows_as_pairs((const uint16_t *)p->q, &p->q_st, s->bb, s->q0 + i0, h, nq, nq, D, w->qa, &qrs);
  start_rows(nq, w->o, D, w->m, w->l);
  keys_of_rows(p, s, i0, nq, &w->keys);
  /* key tiles from an even key: V's pairs of keys */
  for (int64_t j0 = tk->jlo & ~(int64_t)1; j0 < tk->jhi; j0 += BKA) {
    const int64_t nk = min64(BKA, tk->jhi - j0);
    fo_amx_gemm(nq, nk, D2, qa, qrs, kt + j0, lk, w->s, BKA, 0, w->stage); /* s = q k^T */
    softmax_amx(p, tk, j0, nq, nk, w->s, w->pa, w->m, w->l, w->o, D);
    fo_amx_gemm(nq, D, (nk + 1) / 2, w->pa, BKA / 2, vp + j0 / 2 * D, D, w->o, D, 1, w->stage); /* o += p v */
  }
  store_rows(p, s, h, i0, nq, w->m, w->l, w->o, D);
}
#endif

/* The tiles a call takes: fp32 (every dtype and head dim), or, for bf16 with D
 * a multiple of 32, the bf16 tiles with their products on vdpbf16ps (level
 * FO_ISA_V4_BF16) or on AMX (FO_ISA_AMX, where the compiler builds it). */
enum { TILES_F32, TILES_BF16, TILES_AMX };
static int tiles_of(const fo_attn_params *p) {
  if (FO_LEVEL < 4 || p->dtype != FO_BF16 || p->D % 32) return TILES_F32;
  const int isa = fo_cpu_isa();
  return isa >= FO_ISA_AMX && ATTN_AMX ? TILES_AMX : isa >= FO_ISA_V4_BF16 ? TILES_BF16 : TILES_F32;
}

const char *FO_FN(fo_attn_fwd_cpu)(const fo_attn_params *p) {
  const int64_t Dp = round_up(p->D, 16);
  const int tiles = tiles_of(p);
  int64_t *first = seq_prefix(p, 0, BQ, p->Hq);
  packed_amx kv = {0}; /* AMX: K^T and V, packed */
  if (!first || (tiles == TILES_AMX && !packed_init(&kv, p, 1))) {
    free(first), packed_free(&kv);
    return FO_CPU_OOM;
  }
  const int64_t tasks = first[p->B];
  int missing = 0;
#pragma omp parallel if (fo_parallel(tasks, fo_attn_cpu_rows(p) * p->Sk * p->D))
  {
    fwd_scratch w = {0};
#if FO_LEVEL >= 4
    fwd_scratch_bf16 wb = {0};
#endif
#if ATTN_AMX
    fwd_scratch_amx wa = {0};
#endif
    uint32_t *block;
    switch (tiles) {
#if FO_LEVEL >= 4
    case TILES_BF16: block = fwd_scratch_bf16_init(&wb, p->D); break;
#endif
#if ATTN_AMX
    case TILES_AMX: block = fwd_scratch_amx_init(&wa, p->D); break;
#endif
    default: block = fwd_scratch_init(&w, Dp);
    }
    if (fo_every_thread_has(block, &missing)) {
#if ATTN_AMX
      if (tiles == TILES_AMX) {
        pack_all(p, &kv);
        fo_amx_begin();
      }
#endif
      /* dynamic: tiles differ in cost (causal, windows, sequence lengths) */
#pragma omp for schedule(dynamic)
      for (int64_t task = 0; task < tasks; ++task) {
        seq_t s;
        int64_t h, it;
        task_of(p, first, 0, BQ, task, &s, &h, &it);
        switch (tiles) {
#if FO_LEVEL >= 4
        case TILES_BF16: fwd_tile_bf16(p, &s, h, it * BQ, &wb); break;
#endif
#if ATTN_AMX
        case TILES_AMX: fwd_tile_amx(p, &s, h, it * BQ, packed_at(&kv, p, &s, h / (p->Hq / p->Hkv)), &wa); break;
#endif
        default: fwd_tile(p, &s, h, it * BQ, &w);
        }
      }
#if ATTN_AMX
      if (tiles == TILES_AMX) fo_amx_end();
#endif
    }
    free(block);
  }
  free(first), packed_free(&kv);
  return missing ? FO_CPU_OOM : NULL;
}
FO_ENTRY(const char *, fo_attn_fwd_cpu, (const fo_attn_params *p), (p))

/* ---------------------------------------------------------------- backward */

#if FO_LEVEL == 0
int64_t fo_attn_bwd_cpu_splits(const fo_attn_params *p) {
  const int64_t ktiles = (p->Sk + BK - 1) / BK, heads = p->B * p->Hkv;
  /* About two tasks per thread; deterministic: a fixed 16 in place of the
   * thread count, so that the sums do not depend on it. */
  const int64_t want = p->deterministic ? 16 : 2 * (int64_t)omp_get_max_threads();
  const int64_t s = heads > 0 ? (want + heads - 1) / heads : 1;
  return s < 1 ? 1 : min64(s, ktiles > 0 ? ktiles : 1);
}
#endif

/* The batch entry, q head and row along the seq dimension of a scratch row
 * (scratch_row's inverse). */
static inline void row_place(const fo_attn_params *p, int64_t row, int64_t *b, int64_t *h, int64_t *i) {
  const int64_t n = head_rows(p);
  *i = row % n, *h = (row / n) % p->Hq, *b = row / (n * p->Hq);
}

/* delta[row] = sum_d dout * out: one fp32 per query row. */
static void bwd_delta(const fo_attn_params *p, int64_t row, float *delta, float *tmp) {
  const fo_dtype t = p->dtype;
  const int64_t D = p->D;
  int64_t b, h, i;
  row_place(p, row, &b, &h, &i);
  float *x = tmp, *y = tmp + D;
  fo_load_row(t, elem(p->dout, t, q_off(&p->dout_st, b, i, h)), x, D);
  fo_load_row(t, elem(p->out, t, q_off(&p->out_st, b, i, h)), y, D);
  for (int64_t d = 0; d < D; ++d) x[d] *= y[d];
  delta[row] = fo_sum(x, D);
}

typedef struct bwd_scratch {
  float *q, *dout, *dq; /* [BQ, Dp] */
  float *k;             /* [BK, Dp] */
  float *kt, *vt;       /* [Dp, BK] */
  float *dk, *dv;       /* [BK, Dp] */
  float *pr, *ds;       /* [BQ, BK]: probabilities; dp, then ds */
  float *tmp;           /* [2 Dp]: delta's two rows, a row of dQ */
  tile_keys keys;       /* of the query tile in hand */
} bwd_scratch;

static uint32_t *bwd_scratch_init(bwd_scratch *w, int64_t Dp) {
  carver c = {NULL, 0};
  do {
    w->q = take(&c, BQ * Dp);
    w->dout = take(&c, BQ * Dp);
    w->dq = take(&c, BQ * Dp);
    w->k = take(&c, BK * Dp);
    w->kt = take(&c, Dp * BK);
    w->vt = take(&c, Dp * BK);
    w->dk = take(&c, BK * Dp);
    w->dv = take(&c, BK * Dp);
    w->pr = take(&c, BQ * BK);
    w->ds = take(&c, BQ * BK);
    w->tmp = take(&c, 2 * Dp);
  } while (carve_again(&c));
  return c.base;
}

/* P = exp2(score - lse log2e) and dS = P (dP - delta) (soft-capped: times
 * 1 - tanh^2, the cap's derivative) over rows [0, nq) of a query tile
 * (queries i0.. of s, head h) against keys j0.. (nk of them; those a row does
 * not see, tk, and those past nk, rounded up to 16, get 0): pr holds the raw
 * products q.k and takes P, ds holds dP and takes dS, both [BQ, BK]; delta:
 * the tile's first row's. */
FO_INLINE void probs_rows(const fo_attn_params *p, const seq_t *s, const tile_keys *tk, int64_t h, int64_t i0,
                          int64_t j0, int64_t nq, int64_t nk, const float *delta, float *pr_tile, float *ds_tile) {
  const int64_t nk16 = round_up(nk, 16);
  for (int64_t r = 0; r < nq; ++r) {
    const float lse2 = *lse_at(p, s, h, i0 + r) * LOG2E;
    const float dl = delta[r];
    float *pr = pr_tile + r * BK, *ds = ds_tile + r * BK;
    for (int64_t c = 0; c < nk16; c += VL) {
      const vi visible = visible_lanes(tk, r, j0, c, nk, 0);
      vf t;
      const vf pc = vf_select(visible, vf_exp2(log2_scores(p, vf_load(pr + c), &t) - lse2), vf_splat(0.0f));
      vf dsc = pc * (vf_load(ds + c) - dl);
      if (p->softcap > 0.0f) dsc *= 1.0f - t * t;
      vf_store(pr + c, pc);
      vf_store(ds + c, vf_select(visible, dsc, vf_splat(0.0f)));
    }
  }
}

/* dst rows (ldd apart) += src rows (lds apart): n rows of d floats. */
FO_INLINE void add_rows(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t n, int64_t d) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < d; ++c) dst[r * ldd + c] += src[r * lds + c];
}

/* A key tile's finished dk (times scale) and dv rows, keys j0.. (nk of them)
 * of s, kv head hk, from fp32 tiles holding key r, column d at r rs + d cs
 * (rows: cs = 1; dK^T, dV^T: rs = 1). tmp: 2 D floats. */
FO_INLINE void store_dkdv(const fo_attn_params *p, const seq_t *s, int64_t hk, int64_t j0, int64_t nk,
                          const float *dk_tile, const float *dv_tile, int64_t rs, int64_t cs, float *tmp) {
  const fo_dtype t = p->dtype;
  const int64_t D = p->D;
  for (int64_t r = 0; r < nk; ++r) {
    for (int64_t d = 0; d < D; ++d)
      tmp[d] = dk_tile[r * rs + d * cs] * p->scale, tmp[D + d] = dv_tile[r * rs + d * cs];
    const int64_t j = s->k0 + j0 + r;
    fo_store_row(t, (char *)p->dk + q_off(&p->dk_st, s->bb, j, hk) * fo_dtype_size(t), tmp, D);
    fo_store_row(t, (char *)p->dv + q_off(&p->dv_st, s->bb, j, hk) * fo_dtype_size(t), tmp + D, D);
  }
}

/* The contribution of one query tile (queries i0.. of s, nq of them, head h)
 * to the key tile in w (keys j0.., nk of them): dk, dv in w; dq rows added
 * into dq_part. */
static void bwd_pair(const fo_attn_params *p, const seq_t *s, int64_t h, int64_t i0, int64_t nq, int64_t j0,
                     int64_t nk, const float *delta, float *dq_part, bwd_scratch *w) {
  const fo_dtype t = p->dtype;
  const int64_t D = p->D, Dp = round_up(D, 16), nk16 = round_up(nk, 16), mq = round_up(nq, 4);
  const int64_t row0 = scratch_row(p, s, h, i0); /* of delta and dq_part */
  load_rows(t, p->q, q_off(&p->q_st, s->bb, s->q0 + i0, h), p->q_st.seq, nq, D, w->q, Dp);
  load_rows(t, p->dout, q_off(&p->dout_st, s->bb, s->q0 + i0, h), p->dout_st.seq, nq, D, w->dout, Dp);
  gemm_tile(mq, nk16, Dp, w->q, Dp, 1, w->kt, BK, w->pr, BK, 0);    /* s = q k^T */
  gemm_tile(mq, nk16, Dp, w->dout, Dp, 1, w->vt, BK, w->ds, BK, 0); /* dp = dout v^T */
  probs_rows(p, s, &w->keys, h, i0, j0, nq, nk, delta + row0, w->pr, w->ds);
  /* rows nq..mq of pr / ds are never read: the products below sum over nq rows */
  gemm_tile(nk16, Dp, nq, w->pr, 1, BK, w->dout, Dp, w->dv, Dp, 1); /* dv += p^T dout */
  gemm_tile(nk16, Dp, nq, w->ds, 1, BK, w->q, Dp, w->dk, Dp, 1);    /* dk += ds^T q */
  gemm_tile(mq, Dp, nk, w->ds, BK, 1, w->k, Dp, w->dq, Dp, 0);      /* dq tile = ds k */
  add_rows(dq_part + row0 * D, D, w->dq, Dp, nq, D);
}

/* dq partial of a split: splits of fo_attn_cpu_rows x D floats each. */
static inline float *dq_partial(const fo_attn_params *p, int64_t split) {
  return p->workspace + split * fo_attn_cpu_rows(p) * p->D;
}

/* One task: key tiles split, split + splits, ... of sequence s, kv head hk;
 * each against the query tiles that see some key of it. */
static void bwd_task(const fo_attn_params *p, const seq_t *s, int64_t hk, int64_t split,
                               const float *delta, bwd_scratch *w) {
  const fo_dtype t = p->dtype;
  const int64_t D = p->D, Dp = round_up(D, 16), G = p->Hq / p->Hkv;
  const int64_t ktiles = (s->sk + BK - 1) / BK;
  float *dq_part = dq_partial(p, split);
  for (int64_t jt = split; jt < ktiles; jt += p->splits) {
    const int64_t j0 = jt * BK, nk = min64(BK, s->sk - j0), nk16 = round_up(nk, 16), koff = s->k0 + j0;
    load_rows(t, p->k, q_off(&p->k_st, s->bb, koff, hk), p->k_st.seq, nk, D, w->k, Dp);
    load_rows_t(t, p->k, q_off(&p->k_st, s->bb, koff, hk), p->k_st.seq, nk, D, w->kt, BK, w->tmp);
    load_rows_t(t, p->v, q_off(&p->v_st, s->bb, koff, hk), p->v_st.seq, nk, D, w->vt, BK, w->tmp);
    memset(w->dk, 0, sizeof(float) * (size_t)(nk16 * Dp));
    memset(w->dv, 0, sizeof(float) * (size_t)(nk16 * Dp));
    int64_t ilo, ihi;
    queries_of_keys(p, s, j0, j0 + nk, &ilo, &ihi);
    for (int64_t i0 = ilo; i0 < ihi; i0 += BQ) {
      const int64_t nq = min64(BQ, ihi - i0);
      keys_of_rows(p, s, i0, nq, &w->keys);
      for (int64_t h = hk * G; h < (hk + 1) * G; ++h) bwd_pair(p, s, h, i0, nq, j0, nk, delta, dq_part, w);
    }
    store_dkdv(p, s, hk, j0, nk, w->dk, w->dv, Dp, 1, w->tmp);
  }
}

#if FO_LEVEL >= 4
/* ------------------------------------------ backward, bf16 with AVX512-BF16
 * Where the forward takes its bf16 tiles (tiles_of), the backward's five
 * products run on vdpbf16ps too, each operand as bf16 pairs along the
 * product's inner dimension: S = Q K^T and dP = dO V^T with Q, dO rows read
 * in place and K^T, V^T packed once per key tile; dV += P^T dO and dK += dS^T
 * Q over pairs of queries; dQ = dS K over pairs of keys (K packed once per
 * key tile). P and dS are rounded to bf16 for the last three, as the GPU
 * kernels do; everything else is fp32, as in the fp32 tiles. The AMX
 * backward (bwd_pair_amx) shares the walk and the scratch: there dk, dv hold
 * dK^T, dV^T [D, BK], and qr, dr, dq go unused. */
typedef struct bwd_scratch_bf16 {
  uint32_t *kt, *vt; /* [D/2, BK]: K^T, V^T pairs along D, key c at [p * BK + c] (zeros past nk) */
  uint32_t *kr;      /* [BK/2, D]: K as pairs of keys, for dQ */
  uint32_t *qa, *da; /* [BQ, D/2]: a tail tile's Q, dO rows (zeros past nq); others read in place */
  uint32_t *qr, *dr; /* [BQ/2, D]: Q, dO as pairs of queries, for dK, dV */
  uint32_t *pq, *sq; /* [BQ/2, BK]: P, dS as pairs of queries, for dV, dK */
  uint32_t *sk;      /* [BQ, BK/2]: dS rows as pairs of keys, for dQ */
  float *pr, *ds;    /* [BQ, BK]: scores then P; dP then dS */
  float *dk, *dv;    /* [BK, D] */
  float *dq;         /* [BQ, D] */
  float *tmp;        /* [2 D]: delta's two rows, a row of dQ */
#if ATTN_AMX
  fo_amx_stage *stage;
#endif
  tile_keys keys;    /* of the query tile in hand */
} bwd_scratch_bf16;

static uint32_t *bwd_scratch_bf16_init(bwd_scratch_bf16 *w, int64_t D) {
  carver c = {NULL, 0};
  do {
    w->kt = take(&c, D / 2 * BK);
    w->vt = take(&c, D / 2 * BK);
    w->kr = take(&c, BK / 2 * D);
    w->qa = take(&c, BQ * D / 2);
    w->da = take(&c, BQ * D / 2);
    w->qr = take(&c, BQ / 2 * D);
    w->dr = take(&c, BQ / 2 * D);
    w->pq = take(&c, BQ / 2 * BK);
    w->sq = take(&c, BQ / 2 * BK);
    w->sk = take(&c, BQ * BK / 2);
    w->pr = take(&c, BQ * BK);
    w->ds = take(&c, BQ * BK);
    w->dk = take(&c, BK * D);
    w->dv = take(&c, BK * D);
    w->dq = take(&c, BQ * D);
    w->tmp = take(&c, 2 * D);
#if ATTN_AMX
    w->stage = take(&c, sizeof(fo_amx_stage) / 4);
#endif
  } while (carve_again(&c));
  return c.base;
}

FO_TARGET_V4_BF16 static void bwd_pair_bf16(const fo_attn_params *p, const seq_t *s, int64_t h, int64_t i0,
                                            int64_t nq, int64_t j0, int64_t nk, const float *delta,
                                            float *dq_part, bwd_scratch_bf16 *w) {
  const int64_t D = p->D, D2 = D / 2, nk32 = round_up(nk, 32), mk = round_up(nk, 4), nk2 = (nk + 1) / 2;
  const int64_t mq = round_up(nq, 4), nq2 = (nq + 1) / 2, i = s->q0 + i0;
  const int64_t row0 = scratch_row(p, s, h, i0); /* of delta and dq_part */
  const uint16_t *q = (const uint16_t *)p->q, *dout = (const uint16_t *)p->dout;
  int64_t qrs, drs;
  const pair_u *qa = rows_as_pairs(q, &p->q_st, s->bb, i, h, nq, mq, D, w->qa, &qrs);
  const pair_u *da = rows_as_pairs(dout, &p->dout_st, s->bb, i, h, nq, mq, D, w->da, &drs);
  gemm_bf16(mq, nk32, D2, qa, qrs, 1, w->kt, BK, w->pr, BK, 0); /* s = q k^T */
  gemm_bf16(mq, nk32, D2, da, drs, 1, w->vt, BK, w->ds, BK, 0); /* dp = dout v^T */
  probs_rows(p, s, &w->keys, h, i0, j0, nq, nk, delta + row0, w->pr, w->ds);
  /* pairs of queries (an odd last one with zeros) for dV, dK */
  for (int64_t pp = 0; pp < nq2; ++pp) {
    const int two = 2 * pp + 1 < nq;
    pack_rows2_f32(w->pq + pp * BK, w->pr + 2 * pp * BK, two ? w->pr + (2 * pp + 1) * BK : NULL, nk32);
    pack_rows2_f32(w->sq + pp * BK, w->ds + 2 * pp * BK, two ? w->ds + (2 * pp + 1) * BK : NULL, nk32);
    pack_rows2(w->qr + pp * D, q + q_off(&p->q_st, s->bb, i + 2 * pp, h),
               two ? q + q_off(&p->q_st, s->bb, i + 2 * pp + 1, h) : NULL, D);
    pack_rows2(w->dr + pp * D, dout + q_off(&p->dout_st, s->bb, i + 2 * pp, h),
               two ? dout + q_off(&p->dout_st, s->bb, i + 2 * pp + 1, h) : NULL, D);
  }
  gemm_bf16(mk, D, nq2, (const pair_u *)w->pq, 1, BK, w->dr, D, w->dv, D, 1); /* dv += p^T dout */
  gemm_bf16(mk, D, nq2, (const pair_u *)w->sq, 1, BK, w->qr, D, w->dk, D, 1); /* dk += ds^T q */
  /* rows nq..mq of ds are the products of zero rows (0): their dq rows are dropped */
  for (int64_t r = 0; r < mq; ++r) pack_row_f32(w->sk + r * (BK / 2), w->ds + r * BK, nk32);
  gemm_bf16(mq, D, nk2, (const pair_u *)w->sk, BK / 2, 1, w->kr, D, w->dq, D, 0); /* dq tile = ds k */
  add_rows(dq_part + row0 * D, D, w->dq, D, nq, D);
}

#if ATTN_AMX
/* ------------------------------------------------ backward, bf16 on AMX tiles
 * The backward of the bf16 tiles with its five products on AMX, every A
 * operand read in place with its pairs along the product's inner dimension:
 * S = Q K^T and dP = dO V^T as at level V4_BF16 (Q, dO rows in place; K^T,
 * V^T packed once per key tile); dV^T += dO^T P and dK^T += Q^T dS, so that
 * the A operands are Q^T and dO^T as pairs of queries, packed once a call
 * (pack_queries), and P, dS the B operands, two rows of queries a row; the
 * key tile's dK^T, dV^T transposed as they are stored. dQ += dS K into the
 * split's partial in place. Query tiles start at an even query (the pairs of
 * Q^T). */

/* probs_rows for the AMX backward, on 16 lanes and two rows (a pair of
 * queries) at a time: from pr, ds [nq, BK] (the raw products q.k and dP, read
 * only), P and dS as bf16 pairs of queries into pq, sq [ceil(nq / 2), BK]
 * (the B operands of dV^T, dK^T; an odd last query paired with zeros) and dS
 * as bf16 pairs of keys into sk [nq, BK/2] (the A operand of dQ); columns
 * from nk up to nk rounded to 32 get 0. */
FO_TARGET_AMX static void probs_amx(const fo_attn_params *p, const seq_t *s, const tile_keys *tk, int64_t h,
                                    int64_t i0, int64_t j0, int64_t nq, int64_t nk, const float *delta,
                                    const float *pr, const float *ds, uint32_t *pq, uint32_t *sq, uint32_t *sk) {
  const int64_t nk32 = round_up(nk, 32);
  const int whole = tk->all_lo <= j0 && j0 + nk <= tk->all_hi;
  for (int64_t r = 0; r < nq; r += 2) {
    const int rows = r + 1 < nq ? 2 : 1;
    float lse2[2], dl[2];
    for (int x = 0; x < rows; ++x) lse2[x] = *lse_at(p, s, h, i0 + r + x) * LOG2E, dl[x] = delta[r + x];
    for (int64_t c = 0; c < nk32; c += 32) {
      __m512 P[2][2], S[2][2]; /* [row][half] */
      for (int x = 0; x < 2; ++x)
        for (int y = 0; y < 2; ++y) {
          P[x][y] = S[x][y] = _mm512_setzero_ps();
          if (x >= rows) continue;
          const int64_t at = (r + x) * BK + c + 16 * y;
          const __mmask16 vis = visible16(tk, r + x, j0, c + 16 * y, nk, whole);
          __m512 t;
          const __m512 sc = log2_scores16(p, _mm512_loadu_ps(pr + at), &t);
          P[x][y] = _mm512_maskz_mov_ps(vis, exp2_16(_mm512_sub_ps(sc, _mm512_set1_ps(lse2[x]))));
          __m512 d = _mm512_mul_ps(P[x][y], _mm512_sub_ps(_mm512_loadu_ps(ds + at), _mm512_set1_ps(dl[x])));
          if (p->softcap > 0.0f) d = _mm512_mul_ps(d, _mm512_fnmadd_ps(t, t, _mm512_set1_ps(1.0f)));
          S[x][y] = _mm512_maskz_mov_ps(vis, d);
        }
      for (int y = 0; y < 2; ++y) {
        const int64_t at = r / 2 * BK + c + 16 * y;
        _mm512_storeu_si512(pq + at, pairs16(bf16x16(P[0][y]), bf16x16(P[1][y])));
        _mm512_storeu_si512(sq + at, pairs16(bf16x16(S[0][y]), bf16x16(S[1][y])));
      }
      for (int x = 0; x < rows; ++x)
        _mm512_storeu_si512(sk + (r + x) * (BK / 2) + c / 2, (__m512i)_mm512_cvtne2ps_pbh(S[x][1], S[x][0]));
    }
  }
}

FO_TARGET_AMX static void bwd_pair_amx(const fo_attn_params *p, const seq_t *s, int64_t h, int64_t i0, int64_t nq,
                                       int64_t j0, int64_t nk, const float *delta, float *dq_part,
                                       const uint32_t *qd, bwd_scratch_bf16 *w) {
  const int64_t D = p->D, D2 = D / 2, lq = packed_len(s, 0) / 2, nq2 = (nq + 1) / 2;
  const int64_t i = s->q0 + i0, row0 = scratch_row(p, s, h, i0); /* of delta and dq_part */
  int64_t qrs, drs;
  const pair_u *qa = rows_as_pairs((const uint16_t *)p->q, &p->q_st, s->bb, i, h, nq, nq, D, w->qa, &qrs);
  const pair_u *da = rows_as_pairs((const uint16_t *)p->dout, &p->dout_st, s->bb, i, h, nq, nq, D, w->da, &drs);
  fo_amx_gemm(nq, nk, D2, qa, qrs, w->kt, BK, w->pr, BK, 0, w->stage); /* s = q k^T */
  fo_amx_gemm(nq, nk, D2, da, drs, w->vt, BK, w->ds, BK, 0, w->stage); /* dp = dout v^T */
  probs_amx(p, s, &w->keys, h, i0, j0, nq, nk, delta + row0, w->pr, w->ds, w->pq, w->sq, w->sk);
  fo_amx_gemm(D, nk, nq2, qd + D * lq + i0 / 2, lq, w->pq, BK, w->dv, BK, 1, w->stage); /* dv^T += dout^T p */
  fo_amx_gemm(D, nk, nq2, qd + i0 / 2, lq, w->sq, BK, w->dk, BK, 1, w->stage);          /* dk^T += q^T ds */
  fo_amx_gemm(nq, D, (nk + 1) / 2, w->sk, BK / 2, w->kr, D, dq_part + row0 * D, D, 1, w->stage); /* dq += ds k */
}
#endif

/* One task (bwd_task's) on the bf16 tiles: products on vdpbf16ps, or on AMX
 * where qd, the call's Q^T and dO^T packed (pack_queries), is given. */
FO_TARGET_V4_BF16 static void bwd_task_bf16(const fo_attn_params *p, const seq_t *s, int64_t hk, int64_t split,
                                            const float *delta, const packed_amx *qd, bwd_scratch_bf16 *w) {
  const int64_t D = p->D, D2 = D / 2, G = p->Hq / p->Hkv;
  const int64_t ktiles = (s->sk + BK - 1) / BK;
  const uint16_t *k = (const uint16_t *)p->k, *v = (const uint16_t *)p->v;
  float *dq_part = dq_partial(p, split);
  for (int64_t jt = split; jt < ktiles; jt += p->splits) {
    const int64_t j0 = jt * BK, nk = min64(BK, s->sk - j0), nk2 = (nk + 1) / 2, j = s->k0 + j0;
    memset(w->kt, 0, sizeof(uint32_t) * (size_t)(D2 * BK));
    memset(w->vt, 0, sizeof(uint32_t) * (size_t)(D2 * BK));
    pack_pairs_t(w->kt, BK, k, q_off(&p->k_st, s->bb, j, hk), p->k_st.seq, nk, D2);
    pack_pairs_t(w->vt, BK, v, q_off(&p->v_st, s->bb, j, hk), p->v_st.seq, nk, D2);
    for (int64_t pp = 0; pp < nk2; ++pp)
      pack_rows2(w->kr + pp * D, k + q_off(&p->k_st, s->bb, j + 2 * pp, hk),
                 2 * pp + 1 < nk ? k + q_off(&p->k_st, s->bb, j + 2 * pp + 1, hk) : NULL, D);
    memset(w->dk, 0, sizeof(float) * (size_t)(BK * D));
    memset(w->dv, 0, sizeof(float) * (size_t)(BK * D));
    int64_t ilo, ihi;
    queries_of_keys(p, s, j0, j0 + nk, &ilo, &ihi);
    /* query tiles from an even query: the pairs of queries of Q^T, dO^T */
    for (int64_t i0 = ilo & ~(int64_t)1; i0 < ihi; i0 += BQ) {
      const int64_t nq = min64(BQ, ihi - i0);
      keys_of_rows(p, s, i0, nq, &w->keys);
      for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
#if ATTN_AMX
        if (qd) {
          bwd_pair_amx(p, s, h, i0, nq, j0, nk, delta, dq_part, packed_at(qd, p, s, h), w);
          continue;
        }
#endif
        bwd_pair_bf16(p, s, h, i0, nq, j0, nk, delta, dq_part, w);
      }
    }
    /* AMX: dK^T, dV^T */
    store_dkdv(p, s, hk, j0, nk, w->dk, w->dv, qd ? 1 : D, qd ? BK : 1, w->tmp);
  }
}
#endif

/* dq[row] = scale * (sum over splits of the partials, in split order). */
static void bwd_dq_row(const fo_attn_params *p, int64_t row, float *acc) {
  const fo_dtype t = p->dtype;
  const int64_t D = p->D, part = fo_attn_cpu_rows(p) * D;
  int64_t b, h, i;
  row_place(p, row, &b, &h, &i);
  const float *src = p->workspace + row * D;
  for (int64_t d = 0; d < D; ++d) acc[d] = src[d];
  for (int64_t s = 1; s < p->splits; ++s)
    for (int64_t d = 0; d < D; ++d) acc[d] += src[s * part + d];
  for (int64_t d = 0; d < D; ++d) acc[d] *= p->scale;
  fo_store_row(t, (char *)p->dq + q_off(&p->dq_st, b, i, h) * fo_dtype_size(t), acc, D);
}

const char *FO_FN(fo_attn_bwd_cpu)(const fo_attn_params *p) {
  const int64_t D = p->D, Dp = round_up(D, 16), rows = fo_attn_cpu_rows(p);
  float *delta = p->workspace + p->splits * rows * D;
  const int64_t tasks = p->B * p->Hkv * p->splits;
  const int tiles = tiles_of(p);
  packed_amx qd = {0}; /* AMX: Q^T and dO^T, packed */
  if (tiles == TILES_AMX && !packed_init(&qd, p, 0)) {
    packed_free(&qd);
    return FO_CPU_OOM;
  }
  int missing = 0;
  memset(p->workspace, 0, sizeof(float) * (size_t)(p->splits * rows * D));
#pragma omp parallel if (fo_parallel(tasks, rows * p->Sk * D))
  {
    bwd_scratch w = {0};
#if FO_LEVEL >= 4
    bwd_scratch_bf16 wb = {0};
    uint32_t *block = tiles != TILES_F32 ? bwd_scratch_bf16_init(&wb, D) : bwd_scratch_init(&w, Dp);
    float *tmp = tiles != TILES_F32 ? wb.tmp : w.tmp;
#else
    uint32_t *block = bwd_scratch_init(&w, Dp);
    float *tmp = w.tmp;
#endif
    if (fo_every_thread_has(block, &missing)) {
#pragma omp for schedule(static)
      for (int64_t row = 0; row < rows; ++row) bwd_delta(p, row, delta, tmp);
#if ATTN_AMX
      if (tiles == TILES_AMX) {
        pack_all(p, &qd);
        fo_amx_begin();
      }
#endif
      /* the implicit barriers: delta (and the packing) complete */
#pragma omp for schedule(dynamic)
      for (int64_t task = 0; task < tasks; ++task) {
        const int64_t split = task % p->splits, bh = task / p->splits;
        const seq_t s = seq_of(p, bh / p->Hkv);
        switch (tiles) {
#if FO_LEVEL >= 4
        case TILES_BF16: bwd_task_bf16(p, &s, bh % p->Hkv, split, delta, NULL, &wb); break;
        case TILES_AMX: bwd_task_bf16(p, &s, bh % p->Hkv, split, delta, &qd, &wb); break;
#endif
        default: bwd_task(p, &s, bh % p->Hkv, split, delta, &w);
        }
      }
#if ATTN_AMX
      if (tiles == TILES_AMX) fo_amx_end();
#endif
#pragma omp for schedule(static)
      for (int64_t row = 0; row < rows; ++row) bwd_dq_row(p, row, tmp);
    }
    free(block);
  }
  packed_free(&qd);
  return missing ? FO_CPU_OOM : NULL;
}
FO_ENTRY(const char *, fo_attn_bwd_cpu, (const fo_attn_params *p), (p))
