/* Residual-add + LayerNorm / RMSNorm: the C interface between the kernels
 * (norm_cpu.c, norm_cuda.cu) and the registration shim (norm_ops.cpp).
 *
 *   forward:  s = x + residual            (residual optional; s rounded to s_dtype)
 *             LayerNorm: y = (s - mean(s)) * rstd * w + b,  rstd = 1/sqrt(var(s) + eps)
 *             RMSNorm:   y = s * rstd * w,                  rstd = 1/sqrt(mean(s^2) + eps)
 *   backward: g = dy * w, xhat = (s - mean) * rstd  (mean = 0 for RMSNorm)
 *             dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) + ds   (no mean(g) for RMSNorm)
 *             dw = sum over rows of dy * xhat,  db = sum over rows of dy
 *
 * Every matrix is [rows, cols] with unit stride along cols and a row stride in
 * elements (64-bit). Statistics and accumulation are fp32. */
#pragma once
#include "../common/fo_types.h"
#include "norm_plan.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fo_norm_fwd_params {
  int64_t rows, cols;
  const void *x;        /* [rows, cols] x_dtype, row stride x_stride */
  const void *residual; /* [rows, cols] s_dtype, row stride res_stride, or NULL */
  const void *weight;   /* [cols] w_dtype, or NULL (= 1) */
  const void *bias;     /* [cols] w_dtype, or NULL (= 0); LayerNorm only */
  void *y;              /* [rows, cols] x_dtype, contiguous */
  void *s;              /* [rows, cols] s_dtype, contiguous; NULL: s is not stored
                           (only allowed when residual is NULL and s_dtype == x_dtype) */
  float *mean;          /* [rows]; NULL for RMSNorm or when not wanted */
  float *rstd;          /* [rows]; NULL when not wanted (no backward) */
  int64_t x_stride, res_stride;
  float eps;
  int rms;
  fo_dtype x_dtype, s_dtype, w_dtype;
} fo_norm_fwd_params;

typedef struct fo_norm_bwd_params {
  int64_t rows, cols;
  const void *dy;     /* [rows, cols] x_dtype, row stride dy_stride */
  const void *ds;     /* [rows, cols] s_dtype, row stride ds_stride, or NULL */
  const void *s;      /* [rows, cols] s_dtype, row stride s_stride: the normalised input */
  const void *weight; /* [cols] w_dtype, or NULL */
  const float *mean;  /* [rows]; NULL for RMSNorm */
  const float *rstd;  /* [rows] */
  void *dx;           /* [rows, cols] s_dtype, contiguous: gradient of x and of residual */
  void *dweight;      /* [cols] w_dtype, or NULL when not wanted */
  void *dbias;        /* [cols] w_dtype, or NULL when not wanted */
  float *partial;     /* fp32 workspace [2, parts, cols] for dweight/dbias partial sums,
                         parts from fo_norm_bwd_cpu_parts() or the CUDA plan's;
                         NULL when neither is wanted */
  int64_t parts;
  int64_t dy_stride, ds_stride, s_stride;
  int rms;
  fo_dtype x_dtype, s_dtype, w_dtype;
} fo_norm_bwd_params;

/* CPU (norm_cpu.c, OpenMP over rows); each returns NULL, or FO_CPU_OOM. */
const char *fo_norm_fwd_cpu(const fo_norm_fwd_params *p);
int64_t fo_norm_bwd_cpu_parts(const fo_norm_bwd_params *p);
const char *fo_norm_bwd_cpu(const fo_norm_bwd_params *p);

/* CUDA (norm_cuda.cu). Each returns NULL on success or a static message
 * naming the error. The forward plans and launches on `stream` (a
 * cudaStream_t). The backward is planned once (norm_plan.h) on `device`: the
 * shim allocates p->partial for plan->parts rows, then launches that plan. */
const char *fo_norm_fwd_cuda(const fo_norm_fwd_params *p, void *stream);
const char *fo_norm_bwd_cuda_plan(const fo_norm_bwd_params *p, int device, fo_norm_plan *plan);
const char *fo_norm_bwd_cuda(const fo_norm_bwd_params *p, const fo_norm_plan *plan, void *stream);

#ifdef __cplusplus
}
#endif
