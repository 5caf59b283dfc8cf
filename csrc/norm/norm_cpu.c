/* Residual-add + LayerNorm / RMSNorm on the CPU: C11 + OpenMP, one row at a
 * time per thread, the row widened to fp32 in a thread-local buffer.
 *
 * Forward: read x (and residual) once, write s (when stored) and y once.
 * Backward: read dy, s (and ds) once, write dx once; dweight/dbias summed per
 * thread into fp32 partial rows, then one pass over the partials.
 * Math and layout: norm.h. */
#include <stdlib.h>
#include <math.h>
#include <omp.h>

#include "norm.h"
#include "../common/cpu_dtype.h"

static const char *row_ptr(const void *base, fo_dtype t, int64_t row, int64_t stride) {
  return (const char *)base + (size_t)(row * stride) * (size_t)fo_dtype_size(t);
}

/* The per-row work, compiled twice (x86-64-v3: AVX2 + FMA, and the baseline) and
 * picked at load time: one binary, full-width vectors where the CPU has them.
 * Everything it calls is static inline and is compiled into each clone. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FO_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define FO_CLONES
#endif

/* One row of the forward. v, tmp: n floats of scratch. */
FO_CLONES static void fwd_row(const fo_norm_fwd_params *p, int64_t r, const float *w, const float *b,
                              float *restrict v, float *restrict tmp) {
  const int64_t n = p->cols;
  /* s = x + residual, rounded to the dtype s is stored in */
  fo_load_row(p->x_dtype, row_ptr(p->x, p->x_dtype, r, p->x_stride), v, n);
  if (p->residual) {
    fo_load_row(p->s_dtype, row_ptr(p->residual, p->s_dtype, r, p->res_stride), tmp, n);
    for (int64_t j = 0; j < n; ++j) v[j] += tmp[j];
  }
  if (p->s) {
    fo_round_row(p->s_dtype, v, n);
    fo_store_row(p->s_dtype, (char *)p->s + (size_t)(r * n) * fo_dtype_size(p->s_dtype), v, n);
  }
  float mean = 0.0f;
  if (!p->rms) {
    mean = n ? fo_sum(v, n) / (float)n : 0.0f;
    for (int64_t j = 0; j < n; ++j) v[j] -= mean;
  }
  const float var = n ? fo_dot(v, v, n) / (float)n : 0.0f;
  const float rstd = 1.0f / sqrtf(var + p->eps);
  for (int64_t j = 0; j < n; ++j) v[j] = v[j] * rstd * w[j] + b[j];
  fo_store_row(p->x_dtype, (char *)p->y + (size_t)(r * n) * fo_dtype_size(p->x_dtype), v, n);
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

/* One row of the backward; pw, pb: this thread's dweight/dbias partial rows
 * (NULL when not wanted); xhat, g, dy: n floats of scratch each. */
FO_CLONES static void bwd_row(const fo_norm_bwd_params *p, int64_t r, const float *w, float *pw, float *pb,
                              float *restrict xhat, float *restrict g, float *restrict dy) {
  const int64_t n = p->cols;
  const float mean = p->mean ? p->mean[r] : 0.0f, rstd = p->rstd[r];
  fo_load_row(p->s_dtype, row_ptr(p->s, p->s_dtype, r, p->s_stride), xhat, n);
  fo_load_row(p->x_dtype, row_ptr(p->dy, p->x_dtype, r, p->dy_stride), dy, n);
  for (int64_t j = 0; j < n; ++j) {
    xhat[j] = (xhat[j] - mean) * rstd;
    g[j] = dy[j] * w[j];
  }
  const float mean_g = p->rms ? 0.0f : fo_sum(g, n) / (float)n;
  const float mean_gx = fo_dot(g, xhat, n) / (float)n;
  for (int64_t j = 0; j < n; ++j) g[j] = rstd * (g[j] - mean_g - xhat[j] * mean_gx);
  if (p->dweight) for (int64_t j = 0; j < n; ++j) pw[j] += dy[j] * xhat[j];
  if (p->dbias) for (int64_t j = 0; j < n; ++j) pb[j] += dy[j];
  if (p->ds) { /* dy's buffer is free now: reuse it for ds */
    fo_load_row(p->s_dtype, row_ptr(p->ds, p->s_dtype, r, p->ds_stride), dy, n);
    for (int64_t j = 0; j < n; ++j) g[j] += dy[j];
  }
  fo_store_row(p->s_dtype, (char *)p->dx + (size_t)(r * n) * fo_dtype_size(p->s_dtype), g, n);
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
    float *xhat = malloc(sizeof(float) * (size_t)(3 * n + 1));
    float *g = xhat + n, *dy = g + n;
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
    for (int64_t r = 0; r < p->rows; ++r) bwd_row(p, r, w, pw, pb, xhat, g, dy);
    free(xhat);
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
