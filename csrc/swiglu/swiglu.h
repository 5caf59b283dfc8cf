/* Gated linear units, SwiGLU and GeGLU: the C interface between the kernels
 * (swiglu_cpu.c, swiglu_cuda.cu) and the registration shim (swiglu_ops.cpp),
 * and the activation math both kernels share.
 *
 *   forward:  out = act(gate) * up
 *   backward: dgate = dout * up * act'(gate),  dup = dout * act(gate)
 *             (act recomputed from gate: nothing but the inputs is saved)
 *
 * Both activations are g * sigmoid(a(g)):
 *   silu:       a(g) = g
 *   gelu_tanh:  a(g) = 2 k0 (g + k1 g^3)    (0.5 (1 + tanh z) = sigmoid(2 z))
 * so act'(g) = s + g s (1 - s) a'(g) with s = sigmoid(a(g)), one formula for
 * both, and no cancellation near 0 as 1 + tanh(z) would have.
 *
 * Matrices are [rows, cols] with unit stride along cols. Inputs are read
 * through a two-level row map (fo_glu_rows), which covers any view whose
 * leading dims collapse into at most two strides: a slice of a packed
 * [gate | up] projection, a slice along the sequence of a [B, S, F] tensor.
 * Outputs are written densely with one row stride. fp32 math throughout. */
#pragma once
#include "../common/fo_types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fo_glu_act { FO_GLU_SILU = 0, FO_GLU_GELU_TANH = 1 } fo_glu_act;

/* Row r of a matrix starts (r / inner) * outer + (r % inner) * stride
 * elements after its base. One stride: inner >= rows, outer unused. */
typedef struct fo_glu_rows {
  int64_t inner, stride, outer;
} fo_glu_rows;

typedef struct fo_glu_params {
  int64_t rows, cols;
  const void *gate, *up; /* [rows, cols] dtype, through gate_rows / up_rows */
  const void *dout;      /* backward: [rows, cols] dtype, through dout_rows */
  void *out;             /* forward: [rows, cols] dtype, row stride out_stride;
                            backward: NULL, or where the forward's output,
                            recomputed, is written too (row stride h_stride;
                            it may be dout itself, when dout is dense) */
  void *dgate, *dup;     /* backward: [rows, cols] dtype, row stride out_stride
                            (2 cols with dup = dgate + cols when packed) */
  fo_glu_rows gate_rows, up_rows, dout_rows;
  int64_t out_stride;
  int64_t h_stride;      /* backward: the row stride of out */
  fo_glu_act act;
  fo_dtype dtype;
} fo_glu_params;

/* CPU (swiglu_cpu.c, OpenMP). They allocate nothing: NULL, always (the
 * interface every kernel shares: NULL, or what stopped it). */
const char *fo_glu_fwd_cpu(const fo_glu_params *p);
const char *fo_glu_bwd_cpu(const fo_glu_params *p);

/* CUDA (swiglu_cuda.cu). Launch on `stream` (a cudaStream_t); return NULL on
 * success or a static message naming the CUDA error. */
const char *fo_glu_fwd_cuda(const fo_glu_params *p, void *stream);
const char *fo_glu_bwd_cuda(const fo_glu_params *p, void *stream);

#ifdef __cplusplus
}
#endif

/* --- the activation math, shared by the C and CUDA kernels -------------------------------
 * The includer defines FO_GLU_FN (function qualifiers), FO_GLU_EXP(x) (e^x in
 * fp32) and FO_GLU_RCP(x) (1/x in fp32) before including this header with
 * FO_GLU_MATH defined; and FO_GLU_T, the type the math runs on, with
 * FO_GLU_ONE, its 1, where it is not float (the C kernels: a block of fp32
 * lanes, GNU C's vectors, which take a float in arithmetic but not in an
 * assignment). */
#ifdef FO_GLU_MATH
#ifndef FO_GLU_T
#define FO_GLU_T float
#define FO_GLU_ONE 1.f
#endif
#define FO_GLU_K0 0.7978845608028654f /* sqrt(2 / pi) */
#define FO_GLU_K1 0.044715f

/* a(g) and a'(g) of the activation (see above). */
FO_GLU_FN FO_GLU_T fo_glu_arg(FO_GLU_T g, int gelu, FO_GLU_T *da) {
  if (!gelu) {
    *da = FO_GLU_ONE;
    return g;
  }
  const FO_GLU_T g2 = g * g;
  *da = 2.f * FO_GLU_K0 * (1.f + 3.f * FO_GLU_K1 * g2);
  return 2.f * FO_GLU_K0 * (g + FO_GLU_K1 * g2 * g);
}

/* sigmoid(a) = 1 / (1 + e^-a): 0 when e^-a overflows, NaN for NaN. */
FO_GLU_FN FO_GLU_T fo_glu_sigmoid(FO_GLU_T a) { return FO_GLU_RCP(1.f + FO_GLU_EXP(-a)); }

/* out = act(g) * u */
FO_GLU_FN FO_GLU_T fo_glu_fwd(FO_GLU_T g, FO_GLU_T u, int gelu) {
  FO_GLU_T da;
  return g * fo_glu_sigmoid(fo_glu_arg(g, gelu, &da)) * u;
}

/* *dg = d * u * act'(g), *du = d * act(g) */
FO_GLU_FN void fo_glu_bwd(FO_GLU_T d, FO_GLU_T g, FO_GLU_T u, int gelu, FO_GLU_T *dg, FO_GLU_T *du) {
  FO_GLU_T da;
  const FO_GLU_T s = fo_glu_sigmoid(fo_glu_arg(g, gelu, &da));
  const FO_GLU_T act = g * s;
  *du = d * act;
  *dg = d * u * (s + act * (1.f - s) * da);
}
#endif
