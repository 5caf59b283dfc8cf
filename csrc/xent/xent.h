/* Cross-entropy of logits against class indices (the loss of a causal
 * language model): the C interface between the kernels (xent_cpu.c,
 * xent_cuda.cu) and the registration shim (xent_ops.cpp).
 *
 *   forward:  lse_i = log sum_j exp(x_ij),  loss_i = lse_i - x_i,t_i
 *             (0 where t_i is ignore_index)
 *   backward: dx_ij = g_i (exp(x_ij - lse_i) - [j = t_i])
 *             (0 on a row whose target is ignore_index)
 *
 * x is [rows, vocab] in its own dtype, unit stride along vocab, read once by
 * each pass; the row sums run in fp32 as an online max and sum of
 * exponentials, so the logits are never copied or widened in memory (a
 * language model's are the step's largest tensor). A target outside
 * [0, vocab) that is not ignore_index: the shim raises on the CPU, where it
 * can read the targets; the CUDA forward writes NaN for that row's loss. */
#pragma once
#include "../common/fo_types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fo_xent_params {
  int64_t rows, vocab;
  const void *logits;     /* [rows, vocab] dtype, row stride x_stride */
  int64_t x_stride;
  const int64_t *target;  /* [rows], stride t_stride */
  int64_t t_stride;
  int64_t ignore_index;
  float *loss, *lse;      /* forward: [rows] fp32, dense */
  const float *dloss;     /* backward: [rows] fp32, stride g_stride (0: one value for all rows) */
  int64_t g_stride;
  const float *lse_in;    /* backward: the forward's lse, dense */
  void *dlogits;          /* backward: [rows, vocab] dtype, dense */
  fo_dtype dtype;
} fo_xent_params;

/* The target of row r, or -1 when the row is ignored; out of range: vocab. */
FO_HD int64_t fo_xent_class(const fo_xent_params *p, int64_t r) {
  const int64_t t = p->target[r * p->t_stride];
  if (t == p->ignore_index) return -1;
  return t >= 0 && t < p->vocab ? t : p->vocab;
}

/* CPU (xent_cpu.c, OpenMP over rows). They allocate nothing: NULL, always. */
const char *fo_xent_fwd_cpu(const fo_xent_params *p);
const char *fo_xent_bwd_cpu(const fo_xent_params *p);

/* CUDA (xent_cuda.cu): a block a row. Launch on `stream` (a cudaStream_t);
 * NULL on success or a static message naming the CUDA error. */
const char *fo_xent_fwd_cuda(const fo_xent_params *p, void *stream);
const char *fo_xent_bwd_cuda(const fo_xent_params *p, void *stream);

#ifdef __cplusplus
}
#endif
