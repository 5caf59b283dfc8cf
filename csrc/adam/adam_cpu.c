/* Multi-tensor Adam / AdamW on the CPU: C11 + OpenMP (math and layout: adam.h).
 *
 * Bytes: read p, g, m, v and write p, m, v once each (28 bytes a parameter in
 * fp32; amsgrad adds a read and a write of vmax). One pass: all tensors are cut
 * into chunks of CHUNK elements, spread over the threads by one static OpenMP
 * loop, so many small tensors cost one parallel region, not one each.
 *
 * fp32 parameters and states are updated in place by a loop the compiler
 * vectorises (one clone for AVX2 + FMA, one for the baseline: FO_CLONES). 16-bit
 * tensors are widened BLOCK elements at a time into fp32 scratch on the stack,
 * updated by the same loop and rounded back; a master copy is updated in place
 * and the parameter receives it rounded. */
#include <stdlib.h>
#include <string.h>

#include "adam.h"
#include "../common/cpu_dtype.h"

enum { CHUNK = 1 << 14, BLOCK = 256 };

/* n elements, all fp32, in place; vmax NULL unless amsgrad. */
FO_CLONES static void update_f32(fo_adam_coef c, int64_t n, float *restrict p, const float *restrict g,
                                 float *restrict m, float *restrict v, float *restrict vmax) {
  if (c.amsgrad) {
    c.amsgrad = 1;  /* known in the loop: the vmax store is unconditional */
    for (int64_t j = 0; j < n; ++j) fo_adam_update(&c, p + j, g[j], m + j, v + j, vmax + j);
  } else {
    c.amsgrad = 0;  /* lets the compiler drop the vmax branch from this loop */
    for (int64_t j = 0; j < n; ++j) fo_adam_update(&c, p + j, g[j], m + j, v + j, NULL);
  }
}

static void *elem(void *base, fo_dtype t, int64_t off) {
  return (char *)base + (size_t)off * (size_t)fo_dtype_size(t);
}

/* A state array at [off, off + n) as fp32: in place when it is fp32, else
 * widened into `scratch`. */
static float *state_f32(fo_dtype t, void *base, int64_t off, float *scratch, int64_t n) {
  if (t == FO_F32) return (float *)base + off;
  fo_load_row(t, elem(base, t, off), scratch, n);
  return scratch;
}

/* Elements [off, off + n) of tensor i. Cloned too: the 16-bit conversions
 * then vectorise with AVX2 (with SSE2 alone the bf16 path ran at half the
 * speed of fp32 and fp16 did not vectorise at all). */
FO_CLONES static void update_span(const fo_adam_params *a, const fo_adam_coef *c, int64_t i, int64_t off, int64_t n) {
  const fo_dtype pt = a->param_dtype, st = a->state_dtype;
  void *vmax = a->amsgrad ? a->max_exp_avg_sqs[i] : NULL;
  if (pt == FO_F32) { /* states are fp32 too (checked by the shim) */
    update_f32(*c, n, (float *)a->params[i] + off, (const float *)a->grads[i] + off,
               (float *)a->exp_avgs[i] + off, (float *)a->exp_avg_sqs[i] + off,
               vmax ? (float *)vmax + off : NULL);
    return;
  }
  float buf[5][BLOCK];
  for (int64_t b = off; b < off + n; b += BLOCK) {
    const int64_t len = off + n - b < BLOCK ? off + n - b : BLOCK;
    float *pf = a->masters ? a->masters[i] + b : buf[0];
    if (!a->masters) fo_load_row(pt, elem(a->params[i], pt, b), pf, len);
    fo_load_row(pt, elem((void *)a->grads[i], pt, b), buf[1], len);
    float *mf = state_f32(st, a->exp_avgs[i], b, buf[2], len);
    float *vf = state_f32(st, a->exp_avg_sqs[i], b, buf[3], len);
    float *xf = vmax ? state_f32(st, vmax, b, buf[4], len) : NULL;
    update_f32(*c, len, pf, buf[1], mf, vf, xf);
    fo_store_row(pt, elem(a->params[i], pt, b), pf, len);
    if (st != FO_F32) {
      fo_store_row(st, elem(a->exp_avgs[i], st, b), mf, len);
      fo_store_row(st, elem(a->exp_avg_sqs[i], st, b), vf, len);
      if (xf) fo_store_row(st, elem(vmax, st, b), xf, len);
    }
  }
}

void fo_adam_cpu(const fo_adam_params *a) {
  if (a->found_inf && *a->found_inf != 0.0f) return; /* skipped step: nothing moves */
  const int64_t nt = a->ntensors;
  const double lr = a->lr_ptr ? (double)*a->lr_ptr : a->lr;
  const float scale = a->grad_scale ? *a->grad_scale : 1.0f;
  fo_adam_coef *coef = malloc(sizeof(fo_adam_coef) * (size_t)(nt + 1));
  int64_t *first = malloc(sizeof(int64_t) * (size_t)(nt + 1)); /* first chunk of tensor i */
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
}
