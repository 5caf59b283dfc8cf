/* SwiGLU / GeGLU on the CPU: C11 + OpenMP over rows, each row in blocks of
 * FO_VL values (cpu_dtype.h) widened to fp32 in registers, one fused pass:
 * every input element read once, every output element written once (forward
 * 3 matrices, backward 5). The math (swiglu.h) runs on the blocks; the
 * functions are compiled per x86-64 level. Math and layout: swiglu.h. */
#include <omp.h>

#include "../common/cpu_math.h"

#define FO_GLU_MATH
#define FO_GLU_FN FO_INLINE
#define FO_GLU_T fo_vf
#define FO_GLU_ONE ((fo_vf){0} + 1.f)
#define FO_GLU_EXP(x) fo_vexpf(x)
#define FO_GLU_RCP(x) (1.f / (x))
#include "swiglu.h"

static const char *row_at(const void *base, const fo_glu_rows *m, int64_t r, int esize) {
  const int64_t off = r < m->inner ? r * m->stride : (r / m->inner) * m->outer + (r % m->inner) * m->stride;
  return (const char *)base + off * esize;
}

/* One block of m <= FO_VL values at column j. */
FO_INLINE void fwd_block(fo_dtype t, int gelu, const char *g, const char *u, char *out, int64_t j, int m) {
  const int64_t at = j * fo_dtype_size(t);
  const fo_vf o = fo_glu_fwd(fo_vload_n(t, g + at, m), fo_vload_n(t, u + at, m), gelu);
  fo_vstore_n(t, out + at, o, m);
}

/* The same for the backward: out, when not NULL, receives the forward's
 * output too. The block's inputs are read before its outputs are written,
 * so the outputs may be the inputs themselves (glu_bwd_). */
FO_INLINE void bwd_block(fo_dtype t, int gelu, const char *d, const char *g, const char *u, char *dg, char *du,
                         char *out, int64_t j, int m) {
  const int64_t at = j * fo_dtype_size(t);
  const fo_vf gv = fo_vload_n(t, g + at, m), uv = fo_vload_n(t, u + at, m);
  fo_vf dgv, duv;
  fo_glu_bwd(fo_vload_n(t, d + at, m), gv, uv, gelu, &dgv, &duv);
  if (out) fo_vstore_n(t, out + at, fo_glu_fwd(gv, uv, gelu), m);
  fo_vstore_n(t, dg + at, dgv, m);
  fo_vstore_n(t, du + at, duv, m);
}

/* A row of n values: its whole blocks, then the last one (m < FO_VL takes a
 * copy through memory, kept out of the main loop); gelu a constant where
 * it is inlined, so that each activation's loop has no branch on it. */
FO_INLINE void fwd_row(fo_dtype t, int gelu, const char *g, const char *u, char *out, int64_t n) {
  int64_t j = 0;
  for (; j + FO_VL <= n; j += FO_VL) fwd_block(t, gelu, g, u, out, j, FO_VL);
  if (j < n) fwd_block(t, gelu, g, u, out, j, (int)(n - j));
}

FO_INLINE void bwd_row(fo_dtype t, int gelu, const char *d, const char *g, const char *u, char *dg, char *du,
                       char *out, int64_t n) {
  int64_t j = 0;
  for (; j + FO_VL <= n; j += FO_VL) bwd_block(t, gelu, d, g, u, dg, du, out, j, FO_VL);
  if (j < n) bwd_block(t, gelu, d, g, u, dg, du, out, j, (int)(n - j));
}

/* fn(args..., dtype, gelu) with both as constants: one copy of fn's loop
 * per dtype and activation. (Inside the parallel loop: OpenMP outlines a
 * parallel region before inlining, which would make them variables again.) */
#define WITH_DTYPE_ACT(t, gelu, fn, ...)                                                      \
  do {                                                                                      \
    if ((t) == FO_F32) (gelu) ? fn(__VA_ARGS__, FO_F32, 1) : fn(__VA_ARGS__, FO_F32, 0);    \
    else if ((t) == FO_BF16) (gelu) ? fn(__VA_ARGS__, FO_BF16, 1) : fn(__VA_ARGS__, FO_BF16, 0); \
    else (gelu) ? fn(__VA_ARGS__, FO_F16, 1) : fn(__VA_ARGS__, FO_F16, 0);                  \
  } while (0)

/* Row r of the call, its dtype and activation constants. */
FO_INLINE void fwd_row_of(const fo_glu_params *p, int64_t r, fo_dtype t, int gelu) {
  const int es = fo_dtype_size(t);
  fwd_row(t, gelu, row_at(p->gate, &p->gate_rows, r, es), row_at(p->up, &p->up_rows, r, es),
          (char *)p->out + r * p->out_stride * es, p->cols);
}

FO_INLINE void bwd_row_of(const fo_glu_params *p, int64_t r, fo_dtype t, int gelu) {
  const int es = fo_dtype_size(t);
  bwd_row(t, gelu, row_at(p->dout, &p->dout_rows, r, es), row_at(p->gate, &p->gate_rows, r, es),
          row_at(p->up, &p->up_rows, r, es), (char *)p->dgate + r * p->out_stride * es,
          (char *)p->dup + r * p->out_stride * es, p->out ? (char *)p->out + r * p->h_stride * es : NULL, p->cols);
}

/* Rows split evenly over the threads, each walked in blocks. */
const char *FO_FN(fo_glu_fwd_cpu)(const fo_glu_params *p) {
  const int gelu = p->act == FO_GLU_GELU_TANH;
#pragma omp parallel for schedule(static) if (fo_parallel(p->rows, p->rows * p->cols))
  for (int64_t r = 0; r < p->rows; ++r) WITH_DTYPE_ACT(p->dtype, gelu, fwd_row_of, p, r);
  return NULL;
}
FO_ENTRY(const char *, fo_glu_fwd_cpu, (const fo_glu_params *p), (p))

const char *FO_FN(fo_glu_bwd_cpu)(const fo_glu_params *p) {
  const int gelu = p->act == FO_GLU_GELU_TANH;
#pragma omp parallel for schedule(static) if (fo_parallel(p->rows, p->rows * p->cols))
  for (int64_t r = 0; r < p->rows; ++r) WITH_DTYPE_ACT(p->dtype, gelu, bwd_row_of, p, r);
  return NULL;
}
FO_ENTRY(const char *, fo_glu_bwd_cpu, (const fo_glu_params *p), (p))
