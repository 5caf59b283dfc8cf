/* The norm's launch plans (norm_plan.c): which CUDA kernel runs a call and
 * how, from the call's shape, dtypes and layout (norm.h's params: pointers
 * are read as numbers, for alignment, never dereferenced) and the device's
 * facts. Host-only plain C with no CUDA: the CUDA launchers (norm_cuda.cu)
 * plan, allocate from the plan and launch; tests/test_norm_plan.py checks the
 * plans as a table on the CPU (fusedops._C._norm_plan). */
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Sizes the kernels are compiled for and the plans keep to; macros, so that
 * C (the planner) and CUDA launch bounds read the same constant expressions. */
#define FO_NORM_FWD_MAX_VALUES 32 /* a forward thread's values of 16-bit x (half for fp32) */
#define FO_NORM_BWD_MAX_VALUES 16 /* a backward thread's */
#define FO_NORM_FWD_MAX_CHUNKS 8  /* a register thread's chunks, forward */
#define FO_NORM_BWD_MAX_CHUNKS 16 /* and backward (16 from sm_90 on; 8 below) */
/* The register kernels' thread cap at `values` a thread: within the
 * registers a block of that size may use without spilling (1024 threads: 64
 * registers, 512: 128; tools/ci/compile_cuda.sh fails on a spill). */
#define FO_NORM_MAX_THREADS(values) ((values) <= 8 ? 1024 : 512)
/* fwd_regs': 1024 also for 32 values of bf16 x, s and weight (64 registers,
 * s held as stored), the rows no 512-thread team holds; fp16 and fp32 spill. */
#define FO_NORM_FWD_MAX_THREADS(values, bf16) \
  ((values) == FO_NORM_FWD_MAX_VALUES && (bf16) ? 1024 : FO_NORM_MAX_THREADS(values))
/* bwd_regs': chunks of 1 or 2 values take more addresses and registers a
 * value, so 512 past 4 values a thread. */
#define FO_NORM_BWD_MAX_THREADS(values, vec) \
  ((vec) >= 4 ? FO_NORM_MAX_THREADS(values) : (values) <= 4 ? 1024 : 512)
/* bwd_regs' dweight (and dbias) sums a thread: whole float4s. */
#define FO_NORM_SUMS_PER_THREAD(values) (((values) + 3) / 4 * 4)
#define FO_NORM_MAX_TEAMS 15       /* teams a block: named barriers 1..15 */
#define FO_NORM_BLOCK_TARGET 256   /* forward threads a block where teams are one warp */
#define FO_NORM_BWD_BLOCK_TARGET 1024 /* backward's: each block writes one partial row */
#define FO_NORM_NARROW_TEAM 512    /* forward teams of 8 values: at most this many threads */
#define FO_NORM_LOOP_THREADS 512   /* the loop kernels' most threads a block */
#define FO_NORM_SHIFT_THREADS 512  /* fwd_shift / bwd_shift: a block a row */
#define FO_NORM_SHIFT_CHUNKS 4     /* fwd_shift's most 16-byte chunks a thread */
#define FO_NORM_PARK_THREADS 512   /* fwd_park: a block a row */
#define FO_NORM_PARK_CHUNKS 8      /* its chunks a thread, */
#define FO_NORM_PARKED 4           /* of them parked in shared memory */
#define FO_NORM_PIPE_THREADS 512   /* the pipe kernels' teams */
#define FO_NORM_PIPE_CHUNKS 2      /* their chunks a thread */
#define FO_NORM_MAX_STAGES 4       /* cp_async_wait_for takes at most 3 pending groups */
#define FO_NORM_COL_ROWS 8         /* dwdb_cols' blockDim.y */

struct fo_norm_fwd_params;
struct fo_norm_bwd_params;

typedef enum fo_norm_kernel {
  FO_NORM_NONE = 0,   /* the plan names a kernel that is not compiled: a bug */
  FO_NORM_NARROW = 1, /* fwd_narrow (forward only) */
  FO_NORM_GROUP = 2,  /* fwd_group / bwd_group */
  FO_NORM_SHIFT = 3,  /* fwd_shift / bwd_shift */
  FO_NORM_PARK = 4,   /* fwd_park (forward only) */
  FO_NORM_PIPE = 5,   /* fwd_pipe / bwd_pipe */
  FO_NORM_REGS = 6,   /* fwd_regs / bwd_regs */
  FO_NORM_LOOP = 7,   /* fwd_loop / bwd_loop (+ dwdb_cols) */
} fo_norm_kernel;

/* A call's launch: kernel and compile-time shape, grid, block, shared memory
 * and the backward's dweight / dbias partial rows. */
typedef struct fo_norm_plan {
  int kernel;      /* fo_norm_kernel */
  int vec;         /* elements of x an access: 16, 8 or 4 bytes' worth, or 1 */
  int nv;          /* chunks a thread (REGS, SHIFT, PIPE) */
  int team;        /* threads a row */
  int rpb;         /* rows (teams) a block: block (team, rpb) for REGS, team * rpb threads otherwise */
  int cl;          /* blocks a cluster (PIPE over a cluster), else 1 */
  int stages;      /* PIPE: rows staged, plus one */
  int small_l1;    /* NARROW: ask for the largest shared-memory carveout */
  int64_t grid;    /* blocks */
  size_t smem;     /* dynamic shared memory a block, bytes */
  int64_t parts;   /* backward: dweight / dbias partial rows (0: none wanted) */
  int64_t col_blocks, rows_per_part; /* LOOP backward: dwdb_cols' grid (col_blocks, parts) */
} fo_norm_plan;

/* What a plan needs of the device: queried once per device (and occupancy
 * once per kernel and block shape) by the CUDA launcher, or made up by a
 * test. The occupancy answers come through callbacks, since which kernel is
 * asked about depends on the plan being made. */
typedef struct fo_norm_device {
  int sm_count;
  int smem_optin;  /* bytes of shared memory a block may opt in to */
  int gbps_per_sm; /* memory bandwidth per SM, GB/s */
  int cc;          /* compute capability, 10 * major + minor */
  /* Resident blocks an SM (at least 1) of `plan`'s kernel at `threads` a
   * block and `smem` bytes of dynamic shared memory. */
  int (*blocks_per_sm)(void *ctx, const fo_norm_plan *plan, int threads, size_t smem);
  /* Clusters of plan->cl blocks resident at once (at least 1). */
  int (*clusters)(void *ctx, const fo_norm_plan *plan, int threads, size_t smem);
  void *ctx;
} fo_norm_device;

/* The forward's and the backward's plan; kernel FO_NORM_NONE where the rules
 * name a kernel that is not compiled. */
fo_norm_plan fo_norm_fwd_plan(const struct fo_norm_fwd_params *p, const fo_norm_device *d);
fo_norm_plan fo_norm_bwd_plan(const struct fo_norm_bwd_params *p, const fo_norm_device *d);

#ifdef __cplusplus
}
#endif
