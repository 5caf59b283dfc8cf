/* Residual-add + LayerNorm / RMSNorm on the CPU: C11 + OpenMP, one row at a
 * time per thread, each row walked in blocks of FO_VL values (one register of
 * the x86-64 level the copy is compiled for), converted from and to 16-bit
 * inside the pass that reads or writes them (cpu_dtype.h; hardware fp16
 * conversions at x86-64-v3 and v4).
 *
 * Forward: read x (and residual) once from memory, write s (when stored) and y
 * once; three passes over the row (two for RMSNorm): s, stored, with its sum
 * (LayerNorm) or sum of squares (RMSNorm); the squared deviations from the
 * mean (LayerNorm); the output. The later passes read s back from the row just
 * stored (or x), from L1, converting again. Backward: read dy, s (and ds),
 * write dx; two passes (the sums and the dweight/dbias partials, then dx),
 * xhat and g recomputed in the second. dweight/dbias are summed per thread
 * into fp32 partial rows, then one pass over the partials. Every sum is taken
 * in blocks added with compensation (cpu_dtype.h, long sums), so that its
 * error does not grow with the row (or, for dweight/dbias, the rows); a row
 * whose sums overflow fp32 gets its statistics from a rescaled copy
 * (rescaled_stats). Each row function
 * is specialised per dtype pair (x, s) and per x86-64 level. Measured (2 Zen 4
 * cores, 16-bit): 1.1-1.7x eager LayerNorm, 4-11x eager RMSNorm, forward and
 * forward+backward (docs/perf-notes.md). Math and layout: norm.h. */
#include <stdlib.h>
#include <math.h>
#include <omp.h>

#include "norm.h"
#include "../common/cpu_dtype.h"

static inline const char *row_ptr(const void *base, fo_dtype t, int64_t row, int64_t stride) {
  return (const char *)base + (size_t)(row * stride) * (size_t)fo_dtype_size(t);
}

static inline int64_t round_up_block(int64_t n) { return (n + FO_VL - 1) / FO_VL * FO_VL; }

/* A [cols] weight or bias row in fp32, padded with zeros to a whole number of
 * blocks (the block loops read whole blocks); `fill` where there is none.
 * NULL when out of memory. */
static float *param_f32(const void *t, fo_dtype dt, int64_t n, float fill) {
  float *out = calloc((size_t)round_up_block(n) + 1, sizeof(float));
  if (!out) return NULL;
  if (t) fo_load_row(dt, t, out, n);
  else for (int64_t j = 0; j < n; ++j) out[j] = fill;
  return out;
}

/* fn(args..., xt, st) with the dtype pair as constants, one copy of fn per
 * pair the shim allows: s in x's dtype, or 16-bit x with fp32 s. */
#define WITH_DTYPE_PAIR(xt, st, fn, ...)                                            \
  do {                                                                              \
    if ((xt) == FO_F32) fn(__VA_ARGS__, FO_F32, FO_F32);                            \
    else if ((xt) == FO_BF16 && (st) == FO_BF16) fn(__VA_ARGS__, FO_BF16, FO_BF16); \
    else if ((xt) == FO_BF16) fn(__VA_ARGS__, FO_BF16, FO_F32);                     \
    else if ((st) == FO_F16) fn(__VA_ARGS__, FO_F16, FO_F16);                       \
    else fn(__VA_ARGS__, FO_F16, FO_F32);                                           \
  } while (0)

/* ---- forward --------------------------------------------------------------- */

/* Pass 1 over the block of len values at column j: s = x + residual rounded to
 * s's dtype and stored (when s is not NULL); acc += scale * s (LayerNorm) or
 * its square (RMSNorm), lane k into acc[k] (the order of fo_sum; the lanes
 * past len are 0 and add nothing). scale: 1, or the power of two of
 * rescaled_stats. */
FO_INLINE fo_vf fwd_block_s(int rms, const char *x, const char *res, char *s, float scale, fo_vf acc, int64_t j,
                            int len, const fo_dtype xt, const fo_dtype st) {
  const int ss = fo_dtype_size(st);
  fo_vf v = fo_vload_n(xt, x + j * fo_dtype_size(xt), len);
  if (res) {
    v = fo_vstore_keep_n(st, s + j * ss, v + fo_vload_n(st, res + j * ss, len), len);
  } else if (s) { /* s is x, or x widened to fp32: exact either way */
    fo_vstore_n(st, s + j * ss, v, len);
  }
  v *= scale;
  return acc + (rms ? v * v : v);
}

/* Pass 1 over the row, a block of FO_SUM_BLOCK columns at a time (long sums,
 * cpu_dtype.h): returns the sum of scale * s (RMSNorm: of its squares). */
FO_INLINE float fwd_pass_s(int rms, const char *x, const char *res, char *s, int64_t n, float scale,
                           const fo_dtype xt, const fo_dtype st) {
  fo_lanes sum = {{0}, {0}};
  for (int64_t j0 = 0; j0 < n; j0 += FO_SUM_BLOCK) {
    const int64_t end = fo_block_end(n, j0);
    fo_vf acc[FO_NV] = {{0}}; /* the block's sum in 16 lanes (cpu_dtype.h) */
    int64_t j = j0;
    for (; j + FO_STEP <= end; j += FO_STEP)
      for (int k = 0; k < FO_NV; ++k) acc[k] = fwd_block_s(rms, x, res, s, scale, acc[k], j + k * FO_VL, FO_VL, xt, st);
    for (int k = 0; k < FO_NV && j < end; ++k, j += FO_VL)
      acc[k] = fwd_block_s(rms, x, res, s, scale, acc[k], j, fo_tail_len(end, j), xt, st);
    fo_lanes_add(&sum, acc);
  }
  return fo_lanes_total(&sum);
}

/* Pass 3's weight and bias (NULL: none) of dtype t: fp32 copies padded to
 * whole blocks, or the 16-bit tensors themselves (fo_norm_fwd_cpu says when);
 * stream: fp32 x in a call too large for its rows to stay cached
 * (fo_cpu_stream): pass 3 stores y past the caches and prefetches the next
 * row's x and residual, so that memory stays busy while the row's later
 * passes run from L1 (the backward likewise with dx). 16-bit rows, whose
 * passes take longer than their bytes, gained nothing forward and lost
 * backward (docs/perf-notes.md, CPU v6). */
typedef struct affine {
  const void *w, *b;
  fo_dtype t;
  int stream;
} affine;

/* Pass 3 for the block at column j: y = (s - mean) * rstd * w + b, s read back
 * from sr, of dtype t; w and b of dtype wt; a whole block of fp32 y through
 * fo_vstream_f32 when a->stream. */
FO_INLINE void fwd_block_y(const char *sr, const affine *a, float mean, float rstd, char *y, int64_t j, int len,
                           const fo_dtype t, const fo_dtype xt, const fo_dtype wt) {
  const int ws = fo_dtype_size(wt);
  fo_vf v = (fo_vload_n(t, sr + j * fo_dtype_size(t), len) - mean) * rstd;
  if (a->w) v *= fo_vload_n(wt, (const char *)a->w + j * ws, len);
  if (a->b) v += fo_vload_n(wt, (const char *)a->b + j * ws, len);
  if (xt == FO_F32 && len == FO_VL && a->stream) fo_vstream_f32((float *)y + j, v);
  else fo_vstore_n(xt, y + j * fo_dtype_size(xt), v, len);
}

/* Pass 3 over the row; nx, nr: the next row's x and residual, prefetched a
 * block at a time (NULL: not). */
FO_INLINE void fwd_pass_y(const char *sr, const affine *a, float mean, float rstd, char *y, int64_t n,
                          const fo_dtype t, const fo_dtype xt, const fo_dtype wt, const char *nx, const char *nr,
                          const fo_dtype st) {
  int64_t j = 0;
  for (; j + FO_VL <= n; j += FO_VL) {
    if (nx) __builtin_prefetch(nx + j * fo_dtype_size(xt), 0, 3);
    if (nr) __builtin_prefetch(nr + j * fo_dtype_size(st), 0, 3);
    fwd_block_y(sr, a, mean, rstd, y, j, FO_VL, t, xt, wt);
  }
  if (j < n) fwd_block_y(sr, a, mean, rstd, y, j, (int)(n - j), t, xt, wt);
}

/* Pass 2 (LayerNorm) for the block at column j: dev += scale * s - mean and
 * sq += (scale * s - mean)^2, s read back from sr, of dtype t; the lanes past
 * len would add -mean and mean^2: masked. */
FO_INLINE void fwd_block_dev(const char *sr, float scale, float mean, fo_vf *dev, fo_vf *sq, int64_t j, int len,
                             const fo_dtype t) {
  fo_vf d = fo_vload_n(t, sr + j * fo_dtype_size(t), len) * scale - mean;
  if (len < FO_VL) d = (fo_vf)((fo_vu)d & fo_mask_first(len));
  *dev += d;
  *sq += d * d;
}

/* The mean and variance (RMSNorm: 0 and the mean square) of scale * s, s read
 * back from sr, of dtype t, given pass 1's sum. LayerNorm takes pass 2 here:
 * the corrected two-pass variance. The first pass's mean is off by the
 * rounding of its sum (at 1000 + N(0, 1) over 65536 columns, ~5e-4, twice
 * eager's error in y); the deviations' own sum, small and exact to far fewer
 * bits, corrects it: mean += sum(d) / n, and the squared deviations lose
 * sum(d)^2 / n (Chan, Golub and LeVeque). */
FO_INLINE void row_moments(int rms, const char *sr, int64_t n, float sum, float scale, float *mean, float *var,
                           const fo_dtype t) {
  *mean = 0.0f;
  *var = 0.0f;
  if (n && rms) {
    *var = sum / (float)n;
  } else if (n) {
    const float m = sum / (float)n;
    fo_lanes dev = {{0}, {0}}, sq = {{0}, {0}};
    for (int64_t j0 = 0; j0 < n; j0 += FO_SUM_BLOCK) {
      const int64_t end = fo_block_end(n, j0);
      fo_vf d[FO_NV] = {{0}}, q[FO_NV] = {{0}};
      int64_t j = j0;
      for (; j + FO_STEP <= end; j += FO_STEP)
        for (int k = 0; k < FO_NV; ++k) fwd_block_dev(sr, scale, m, &d[k], &q[k], j + k * FO_VL, FO_VL, t);
      for (int k = 0; k < FO_NV && j < end; ++k, j += FO_VL)
        fwd_block_dev(sr, scale, m, &d[k], &q[k], j, fo_tail_len(end, j), t);
      fo_lanes_add(&dev, d);
      fo_lanes_add(&sq, q);
    }
    const float d = fo_lanes_total(&dev);
    *mean = m + d / (float)n;
    /* at least 0, and NaN where the sums overflowed (fmaxf would give 0) */
    const float v = fo_lanes_total(&sq) - d * d / (float)n;
    *var = (v < 0.0f ? 0.0f : v) / (float)n;
  }
}

/* The largest |s| of the row read back from sr, of dtype t (NaN lanes
 * skipped). */
FO_INLINE float row_amax(const char *sr, int64_t n, const fo_dtype t) {
  fo_vf m = {0};
  for (int64_t j = 0; j < n; j += FO_VL) {
    const fo_vf v = (fo_vf)((fo_vu)fo_vload_n(t, sr + j * fo_dtype_size(t), fo_tail_len(n, j)) & 0x7FFFFFFFu);
    m = fo_vselect(v > m, v, m);
  }
  float r = 0.0f;
  for (int k = 0; k < FO_VL; ++k) r = m[k] > r ? m[k] : r;
  return r;
}

/* A row whose sums overflow fp32 (a sum of squares past 3.4e38: values from
 * about 1e19 on), which would give rstd = 0 or NaN where the true outputs
 * are bounded (LayerNorm's by sqrt(n - 1)): its statistics are taken again
 * on the row times a power of two that brings its largest |value| into
 * [2, 4) (exact, and never a subnormal factor), then scaled back. A row
 * holding an inf or NaN keeps the plain result (not finite, as torch's). */
FO_INLINE void rescaled_stats(int rms, const char *sr, int64_t n, float eps, float *mean, float *rstd,
                              const fo_dtype t) {
  const float amax = row_amax(sr, n, t);
  if (!isfinite(amax) || amax == 0.0f) return;
  int e;
  frexpf(amax, &e); /* amax in [2^(e-1), 2^e), e <= 128 */
  const float scale = ldexpf(1.0f, 2 - e);
  float m, v;
  row_moments(rms, sr, n, fwd_pass_s(rms, sr, NULL, NULL, n, scale, t, t), scale, &m, &v, t);
  *mean = m / scale;
  *rstd = scale / sqrtf(v + eps * scale * scale);
}

/* Passes 2 (LayerNorm: the squared deviations from the mean) and 3 (y = (s -
 * mean) * rstd * w + b), reading s back from sr, of dtype t: the row just
 * stored, or x when s is not stored (then s is x). Reading the 16-bit row
 * again costs a conversion; keeping s in fp32 scratch instead cost cache: at
 * 4096 columns the scratch, w and b (48 KB) no longer fit L1. */
FO_INLINE void fwd_rest(const fo_norm_fwd_params *p, int64_t r, const char *sr, float sum, const affine *a, char *y,
                        const fo_dtype t, const fo_dtype xt, const char *nx, const char *nr, const fo_dtype st) {
  const int64_t n = p->cols;
  float mean, var;
  row_moments(p->rms, sr, n, sum, 1.0f, &mean, &var, t);
  float rstd = 1.0f / sqrtf(var + p->eps);
  if (!isfinite(mean) || !isfinite(var)) rescaled_stats(p->rms, sr, n, p->eps, &mean, &rstd, t);
  if (a->t == FO_F32) fwd_pass_y(sr, a, mean, rstd, y, n, t, xt, FO_F32, nx, nr, st);
  else if (a->t == FO_BF16) fwd_pass_y(sr, a, mean, rstd, y, n, t, xt, FO_BF16, nx, nr, st);
  else fwd_pass_y(sr, a, mean, rstd, y, n, t, xt, FO_F16, nx, nr, st);
  if (p->mean) p->mean[r] = mean;
  if (p->rstd) p->rstd[r] = rstd;
}

/* One row. */
FO_INLINE void fwd_row_t(const fo_norm_fwd_params *p, int64_t r, const affine *a, const fo_dtype xt,
                         const fo_dtype st) {
  const int64_t n = p->cols;
  const char *x = row_ptr(p->x, xt, r, p->x_stride);
  const char *res = p->residual ? row_ptr(p->residual, st, r, p->res_stride) : NULL;
  char *s = p->s ? (char *)p->s + (size_t)(r * n) * fo_dtype_size(st) : NULL;
  char *y = (char *)p->y + (size_t)(r * n) * fo_dtype_size(xt);
  const int rms = p->rms; /* a local: the stores through s could alias *p */
  const float sum = fwd_pass_s(rms, x, res, s, n, 1.0f, xt, st);
  const int pf = a->stream && r + 1 < p->rows;
  const char *nx = pf ? row_ptr(p->x, xt, r + 1, p->x_stride) : NULL;
  const char *nr = pf && res ? row_ptr(p->residual, st, r + 1, p->res_stride) : NULL;
  if (s) fwd_rest(p, r, s, sum, a, y, st, xt, nx, nr, st);
  else fwd_rest(p, r, x, sum, a, y, xt, xt, nx, nr, st);
}

static void fwd_row(const fo_norm_fwd_params *p, int64_t r, const affine *a) {
  WITH_DTYPE_PAIR(p->x_dtype, p->s_dtype, fwd_row_t, p, r, a);
}

/* Pass 3 reads w and b once a row. As fp32 copies they take 8 bytes a column
 * of L1 cache, and the row's x and y 4 more (16-bit): past a 32 KB L1 from
 * about 2700 columns. From NARROW_COLS columns on, 16-bit w and b are read as
 * they are and converted on the way, which keeps the row in L1; below it the
 * fp32 copies are faster (figures: docs/perf/norm.md). */
enum { NARROW_COLS = 3072 };

const char *FO_FN(fo_norm_fwd_cpu)(const fo_norm_fwd_params *p) {
  const int64_t n = p->cols;
  float *w = NULL, *b = NULL;
  /* x, residual, y and s: bytes moved */
  const int64_t moved = p->rows * n * (2 * fo_dtype_size(p->x_dtype) + 2 * fo_dtype_size(p->s_dtype));
  affine a = {p->weight, p->bias, p->w_dtype, p->x_dtype == FO_F32 && fo_cpu_stream(moved)};
  if (p->w_dtype == FO_F32 || n < NARROW_COLS) {
    w = param_f32(p->weight, p->w_dtype, n, 1.0f);
    b = p->bias ? param_f32(p->bias, p->w_dtype, n, 0.0f) : NULL;
    if (!w || (p->bias && !b)) {
      free(b);
      free(w);
      return FO_CPU_OOM;
    }
    a = (affine){w, b, FO_F32, a.stream};
  }
#pragma omp parallel if (fo_parallel(p->rows, p->rows * n))
  {
#pragma omp for schedule(static) nowait
    for (int64_t r = 0; r < p->rows; ++r) fwd_row(p, r, &a);
    if (a.stream) fo_stream_fence();
  }
  free(b);
  free(w);
  return NULL;
}
FO_ENTRY(const char *, fo_norm_fwd_cpu, (const fo_norm_fwd_params *p), (p))


/* ---- backward -------------------------------------------------------------- */

/* dweight / dbias: each thread sums dy * xhat and dy over its rows into a
 * partial row, and every ROW_BLOCK rows adds that row into its total with
 * Kahan's compensation (long sums, cpu_dtype.h), so that the sums' error does
 * not grow with the rows a thread takes. The workspace holds PART_ROWS rows
 * a thread for each: the partial row, the total, the compensation. */
enum { ROW_BLOCK = 64, PART_ROWS = 3 };

#if FO_LEVEL == 0
int64_t fo_norm_bwd_cpu_parts(const fo_norm_bwd_params *p) {
  (void)p;
  return PART_ROWS * omp_get_max_threads();
}
#endif

/* A thread's partial row part (PART_ROWS rows of n) added into its total,
 * and zeroed. */
static void flush_part(float *part, int64_t n) {
  fo_kahan_add(part + n, part + 2 * n, part, n);
  for (int64_t j = 0; j < n; ++j) part[j] = 0.0f;
}

/* The backward's per-row inputs. */
typedef struct bwd_row_in {
  const char *s, *dy, *ds; /* ds NULL when there is none */
  float mean, rstd;
} bwd_row_in;

/* dy, xh = (s - mean) * rstd and g = dy * w for the block at column j (the
 * lanes past len: 0, something finite, 0). */
FO_INLINE void bwd_load(const bwd_row_in *in, const float *w, int64_t j, int len, fo_vf *dy, fo_vf *xh, fo_vf *g,
                        const fo_dtype xt, const fo_dtype st) {
  *dy = fo_vload_n(xt, in->dy + j * fo_dtype_size(xt), len);
  *xh = (fo_vload_n(st, in->s + j * fo_dtype_size(st), len) - in->mean) * in->rstd;
  *g = *dy * *(const fo_vf *)(w + j);
}

/* Pass 1: ag += g, agx += g * xhat (lane k into [k]); this thread's dweight /
 * dbias partial rows pw += dy * xhat, pb += dy (NULL when not wanted; rows of
 * cols floats, written only below len). */
FO_INLINE void bwd_block_sums(const bwd_row_in *in, const float *w, float *pw, float *pb, fo_vf *ag, fo_vf *agx,
                              int64_t j, int len, const fo_dtype xt, const fo_dtype st) {
  fo_vf dy, xh, g;
  bwd_load(in, w, j, len, &dy, &xh, &g, xt, st);
  *ag += g;
  *agx += g * xh;
  if (len == FO_VL) {
    if (pw) *(fo_vf *)(pw + j) += dy * xh;
    if (pb) *(fo_vf *)(pb + j) += dy;
  } else {
    const fo_vf dw = dy * xh;
    for (int k = 0; k < len; ++k) {
      if (pw) pw[j + k] += dw[k];
      if (pb) pb[j + k] += dy[k];
    }
  }
}

/* Pass 2: dx = rstd * (g - mean_g - xhat * mean_gx) + ds; with next (the
 * next row's inputs, or NULL), a whole block of fp32 dx stored past the
 * caches and the next row's block prefetched (fwd_pass_y). */
FO_INLINE void bwd_block_dx(const bwd_row_in *in, const bwd_row_in *next, const float *w, float mean_g,
                            float mean_gx, char *dx, int64_t j, int len, const fo_dtype xt, const fo_dtype st) {
  const int ss = fo_dtype_size(st);
  fo_vf dy, xh, g;
  bwd_load(in, w, j, len, &dy, &xh, &g, xt, st);
  fo_vf v = in->rstd * (g - mean_g - xh * mean_gx);
  if (in->ds) v += fo_vload_n(st, in->ds + j * ss, len);
  if (st == FO_F32 && next && len == FO_VL) {
    __builtin_prefetch(next->s + j * ss, 0, 3);
    __builtin_prefetch(next->dy + j * fo_dtype_size(xt), 0, 3);
    if (next->ds) __builtin_prefetch(next->ds + j * ss, 0, 3);
    fo_vstream_f32((float *)dx + j, v);
  } else {
    fo_vstore_n(st, dx + j * ss, v, len);
  }
}

/* Row r's inputs. */
FO_INLINE bwd_row_in bwd_inputs(const fo_norm_bwd_params *p, int64_t r, const fo_dtype xt, const fo_dtype st) {
  return (bwd_row_in){row_ptr(p->s, st, r, p->s_stride), row_ptr(p->dy, xt, r, p->dy_stride),
                      p->ds ? row_ptr(p->ds, st, r, p->ds_stride) : NULL, p->mean ? p->mean[r] : 0.0f,
                      p->rstd[r]};
}

/* One row of the backward; pw, pb: this thread's partial rows, or NULL;
 * stream: dx stored past the caches, the next row prefetched (fo_cpu_stream). */
FO_INLINE void bwd_row_t(const fo_norm_bwd_params *p, int64_t r, const float *w, float *pw, float *pb, int stream,
                         const fo_dtype xt, const fo_dtype st) {
  const int64_t n = p->cols;
  const bwd_row_in in = bwd_inputs(p, r, xt, st);
  const int ahead = stream && r + 1 < p->rows;
  const bwd_row_in next = ahead ? bwd_inputs(p, r + 1, xt, st) : in;
  fo_lanes ag = {{0}, {0}}, agx = {{0}, {0}}; /* sums of g, of g * xhat, a block at a time (long sums) */
  for (int64_t j0 = 0; j0 < n; j0 += FO_SUM_BLOCK) {
    const int64_t end = fo_block_end(n, j0);
    fo_vf g[FO_NV] = {{0}}, gx[FO_NV] = {{0}}; /* the block's, in 16 lanes */
    int64_t j = j0;
    for (; j + FO_STEP <= end; j += FO_STEP)
      for (int k = 0; k < FO_NV; ++k) bwd_block_sums(&in, w, pw, pb, &g[k], &gx[k], j + k * FO_VL, FO_VL, xt, st);
    for (int k = 0; k < FO_NV && j < end; ++k, j += FO_VL)
      bwd_block_sums(&in, w, pw, pb, &g[k], &gx[k], j, fo_tail_len(end, j), xt, st);
    fo_lanes_add(&ag, g);
    fo_lanes_add(&agx, gx);
  }
  const float mean_g = p->rms ? 0.0f : fo_lanes_total(&ag) / (float)n;
  const float mean_gx = fo_lanes_total(&agx) / (float)n;
  char *dx = (char *)p->dx + (size_t)(r * n) * fo_dtype_size(st);
  int64_t j;
  for (j = 0; j + FO_VL <= n; j += FO_VL)
    bwd_block_dx(&in, ahead ? &next : NULL, w, mean_g, mean_gx, dx, j, FO_VL, xt, st);
  if (j < n) bwd_block_dx(&in, NULL, w, mean_g, mean_gx, dx, j, (int)(n - j), xt, st);
}

static void bwd_row(const fo_norm_bwd_params *p, int64_t r, const float *w, float *pw, float *pb, int stream) {
  WITH_DTYPE_PAIR(p->x_dtype, p->s_dtype, bwd_row_t, p, r, w, pw, pb, stream);
}

const char *FO_FN(fo_norm_bwd_cpu)(const fo_norm_bwd_params *p) {
  const int64_t n = p->cols;
  const int want_partial = p->dweight || p->dbias;
  float *w = param_f32(p->weight, p->w_dtype, n, 1.0f);
  float *sum = want_partial ? malloc(sizeof(float) * (size_t)(2 * n + 1)) : NULL;
  if (!w || (want_partial && !sum)) {
    free(sum);
    free(w);
    return FO_CPU_OOM;
  }
  int64_t used = 0; /* threads the runtime actually gave: only their partial rows are written */
  /* dy, s, ds and dx: bytes moved */
  const int64_t moved = p->rows * n * (fo_dtype_size(p->x_dtype) + 3 * fo_dtype_size(p->s_dtype));
  const int stream = p->s_dtype == FO_F32 && fo_cpu_stream(moved);

#pragma omp parallel num_threads((int)(want_partial ? p->parts / PART_ROWS : omp_get_max_threads())) \
    if (fo_parallel(p->rows, p->rows * n))
  {
    float *pw = NULL, *pb = NULL;
#pragma omp single
    used = omp_get_num_threads();
    if (want_partial) {
      /* this thread's rows; zeroed here, so threads given no rows add nothing */
      const int64_t t = omp_get_thread_num();
      pw = p->partial + PART_ROWS * t * n;
      pb = p->partial + (p->parts + PART_ROWS * t) * n;
      for (int64_t j = 0; j < PART_ROWS * n; ++j) pw[j] = pb[j] = 0.0f;
    }
    if (!p->dweight) pw = NULL;
    if (!p->dbias) pb = NULL;
    int64_t done = 0; /* rows this thread took */
#pragma omp for schedule(static) nowait
    for (int64_t r = 0; r < p->rows; ++r) {
      bwd_row(p, r, w, pw, pb, stream);
      if (++done % ROW_BLOCK == 0) {
        if (pw) flush_part(pw, n);
        if (pb) flush_part(pb, n);
      }
    }
    if (pw) flush_part(pw, n);
    if (pb) flush_part(pb, n);
    if (stream) fo_stream_fence();
  }
  free(w);

  if (want_partial) {
    /* one pass over the threads' totals (less their compensations):
     * dweight[j] = sum_t total_t[j] - comp_t[j] */
#pragma omp parallel for schedule(static) if (fo_parallel(n, used * n))
    for (int64_t j = 0; j < n; ++j) {
      float sw = 0.0f, sb = 0.0f;
      for (int64_t t = 0; t < used; ++t) {
        const float *tw = p->partial + PART_ROWS * t * n, *tb = p->partial + (p->parts + PART_ROWS * t) * n;
        sw += tw[n + j] - tw[2 * n + j];
        sb += tb[n + j] - tb[2 * n + j];
      }
      sum[j] = sw;
      sum[n + j] = sb;
    }
    if (p->dweight) fo_store_row(p->w_dtype, p->dweight, sum, n);
    if (p->dbias) fo_store_row(p->w_dtype, p->dbias, sum + n, n);
  }
  free(sum);
  return NULL;
}
FO_ENTRY(const char *, fo_norm_bwd_cpu, (const fo_norm_bwd_params *p), (p))

