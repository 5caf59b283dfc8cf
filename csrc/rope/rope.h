/* Rotary position embedding (RoPE) of q and k in one call, in the
 * rotate-half layout of GPT-NeoX and Hugging Face's Llama family: the two
 * halves of a head's D values are rotated against each other,
 *
 *   forward:  y1 = x1 c1 - x2 s1,   y2 = x2 c2 + x1 s2
 *   inverse:  y1 = x1 c1 + x2 s2,   y2 = x2 c2 - x1 s1
 *
 * where x1, x2 are the first and second halves of a row, and c1, c2, s1, s2
 * the halves of the position's cos and sin rows (equal halves in every model
 * we know of; the formulas do not assume it). The inverse is the transpose of
 * the forward map: the backward applies it to the output gradients.
 *
 * Layout: x is [batch, heads, seq, D] read through its strides (unit stride
 * along D); cos and sin are [batch or 1, seq, D] (batch stride 0 when
 * broadcast, unit stride along D); outputs are written with their own
 * strides. fp32 math, one rounding per output. */
#pragma once
#include "../common/fo_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One rotated tensor: input x, output out, each [batch, heads, seq, D]. */
typedef struct fo_rope_tensor {
  const void *x;
  void *out;
  int64_t heads;
  int64_t xb, xh, xs; /* x's strides (elements) */
  int64_t ob, oh, os; /* out's strides */
} fo_rope_tensor;

typedef struct fo_rope_params {
  fo_rope_tensor t[2]; /* q and k (n_tensors of them) */
  int n_tensors;
  int64_t batch, seq, dim; /* dim: D, even */
  const void *cos, *sin;   /* [batch or 1, seq, D] */
  int64_t cb, cs, sb, ss;  /* their batch and seq strides (batch 0: broadcast) */
  int inverse;
  fo_dtype dtype; /* of every tensor */
} fo_rope_params;

/* CPU (rope_cpu.c, OpenMP over positions). It allocates nothing: NULL, always. */
const char *fo_rope_cpu(const fo_rope_params *p);

/* CUDA (rope_cuda.cu). Launch on `stream` (a cudaStream_t); NULL on success,
 * or a static message naming the CUDA error. */
const char *fo_rope_cuda(const fo_rope_params *p, void *stream);

#ifdef __cplusplus
}
#endif

/* --- the rotation, shared by the C and CUDA kernels: the includer defines
 * FO_ROPE_FN (function qualifiers) before including this header with
 * FO_ROPE_MATH defined. */
#ifdef FO_ROPE_MATH
FO_ROPE_FN void fo_rope_pair(float x1, float x2, float c1, float c2, float s1, float s2, int inverse,
                             float *y1, float *y2) {
  if (inverse) {
    *y1 = x1 * c1 + x2 * s2;
    *y2 = x2 * c2 - x1 * s1;
  } else {
    *y1 = x1 * c1 - x2 * s1;
    *y2 = x2 * c2 + x1 * s2;
  }
}
#endif
