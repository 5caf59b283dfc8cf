/* Cross-entropy on the CPU: OpenMP over rows, each row read in blocks of
 * FO_VL values straight from the logits (widened in registers, never copied):
 * the forward in two passes (the max and a NaN test, then the sum of
 * exponentials in FO_VL partial sums), the backward in one. Deterministic:
 * a row's sums have one order whatever the thread count. */
#include <math.h>

#include "xent.h"
#include "../common/cpu_dtype.h"
#include "../common/cpu_math.h"

static const char *row_at(const fo_xent_params *p, int64_t r) {
  return (const char *)p->logits + (size_t)(r * p->x_stride) * (size_t)fo_dtype_size(p->dtype);
}

/* The row's block at column j (lanes past the row: `pad`). */
FO_INLINE fo_vf block_at(fo_dtype t, const char *row, int64_t j, int64_t n, float pad) {
  const int es = fo_dtype_size(t);
  if (j + FO_VL <= n) return fo_vload(t, row + j * es);
  const fo_vf v = fo_vload_n(t, row + j * es, (int)(n - j));
  return fo_vselect((fo_vi)fo_mask_first((int)(n - j)), v, (fo_vf){0} + pad); /* lane k: column j + k */
}

/* log sum exp of row r: the max first (a vector select: a scalar
 * x > m ? x : m loop does not vectorise, it is not a max for NaN), then the
 * exponentials summed in FO_VL partial sums (a running sum over 32000
 * classes loses ~10x torch's accuracy). A NaN or a +inf anywhere gives NaN,
 * all -inf gives -inf: the row's loss is then NaN, as torch's (its
 * log_softmax subtracts an infinite max). */
FO_INLINE float row_lse(fo_dtype t, const char *row, int64_t n) {
  fo_vf mv = (fo_vf){0} - INFINITY;
  fo_vi nan = {0};
  for (int64_t j = 0; j < n; j += FO_VL) {
    const fo_vf v = block_at(t, row, j, n, -INFINITY);
    mv = fo_vselect(v > mv, v, mv);
    nan |= v != v;
  }
  float m = -INFINITY;
  int any_nan = 0;
  for (int k = 0; k < FO_VL; ++k) {
    const float c = mv[k];
    m = c > m ? c : m;
    any_nan |= nan[k];
  }
  if (any_nan || m == INFINITY) return NAN;
  if (m == -INFINITY) return m;
  fo_vf s = {0};
  for (int64_t j = 0; j < n; j += FO_VL) s += fo_vexpf(block_at(t, row, j, n, -INFINITY) - m);
  float sum = 0.0f;
  for (int k = 0; k < FO_VL; ++k) sum += s[k];
  return m + logf(sum);
}

/* Row r: loss and lse. */
static void fwd_row(const fo_xent_params *p, int64_t r) {
  const char *row = row_at(p, r);
  const int64_t t = fo_xent_class(p, r);
  const float lse = row_lse(p->dtype, row, p->vocab);
  p->lse[r] = lse;
  if (t < 0) {
    p->loss[r] = 0.0f;
  } else {
    float xt = NAN;
    if (t < p->vocab) fo_load_row(p->dtype, row + t * fo_dtype_size(p->dtype), &xt, 1);
    p->loss[r] = lse - xt;
  }
}

/* Row r of dlogits: g (exp(x - lse) - [j = t]). */
static void bwd_row(const fo_xent_params *p, int64_t r) {
  const fo_dtype dt = p->dtype;
  const int es = fo_dtype_size(dt);
  const int64_t n = p->vocab, t = fo_xent_class(p, r);
  const float g = t < 0 ? 0.0f : p->dloss[r * p->g_stride], lse = p->lse_in[r];
  const char *row = row_at(p, r);
  char *out = (char *)p->dlogits + (size_t)(r * n) * (size_t)es;
  for (int64_t j = 0; j < n; j += FO_VL) {
    fo_vf d = g * fo_vexpf(block_at(dt, row, j, n, 0.0f) - lse);
    if (t >= j && t < j + FO_VL) d[t - j] -= g;
    if (j + FO_VL <= n) fo_vstore(dt, out + j * es, d);
    else fo_vstore_n(dt, out + j * es, d, (int)(n - j));
  }
}

const char *FO_FN(fo_xent_fwd_cpu)(const fo_xent_params *p) {
#pragma omp parallel for schedule(static) if (fo_parallel(p->rows, p->rows * p->vocab))
  for (int64_t r = 0; r < p->rows; ++r) fwd_row(p, r);
  return NULL;
}
FO_ENTRY(const char *, fo_xent_fwd_cpu, (const fo_xent_params *p), (p))

const char *FO_FN(fo_xent_bwd_cpu)(const fo_xent_params *p) {
#pragma omp parallel for schedule(static) if (fo_parallel(p->rows, p->rows * p->vocab))
  for (int64_t r = 0; r < p->rows; ++r) bwd_row(p, r);
  return NULL;
}
FO_ENTRY(const char *, fo_xent_bwd_cpu, (const fo_xent_params *p), (p))
