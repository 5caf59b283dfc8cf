/* Multi-tensor Adam / AdamW on the CPU: C11 + OpenMP (math and layout: adam.h).
 *
 * Bytes: read p, g, m, v and write p, m, v once each (28 bytes a parameter in
 * fp32; amsgrad adds a read and a write of vmax). One pass: all tensors are cut
 * into chunks of CHUNK elements, spread over the threads by one static OpenMP
 * loop, so many small tensors cost one parallel region, not one each.
 *
 * fp32 parameters and states are updated in place by a loop the compiler
 * vectorises, compiled per x86-64 level (cpu_dtype.h). 16-bit tensors go
 * FO_STEP (16) elements at a time: loaded and widened into registers, updated
 * by the same loop (16 lanes, FO_NV vectors), rounded and stored, the
 * conversions inside the update (F16C for fp16 at v3 and v4), so that they
 * overlap its divisions and square roots; a master copy is updated in place
 * and the parameter receives it rounded. Measured (2 Zen 4 cores, 6.3 M
 * parameters): bf16 and fp16 1.1-1.4x torch's fused=True (docs/perf-notes.md). */
#include <stdlib.h>
#include <string.h>

#include "adam.h"
#include "../common/cpu_dtype.h"

enum { CHUNK = 1 << 14 };

/* n elements, all fp32, in place; vmax NULL unless amsgrad. */
FO_INLINE void update_f32(fo_adam_coef c, int64_t n, float *restrict p, const float *restrict g,
                          float *restrict m, float *restrict v, float *restrict vmax) {
  if (c.amsgrad) {
    c.amsgrad = 1;  /* known in the loop: the vmax store is unconditional */
    for (int64_t j = 0; j < n; ++j) fo_adam_update(&c, p + j, g[j], m + j, v + j, vmax + j);
  } else {
    c.amsgrad = 0;  /* lets the compiler drop the vmax branch from this loop */
    for (int64_t j = 0; j < n; ++j) fo_adam_update(&c, p + j, g[j], m + j, v + j, NULL);
  }
}

static inline void *elem(void *base, fo_dtype t, int64_t off) {
  return (char *)base + (size_t)off * (size_t)fo_dtype_size(t);
}

/* Elements [b, b + len) of tensor i, len <= FO_STEP, 16-bit params of dtype
 * pt and states of dtype st: widened into fp32 arrays, updated by the scalar
 * update vectorised over them, rounded back. FO_STEP values a call at every
 * level (FO_NV registers an array): at v3, 8-value blocks cost the call's
 * pointer set-up and branches twice as often. With a master copy, p is the
 * master (fp32, in place) and the param receives it rounded. */
FO_INLINE void update_block(const fo_adam_params *a, const fo_adam_coef *c, int64_t i, int64_t b, int len,
                            const fo_dtype pt, const fo_dtype st) {
  float *master = a->masters ? a->masters[i] + b : NULL;
  void *p_at = elem(a->params[i], pt, b), *m_at = elem(a->exp_avgs[i], st, b);
  void *v_at = elem(a->exp_avg_sqs[i], st, b);
  void *x_at = a->amsgrad ? elem(a->max_exp_avg_sqs[i], st, b) : NULL;
  float p[FO_STEP], g[FO_STEP], m[FO_STEP], v[FO_STEP], x[FO_STEP];
  if (len > FO_STEP) __builtin_unreachable(); /* tells GCC the row loads below stay in the arrays */
  if (len < FO_STEP) { /* a tensor's last block: the lanes past len updated as zeros, not stored */
    memset(p, 0, sizeof p), memset(g, 0, sizeof g), memset(m, 0, sizeof m), memset(v, 0, sizeof v);
    memset(x, 0, sizeof x);
  }
  if (master) fo_load_row(FO_F32, master, p, len);
  else fo_load_row(pt, p_at, p, len);
  fo_load_row(pt, elem((void *)a->grads[i], pt, b), g, len);
  fo_load_row(st, m_at, m, len);
  fo_load_row(st, v_at, v, len);
  if (x_at) fo_load_row(st, x_at, x, len);
  update_f32(*c, FO_STEP, p, g, m, v, x_at ? x : NULL);
  if (master) fo_store_row(FO_F32, master, p, len);
  fo_store_row(pt, p_at, p, len);
  fo_store_row(st, m_at, m, len);
  fo_store_row(st, v_at, v, len);
  if (x_at) fo_store_row(st, x_at, x, len);
}

FO_INLINE void update_blocks(const fo_adam_params *a, const fo_adam_coef *c, int64_t i, int64_t off, int64_t n,
                             const fo_dtype pt, const fo_dtype st) {
  int64_t b = off;
  for (; b + FO_STEP <= off + n; b += FO_STEP) update_block(a, c, i, b, FO_STEP, pt, st);
  if (b < off + n) update_block(a, c, i, b, (int)(off + n - b), pt, st);
}

/* Elements [off, off + n) of tensor i. fp32 is updated in place by one loop;
 * 16-bit data FO_STEP values at a time, the conversions inside the update
 * (hardware fp16 conversions at x86-64-v3 and v4), one copy of the loop per
 * dtype pair. */
static void update_span(const fo_adam_params *a, const fo_adam_coef *c, int64_t i, int64_t off, int64_t n) {
  const fo_dtype pt = a->param_dtype, st = a->state_dtype;
  if (pt == FO_F32) { /* states are fp32 too (checked by the shim) */
    void *vmax = a->amsgrad ? a->max_exp_avg_sqs[i] : NULL;
    update_f32(*c, n, (float *)a->params[i] + off, (const float *)a->grads[i] + off,
               (float *)a->exp_avgs[i] + off, (float *)a->exp_avg_sqs[i] + off,
               vmax ? (float *)vmax + off : NULL);
  } else if (pt == FO_BF16) {
    if (st == FO_F32) update_blocks(a, c, i, off, n, FO_BF16, FO_F32);
    else update_blocks(a, c, i, off, n, FO_BF16, FO_BF16);
  } else {
    if (st == FO_F32) update_blocks(a, c, i, off, n, FO_F16, FO_F32);
    else update_blocks(a, c, i, off, n, FO_F16, FO_F16);
  }
}

const char *FO_FN(fo_adam_cpu)(const fo_adam_params *a) {
  if (a->found_inf && *a->found_inf != 0.0f) return NULL; /* skipped step: nothing moves */
  const int64_t nt = a->ntensors;
  const double lr = a->lr_ptr ? (double)*a->lr_ptr : a->lr;
  const float scale = a->grad_scale ? *a->grad_scale : 1.0f;
  fo_adam_coef *coef = malloc(sizeof(fo_adam_coef) * (size_t)(nt + 1));
  int64_t *first = malloc(sizeof(int64_t) * (size_t)(nt + 1)); /* first chunk of tensor i */
  if (!coef || !first) {
    free(first);
    free(coef);
    return FO_CPU_OOM;
  }
  first[0] = 0;
  for (int64_t i = 0; i < nt; ++i) {
    *a->steps[i] += 1.0f;
    coef[i] = fo_adam_coef_make(a, (double)*a->steps[i], lr, scale);
    first[i + 1] = first[i] + (a->numels[i] + CHUNK - 1) / CHUNK;
  }
  const int64_t chunks = first[nt];
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t k = 0; k < chunks; ++k) {
    int64_t lo = 0, hi = nt - 1; /* the tensor holding chunk k: first[i] <= k < first[i + 1] */
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (first[mid] <= k) lo = mid; else hi = mid - 1;
    }
    const int64_t off = (k - first[lo]) * CHUNK;
    const int64_t n = a->numels[lo] - off < CHUNK ? a->numels[lo] - off : CHUNK;
    update_span(a, &coef[lo], lo, off, n);
  }
  free(first);
  free(coef);
  return NULL;
}
FO_ENTRY(const char *, fo_adam_cpu, (const fo_adam_params *a), (a))
