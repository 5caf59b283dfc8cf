/* fo_amx_gemm (csrc/common/cpu_amx.h) against a scalar product, on an Intel
 * CPU with AMX: random M, N, K2 (whole tiles, and remainders of every kind
 * past them), row strides wider than the rows, A and B at odd 2-byte
 * offsets, with and without accumulation; every OpenMP thread loads its own
 * tile configuration. Prints PASS, or FAIL and why (exit status 1).
 *
 *   gcc -O2 -fopenmp tools/probes/amx_gemm.c -o /tmp/amx_gemm && /tmp/amx_gemm
 *
 * On a CPU without AMX, add -DFO_AMX_EMULATE: software tiles
 * (tools/probes/amx_emulate.h) check the tiling and the edge copies. */
#define _GNU_SOURCE /* syscall() */
#ifdef FO_AMX_EMULATE
#include "amx_emulate.h"
#endif
#include "../../csrc/common/cpu_amx.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#if !FO_AMX
int main(void) {
  puts("FAIL: this compiler or platform builds no AMX code (cpu_amx.h: FO_AMX)");
  return 1;
}
#else

enum { CASES = 400, MAXD = 100, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };

static __thread uint64_t rng_state = 0x9E3779B97F4A7C15u; /* per thread: each case reseeds it */
static uint32_t rnd(void) { /* xorshift64* */
  rng_state ^= rng_state >> 12, rng_state ^= rng_state << 25, rng_state ^= rng_state >> 27;
  return (uint32_t)((rng_state * 0x2545F4914F6CDD1Du) >> 32);
}
static float bf16_to_f32(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
/* A random bf16 in about (-2, 2), never subnormal (the tiles flush those). */
static uint16_t rnd_bf16(void) {
  const float f = ((float)(rnd() % 4001) - 2000.0f) / 1000.0f;
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16);
}

/* A dimension: whole tiles, or any size up to MAXD (remainders). */
static int64_t rnd_dim(void) { return rnd() % 4 == 0 ? 16 * (1 + rnd() % 5) : rnd() % (MAXD + 1); }

/* One random case; returns msg, filled, on failure, NULL on success. */
static const char *one_case(int id, fo_amx_stage *st, char *msg, size_t cap) {
  const int64_t M = rnd_dim(), N = rnd_dim(), K2 = rnd_dim();
  const int64_t lda = K2 + rnd() % 3, ldb = N + rnd() % 3, ldc = N + rnd() % 3;
  const int accumulate = rnd() & 1;
  const int64_t oa = rnd() & 1, ob = rnd() & 1; /* bf16 elements: odd ones put A, B at 2 (mod 4) */
  uint16_t *a = malloc(sizeof(uint16_t) * (size_t)(2 * (M * lda + 1) + 2));
  uint16_t *b = malloc(sizeof(uint16_t) * (size_t)(2 * (K2 * ldb + 1) + 2));
  const int64_t crows = M + 1, cn = crows * ldc + 1; /* a spare row after C: must stay untouched */
  float *c = malloc(sizeof(float) * (size_t)cn);
  double *want = malloc(sizeof(double) * (size_t)(M * N + 1));
  double *bound = malloc(sizeof(double) * (size_t)(M * N + 1));
  for (int64_t i = 0; i < 2 * (M * lda + 1) + 2; ++i) a[i] = rnd_bf16();
  for (int64_t i = 0; i < 2 * (K2 * ldb + 1) + 2; ++i) b[i] = rnd_bf16();
  for (int64_t i = 0; i < cn; ++i) c[i] = (float)((int)(rnd() % 2001) - 1000) / 100.0f;
  const uint16_t *A = a + oa, *B = b + ob;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = accumulate ? c[i * ldc + j] : 0.0, mag = fabs(s);
      for (int64_t p = 0; p < K2; ++p)
        for (int e = 0; e < 2; ++e) {
          const double x = (double)bf16_to_f32(A[2 * (i * lda + p) + e]) * bf16_to_f32(B[2 * (p * ldb + j) + e]);
          s += x, mag += fabs(x);
        }
      want[i * N + j] = s, bound[i * N + j] = 1e-5 * mag + 1e-30;
    }
  float *before = malloc(sizeof(float) * (size_t)cn);
  memcpy(before, c, sizeof(float) * (size_t)cn);
  fo_amx_gemm(M, N, K2, A, lda, B, ldb, c, ldc, accumulate, st);
  const char *bad = NULL;
  for (int64_t i = 0; i < crows && !bad; ++i)
    for (int64_t j = 0; j < ldc && !bad; ++j) {
      const float got = c[i * ldc + j];
      if (i < M && j < N) {
        if (!(fabs(got - want[i * N + j]) <= bound[i * N + j])) {
          snprintf(msg, cap, "case %d (M %ld N %ld K2 %ld accumulate %d): C[%ld][%ld] = %.9g, expected %.9g", id,
                   (long)M, (long)N, (long)K2, accumulate, (long)i, (long)j, got, want[i * N + j]);
          bad = msg;
        }
      } else if (memcmp(&got, &before[i * ldc + j], 4) != 0) {
        snprintf(msg, cap, "case %d (M %ld N %ld K2 %ld): C[%ld][%ld], outside M x N, was written", id, (long)M,
                 (long)N, (long)K2, (long)i, (long)j);
        bad = msg;
      }
    }
  free(a), free(b), free(c), free(want), free(bound), free(before);
  return bad;
}

int main(void) {
#ifndef FO_AMX_EMULATE
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) {
    puts("FAIL: this CPU reports no AMX-TILE / AMX-BF16 (build with -DFO_AMX_EMULATE for software tiles)");
    return 1;
  }
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
    puts("FAIL: the kernel refused the AMX tile-data permission (arch_prctl ARCH_REQ_XCOMP_PERM)");
    return 1;
  }
#endif
  /* Cases drawn up front in one sequence (their seeds), then run in parallel. */
  uint64_t seeds[CASES];
  for (int i = 0; i < CASES; ++i) seeds[i] = ((uint64_t)rnd() << 32 | rnd()) | 1;
  char first[512] = "";
  int failed = 0;
#pragma omp parallel
  {
    fo_amx_stage *st = malloc(sizeof *st);
    char msg[512];
    fo_amx_begin();
#pragma omp for schedule(dynamic)
    for (int i = 0; i < CASES; ++i) {
      rng_state = seeds[i]; /* the same cases at any thread count */
      if (one_case(i, st, msg, sizeof msg)) {
#pragma omp critical(report)
        if (!failed++) snprintf(first, sizeof first, "%s", msg);
      }
    }
    fo_amx_end();
    free(st);
  }
  if (failed) {
    printf("FAIL: %d of %d cases; first: %s\n", failed, CASES, first);
    return 1;
  }
  printf("PASS: %d cases (M, N, K2 up to %d, remainders, strides, odd offsets) on %d threads%s\n", CASES, MAXD,
         omp_get_max_threads(),
#ifdef FO_AMX_EMULATE
         ", software tiles"
#else
         ""
#endif
  );
  return 0;
}
#endif
