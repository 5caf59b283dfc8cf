/* Tuning knobs of the GPU launch plans: one struct, one table of ranges and
 * defaults (FO_TUNE_KNOBS), one private setter. The plans read fo_tuning on
 * every call, so tests and the probes in tools/probes/ change a knob
 * in-process (fusedops._C._tune(name, value)) and restore it after; nothing
 * here is read from the environment, and users never need it. Plain C: the
 * C planners, the CUDA launchers and module.c all include it. */
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

/* X(name, lowest, highest, default) */
#define FO_TUNE_KNOBS(X)                                                                    \
  /* norm (norm_plan.c) */                                                                \
  X(norm_values, 0, 32, 0)          /* values a thread the register kernels aim for; 0: the plan's */ \
  X(norm_stages, 0, 4, 2)           /* pipe kernels' rows staged, plus one; 0, 1: no pipe kernels */ \
  X(norm_narrow, 0, 1, 1)           /* fwd_narrow on / off */                              \
  X(norm_park, 0, 2, 1)             /* fwd_park: 1 by its rule, 0 never, 2 every row it holds */ \
  X(norm_narrow_block, 0, 2, 0)     /* fwd_narrow's rows a block without statistics; 0: by the GPU */ \
  X(norm_ln16, 0, 2, 1)             /* LayerNorm 16 values a thread at 2K-4K: 1 by the GPU, 0, 2 */ \
  X(norm_bwd_pipe_from, 1, 1 << 30, 2304) /* 16-bit rows this wide and up: bwd_pipe */     \
  X(norm_group, 0, 2, 1)            /* fwd_group: 1 below 8-byte access, 0 never, 2 at 8 too */ \
  X(norm_group_kb, 1, 227, 48)      /* fwd_group's most shared memory a block, KB */       \
  X(norm_group_bwd, 0, 1, 1)        /* bwd_group on / off */                               \
  X(norm_shift, 0, 2, 1)            /* fwd_shift: 1 by its rule, 0 never, 2 any width */   \
  X(norm_shift_bwd, 0, 2, 1)        /* bwd_shift: 1 by its rule, 0 never, 2 any width */   \
  /* swiglu (swiglu_cuda.cu): 16-byte vectors a thread, forward and backward */           \
  X(glu_fwd_vectors, 1, 4, 1)                                                              \
  X(glu_bwd_vectors, 1, 4, 2)                                                              \
  /* adam (adam_cuda.cu, plan_for): 0 by the GPU; 1 registers, persistent grid; */         \
  /* 2 registers, one block a tile; 3 the shared-memory ring */                            \
  X(adam_plan, 0, 3, 0)

#define FO_TUNE_FIELD(name, lo, hi, dflt) int name;
typedef struct fo_tune {
  FO_TUNE_KNOBS(FO_TUNE_FIELD)
} fo_tune;
#undef FO_TUNE_FIELD

extern fo_tune fo_tuning;

/* Sets knob `name` to `value`, or to its default where `reset` is nonzero;
 * *old gets the value it had. Returns 0, -1 for an unknown name, -2 for a
 * value outside the knob's range. */
int fo_tune_set(const char *name, int value, int reset, int *old);
/* The i-th knob's name, value, range and default; NULL past the last. */
const char *fo_tune_knob(int i, int *value, int *lo, int *hi, int *dflt);

#ifdef __cplusplus
}
#endif
