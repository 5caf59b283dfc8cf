/* Residual-add + LayerNorm / RMSNorm on the CPU: C11 + OpenMP, one row at a
 * time per thread, the row widened to fp32 in a thread-local buffer.
 *
 * Forward: read x (and residual) once, write s (when stored) and y once.
 * Backward: read dy, s (and ds) once, write dx once; dweight/dbias summed per
 * thread into fp32 partial rows, then one pass over the partials. fp32 rows
 * are used in place; 16-bit rows are widened into thread-local scratch.
 * Math and layout: norm.h. */
#include <stdlib.h>
#include <math.h>
#include <omp.h>

#include "norm.h"
#include "../common/cpu_dtype.h"

static const char *row_ptr(const void *base, fo_dtype t, int64_t row, int64_t stride) {
  return (const char *)base + (size_t)(row * stride) * (size_t)fo_dtype_size(t);
}

/* The per-row work is compiled twice (FO_CLONES, cpu_dtype.h): everything it
 * calls is static inline and is compiled into each clone. */
/* An fp32 view of a row: the row itself when it is fp32, else converted into
 * `scratch`. */
static inline const float *as_f32(fo_dtype t, const void *row, float *scratch, int64_t n) {
  if (t == FO_F32) return (const float *)row;
  fo_load_row(t, row, scratch, n);
  return scratch;
}

/* One row of the forward: three passes (s and its sum, squared deviations,
 * output), fp32 rows read and written in place; v, tmp: n floats of scratch
 * for the 16-bit conversions. */
FO_CLONES static void fwd_row(const fo_norm_fwd_params *p, int64_t r, const float *w, const float *b,
                              float *v, float *tmp) {
  const int64_t n = p->cols;
  const fo_dtype xt = p->x_dtype, st = p->s_dtype;
  const void *xrow = row_ptr(p->x, xt, r, p->x_stride);
  void *srow = p->s ? (char *)p->s + (size_t)(r * n) * fo_dtype_size(st) : NULL;
  void *yrow = (char *)p->y + (size_t)(r * n) * fo_dtype_size(xt);
  /* sf: s in fp32 (the stored s when that is fp32, else v) */
  const float *sf;
  if (p->residual) {
    float *sv = st == FO_F32 ? (float *)srow : v;
    const float *xf = as_f32(xt, xrow, v, n);
    const float *rf = as_f32(st, row_ptr(p->residual, st, r, p->res_stride), tmp, n);
    for (int64_t j = 0; j < n; ++j) sv[j] = xf[j] + rf[j];
    if (st != FO_F32) {
      fo_round_row(st, sv, n);
      fo_store_row(st, srow, sv, n);
    }
    sf = sv;
  } else if (srow) { /* s is x widened to fp32 */
    fo_load_row(xt, xrow, (float *)srow, n);
    sf = (const float *)srow;
  } else {
    sf = as_f32(xt, xrow, v, n);
  }
  const float mean = p->rms || !n ? 0.0f : fo_sum(sf, n) / (float)n;
  const float var = n ? fo_sqdev(sf, mean, n) / (float)n : 0.0f;
  const float rstd = 1.0f / sqrtf(var + p->eps);
  float *yv = xt == FO_F32 ? (float *)yrow : v;  /* in place over v is fine: element by element */
  for (int64_t j = 0; j < n; ++j) yv[j] = (sf[j] - mean) * rstd * w[j] + b[j];
  if (xt != FO_F32) fo_store_row(xt, yrow, yv, n);
  if (p->mean) p->mean[r] = mean;
  p->rstd[r] = rstd;
}

void fo_norm_fwd_cpu(const fo_norm_fwd_params *p) {
  const int64_t n = p->cols;
  float *params = malloc(sizeof(float) * (size_t)(2 * n + 1));
  float *w = params, *b = params + n;
  if (p->weight) fo_load_row(p->w_dtype, p->weight, w, n);
  else for (int64_t j = 0; j < n; ++j) w[j] = 1.0f;
  if (p->bias) fo_load_row(p->w_dtype, p->bias, b, n);
  else for (int64_t j = 0; j < n; ++j) b[j] = 0.0f;

#pragma omp parallel
  {
    float *v = malloc(sizeof(float) * (size_t)(2 * n + 1));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p->rows; ++r) fwd_row(p, r, w, b, v, v + n);
    free(v);
  }
  free(params);
}

int64_t fo_norm_bwd_cpu_parts(const fo_norm_bwd_params *p) {
  (void)p;
  return omp_get_max_threads();
}

/* One row of the backward, two passes (sums and dweight/dbias, then dx) with
 * xhat and g recomputed in the second; pw, pb: this thread's dweight/dbias
 * partial rows (NULL when not wanted); s_tmp, dy_tmp, ds_tmp: n floats of
 * scratch each for 16-bit conversions. */
FO_CLONES static void bwd_row(const fo_norm_bwd_params *p, int64_t r, const float *w, float *pw, float *pb,
                              float *s_tmp, float *dy_tmp, float *ds_tmp) {
  const int64_t n = p->cols;
  const fo_dtype st = p->s_dtype;
  const float mean = p->mean ? p->mean[r] : 0.0f, rstd = p->rstd[r];
  const float *sf = as_f32(st, row_ptr(p->s, st, r, p->s_stride), s_tmp, n);
  const float *dyf = as_f32(p->x_dtype, row_ptr(p->dy, p->x_dtype, r, p->dy_stride), dy_tmp, n);
  float ag[16] = {0}, agx[16] = {0};  /* sum of g, of g * xhat: 16 accumulators */
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int m = n - j0 < 16 ? (int)(n - j0) : 16;
    for (int k = 0; k < m; ++k) {
      const int64_t j = j0 + k;
      const float xh = (sf[j] - mean) * rstd, g = dyf[j] * w[j];
      ag[k] += g;
      agx[k] += g * xh;
      if (pw) pw[j] += dyf[j] * xh;
      if (pb) pb[j] += dyf[j];
    }
  }
  for (int h = 8; h > 0; h >>= 1)
    for (int k = 0; k < h; ++k) {
      ag[k] += ag[k + h];
      agx[k] += agx[k + h];
    }
  const float mean_g = p->rms ? 0.0f : ag[0] / (float)n, mean_gx = agx[0] / (float)n;
  void *dxrow = (char *)p->dx + (size_t)(r * n) * fo_dtype_size(st);
  float *dxv = st == FO_F32 ? (float *)dxrow : s_tmp;  /* over s_tmp: element by element */
  const float *dsf = p->ds ? as_f32(st, row_ptr(p->ds, st, r, p->ds_stride), ds_tmp, n) : NULL;
  for (int64_t j = 0; j < n; ++j) {
    const float xh = (sf[j] - mean) * rstd, g = dyf[j] * w[j];
    dxv[j] = rstd * (g - mean_g - xh * mean_gx) + (dsf ? dsf[j] : 0.0f);
  }
  if (st != FO_F32) fo_store_row(st, dxrow, dxv, n);
}

void fo_norm_bwd_cpu(const fo_norm_bwd_params *p) {
  const int64_t n = p->cols;
  const int want_partial = p->dweight || p->dbias;
  float *w = malloc(sizeof(float) * (size_t)(n + 1));
  int64_t used = 0; /* threads the runtime actually gave: only their partial rows are written */
  if (p->weight) fo_load_row(p->w_dtype, p->weight, w, n);
  else for (int64_t j = 0; j < n; ++j) w[j] = 1.0f;

#pragma omp parallel num_threads((int)(want_partial ? p->parts : omp_get_max_threads()))
  {
    float *scratch = malloc(sizeof(float) * (size_t)(3 * n + 1));
    float *pw = NULL, *pb = NULL;
#pragma omp single
    used = omp_get_num_threads();
    if (want_partial) {
      /* this thread's partial rows; zeroed here, so threads given no rows add nothing */
      const int64_t t = omp_get_thread_num();
      pw = p->partial + t * n;
      pb = p->partial + (p->parts + t) * n;
      for (int64_t j = 0; j < n; ++j) pw[j] = pb[j] = 0.0f;
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p->rows; ++r) bwd_row(p, r, w, pw, pb, scratch, scratch + n, scratch + 2 * n);
    free(scratch);
  }
  free(w);

  if (want_partial) {
    /* one pass over the partial rows: dweight[j] = sum_t partial[0][t][j] */
    float *sum = malloc(sizeof(float) * (size_t)(2 * n + 1));
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; ++j) {
      float sw = 0.0f, sb = 0.0f;
      for (int64_t t = 0; t < used; ++t) {
        sw += p->partial[t * n + j];
        sb += p->partial[(p->parts + t) * n + j];
      }
      sum[j] = sw;
      sum[n + j] = sb;
    }
    if (p->dweight) fo_store_row(p->w_dtype, p->dweight, sum, n);
    if (p->dbias) fo_store_row(p->w_dtype, p->dbias, sum + n, n);
    free(sum);
  }
}
