/* Intel AMX tiles for the CPU kernels' bf16 products (level FO_ISA_AMX,
 * cpu_dtype.h): the tile configuration a thread runs under and
 * fo_amx_gemm, C (+)= A B in fp32 from bf16 pairs on 16 x 16 fp32 tiles.
 * Used by the v4 copy of attention_cpu.c; tools/probes/amx_gemm.c checks
 * fo_amx_gemm against a scalar product on every kind of shape, on the
 * hardware or on software tiles (tools/probes/amx_emulate.h).
 *
 * One configuration serves every product (palette 1, every tile 16 rows of
 * 64 bytes): C 16 x 16 fp32; A 16 rows of 16 bf16 pairs along K; B 16 rows
 * (pairs of K) of 16 columns, each a pair. Tile registers: C 0..3 (a 32 x 32
 * block of C), A 4 and 5, B 6 and 7; per step along K, four TDPBF16PS on two
 * loads of A and two of B.
 *
 * A thread loads the configuration (fo_amx_begin) before its first tile
 * instruction and releases it (fo_amx_end) after its last, once per call:
 * configuration and tile data belong to the thread (each OpenMP thread loads
 * its own), and other code on the same threads (oneDNN, in torch) loads its
 * own configurations between our calls, so ours cannot be assumed to
 * survive from one call to the next. The release puts the tile state back
 * in its initial state, which a context switch then does not save (8 KiB a
 * thread otherwise). Using the tiles at all takes the process's permission,
 * asked once at load time (dtype_cpu.c, fo_cpu_isa). */
#pragma once
#include <stdint.h>
#include <string.h>

/* FO_AMX: this compiler builds AMX code (GCC 11, clang 12 and later) for
 * x86-64 Linux, where the kernel grants the permission. */
#if defined(__x86_64__) && defined(__linux__) && \
    (defined(__clang__) ? __clang_major__ >= 12 : defined(__GNUC__) && __GNUC__ >= 11)
#define FO_AMX 1
#include <immintrin.h>
#else
#define FO_AMX 0
#endif

#if FO_AMX
#define FO_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))

/* LDTILECFG's 64 bytes, as a constant: every thread loads the same. */
typedef struct fo_amx_config {
  uint8_t palette, start_row, reserved0[14];
  uint16_t colsb[16]; /* bytes a row, tiles 0..7 (8..15: none in palette 1) */
  uint8_t rows[16];
} fo_amx_config;
_Static_assert(sizeof(fo_amx_config) == 64 && __builtin_offsetof(fo_amx_config, colsb) == 16 &&
                   __builtin_offsetof(fo_amx_config, rows) == 48,
               "LDTILECFG's layout");

static const fo_amx_config fo_amx_tiles __attribute__((aligned(64), unused)) = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

FO_AMX_TARGET static inline void fo_amx_begin(void) { _tile_loadconfig(&fo_amx_tiles); }
FO_AMX_TARGET static inline void fo_amx_end(void) { _tile_release(); }

/* GCC's _tile_loadd is an asm statement that does not tell the compiler it
 * reads memory: a compiler barrier either side keeps the stores that fill
 * the memory before the load and those that refill it after. */
#define FO_AMX_BARRIER() __asm__ volatile("" ::: "memory")
#define FO_TILE_LOAD(t, base, stride_bytes) \
  do {                                      \
    FO_AMX_BARRIER();                       \
    _tile_loadd(t, base, stride_bytes);     \
    FO_AMX_BARRIER();                       \
  } while (0)

/* Where a block's tiles are partial: zero-padded copies, 16 rows of 64 bytes
 * each. Caller-owned (a thread's scratch), so that the compiler sees the
 * memory escape to the tile loads. */
typedef struct fo_amx_stage {
  uint32_t a[2][256], b[2][256];
  float c[4][256];
} fo_amx_stage;

/* A tile of rows x cols 32-bit values at src (rows ld values apart): src
 * itself when it is a whole 16 x 16, else a copy in pad with zeros around it.
 * *stride: the bytes between its rows. */
static inline const void *fo_amx_operand(const void *src, int64_t ld, int64_t rows, int64_t cols, void *pad,
                                         int64_t *stride) {
  if (rows == 16 && cols == 16) {
    *stride = ld * 4;
    return src;
  }
  memset(pad, 0, 1024);
  for (int64_t r = 0; r < rows; ++r) memcpy((char *)pad + r * 64, (const char *)src + r * ld * 4, (size_t)cols * 4);
  *stride = 64;
  return pad;
}

static inline int64_t fo_amx_min16(int64_t n) { return n < 16 ? n : 16; }

/* C[M, N] (+)= A B in fp32, from bf16 pairs: A row i, K2 pairs along K, at
 * A + i lda pairs; B row p (the pair of rows 2p, 2p + 1 of B; N pairs) at
 * B + p ldb pairs; C row-major, rows ldc floats apart. A and B may sit at any
 * 2-byte alignment. Any M, N, K2 >= 0: whole tiles are read and written in
 * place, partial ones (past M, N or K2) through zero-padded copies in st.
 * Nothing outside A's M x K2, B's K2 x N and C's M x N is read or written.
 * The thread must have called fo_amx_begin. */
FO_AMX_TARGET static inline void fo_amx_gemm(int64_t M, int64_t N, int64_t K2, const void *A, int64_t lda,
                                             const void *B, int64_t ldb, float *C, int64_t ldc, int accumulate,
                                             fo_amx_stage *st) {
  const char *a = (const char *)A, *b = (const char *)B;
  for (int64_t i0 = 0; i0 < M; i0 += 32) {
    const int64_t mr = M - i0 < 32 ? M - i0 : 32;
    const int two_rows = mr > 16;
    for (int64_t j0 = 0; j0 < N; j0 += 32) {
      const int64_t nr = N - j0 < 32 ? N - j0 : 32;
      const int two_cols = nr > 16;
      /* C tile t = 2 r + c: rows i0 + 16 r.., columns j0 + 16 c.. */
      float *ct[4];
      int64_t cs[4], crows[4], ccols[4];
      for (int t = 0; t < 4; ++t) {
        const int r = t >> 1, c = t & 1;
        crows[t] = r < 1 + two_rows ? fo_amx_min16(mr - 16 * r) : 0;
        ccols[t] = c < 1 + two_cols ? fo_amx_min16(nr - 16 * c) : 0;
        float *at = C + (i0 + 16 * r) * ldc + j0 + 16 * c;
        if (crows[t] == 16 && ccols[t] == 16) {
          ct[t] = at, cs[t] = ldc * 4;
        } else {
          ct[t] = st->c[t], cs[t] = 64;
          if (accumulate && crows[t] && ccols[t]) fo_amx_operand(at, ldc, crows[t], ccols[t], st->c[t], &cs[t]);
        }
      }
      if (accumulate) {
        FO_TILE_LOAD(0, ct[0], cs[0]);
        if (two_cols) FO_TILE_LOAD(1, ct[1], cs[1]);
        if (two_rows) FO_TILE_LOAD(2, ct[2], cs[2]);
        if (two_rows && two_cols) FO_TILE_LOAD(3, ct[3], cs[3]);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t k0 = 0; k0 < K2; k0 += 16) {
        const int64_t kr = fo_amx_min16(K2 - k0);
        int64_t s;
        const void *t = fo_amx_operand(a + (i0 * lda + k0) * 4, lda, fo_amx_min16(mr), kr, st->a[0], &s);
        FO_TILE_LOAD(4, t, s);
        if (two_rows) {
          t = fo_amx_operand(a + ((i0 + 16) * lda + k0) * 4, lda, mr - 16, kr, st->a[1], &s);
          FO_TILE_LOAD(5, t, s);
        }
        t = fo_amx_operand(b + (k0 * ldb + j0) * 4, ldb, kr, fo_amx_min16(nr), st->b[0], &s);
        FO_TILE_LOAD(6, t, s);
        if (two_cols) {
          t = fo_amx_operand(b + (k0 * ldb + j0 + 16) * 4, ldb, kr, nr - 16, st->b[1], &s);
          FO_TILE_LOAD(7, t, s);
        }
        _tile_dpbf16ps(0, 4, 6);
        if (two_cols) _tile_dpbf16ps(1, 4, 7);
        if (two_rows) _tile_dpbf16ps(2, 5, 6);
        if (two_rows && two_cols) _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, ct[0], cs[0]);
      if (two_cols) _tile_stored(1, ct[1], cs[1]);
      if (two_rows) _tile_stored(2, ct[2], cs[2]);
      if (two_rows && two_cols) _tile_stored(3, ct[3], cs[3]);
      for (int t = 0; t < 4; ++t) { /* partial tiles: their rows back into C */
        if (ct[t] != st->c[t]) continue;
        float *at = C + (i0 + 16 * (t >> 1)) * ldc + j0 + 16 * (t & 1);
        for (int64_t r = 0; r < crows[t]; ++r)
          memcpy(at + r * ldc, st->c[t] + r * 16, (size_t)ccols[t] * 4);
      }
    }
  }
}
#endif
