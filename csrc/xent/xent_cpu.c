/* Cross-entropy on the CPU: OpenMP over rows; each row widened to fp32 in a
 * per-thread buffer, then its max, its sum of exponentials and (backward) its
 * gradient in fp32. Deterministic: a row's sums have one order whatever the
 * thread count. */
#include <stdlib.h>
#include <math.h>

#include "xent.h"
#include "../common/cpu_dtype.h"
#include "../common/cpu_math.h"
#include "../common/cpu_scratch.h"

static const void *row_at(const fo_xent_params *p, int64_t r) {
  return (const char *)p->logits + (size_t)(r * p->x_stride) * (size_t)fo_dtype_size(p->dtype);
}

/* log sum exp of x[0..n), overwriting x with exp(x - max): max first, then
 * the exponentials summed by fo_sum (16 partial sums: at 32000 classes a
 * running sum loses ~10x torch's accuracy). A NaN or a +inf anywhere gives
 * NaN, all -inf gives -inf: the row's loss is then NaN, as torch's. */
FO_INLINE float row_lse(float *x, int64_t n) {
  /* the max and a NaN test FO_VL lanes at a time (a scalar x > m ? x : m
   * loop does not vectorise: it is not a max for NaN) */
  fo_vi mv = (fo_vi){0} + (int32_t)0xFF800000, nan = {0}; /* lanes of -inf's bits; no NaN */
  int64_t j = 0;
  for (; j + FO_VL <= n; j += FO_VL) {
    fo_vf v;
    memcpy(&v, x + j, sizeof v);
    const fo_vi gt = v > (fo_vf)mv;
    mv = ((fo_vi)v & gt) | (mv & ~gt);
    nan |= v != v;
  }
  float m = -INFINITY;
  int any_nan = 0;
  for (int k = 0; k < FO_VL; ++k) {
    const float c = ((fo_vf)mv)[k];
    m = c > m ? c : m;
    any_nan |= nan[k];
  }
  for (; j < n; ++j) {
    m = x[j] > m ? x[j] : m;
    any_nan |= x[j] != x[j];
  }
  if (any_nan || m == INFINITY) return NAN; /* torch: x - max is NaN at an inf */
  if (m == -INFINITY) return m;
  for (int64_t j = 0; j < n; ++j) x[j] = fo_expf(x[j] - m);
  return m + logf(fo_sum(x, n));
}

/* Row r: loss and lse (x: the thread's buffer of vocab floats). */
FO_INLINE void fwd_row_at(const fo_xent_params *p, int64_t r, float *x, const int isa) {
  fo_load_row_at(isa, p->dtype, row_at(p, r), x, p->vocab);
  const int64_t t = fo_xent_class(p, r);
  const float xt = t >= 0 && t < p->vocab ? x[t] : NAN;
  const float lse = row_lse(x, p->vocab);
  p->lse[r] = lse;
  p->loss[r] = t < 0 ? 0.0f : lse - xt;
}
FO_ISA_DISPATCH(fwd_row, (const fo_xent_params *p, int64_t r, float *x), (p, r, x))

const char *fo_xent_fwd_cpu(const fo_xent_params *p) {
  int missing = 0;
#pragma omp parallel if (p->rows > 1)
  {
    float *x = malloc(sizeof(float) * (size_t)(p->vocab > 0 ? p->vocab : 1));
    if (fo_every_thread_has(x, &missing)) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < p->rows; ++r) fwd_row(p, r, x);
    }
    free(x);
  }
  return missing ? FO_CPU_OOM : NULL;
}

/* Row r of dlogits (x: the thread's buffer of vocab floats). */
FO_INLINE void bwd_row_at(const fo_xent_params *p, int64_t r, float *x, const int isa) {
  const int64_t n = p->vocab, t = fo_xent_class(p, r);
  const float g = t < 0 ? 0.0f : p->dloss[r * p->g_stride], lse = p->lse_in[r];
  fo_load_row_at(isa, p->dtype, row_at(p, r), x, n);
  for (int64_t j = 0; j < n; ++j) x[j] = g * fo_expf(x[j] - lse);
  if (t >= 0 && t < n) x[t] -= g;
  fo_store_row_at(isa, p->dtype, (char *)p->dlogits + (size_t)(r * n) * (size_t)fo_dtype_size(p->dtype), x, n);
}
FO_ISA_DISPATCH(bwd_row, (const fo_xent_params *p, int64_t r, float *x), (p, r, x))

const char *fo_xent_bwd_cpu(const fo_xent_params *p) {
  int missing = 0;
#pragma omp parallel if (p->rows > 1)
  {
    float *x = malloc(sizeof(float) * (size_t)(p->vocab > 0 ? p->vocab : 1));
    if (fo_every_thread_has(x, &missing)) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < p->rows; ++r) bwd_row(p, r, x);
    }
    free(x);
  }
  return missing ? FO_CPU_OOM : NULL;
}
