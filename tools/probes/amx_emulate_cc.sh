#!/bin/sh
# The C compiler for a build of fusedops whose CPU kernels run their AMX code on
# software tiles (amx_emulate.h, forced into each *_cpu.c), so that the level-6
# attention path runs, and its tests check it, on any CPU with AVX512-BF16:
#   CC=tools/probes/amx_emulate_cc.sh FUSEDOPS_CUDA=0 python setup.py -q build_ext --inplace
# (slow tiles: a test build only; rebuild without CC afterwards).
for arg in "$@"; do
  case "$arg" in *_cpu.c) exec gcc -include "$(dirname "$0")/amx_emulate.h" "$@" ;; esac
done
exec gcc "$@"
