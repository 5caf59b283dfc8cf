/* Software AMX tiles, for running the AMX code (csrc/common/cpu_amx.h) on a
 * CPU without AMX: each tile intrinsic that code uses becomes a C function
 * on a per-thread copy of the tile state, with the instructions' semantics
 * (Intel's SDM: LDTILECFG, TILELOADD, TILESTORED, TILEZERO, TDPBF16PS,
 * TILERELEASE; fp32 products and sums, no flushing of subnormals). A tile
 * instruction before the thread has loaded a configuration, or on shapes
 * TDPBF16PS does not take, aborts, as the hardware faults.
 *
 * Included before cpu_amx.h, it replaces the intrinsics; where a file includes
 * <immintrin.h> itself, this header must come first (forced in: -include, as
 * amx_emulate_cc.sh does for a build of the library whose attention runs its
 * AMX path on these tiles). dtype_cpu.c then reports level 6 on any CPU
 * with AVX512-BF16 (FO_AMX_EMULATE). */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FO_AMX_EMULATE 1

static __thread struct {
  uint8_t config[64];
  uint8_t tile[8][1024];
} fo_emu __attribute__((aligned(64), unused));

static inline int fo_emu_rows(int t) { return fo_emu.config[48 + t]; }
static inline int fo_emu_colsb(int t) { return fo_emu.config[16 + 2 * t] | fo_emu.config[17 + 2 * t] << 8; }

static inline void fo_emu_need(int ok) {
  if (!ok) abort();
}

static inline void fo_emu_loadconfig(const void *config) {
  memcpy(fo_emu.config, config, 64);
  fo_emu_need(fo_emu.config[0] == 1);
  for (int t = 0; t < 8; ++t) fo_emu_need(fo_emu_rows(t) <= 16 && fo_emu_colsb(t) <= 64);
  memset(fo_emu.tile, 0, sizeof fo_emu.tile);
}

static inline void fo_emu_release(void) { memset(&fo_emu, 0, sizeof fo_emu); }

static inline void fo_emu_configured(int t) {
  fo_emu_need(fo_emu.config[0] == 1 && t >= 0 && t < 8 && fo_emu_rows(t));
}

static inline void fo_emu_load(int t, const void *base, long stride) {
  fo_emu_configured(t);
  memset(fo_emu.tile[t], 0, 1024);
  for (int r = 0; r < fo_emu_rows(t); ++r)
    memcpy(fo_emu.tile[t] + 64 * r, (const char *)base + r * stride, fo_emu_colsb(t));
}

static inline void fo_emu_store(int t, void *base, long stride) {
  fo_emu_configured(t);
  for (int r = 0; r < fo_emu_rows(t); ++r)
    memcpy((char *)base + r * stride, fo_emu.tile[t] + 64 * r, fo_emu_colsb(t));
}

static inline void fo_emu_zero(int t) {
  fo_emu_configured(t);
  memset(fo_emu.tile[t], 0, 1024);
}

static inline float fo_emu_bf16(const uint8_t *row, int i) {
  uint16_t h;
  memcpy(&h, row + 2 * i, 2);
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* c[m][n] += sum over k of a[m].bf16[2k] b[k].bf16[2n] + a[m].bf16[2k + 1] b[k].bf16[2n + 1] */
static inline void fo_emu_dpbf16ps(int c, int a, int b) {
  fo_emu_configured(c), fo_emu_configured(a), fo_emu_configured(b);
  const int M = fo_emu_rows(c), N = fo_emu_colsb(c) / 4, K = fo_emu_colsb(a) / 4;
  fo_emu_need(fo_emu_rows(a) == M && fo_emu_rows(b) == K && fo_emu_colsb(b) == 4 * N);
  for (int m = 0; m < M; ++m) {
    const uint8_t *arow = fo_emu.tile[a] + 64 * m;
    float crow[16];
    memcpy(crow, fo_emu.tile[c] + 64 * m, 64);
    for (int k = 0; k < K; ++k) {
      const uint8_t *brow = fo_emu.tile[b] + 64 * k;
      for (int n = 0; n < N; ++n)
        crow[n] += fo_emu_bf16(arow, 2 * k) * fo_emu_bf16(brow, 2 * n) +
                   fo_emu_bf16(arow, 2 * k + 1) * fo_emu_bf16(brow, 2 * n + 1);
    }
    memcpy(fo_emu.tile[c] + 64 * m, crow, 64);
  }
}

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) fo_emu_loadconfig(config)
#define _tile_release() fo_emu_release()
#define _tile_loadd(t, base, stride) fo_emu_load(t, base, stride)
#define _tile_stored(t, base, stride) fo_emu_store(t, base, stride)
#define _tile_zero(t) fo_emu_zero(t)
#define _tile_dpbf16ps(c, a, b) fo_emu_dpbf16ps(c, a, b)
