/* RoPE on the CPU: C11 + OpenMP over positions (batch, seq). At a position,
 * each tile of kTile columns of the half-row has its cos and sin widened to
 * fp32 once, then every head of q and k is rotated with them: each input
 * element read once, each output element written once. Compiled per x86-64
 * level (cpu_dtype.h: fp16 through F16C at v3 and v4). Math and layout:
 * rope.h. */
#include <omp.h>

#include "../common/cpu_math.h"

#define FO_ROPE_MATH
#define FO_ROPE_FN static inline
#include "rope.h"

enum { kTile = 128 };

static void position(const fo_rope_params *p, int64_t b, int64_t s) {
  const fo_dtype t = p->dtype;
  const int es = fo_dtype_size(t), inv = p->inverse;
  const int64_t half = p->dim / 2;
  const char *cr = (const char *)p->cos + (b * p->cb + s * p->cs) * es;
  const char *sr = (const char *)p->sin + (b * p->sb + s * p->ss) * es;
  float cbuf[2][kTile], sbuf[2][kTile], xbuf[2][kTile], ybuf[2][kTile];
  for (int64_t j = 0; j < half; j += kTile) {
    const int64_t n = half - j < kTile ? half - j : kTile;
    const float *c1 = fo_as_f32(t, cr + j * es, cbuf[0], n);
    const float *c2 = fo_as_f32(t, cr + (j + half) * es, cbuf[1], n);
    const float *s1 = fo_as_f32(t, sr + j * es, sbuf[0], n);
    const float *s2 = fo_as_f32(t, sr + (j + half) * es, sbuf[1], n);
    for (int k = 0; k < p->n_tensors; ++k) {
      const fo_rope_tensor *q = &p->t[k];
      for (int64_t h = 0; h < q->heads; ++h) {
        const char *x = (const char *)q->x + (b * q->xb + h * q->xh + s * q->xs + j) * es;
        char *o = (char *)q->out + (b * q->ob + h * q->oh + s * q->os + j) * es;
        const float *x1 = fo_as_f32(t, x, xbuf[0], n), *x2 = fo_as_f32(t, x + half * es, xbuf[1], n);
        /* Results go through scratch in every dtype: out may be x itself. */
        for (int64_t i = 0; i < n; ++i)
          fo_rope_pair(x1[i], x2[i], c1[i], c2[i], s1[i], s2[i], inv, &ybuf[0][i], &ybuf[1][i]);
        fo_store_row(t, o, ybuf[0], n);
        fo_store_row(t, o + half * es, ybuf[1], n);
      }
    }
  }
}

const char *FO_FN(fo_rope_cpu)(const fo_rope_params *p) {
  const int64_t n = p->batch * p->seq;
  int64_t heads = 0;
  for (int i = 0; i < p->n_tensors; ++i) heads += p->t[i].heads;
#pragma omp parallel for schedule(static) if (fo_parallel(n, n * heads * p->dim))
  for (int64_t i = 0; i < n; ++i) position(p, i / p->seq, i % p->seq);
  return NULL;
}
FO_ENTRY(const char *, fo_rope_cpu, (const fo_rope_params *p), (p))
