#!/usr/bin/env bash
# Tuning sweep of the cluster plan of the norm kernels (FUSEDOPS_NORM_CLUSTER =
# "min_chunks,chunks,max_blocks", norm_cuda.cu) at the wide benchmark shapes,
# on a GPU, after the extension is built. Prints one line per setting and shape.
cd "$(dirname "$0")/.."
shapes=${SHAPES:-2048x8192,8192x8192,1024x16384,512x32768,256x65536}
for setting in ${SETTINGS:-99999999,512,8 2048,512,8 1024,512,8 2048,256,8 2048,1024,8 2048,512,16}; do
  FUSEDOPS_NORM_CLUSTER=$setting python3 tools/norm_tune.py --shapes "$shapes" | grep -v "^$"
done
for setting in 99999999,512,8 2048,512,8; do
  FUSEDOPS_NORM_CLUSTER=$setting python3 tools/norm_tune.py --rms --shapes "$shapes"
done
