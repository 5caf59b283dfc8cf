/* Multi-tensor Adam / AdamW on the CPU: C11 + OpenMP (math and layout: adam.h).
 *
 * Bytes: read p, g, m, v and write p, m, v once each (28 bytes a parameter in
 * fp32; amsgrad adds a read and a write of vmax). One pass: all tensors are cut
 * into chunks of CHUNK elements, spread over the threads by one static OpenMP
 * loop, so many small tensors cost one parallel region, not one each.
 *
 * fp32 parameters and states are updated in place by a loop the compiler
 * vectorises, compiled per x86-64 level (cpu_dtype.h). 16-bit tensors go
 * FO_VL elements at a time: loaded and widened into a register, updated by
 * the same loop (FO_VL lanes, one vector), rounded and stored, the
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

/* Elements [b, b + len) of tensor i, len <= FO_VL, 16-bit params of dtype pt
 * and states of dtype st: widened into registers, updated, rounded back. With
 * a master copy, p is the master (fp32, in place) and the param receives it
 * rounded. */
FO_INLINE void update_block(const fo_adam_params *a, const fo_adam_coef *c, int64_t i, int64_t b, int len,
                            const fo_dtype pt, const fo_dtype st) {
  float *master = a->masters ? a->masters[i] + b : NULL;
  void *p_at = elem(a->params[i], pt, b), *m_at = elem(a->exp_avgs[i], st, b);
  void *v_at = elem(a->exp_avg_sqs[i], st, b);
  void *x_at = a->amsgrad ? elem(a->max_exp_avg_sqs[i], st, b) : NULL;
  /* the update reads and writes arrays (one scalar function, vectorised over
   * the block); the conversions take and give vectors */
  float p[FO_VL], g[FO_VL], m[FO_VL], v[FO_VL], x[FO_VL];
  fo_vf t = master ? fo_vload_n(FO_F32, master, len) : fo_vload_n(pt, p_at, len);
  memcpy(p, &t, sizeof t);
  t = fo_vload_n(pt, elem((void *)a->grads[i], pt, b), len);
  memcpy(g, &t, sizeof t);
  t = fo_vload_n(st, m_at, len);
  memcpy(m, &t, sizeof t);
  t = fo_vload_n(st, v_at, len);
  memcpy(v, &t, sizeof t);
  if (x_at) {
    t = fo_vload_n(st, x_at, len);
    memcpy(x, &t, sizeof t);
  }
  update_f32(*c, FO_VL, p, g, m, v, x_at ? x : NULL);
  if (master) fo_vstore_n(FO_F32, master, *(fo_vf *)p, len);
  fo_vstore_n(pt, p_at, *(fo_vf *)p, len);
  fo_vstore_n(st, m_at, *(fo_vf *)m, len);
  fo_vstore_n(st, v_at, *(fo_vf *)v, len);
  if (x_at) fo_vstore_n(st, x_at, *(fo_vf *)x, len);
}

FO_INLINE void update_blocks(const fo_adam_params *a, const fo_adam_coef *c, int64_t i, int64_t off, int64_t n,
                             const fo_dtype pt, const fo_dtype st) {
  int64_t b = off;
  for (; b + FO_VL <= off + n; b += FO_VL) update_block(a, c, i, b, FO_VL, pt, st);
  if (b < off + n) update_block(a, c, i, b, (int)(off + n - b), pt, st);
}

/* Elements [off, off + n) of tensor i. fp32 is updated in place by one loop;
 * 16-bit data a block of FO_VL at a time, the conversions inside the update
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
