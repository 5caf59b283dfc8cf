/* The norm's launch plans (norm_plan.h): which kernel, its shape, grid and
 * shared memory, from the call and the device's facts. Each rule below says
 * what it decides and why; the measurements behind them are in
 * docs/perf/norm.md. Kernels and what they are for: norm_cuda.cu and the
 * norm_*.cuh files it lists. */
#include "norm_plan.h"

#include <stdbool.h>

#include "../common/tune.h"
#include "norm.h"

/* How a call's rows are cut: vec elements an access, nv chunks a thread (0:
 * the loop kernel), team threads a row, rpb rows a block, cl blocks a row. */
typedef struct shape {
  int vec, nv, team, rpb, cl;
} shape;

static const shape kNoShape = {0, 0, 0, 0, 0};

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int round_up32(int64_t n) { return (int)((n + 31) / 32 * 32); }
static bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* A GPU whose SMs have more memory bandwidth each than an H100's (25 GB/s an
 * SM), as an H200's (36): the plans that differ between the two key on this
 * one test. No GPU between the two was measured: 30 is a guess between them. */
static bool bandwidth_rich(const fo_norm_device *d) { return d->gbps_per_sm > 30; }

/* Values a thread the register kernels aim for: fewer means larger teams
 * (fewer registers each), more means fewer threads a row; a tuning knob. */
static int target_values(int fallback) { return fo_tuning.norm_values > 0 ? fo_tuning.norm_values : fallback; }

/* The loop kernels' vector: 16 or 8 bytes of x, else one element (chunks of
 * 4 bytes only the register kernels are compiled for). */
static int loop_vec(int vec) { return vec >= 4 ? vec : 1; }

/* The loop kernel: one block a row, 4 chunks a thread a pass, 128-512 threads. */
static shape loop_shape(int64_t cols, int vec) {
  vec = loop_vec(vec);
  const int64_t chunks = ceil_div(cols, vec);
  const shape s = {vec, 0, (int)min64(FO_NORM_LOOP_THREADS, max64(128, round_up32(chunks / 4))), 1, 1};
  return s;
}

/* The register kernels' thread caps (norm_plan.h), by kind. */
enum cap_kind { CAP_PLAIN, CAP_FWD, CAP_BWD };
static int cap(enum cap_kind kind, int arg, int values) {
  switch (kind) {
    case CAP_FWD: return FO_NORM_FWD_MAX_THREADS(values, arg);
    case CAP_BWD: return FO_NORM_BWD_MAX_THREADS(values, arg);
    default: return FO_NORM_MAX_THREADS(values);
  }
}

/* The fewest chunks a thread (a power of two) that give at least `target`
 * values and a team within its thread cap, up to `max_values`; the loop
 * kernel's shape where none does. Forward blocks: one team, or one-warp teams
 * FO_NORM_BLOCK_TARGET threads' worth (warps need no barrier); the backward
 * sets its own. */
static shape choose(int64_t cols, int vec, int target, int max_values, enum cap_kind kind, int arg) {
  const int64_t chunks = ceil_div(cols, vec);
  for (int nv = 1; nv * vec <= max_values; nv *= 2) {
    const int64_t team = max64(32, round_up32(ceil_div(chunks, nv)));
    if (nv * vec < target && nv * vec * 2 <= max_values && team > 32) continue;
    if (team <= cap(kind, arg, nv * vec)) {
      const shape s = {vec, nv, (int)team, team == 32 ? FO_NORM_BLOCK_TARGET / 32 : 1, 1};
      return s;
    }
  }
  return loop_shape(cols, vec);
}

/* One warp a row at twice the chunks a thread, in place of a team of two
 * warps, where max_values allows; returns whether it changed c. */
static bool to_one_warp(shape *c, int max_values) {
  if (c->nv == 0 || c->team != 64 || 2 * c->nv * c->vec > max_values) return false;
  c->nv *= 2;
  c->team = 32;
  return true;
}

/* Whether every row of an array (elements of `size` bytes, rows `stride`
 * apart; a null array passes) can be read `vec` elements at a time: each
 * access aligned to its bytes, or to 16 where it is 16 or more. */
static bool fits(const void *ptr, int64_t stride, int size, int vec) {
  const int a = vec * size < 16 ? vec * size : 16;
  return !ptr || ((uintptr_t)ptr % (uintptr_t)a == 0 && stride * size % a == 0);
}

static bool fwd_vec_ok(const fo_norm_fwd_params *p, int vec) {
  const int xs = fo_dtype_size(p->x_dtype), ss = fo_dtype_size(p->s_dtype), ws = fo_dtype_size(p->w_dtype);
  return p->cols % vec == 0 && fits(p->x, p->x_stride, xs, vec) && fits(p->y, p->cols, xs, vec) &&
         fits(p->residual, p->res_stride, ss, vec) && fits(p->s, p->cols, ss, vec) &&
         fits(p->weight, 0, ws, vec) && fits(p->bias, 0, ws, vec);
}

static bool bwd_vec_ok(const fo_norm_bwd_params *p, int vec) {
  const int xs = fo_dtype_size(p->x_dtype), ss = fo_dtype_size(p->s_dtype), ws = fo_dtype_size(p->w_dtype);
  return p->cols % vec == 0 && fits(p->dy, p->dy_stride, xs, vec) && fits(p->s, p->s_stride, ss, vec) &&
         fits(p->dx, p->cols, ss, vec) && fits(p->ds, p->ds_stride, ss, vec) && fits(p->weight, 0, ws, vec);
}

/* access_vec: elements of x a call reads at a time: the widest of 16, 8 and 4 bytes that
 * every row allows, else one (odd widths, a slice at an odd element). Every
 * narrower step was measured slower than the next wider where rows allow it. */
static int fwd_access_vec(const fo_norm_fwd_params *p) {
  for (int v = 16 / fo_dtype_size(p->x_dtype); v > 1; v /= 2)
    if (fwd_vec_ok(p, v)) return v;
  return 1;
}
static int bwd_access_vec(const fo_norm_bwd_params *p) {
  for (int v = 16 / fo_dtype_size(p->x_dtype); v > 1; v /= 2)
    if (bwd_vec_ok(p, v)) return v;
  return 1;
}

/* Whether every array's rows follow each other with no gap and start 16-byte
 * aligned (a null array passes): the group and shift kernels copy them as
 * runs of 16-byte words. */
static bool whole_rows(int64_t cols, int n, const void *const *ptr, const int64_t *stride) {
  for (int i = 0; i < n; ++i)
    if (ptr[i] && (stride[i] != cols || !aligned16(ptr[i]))) return false;
  return true;
}
static bool fwd_whole_rows(const fo_norm_fwd_params *p) {
  const void *ptr[4] = {p->x, p->residual, p->y, p->s};
  const int64_t stride[4] = {p->x_stride, p->res_stride, p->cols, p->cols};
  return whole_rows(p->cols, 4, ptr, stride);
}
static bool bwd_whole_rows(const fo_norm_bwd_params *p) {
  const void *ptr[4] = {p->dy, p->s, p->ds, p->dx};
  const int64_t stride[4] = {p->dy_stride, p->s_stride, p->ds_stride, p->cols};
  return whole_rows(p->cols, 4, ptr, stride);
}

/* Persistent grid: as many blocks as are resident at once, at most one a group of rpb rows. */
static int64_t persistent_grid(const fo_norm_device *d, const fo_norm_plan *pl, int64_t rows, int rpb, int threads,
                               size_t smem) {
  const int64_t groups = ceil_div(rows, rpb);
  const int64_t resident = (int64_t)d->sm_count * d->blocks_per_sm(d->ctx, pl, threads, smem);
  return max64(1, min64(groups, resident));
}

/* The pipe kernels' shape: teams of at most FO_NORM_PIPE_THREADS threads of
 * FO_NORM_PIPE_CHUNKS chunks, the row split over a cluster (sm_90, at most 16
 * blocks) where one team cannot hold it; nv 0 where there is none. */
static shape pipe_shape(int64_t cols, int vec, bool vec_ok, int cc) {
  if (!vec_ok || fo_tuning.norm_stages < 2) return kNoShape;
  const int64_t chunks = cols / vec, per_block = FO_NORM_PIPE_THREADS * FO_NORM_PIPE_CHUNKS;
  const int64_t cl = ceil_div(chunks, per_block);
  if (cl > 1 && (cl > 16 || cc < 90)) return kNoShape;
  const int64_t slice = ceil_div(chunks, cl);
  const shape s = {vec, FO_NORM_PIPE_CHUNKS, (int)max64(32, round_up32(ceil_div(slice, FO_NORM_PIPE_CHUNKS))), 1,
                   (int)cl};
  return s;
}

/* The most stages (from the knob's, 2 by default, down to 2) of `stage` bytes
 * that fit in shared memory beside the kernels' static arrays; their bytes,
 * or 0 where even two do not fit. One row ahead measured best. */
static size_t pipe_smem(size_t stage, const fo_norm_device *d, int *stages) {
  const size_t limit = (size_t)d->smem_optin - 8 * 1024;
  for (*stages = fo_tuning.norm_stages; *stages >= 2; --*stages)
    if (*stages * stage <= limit) return *stages * stage;
  return 0;
}

/* A pipe plan's grid: persistent, in clusters where the row is split over
 * them; pl->parts counts its units (blocks or clusters), each writes one
 * partial row. */
static void pipe_grid(fo_norm_plan *pl, const fo_norm_device *d, int64_t rows) {
  if (pl->cl > 1) {
    const int64_t units = max64(1, min64(rows, d->clusters(d->ctx, pl, pl->team, pl->smem)));
    pl->grid = units * pl->cl;
    pl->parts = units;
  } else {
    pl->grid = persistent_grid(d, pl, rows, 1, pl->team, pl->smem);
    pl->parts = pl->grid;
  }
}

/* fwd_shift's and bwd_shift's shape: the fewest chunks a thread, of 1, 2 ...
 * max_nv, that hold the row in one team of at most FO_NORM_SHIFT_THREADS (a
 * multiple of 32: the head and the tail take threads of their own); nv 0
 * where none does. */
static shape shift_shape(int64_t cols, int max_nv) {
  const int64_t chunks = cols / 8;
  for (int nv = 1; nv <= max_nv; nv *= 2)
    if (ceil_div(chunks, nv) <= FO_NORM_SHIFT_THREADS) {
      const shape s = {8, nv, (int)max64(32, (ceil_div(chunks, nv) + 31) / 32 * 32), 1, 1};
      return s;
    }
  const shape none = {8, 0, 0, 1, 1};
  return none;
}

static fo_norm_plan plan_of(int kernel, shape c) {
  fo_norm_plan pl = {0};
  pl.kernel = kernel;
  pl.vec = c.vec;
  pl.nv = c.nv;
  pl.team = c.team;
  pl.rpb = c.rpb;
  pl.cl = c.cl > 1 ? c.cl : 1;
  return pl;
}

/* Whether the register kernels are compiled for nv chunks of vec values:
 * powers of two up to max_chunks whose values fit the thread's budget. */
static bool regs_compiled(int nv, int vec, int budget, int max_chunks) {
  return (nv == 1 || nv == 2 || nv == 4 || nv == 8 || nv == 16) && nv <= max_chunks && nv * vec <= budget;
}

/* ---- forward ---------------------------------------------------------------------------- */

/* fwd_narrow: 16-byte access, x, s and weight of one 16-bit dtype, a residual
 * and a weight, rows of 256, 512, 768 or 1024: the pre-norm transformer's
 * call, with the width a compile-time constant. */
static bool narrow_fwd(const fo_norm_fwd_params *p, bool vec_ok) {
  return fo_tuning.norm_narrow && vec_ok && fo_dtype_size(p->x_dtype) == 2 && p->s_dtype == p->x_dtype &&
         p->w_dtype == p->x_dtype && p->residual && p->weight && p->s &&
         (p->cols == 256 || p->cols == 512 || p->cols == 768 || p->cols == 1024) && p->rows <= INT32_MAX;
}

/* fwd_narrow's rows a block (one a warp): eight where statistics are stored
 * at 256 wide, and for LayerNorm at 512 (whole-sector statistics stores);
 * without statistics at 256 and 512, two on bandwidth-rich SMs, else one, as
 * Inductor runs these rows. */
static int narrow_rows(const fo_norm_fwd_params *p, const fo_norm_device *d) {
  if (p->cols != 256 && p->cols != 512) return 1;
  if (p->rstd) return p->cols == 256 || !p->rms ? 8 : 1;
  if (fo_tuning.norm_narrow_block) return fo_tuning.norm_narrow_block;
  return bandwidth_rich(d) ? 2 : 1;
}

/* fwd_group's bytes of shared memory a block, or 0 where it does not run:
 * rows that allow neither 16- nor 8-byte access, contiguous and 16-byte
 * aligned, a group of rows (16 bytes of x's elements) within 48 KB. */
static size_t group_fwd(const fo_norm_fwd_params *p, int vec) {
  const int mode = fo_tuning.norm_group;
  const int xs = fo_dtype_size(p->x_dtype), ss = fo_dtype_size(p->s_dtype), g = 16 / xs;
  const size_t smem = (size_t)g * p->cols * (xs + ss);
  const bool ok = mode && vec * xs < (mode == 2 ? 16 : 8) && p->rows > 0 &&
                  smem <= (size_t)fo_tuning.norm_group_kb * 1024 && ceil_div(p->rows, g) <= INT32_MAX &&
                  fwd_whole_rows(p);
  return ok ? smem : 0;
}

/* fwd_shift's shape (nv 0: it does not run): 16-bit x and s of one dtype
 * whose rows allow no 16-byte access, past fwd_group's rows (1536 values) or
 * at 8 bytes a chunk, up to 16K, contiguous and 16-byte aligned. */
static shape shift_fwd(const fo_norm_fwd_params *p, int vec) {
  const int mode = fo_tuning.norm_shift, xs = fo_dtype_size(p->x_dtype);
  const shape none = {8, 0, 0, 1, 1};
  if (!mode || xs != 2 || p->s_dtype != p->x_dtype || vec * xs >= 16 || p->rows <= 0 || p->rows > INT32_MAX ||
      (mode == 1 && vec * xs < 8 && p->cols <= 1536) || !fwd_whole_rows(p))
    return none;
  return shift_shape(p->cols, FO_NORM_SHIFT_CHUNKS);
}

/* LayerNorm's forward at 16 values a thread where choose() gave 8 to a team
 * of 256-512 (16-bit rows of 2K-4K), on bandwidth-rich SMs: each row costs
 * such a team two block barriers, and halving the team pays there. */
static bool ln_sixteen(const fo_norm_fwd_params *p, shape c, const fo_norm_device *d) {
  const int mode = fo_tuning.norm_ln16;
  if (mode == 0 || p->rms || target_values(0) != 0 || c.nv != 1 || c.vec != 8 || c.team < 256) return false;
  return fo_dtype_size(p->x_dtype) == 2 && (mode == 2 || bandwidth_rich(d));
}

/* The forward's one warp a row where choose() gave a team of two warps about
 * half of whose chunk slots are empty (at most 9 / 16 used), of 16-byte
 * chunks, or of 8-byte ones for LayerNorm (two reductions, two barriers). */
static bool fwd_warp(int64_t cols, shape c, int size, bool rms) {
  if (c.nv == 0 || c.team != 64) return false;
  const int64_t chunks = ceil_div(cols, c.vec);
  const int bytes = c.vec * size;
  return (bytes == 16 || (bytes == 8 && !rms)) && chunks * 16 <= (int64_t)9 * 64 * c.nv;
}

/* fwd_park's rows: 16-byte access, x and s of one 16-bit dtype, wider than
 * fwd_regs' 512-thread teams hold (16K values), within its block (32K). */
static bool park_fwd(const fo_norm_fwd_params *p, bool vec_ok) {
  return fo_tuning.norm_park && vec_ok && fo_dtype_size(p->x_dtype) == 2 && p->s_dtype == p->x_dtype &&
         p->cols > (int64_t)FO_NORM_MAX_THREADS(FO_NORM_FWD_MAX_VALUES) * FO_NORM_FWD_MAX_VALUES &&
         p->cols <= (int64_t)FO_NORM_PARK_THREADS * FO_NORM_PARK_CHUNKS * 8 && p->rows <= INT32_MAX;
}

/* fwd_park's plan where it beats the plan it replaces, else kernel NONE. Its
 * rows must fill the last wave of blocks to 90 %; in place of fwd_regs'
 * 1024-thread teams (over_regs) they must also be at most two waves, one for
 * RMSNorm on bandwidth-rich SMs (LayerNorm's two block reductions a row
 * keep two). */
static fo_norm_plan park_plan(const fo_norm_fwd_params *p, bool over_regs, const fo_norm_device *d) {
  const shape c = {8, FO_NORM_PARK_CHUNKS, round_up32(ceil_div(p->cols / 8, FO_NORM_PARK_CHUNKS)), 1, 1};
  fo_norm_plan pl = plan_of(FO_NORM_PARK, c);
  pl.smem = (size_t)FO_NORM_PARKED * 2 * pl.team * 16;
  if (fo_tuning.norm_park == 1) {
    const int64_t slots = (int64_t)d->sm_count * d->blocks_per_sm(d->ctx, &pl, pl.team, pl.smem);
    const int64_t waves = ceil_div(p->rows, slots);
    const int64_t most_waves = p->rms && bandwidth_rich(d) ? 1 : 2;
    if (p->rows * 10 < waves * slots * 9 || (over_regs && waves > most_waves)) pl.kernel = FO_NORM_NONE;
  }
  pl.grid = p->rows;
  return pl;
}

fo_norm_plan fo_norm_fwd_plan(const fo_norm_fwd_params *p, const fo_norm_device *d) {
  const int xs = fo_dtype_size(p->x_dtype), ss = fo_dtype_size(p->s_dtype);
  const int v16 = 16 / xs, vec = fwd_access_vec(p);
  const bool full = vec == v16; /* 16-byte access: fwd_narrow, fwd_park and the pipe too */
  if (p->rows > 0 && narrow_fwd(p, full)) {
    const shape c = {vec, 0, 32, narrow_rows(p, d), 1};
    fo_norm_plan pl = plan_of(FO_NORM_NARROW, c);
    pl.grid = ceil_div(p->rows, pl.rpb);
    /* At 512 wide a block a row asks for the smallest L1 (they use no shared
     * memory); at 1024 that cost them and the kernels after them. */
    pl.small_l1 = p->cols == 512 && pl.rpb == 1;
    return pl;
  }
  const size_t group_smem = group_fwd(p, vec);
  if (group_smem) {
    const shape c = {vec, 0, 32, v16, 1}; /* a group: v16 rows, a warp each */
    fo_norm_plan pl = plan_of(FO_NORM_GROUP, c);
    pl.smem = group_smem;
    pl.grid = ceil_div(p->rows, v16);
    return pl;
  }
  const shape sc = shift_fwd(p, vec);
  if (sc.nv) {
    fo_norm_plan pl = plan_of(FO_NORM_SHIFT, sc);
    pl.grid = p->rows;
    return pl;
  }
  /* 8 values a thread (one chunk of 16-bit x) where that team has at most
   * 512 threads, else 16; past those, the most values a thread that a team
   * holds (1024-thread teams of 32 bf16 values only where 512 cannot). */
  const int target = target_values(16 * v16 / 8);
  const int max_values = FO_NORM_FWD_MAX_VALUES * v16 / 8 < FO_NORM_FWD_MAX_CHUNKS * vec
                             ? FO_NORM_FWD_MAX_VALUES * v16 / 8
                             : FO_NORM_FWD_MAX_CHUNKS * vec;
  shape c = choose(p->cols, vec, target_values(8), max_values, CAP_PLAIN, 0);
  if (c.nv == 0 || c.team > FO_NORM_NARROW_TEAM || ln_sixteen(p, c, d))
    c = choose(p->cols, vec, target, max_values, CAP_PLAIN, 0);
  const bool bf16 = full && p->x_dtype == FO_BF16 && p->s_dtype == FO_BF16 && p->w_dtype == FO_BF16;
  if (c.nv == 0) c = choose(p->cols, vec, max_values, max_values, CAP_FWD, bf16);
  if (fwd_warp(p->cols, c, xs, p->rms) && to_one_warp(&c, max_values)) c.rpb = FO_NORM_BLOCK_TARGET / 32;
  /* The loop kernel also where a team would take one-element chunks past
   * 512 threads (odd rows of 4097-8192 values): it reads them faster. */
  if (c.nv && (ceil_div(p->rows, c.rpb) > INT32_MAX || (vec == 1 && c.team > FO_NORM_NARROW_TEAM)))
    c = loop_shape(p->cols, c.vec);
  /* fwd_pipe where no register team holds the row (on sm_90 split over a
   * cluster), rather than the loop kernel; where one does, fwd_regs leads. */
  const shape pc = c.nv == 0 ? pipe_shape(p->cols, vec, full, d->cc) : kNoShape;
  if (p->rows > 0 && park_fwd(p, full)) {
    const fo_norm_plan pl = park_plan(p, c.nv != 0, d);
    if (pl.kernel) return pl;
  }
  int stages = 0;
  const size_t smem =
      pc.nv ? pipe_smem((size_t)FO_NORM_PIPE_CHUNKS * v16 * pc.team * (xs + (p->residual ? ss : 0)), d, &stages) : 0;
  if (smem) {
    fo_norm_plan pl = plan_of(FO_NORM_PIPE, pc);
    pl.stages = stages;
    pl.smem = smem;
    pipe_grid(&pl, d, p->rows);
    pl.parts = 0;
    return pl;
  }
  if (c.nv == 0) {
    fo_norm_plan pl = plan_of(FO_NORM_LOOP, c);
    pl.grid = persistent_grid(d, &pl, p->rows, c.rpb, c.team * c.rpb, 0);
    return pl;
  }
  fo_norm_plan pl = plan_of(FO_NORM_REGS, c);
  if (!regs_compiled(c.nv, c.vec, FO_NORM_FWD_MAX_VALUES * v16 / 8, FO_NORM_FWD_MAX_CHUNKS)) pl.kernel = FO_NORM_NONE;
  pl.grid = ceil_div(p->rows, c.rpb);
  return pl;
}

/* ---- backward --------------------------------------------------------------------------- */

/* bf16 rows (x, s and weight) at 16 values a thread where choose() gave a
 * team of 8 values between 256 and 512 threads (2056-3840 wide): fewer,
 * larger teams a block. fp16 keeps 8 (its 16-value kernel's registers). */
static bool bwd_mid_bf16(const fo_norm_bwd_params *p, shape c) {
  return target_values(0) == 0 && p->x_dtype == FO_BF16 && p->s_dtype == FO_BF16 &&
         (!p->weight || p->w_dtype == FO_BF16) && c.vec == 8 && c.nv == 1 && c.team > 256 && c.team < 512;
}

/* bwd_pipe for rows of x and s of one 16-bit dtype from 2304 values, where
 * bwd_regs' teams would hold them: the pipe keeps the next row's loads in
 * flight and dweight / dbias in registers while a team reduces. */
static bool bwd_pipe_mid(const fo_norm_bwd_params *p, bool full) {
  return full && fo_dtype_size(p->x_dtype) == 2 && p->s_dtype == p->x_dtype &&
         p->cols >= fo_tuning.norm_bwd_pipe_from;
}

/* bwd_group's bytes of shared memory a block, or 0 where it does not run:
 * fwd_group's rows of a contiguous dy, s and ds, a group with its warps'
 * dweight / dbias sums within 48 KB. */
static size_t group_bwd(const fo_norm_bwd_params *p, int vec) {
  const int xs = fo_dtype_size(p->x_dtype), ss = fo_dtype_size(p->s_dtype), g = 16 / xs;
  const bool want = p->dweight || p->dbias;
  const size_t smem =
      (size_t)g * p->cols * (xs + ss + (p->ds ? ss : 0)) + (want ? (size_t)g * 2 * p->cols * 4 : 0);
  const bool ok = fo_tuning.norm_group_bwd && vec * xs < 8 && p->rows > 0 && smem <= 48 * 1024 && bwd_whole_rows(p);
  return ok ? smem : 0;
}

/* bwd_shift's shape (nv 0: it does not run): fwd_shift's rows where bwd_group
 * does not take them, up to 8K values (its column sums' shared memory).
 * LayerNorm's 4-byte rows below 2K keep bwd_regs, which leads there. */
static shape shift_bwd(const fo_norm_bwd_params *p, int vec, bool group) {
  const int mode = fo_tuning.norm_shift_bwd, xs = fo_dtype_size(p->x_dtype);
  const bool regs_lead = mode == 1 && !p->rms && vec * xs >= 4 && p->cols < 2048;
  const shape none = {8, 0, 0, 1, 1};
  if (!mode || (mode == 1 && group) || regs_lead || xs != 2 || p->s_dtype != p->x_dtype || vec * xs >= 16 ||
      p->rows <= 0 || p->cols > 8192 || !bwd_whole_rows(p))
    return none;
  return shift_shape(p->cols, 2);
}

/* bwd_regs' rows (teams) a block for chunks of one or two values, 1 to
 * c.rpb: the count whose blocks keep the most warps resident an SM, the most
 * rows where counts tie (fewer partial rows). */
static int resident_rows(const fo_norm_device *d, const fo_norm_plan *pl, size_t team_smem) {
  int best = pl->rpb, most = 0;
  for (int r = pl->rpb; r >= 1; --r) {
    const int warps = d->blocks_per_sm(d->ctx, pl, pl->team * r, team_smem * r) * pl->team * r / 32;
    if (warps > most) {
      best = r;
      most = warps;
    }
  }
  return best;
}

fo_norm_plan fo_norm_bwd_plan(const fo_norm_bwd_params *p, const fo_norm_device *d) {
  const int xs = fo_dtype_size(p->x_dtype), ss = fo_dtype_size(p->s_dtype);
  const int v16 = 16 / xs, vec = bwd_access_vec(p);
  const bool full = vec == v16; /* 16-byte access: the pipes too */
  const bool want = p->dweight || p->dbias;
  /* 16 chunks of one element (16-bit x) from sm_90 on; on sm_80 they spill. */
  const int max_chunks = d->cc >= 90 ? FO_NORM_BWD_MAX_CHUNKS : 8;
  const int max_values = FO_NORM_BWD_MAX_VALUES * v16 / 8 < max_chunks * vec ? FO_NORM_BWD_MAX_VALUES * v16 / 8
                                                                             : max_chunks * vec;
  shape c = choose(p->cols, vec, target_values(v16), max_values, CAP_BWD, vec);
  if (bwd_mid_bf16(p, c)) c = choose(p->cols, vec, 2 * v16, max_values, CAP_BWD, vec);
  /* One warp a row where a team of two warps has lanes to spare. */
  if (p->cols < (int64_t)64 * c.nv * c.vec) to_one_warp(&c, max_values);
  if (c.nv) { /* teams a block toward the block target, within the launch bound */
    const int threads = FO_NORM_BWD_MAX_THREADS(c.nv * c.vec, vec);
    const int per_block = FO_NORM_BWD_BLOCK_TARGET < threads ? FO_NORM_BWD_BLOCK_TARGET : threads;
    c.rpb = per_block / c.team < FO_NORM_MAX_TEAMS ? per_block / c.team : FO_NORM_MAX_TEAMS;
    if (c.rpb < 1) c.rpb = 1;
  }
  /* bwd_pipe where bwd_regs' team would be a whole SM, where no team's
   * registers hold the row, or for 16-bit rows of 2304 values and up. */
  const shape pc = c.nv == 0 || c.team > FO_NORM_PIPE_THREADS || bwd_pipe_mid(p, full)
                       ? pipe_shape(p->cols, vec, full, d->cc)
                       : kNoShape;
  size_t group_smem = group_bwd(p, vec);
  const shape sc = shift_bwd(p, vec, group_smem != 0);
  if (sc.nv) group_smem = 0;
  fo_norm_plan pl;
  if (sc.nv) {
    pl = plan_of(FO_NORM_SHIFT, sc);
    pl.smem = (size_t)((p->dweight ? 1 : 0) + (p->dbias ? 1 : 0)) * 8 * ceil_div(p->cols, 8) * sizeof(float);
    pl.grid = persistent_grid(d, &pl, p->rows, 1, sc.team, pl.smem);
  } else if (group_smem) {
    const shape gc = {c.vec, 0, 32, v16, 1}; /* a group: v16 rows, a warp each */
    pl = plan_of(FO_NORM_GROUP, gc);
    pl.smem = group_smem;
    pl.grid = persistent_grid(d, &pl, p->rows, v16, 32 * v16, group_smem);
  } else {
    int stages = 0;
    const size_t stage =
        (size_t)FO_NORM_PIPE_CHUNKS * v16 * pc.team * (ss + xs + (p->ds ? ss : 0));
    const size_t smem = pc.nv ? pipe_smem(stage, d, &stages) : 0;
    if (smem) {
      pl = plan_of(FO_NORM_PIPE, pc);
      pl.stages = stages;
      pl.smem = smem;
      pipe_grid(&pl, d, p->rows);
      pl.parts = want ? pl.parts : 0;
      return pl;
    }
    if (c.nv) {
      pl = plan_of(FO_NORM_REGS, c);
      if (!regs_compiled(c.nv, c.vec, FO_NORM_BWD_MAX_VALUES * v16 / 8, FO_NORM_BWD_MAX_CHUNKS)) {
        pl.kernel = FO_NORM_NONE;
        return pl;
      }
      const size_t team_smem =
          want ? (size_t)2 * FO_NORM_SUMS_PER_THREAD(c.nv * c.vec) * c.team * sizeof(float) : 0;
      if (c.vec < 4) pl.rpb = resident_rows(d, &pl, team_smem);
      pl.smem = pl.rpb * team_smem;
      pl.grid = persistent_grid(d, &pl, p->rows, pl.rpb, pl.team * pl.rpb, pl.smem);
    } else {
      pl = plan_of(FO_NORM_LOOP, c);
      pl.grid = persistent_grid(d, &pl, p->rows, 1, c.team, 0);
      if (want) { /* dwdb_cols: a tile of 32 chunks by a chunk of rows, about 4 blocks an SM */
        pl.col_blocks = ceil_div(p->cols, 32 * c.vec);
        pl.parts = max64(1, min64(p->rows, ceil_div(4 * (int64_t)d->sm_count, pl.col_blocks)));
        pl.parts = min64(pl.parts, 65535);
        pl.rows_per_part = ceil_div(p->rows, pl.parts);
      }
      return pl;
    }
  }
  pl.parts = want ? pl.grid : 0;
  return pl;
}
