/* Cross-entropy on the CPU (math and layout: xent.h): OpenMP over rows, each
 * row read in blocks of FO_VL values straight from the logits (widened and
 * soft-capped in registers, never copied). The forward takes two passes (the
 * max and a NaN test, then the sum of exponentials and of the logits in
 * FO_VL partial sums), the backward one, the fused pass all three on a row
 * that is still in cache. Deterministic: a row's sums have one order whatever
 * the thread count. */
#include <math.h>

#include "xent.h"
#include "../common/cpu_dtype.h"
#include "../common/cpu_math.h"

static const char *row_at(const fo_xent_params *p, int64_t r) {
  return (const char *)p->logits + (size_t)(r * p->x_stride) * (size_t)fo_dtype_size(p->dtype);
}

/* z of the row's block at column j (lanes past the row: `pad`). */
FO_INLINE fo_vf block_at(const fo_xent_params *p, const char *row, int64_t j, float pad) {
  const fo_dtype t = p->dtype;
  const int64_t n = p->vocab;
  const int es = fo_dtype_size(t);
  const int full = j + FO_VL <= n;
  fo_vf v = full ? fo_vload(t, row + j * es) : fo_vload_n(t, row + j * es, (int)(n - j));
  if (p->softcap > 0.f) v = p->softcap * fo_vtanhf(v * (1.f / p->softcap));
  if (full) return v;
  return fo_vselect((fo_vi)fo_mask_first((int)(n - j)), v, (fo_vf){0} + pad); /* lane k: column j + k */
}

/* z of column j alone. */
static float z_at(const fo_xent_params *p, const char *row, int64_t j) {
  float x;
  fo_load_row(p->dtype, row + j * fo_dtype_size(p->dtype), &x, 1);
  if (p->softcap > 0.f) x = (p->softcap * fo_vtanhf((fo_vf){0} + x * (1.f / p->softcap)))[0];
  return x;
}

/* log sum exp of row r's z (and, in *zsum, the sum of its z): the max first
 * (a vector select: a scalar x > m ? x : m loop does not vectorise, it is not
 * a max for NaN), then the exponentials summed in 2 FO_VL partial sums (a
 * running sum over 32000 classes loses ~10x torch's accuracy); both passes
 * take two blocks a step, so that two dependency chains overlap. A NaN or a
 * +inf anywhere gives NaN, all -inf gives -inf: the row's loss is then NaN,
 * as torch's (its log_softmax subtracts an infinite max). */
FO_INLINE float row_lse(const fo_xent_params *p, const char *row, float *zsum) {
  const int64_t n = p->vocab;
  fo_vf mv = (fo_vf){0} - INFINITY, mv2 = mv;
  fo_vi nan = {0};
  int64_t j = 0;
  for (; j + 2 * FO_VL <= n; j += 2 * FO_VL) {
    const fo_vf v = block_at(p, row, j, -INFINITY), v2 = block_at(p, row, j + FO_VL, -INFINITY);
    mv = fo_vselect(v > mv, v, mv);
    mv2 = fo_vselect(v2 > mv2, v2, mv2);
    nan |= (v != v) | (v2 != v2);
  }
  for (; j < n; j += FO_VL) {
    const fo_vf v = block_at(p, row, j, -INFINITY);
    mv = fo_vselect(v > mv, v, mv);
    nan |= v != v;
  }
  mv = fo_vselect(mv2 > mv, mv2, mv);
  float m = -INFINITY;
  int any_nan = 0;
  for (int k = 0; k < FO_VL; ++k) {
    const float c = mv[k];
    m = c > m ? c : m;
    any_nan |= nan[k];
  }
  *zsum = NAN;
  if (any_nan || m == INFINITY) return NAN;
  if (m == -INFINITY) return m;
  fo_vf s = {0}, s2 = {0}, zs = {0};
  for (j = 0; j + 2 * FO_VL <= n; j += 2 * FO_VL) {
    const fo_vf v = block_at(p, row, j, -INFINITY), v2 = block_at(p, row, j + FO_VL, -INFINITY);
    s += fo_vexpf(v - m);
    s2 += fo_vexpf(v2 - m);
    if (p->smoothing != 0.f) zs += v + v2;
  }
  s += s2;
  for (; j < n; j += FO_VL) {
    const fo_vf v = block_at(p, row, j, -INFINITY);
    s += fo_vexpf(v - m);
    /* a -inf logit makes the smoothed loss +inf, as torch's; the pad adds 0 */
    if (p->smoothing != 0.f) zs += j + FO_VL <= n ? v : fo_vselect((fo_vi)fo_mask_first((int)(n - j)), v, (fo_vf){0});
  }
  float sum = 0.0f, z = 0.0f;
  for (int k = 0; k < FO_VL; ++k) {
    sum += s[k];
    z += zs[k];
  }
  *zsum = z;
  return m + logf(sum);
}

/* Row r: loss (and lse where asked for); its lse returned. */
static float fwd_row(const fo_xent_params *p, int64_t r) {
  const char *row = row_at(p, r);
  const int64_t t = fo_xent_class(p, r);
  float zsum;
  const float lse = row_lse(p, row, &zsum);
  if (p->lse) p->lse[r] = lse;
  p->loss[r] = t < 0 ? 0.0f : t < p->vocab ? fo_xent_loss(p, lse, z_at(p, row, t), zsum) : NAN;
  return lse;
}

FO_INLINE void store_block(fo_dtype dt, char *out, int64_t j, int64_t n, fo_vf d) {
  const int es = fo_dtype_size(dt);
  if (j + FO_VL <= n) fo_vstore(dt, out + j * es, d);
  else fo_vstore_n(dt, out + j * es, d, (int)(n - j));
}

/* Row r of dlogits from the row's lse: g (exp(z - lse) - e/V - (1 - e) [j = t]) dz/dx. */
static void bwd_row(const fo_xent_params *p, int64_t r, float lse, const float *count_in) {
  const fo_dtype dt = p->dtype;
  const int es = fo_dtype_size(dt);
  const int64_t n = p->vocab, t = fo_xent_class(p, r);
  char *out = (char *)p->dlogits + (size_t)(r * p->d_stride) * (size_t)es;
  if (t < 0) {  /* ignored: no gradient, nothing to read */
    for (int64_t j = 0; j < n; j += FO_VL) store_block(dt, out, j, n, (fo_vf){0});
    return;
  }
  /* (no smoothing: no g * 0 term, which an infinite g would make NaN) */
  const float g = fo_xent_dloss(p, count_in, r), gs = p->smoothing == 0.f ? 0.f : g * p->smoothing / (float)n;
  const float gt = p->smoothing == 0.f ? g : g * (1.f - p->smoothing);
  const float c = p->softcap, ic = c > 0.f ? 1.f / c : 0.f;
  const char *row = row_at(p, r);
  for (int64_t j = 0; j < n; j += FO_VL) {
    const fo_vf z = block_at(p, row, j, 0.0f);
    fo_vf d = g * fo_vexpf(z - lse) - gs;
    if (t >= j && t < j + FO_VL) d[t - j] -= gt;
    if (c > 0.f) d *= 1.f - (z * ic) * (z * ic);
    store_block(dt, out, j, n, d);
  }
}

/* total and count from the rows' losses, in row order (deterministic). */
static void reduce_rows(const fo_xent_params *p, const fo_xent_reduce *red) {
  double sum = 0.0;
  int64_t n = 0;
  for (int64_t r = 0; r < p->rows; ++r) {
    sum += p->loss[r];
    n += fo_xent_class(p, r) >= 0;
  }
  *red->count = (float)n;
  *red->total = (float)(red->mean ? sum / (double)n : sum);  /* a mean of no rows: NaN, as torch's */
}

const char *FO_FN(fo_xent_fwd_cpu)(const fo_xent_params *p, const fo_xent_reduce *red) {
#pragma omp parallel for schedule(static) if (fo_parallel(p->rows, p->rows * p->vocab))
  for (int64_t r = 0; r < p->rows; ++r) fwd_row(p, r);
  if (red && red->total) reduce_rows(p, red);
  return NULL;
}
FO_ENTRY(const char *, fo_xent_fwd_cpu, (const fo_xent_params *p, const fo_xent_reduce *red), (p, red))

const char *FO_FN(fo_xent_bwd_cpu)(const fo_xent_params *p, const fo_xent_reduce *red) {
  const float *count_in = red ? red->count_in : NULL;
#pragma omp parallel for schedule(static) if (fo_parallel(p->rows, p->rows * p->vocab))
  for (int64_t r = 0; r < p->rows; ++r) bwd_row(p, r, p->lse_in[r], count_in);
  return NULL;
}
FO_ENTRY(const char *, fo_xent_bwd_cpu, (const fo_xent_params *p, const fo_xent_reduce *red), (p, red))

/* An ignored row is zeroed without its lse (its loss is 0 and its gradient
 * 0 whatever its logits). */
const char *FO_FN(fo_xent_fwd_bwd_cpu)(const fo_xent_params *p) {
#pragma omp parallel for schedule(static) if (fo_parallel(p->rows, p->rows * p->vocab))
  for (int64_t r = 0; r < p->rows; ++r) {
    if (fo_xent_class(p, r) < 0) {
      p->loss[r] = 0.0f;
      if (p->lse) p->lse[r] = NAN;
      bwd_row(p, r, 0.0f, NULL);
    } else {
      bwd_row(p, r, fwd_row(p, r), NULL);
    }
  }
  return NULL;
}
FO_ENTRY(const char *, fo_xent_fwd_bwd_cpu, (const fo_xent_params *p), (p))

/* Blocks of FO_SCALE_BLOCK values widened to fp32, scaled and rounded back
 * (one rounding, as torch's mul_); nothing touched when the factor is 1. */
#define FO_SCALE_BLOCK 1024
const char *FO_FN(fo_xent_scale_cpu)(const fo_xent_scale_params *p) {
  const float s = *p->dloss;
  if (s == 1.0f) return NULL;
  const int64_t blocks = (p->n + FO_SCALE_BLOCK - 1) / FO_SCALE_BLOCK;
  const int es = fo_dtype_size(p->dtype);
#pragma omp parallel for schedule(static) if (fo_parallel(blocks, p->n))
  for (int64_t b = 0; b < blocks; ++b) {
    float v[FO_SCALE_BLOCK];
    const int64_t j = b * FO_SCALE_BLOCK, m = p->n - j < FO_SCALE_BLOCK ? p->n - j : FO_SCALE_BLOCK;
    char *at = (char *)p->grad + (size_t)j * (size_t)es;
    fo_load_row(p->dtype, at, v, m);
    for (int64_t i = 0; i < m; ++i) v[i] *= s;
    fo_store_row(p->dtype, at, v, m);
  }
  return NULL;
}
FO_ENTRY(const char *, fo_xent_scale_cpu, (const fo_xent_scale_params *p), (p))
