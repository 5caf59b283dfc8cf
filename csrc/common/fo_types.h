/* Types shared by every op's C interface: the dtype tag kernels dispatch on.
 * Plain C so that C kernels, CUDA C kernels and the C++ shim all include it. */
#pragma once
#include <stdint.h>

typedef enum fo_dtype {
  FO_F32 = 0,
  FO_F16 = 1,
  FO_BF16 = 2,
} fo_dtype;

static inline int fo_dtype_size(fo_dtype t) { return t == FO_F32 ? 4 : 2; }

/* A helper of an op's header that the CPU and the CUDA kernels both call. */
#if defined(__CUDACC__)
#define FO_HD static __host__ __device__ __forceinline__
#else
#define FO_HD static inline
#endif

/* What a C CPU kernel returns when its own scratch (malloc'd, outside torch's
 * allocator) could not be had; NULL means it ran. The shim raises it. */
#define FO_CPU_OOM "out of memory for the CPU kernel's scratch"
