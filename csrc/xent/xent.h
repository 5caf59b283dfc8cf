/* Cross-entropy of logits against class indices (the loss of a causal
 * language model): the C interface between the kernels (xent_cpu.c,
 * xent_cuda.cu) and the registration shim (xent_ops.cpp).
 *
 * With softcap c > 0 the loss sees z = c tanh(x / c) (Gemma 2's final
 * layer), else z = x; with label smoothing e the target is the mix
 * (1 - e) onehot(t) + e / V:
 *
 *   forward:  lse_i = log sum_j exp(z_ij),
 *             loss_i = lse_i - (1 - e) z_i,t_i - (e / V) sum_j z_ij
 *             (0 where t_i is ignore_index)
 *   gradient: dx_ij = g_i (exp(z_ij - lse_i) - e / V - (1 - e) [j = t_i]) dz_ij/dx_ij,
 *             dz/dx = 1 - (z / c)^2 with a softcap, else 1
 *             (0 on a row whose target is ignore_index)
 *
 * Three passes of one family (a row at a time, the same row functions):
 * the forward (loss and lse), the backward (the gradient from a saved lse)
 * and both at once, the gradient written over the logits as soon as the
 * row's loss is known (fused linear cross-entropy: only a chunk's logits
 * exist, and they are gone once its gradient is there). The forward also
 * reduces the rows' losses to their sum or mean where asked (the loss of
 * cross_entropy's default reduction, with no op after the kernel), and the
 * backward of a mean divides dloss by the count the forward gave.
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
  float smoothing;        /* label smoothing e in [0, 1] */
  float softcap;          /* c > 0, or 0: none */
  float *loss, *lse;      /* forward: [rows] fp32, dense (lse may be NULL with dlogits) */
  const float *dloss;     /* gradient: [rows] fp32, stride g_stride (0: one value for all rows) */
  int64_t g_stride;
  const float *lse_in;    /* backward: the forward's lse, dense; NULL: computed in the pass */
  void *dlogits;          /* gradient: [rows, vocab] dtype, row stride d_stride; may be logits */
  int64_t d_stride;
  fo_dtype dtype;
} fo_xent_params;

/* A forward's reduction and a mean's backward: apart from fo_xent_params,
 * which the fused pass's kernel takes (at 32 registers a thread it spilled
 * with these fields in the struct it is passed). */
typedef struct fo_xent_reduce {
  float *total, *count;   /* forward: [] fp32, the sum of loss over the rows (the mean with `mean`:
                             divided by count), and count, the rows whose target is not
                             ignore_index; in a fixed row order, summed in double */
  int mean;
  const float *count_in;  /* backward of a mean (else NULL): its count; each row's dloss divided by it */
} fo_xent_reduce;

/* The target of row r, or -1 when the row is ignored; out of range: vocab. */
FO_HD int64_t fo_xent_class(const fo_xent_params *p, int64_t r) {
  const int64_t t = p->target[r * p->t_stride];
  if (t == p->ignore_index) return -1;
  return t >= 0 && t < p->vocab ? t : p->vocab;
}

/* The row's loss from its lse, the target's z and the sum of its z. */
FO_HD float fo_xent_loss(const fo_xent_params *p, float lse, float zt, float zsum) {
  return p->smoothing == 0.f ? lse - zt
                             : lse - (1.f - p->smoothing) * zt - p->smoothing / (float)p->vocab * zsum;
}

/* A row's weight in the gradient: dloss, divided by the count of a mean. */
FO_HD float fo_xent_dloss(const fo_xent_params *p, const float *count_in, int64_t r) {
  const float g = p->dloss[r * p->g_stride];
  return count_in ? g / count_in[0] : g;
}

/* The backward of the fused linear cross-entropy: grad *= *dloss, where
 * dloss (fp32, one value, on grad's device) is read on the device, and
 * nothing is read or written where it is 1 (x * 1 is x for every x, NaN and
 * inf included: the values the multiplication would leave). The forward
 * hands out the gradients of the loss (fusedops/ops/linear_xent.py); a loss
 * that is the root of backward() gets 1, and the weight's gradient is the
 * size of the weight. grad is dense, n values of dtype. */
typedef struct fo_xent_scale_params {
  int64_t n;
  void *grad;
  const float *dloss;
  fo_dtype dtype;
} fo_xent_scale_params;

/* CPU (xent_cpu.c, OpenMP over rows). They allocate nothing: NULL, always.
 * fwd: loss and lse, then total and count where asked. bwd: dlogits from lse_in. fwd_bwd: loss (and lse if
 * given) and dlogits in one pass over each row (dlogits may be logits). */
const char *fo_xent_fwd_cpu(const fo_xent_params *p, const fo_xent_reduce *red);  /* red: NULL, or the */
const char *fo_xent_bwd_cpu(const fo_xent_params *p, const fo_xent_reduce *red);  /* reduction's fields */
const char *fo_xent_fwd_bwd_cpu(const fo_xent_params *p);
const char *fo_xent_scale_cpu(const fo_xent_scale_params *p);

/* CUDA (xent_cuda.cu): a block a row (and one block for total and count). Launch on `stream` (a cudaStream_t);
 * NULL on success or a static message naming the CUDA error. */
const char *fo_xent_fwd_cuda(const fo_xent_params *p, const fo_xent_reduce *red, void *stream);
const char *fo_xent_bwd_cuda(const fo_xent_params *p, const fo_xent_reduce *red, void *stream);
const char *fo_xent_fwd_bwd_cuda(const fo_xent_params *p, void *stream);
const char *fo_xent_scale_cuda(const fo_xent_scale_params *p, void *stream);

#ifdef __cplusplus
}
#endif
