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
 * running sum loses ~10x torch's accuracy). A NaN anywhere gives NaN; all
 * -inf gives -inf (torch's logsumexp does the same). */
FO_CLONES static float row_lse(float *x, int64_t n) {
  float m = -INFINITY;
  int nan = 0;
  for (int64_t j = 0; j < n; ++j) {
    m = x[j] > m ? x[j] : m;
    nan |= x[j] != x[j];
  }
  if (nan) return NAN;
  if (m == -INFINITY || m == INFINITY) return m;
  for (int64_t j = 0; j < n; ++j) x[j] = fo_expf(x[j] - m);
  return m + logf(fo_sum(x, n));
}

const char *fo_xent_fwd_cpu(const fo_xent_params *p) {
  int missing = 0;
#pragma omp parallel if (p->rows > 1)
  {
    float *x = malloc(sizeof(float) * (size_t)(p->vocab > 0 ? p->vocab : 1));
    if (fo_every_thread_has(x, &missing)) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < p->rows; ++r) {
        fo_load_row(p->dtype, row_at(p, r), x, p->vocab);
        const int64_t t = fo_xent_class(p, r);
        const float xt = t >= 0 && t < p->vocab ? x[t] : NAN;
        const float lse = row_lse(x, p->vocab);
        p->lse[r] = lse;
        p->loss[r] = t < 0 ? 0.0f : lse - xt;
      }
    }
    free(x);
  }
  return missing ? FO_CPU_OOM : NULL;
}

FO_CLONES static void row_grad(float *x, int64_t n, float lse, float g, int64_t t) {
  for (int64_t j = 0; j < n; ++j) x[j] = g * fo_expf(x[j] - lse);
  if (t < n) x[t] -= g;
}

const char *fo_xent_bwd_cpu(const fo_xent_params *p) {
  int missing = 0;
  const int es = fo_dtype_size(p->dtype);
#pragma omp parallel if (p->rows > 1)
  {
    float *x = malloc(sizeof(float) * (size_t)(p->vocab > 0 ? p->vocab : 1));
    if (fo_every_thread_has(x, &missing)) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < p->rows; ++r) {
        const int64_t t = fo_xent_class(p, r);
        const float g = t < 0 ? 0.0f : p->dloss[r * p->g_stride];
        fo_load_row(p->dtype, row_at(p, r), x, p->vocab);
        row_grad(x, p->vocab, p->lse_in[r], g, t);
        fo_store_row(p->dtype, (char *)p->dlogits + (size_t)(r * p->vocab) * (size_t)es, x, p->vocab);
      }
    }
    free(x);
  }
  return missing ? FO_CPU_OOM : NULL;
}
