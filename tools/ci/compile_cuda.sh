#!/usr/bin/env bash
# Compile every CUDA source and the CUDA half of every registration shim,
# without linking: the check CI runs on machines with nvcc but no GPU (and a
# CPU-only torch, which cannot link a CUDA extension). Any compile error or
# ptxas spill fails it, and so does a 16-byte global store that the compiler
# split into 32-bit ones (tools/ci/ptx_stores.py, on the PTX that -keep leaves).
# Usage: tools/ci/compile_cuda.sh [archs, default "80 90"]
# (90 is compiled as sm_90a, as setup.py does: the wgmma kernels need it).
set -euo pipefail
cd "$(dirname "$0")/../.."
archs=${1:-"80 90"}
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || { echo "compile_cuda: nvcc not found" >&2; exit 1; }
TORCH_INC=$(python -c "import torch.utils.cpp_extension as c; print(' '.join(c.include_paths()))")
defs="-DTORCH_TARGET_VERSION=0x020B000000000000 -DFUSEDOPS_WITH_CUDA -DUSE_CUDA"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0
python tools/ci/gen_wgmma.py --check || status=1
for cu in csrc/*/*_cuda.cu; do
  for a in $archs; do
    [ "$a" = 90 ] && a=90a
    log="$out/$(basename "$cu").$a.log" keep="$out/keep-$(basename "$cu").$a"
    mkdir -p "$keep"
    if ! "$NVCC" -std=c++17 -O3 --expt-relaxed-constexpr -gencode "arch=compute_$a,code=sm_$a" \
         -Xptxas -v -keep -keep-dir "$keep" $defs -c "$cu" -o "$out/$(basename "$cu").$a.o" >"$log" 2>&1; then
      cat "$log" >&2; echo "compile_cuda: FAILED $cu (sm_$a)" >&2; status=1; continue
    fi
    spills=$(grep -E "bytes spill stores" "$log" | grep -vc " 0 bytes spill stores" || true)
    if [ "$spills" != 0 ]; then
      grep -B1 -E "[1-9][0-9]* bytes spill stores" "$log" >&2
      echo "compile_cuda: $cu (sm_$a) spills registers in $spills kernels" >&2; status=1
    fi
    echo "compile_cuda: ok $cu sm_$a ($(grep -c 'Compiling entry' "$log") kernels)"
  done
done
# Every 16-byte global store one instruction (tools/ci/ptx_stores.py).
python tools/ci/ptx_stores.py $(find "$out" -name '*.ptx' | sort) || status=1
for shim in csrc/*/*_ops.cpp; do
  ${CXX:-g++} -std=c++17 -fsyntax-only -Wall -Werror $defs $(printf -- '-I%s ' $TORCH_INC) -I"$(dirname "$(command -v "$NVCC")")/../include" "$shim" \
    && echo "compile_cuda: ok $shim (CUDA registration)" || { echo "compile_cuda: FAILED $shim" >&2; status=1; }
done
exit $status
