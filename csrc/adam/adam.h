/* Multi-tensor Adam / AdamW: the C interface between the kernels (adam_cpu.c,
 * adam_cuda.cu) and the registration shim (adam_ops.cpp), and the update math,
 * written once here for both (plain C that nvcc also compiles, as host and
 * device code).
 *
 * One call updates a list of tensors that share a device, a parameter dtype
 * and a state dtype. For each tensor i, with t = steps[i] + 1 (the step being
 * taken; steps[i] is incremented unless found_inf is set), all in fp32 per
 * element: the operations of torch.optim.Adam's fused CPU kernel, in its order
 * and with its fmas (so bitwise equal to it on fp32 but for its scalar tails).
 * torch's for-loop and foreach paths differ from both by an ulp here and there:
 * torch.sqrt on the CPU is not correctly rounded, and CUDA foreach computes
 * p + s * (m / d).
 *
 *   g = grad / grad_scale                      (grad_scale optional)
 *   g = -g                                     (maximize)
 *   p = p * (1 - lr * wd)                      (AdamW: decoupled weight decay)
 *   g = p * wd + g   (one fma)                 (Adam: L2 weight decay)
 *   m = lerp(m, g, 1 - beta1)                  (fma, as torch.lerp)
 *   v = fma((1 - beta2) * g, g, v * beta2)
 *   vmax = max(vmax, v); v' = vmax             (amsgrad; else v' = v)
 *   p = p + (-lr / (1 - beta1^t)) * m / (sqrt(v') / sqrt(1 - beta2^t) + eps)
 *
 * Per-tensor scalars (1 - lr*wd, step size, sqrt(1 - beta2^t)) are computed in
 * double and rounded to fp32, as torch does. With master weights, p is the fp32
 * master copy and the parameter receives p rounded to its dtype; otherwise p is
 * the parameter widened to fp32. States are in the state dtype (the parameter's
 * or fp32); grads in the parameter's dtype. Nothing is updated (and no step
 * counted) when *found_inf != 0. */
#pragma once
#include <math.h>
#include "../common/fo_types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fo_adam_params {
  int64_t ntensors;
  void *const *params;            /* [ntensors] param_dtype, dense */
  const void *const *grads;       /* [ntensors] param_dtype, same layout as params */
  void *const *exp_avgs;          /* [ntensors] state_dtype */
  void *const *exp_avg_sqs;       /* [ntensors] state_dtype */
  void *const *max_exp_avg_sqs;   /* [ntensors] state_dtype, or NULL (no amsgrad) */
  float *const *masters;          /* [ntensors] fp32 master copies, or NULL */
  float *const *steps;            /* [ntensors] one fp32 step count each */
  const int64_t *numels;          /* [ntensors] */
  const float *lr_ptr;            /* fp32 scalar on the device, or NULL: use lr */
  const float *grad_scale;        /* fp32 scalar on the device, or NULL */
  const float *found_inf;         /* fp32 scalar on the device, or NULL */
  double lr, beta1, beta2, eps, weight_decay;
  int decoupled_weight_decay, amsgrad, maximize;
  fo_dtype param_dtype, state_dtype;
} fo_adam_params;

/* CPU (adam_cpu.c, OpenMP over chunks of all tensors); NULL, or FO_CPU_OOM. */
const char *fo_adam_cpu(const fo_adam_params *a);

/* CUDA (adam_cuda.cu). Launches on `stream` (a cudaStream_t); never
 * synchronises. Returns NULL on success or a static message naming the error. */
const char *fo_adam_cuda(const fo_adam_params *a, void *stream);

#ifdef __cplusplus
}
#endif

/* The per-tensor, per-step scalars of the update, in fp32. */
typedef struct fo_adam_coef {
  float decay;          /* 1 - lr * wd for AdamW, else 1 */
  float l2;             /* wd for Adam with L2 decay, else 0 (then unused) */
  float lerp_coef;      /* w = 1 - beta1 when w < 0.5 (lerp_small), else w - 1 */
  float beta2, one_minus_beta2;
  float neg_step_size;  /* -lr / (1 - beta1^t) */
  float bc2_sqrt;       /* sqrt(1 - beta2^t) */
  float eps;
  float grad_scale;     /* 1 when there is none (then scaled = 0: g / 1 is g) */
  float sign;           /* -1 for maximize, else 1 */
  int l2_on, lerp_small, amsgrad, scaled;
} fo_adam_coef;

/* Scalars for step count t (the step being taken) and learning rate lr. */
FO_HD fo_adam_coef fo_adam_coef_make(const fo_adam_params *a, double t, double lr, float grad_scale) {
  fo_adam_coef c;
  const double bc1 = 1.0 - pow(a->beta1, t), bc2 = 1.0 - pow(a->beta2, t);
  const int wd_on = a->weight_decay != 0.0;
  c.decay = (float)(wd_on && a->decoupled_weight_decay ? 1.0 - lr * a->weight_decay : 1.0);
  c.l2_on = wd_on && !a->decoupled_weight_decay;
  c.l2 = (float)a->weight_decay;
  const float w = (float)(1.0 - a->beta1);
  c.lerp_small = w < 0.5f;
  c.lerp_coef = c.lerp_small ? w : w - 1.0f;
  c.beta2 = (float)a->beta2;
  c.one_minus_beta2 = (float)(1.0 - a->beta2);
  c.neg_step_size = (float)(-(lr / bc1));
  c.bc2_sqrt = (float)sqrt(bc2);
  c.eps = (float)a->eps;
  c.grad_scale = grad_scale;
  c.scaled = grad_scale != 1.0f;
  c.sign = a->maximize ? -1.0f : 1.0f;
  c.amsgrad = a->amsgrad;
  return c;
}

/* One element: p, m, v (and vmax with amsgrad) updated in place. */
FO_HD void fo_adam_update(const fo_adam_coef *c, float *p, float grad, float *m, float *v,
                          float *vmax) {
  /* Branch-free where the flags allow (selects, not jumps), so that the CPU
   * loop vectorises; the flags are uniform over a call. */
  const float g0 = (c->scaled ? grad / c->grad_scale : grad) * c->sign;
  const float pv = *p * c->decay;
  const float g = c->l2_on ? fmaf(pv, c->l2, g0) : g0;
  /* torch.lerp with weight w = 1 - beta1: m + w (g - m) for w < 0.5, else
   * g - (1 - w) (g - m); one fma either way, the choice made per call */
  const float mv = fmaf(c->lerp_coef, g - *m, c->lerp_small ? *m : g);
  const float vv = fmaf(c->one_minus_beta2 * g, g, *v * c->beta2);  /* torch: v*b2, then addcmul */
  float vd = vv;
  if (c->amsgrad) { /* torch.maximum: a NaN on either side wins */
    vd = ((*vmax > vv) | (*vmax != *vmax)) ? *vmax : vv;  /* | not ||: no branch */
    *vmax = vd;
  }
  const float denom = sqrtf(vd) / c->bc2_sqrt + c->eps;
  *p = pv + c->neg_step_size * mv / denom;
  *m = mv;
  *v = vv;
}
