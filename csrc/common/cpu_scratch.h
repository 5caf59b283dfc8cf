/* Scratch that a C CPU kernel allocates itself (outside torch's allocator),
 * one block per OpenMP thread: when a thread cannot get its block, every
 * thread skips the work and the kernel returns FO_CPU_OOM (fo_types.h). */
#pragma once
#include <omp.h>

/* Inside a parallel region, after each thread has tried to allocate its
 * block: whether every thread has one (a barrier: all threads return the
 * same, so all take the same worksharing loops). */
static inline int fo_every_thread_has(const void *block, int *missing) {
  if (!block) {
#pragma omp atomic write
    *missing = 1;
  }
#pragma omp barrier
  return !*missing;
}
