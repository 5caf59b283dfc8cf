/* SwiGLU / GeGLU on the CPU: C11 + OpenMP over rows, each row in tiles of
 * kTile elements widened to fp32 on the stack, one fused pass: every input
 * element read once, every output element written once (forward 3 matrices,
 * backward 5). The tile functions are compiled per x86-64 level
 * (cpu_dtype.h: fp16 through F16C at v3 and v4). Math and layout:
 * swiglu.h. */
#include <omp.h>

#include "../common/cpu_math.h"

#define FO_GLU_MATH
#define FO_GLU_FN static inline
#define FO_GLU_EXP(x) fo_expf(x)
#define FO_GLU_RCP(x) (1.f / (x))
#include "swiglu.h"

enum { kTile = 256 };

static const char *row_at(const void *base, const fo_glu_rows *m, int64_t r, int esize) {
  const int64_t off = r < m->inner ? r * m->stride : (r / m->inner) * m->outer + (r % m->inner) * m->stride;
  return (const char *)base + off * esize;
}

static void fwd_tile(fo_dtype t, int gelu, const void *g, const void *u, void *out, int64_t n) {
  float gs[kTile], us[kTile], os[kTile];
  const float *restrict gf = fo_as_f32(t, g, gs, n), *restrict uf = fo_as_f32(t, u, us, n);
  float *restrict of = t == FO_F32 ? (float *)out : os;
  if (gelu) /* one loop per activation: each vectorises with no branch inside */
    for (int64_t j = 0; j < n; ++j) of[j] = fo_glu_fwd(gf[j], uf[j], 1);
  else
    for (int64_t j = 0; j < n; ++j) of[j] = fo_glu_fwd(gf[j], uf[j], 0);
  if (t != FO_F32) fo_store_row(t, out, of, n);
}

/* The results go through scratch tiles, in every dtype: the outputs may be
 * the inputs themselves (glu_bwd_), which restrict rules out. out, when not
 * NULL, receives the forward's output too. */
static void bwd_tile(fo_dtype t, int gelu, const void *d, const void *g, const void *u, void *dg, void *du,
                           void *out, int64_t n) {
  float ds[kTile], gs[kTile], us[kTile], dgf[kTile], duf[kTile], hf[kTile];
  const float *restrict df = fo_as_f32(t, d, ds, n), *restrict gf = fo_as_f32(t, g, gs, n),
                        *restrict uf = fo_as_f32(t, u, us, n);
  if (gelu)
    for (int64_t j = 0; j < n; ++j) fo_glu_bwd(df[j], gf[j], uf[j], 1, &dgf[j], &duf[j]);
  else
    for (int64_t j = 0; j < n; ++j) fo_glu_bwd(df[j], gf[j], uf[j], 0, &dgf[j], &duf[j]);
  if (out) {
    if (gelu)
      for (int64_t j = 0; j < n; ++j) hf[j] = fo_glu_fwd(gf[j], uf[j], 1);
    else
      for (int64_t j = 0; j < n; ++j) hf[j] = fo_glu_fwd(gf[j], uf[j], 0);
    fo_store_row(t, out, hf, n);
  }
  fo_store_row(t, dg, dgf, n);
  fo_store_row(t, du, duf, n);
}

/* Rows split evenly over the threads; a row of more than kTile elements is
 * walked in tiles. Narrow rows are as cheap per element as wide ones: the
 * work is per tile, not per row. */
const char *FO_FN(fo_glu_fwd_cpu)(const fo_glu_params *p) {
  const int es = fo_dtype_size(p->dtype), gelu = p->act == FO_GLU_GELU_TANH;
#pragma omp parallel for schedule(static) if (fo_parallel(p->rows, p->rows * p->cols))
  for (int64_t r = 0; r < p->rows; ++r) {
    const char *g = row_at(p->gate, &p->gate_rows, r, es);
    const char *u = row_at(p->up, &p->up_rows, r, es);
    char *o = (char *)p->out + r * p->out_stride * es;
    for (int64_t c = 0; c < p->cols; c += kTile) {
      const int64_t n = p->cols - c < kTile ? p->cols - c : kTile;
      fwd_tile(p->dtype, gelu, g + c * es, u + c * es, o + c * es, n);
    }
  }
  return NULL;
}
FO_ENTRY(const char *, fo_glu_fwd_cpu, (const fo_glu_params *p), (p))

const char *FO_FN(fo_glu_bwd_cpu)(const fo_glu_params *p) {
  const int es = fo_dtype_size(p->dtype), gelu = p->act == FO_GLU_GELU_TANH;
#pragma omp parallel for schedule(static) if (fo_parallel(p->rows, p->rows * p->cols))
  for (int64_t r = 0; r < p->rows; ++r) {
    const char *d = row_at(p->dout, &p->dout_rows, r, es);
    const char *g = row_at(p->gate, &p->gate_rows, r, es);
    const char *u = row_at(p->up, &p->up_rows, r, es);
    char *dg = (char *)p->dgate + r * p->out_stride * es;
    char *du = (char *)p->dup + r * p->out_stride * es;
    char *o = p->out ? (char *)p->out + r * p->h_stride * es : NULL;
    for (int64_t c = 0; c < p->cols; c += kTile) {
      const int64_t n = p->cols - c < kTile ? p->cols - c : kTile;
      bwd_tile(p->dtype, gelu, d + c * es, g + c * es, u + c * es, dg + c * es, du + c * es,
               o ? o + c * es : NULL, n);
    }
  }
  return NULL;
}
FO_ENTRY(const char *, fo_glu_bwd_cpu, (const fo_glu_params *p), (p))
