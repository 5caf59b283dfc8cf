#!/usr/bin/env bash
# One call on the GPU machine: build the CUDA extension, run the CUDA tests and
# the fuzz sweep, run the benchmark suite, print a short table last.
#   tools/ci/gpu.sh [build|test|bench|all] [extra args for the benchmark runner]
#   tools/ci/gpu.sh e2e [extra args for benchmarks/bench_e2e.py]   (not part of all)
#   tools/ci/gpu.sh reliability   (not part of all: tests/test_reliability.py on
#       CUDA, tools/reliability/huge.py, tools/reliability/sanitize.sh per tool, tools/reliability/fuzz.py; one
#       summary line each, printed as each ends and again last)
# Environment: PYTEST_ARGS (extra pytest args, e.g. "-k cuda"), FUZZ_CASES
# (per op, default 300; 0 skips), FUZZ_OPS (default every op, e.g. "rope,xent"), SANITIZE_TOOLS (default "memcheck initcheck
# racecheck"; "none" skips), RELIABILITY_TIMEOUT (seconds each reliability
# step may take, default 170), RELIABILITY_DEADLINE (seconds from the start,
# build included, after which no step starts or runs on; default 540). Logs and results go to $OUT (the device tool's
# folder) or ./gpu-out. e2e needs transformers: installed, or wheels for this
# Python carried in .whl/hf-py312 (the GPU machine has no network).
set -uo pipefail
start=$(date +%s)
cd "$(dirname "$0")/../.."
what=${1:-all}; shift || true
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export FUSEDOPS_CUDA=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
t0=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
  || { tail -50 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
python3 -c "import fusedops; print(fusedops.build_info())" || exit 1
rc=0 summary=""
if [[ $what == test || $what == all ]]; then
  t0=$(date +%s)
  python3 -m pytest -q -p no:cacheprovider tests ${PYTEST_ARGS:-} >"$OUT/tests.log" 2>&1
  trc=$?; rc=$(( rc || trc ))
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30
  summary+="tests: $(tail -1 "$OUT/tests.log") ($(( $(date +%s) - t0 )) s)"$'\n'
  if [[ ${FUZZ_CASES:-300} != 0 ]]; then
    python3 tools/reliability/fuzz.py --device cuda --cases "${FUZZ_CASES:-300}" ${FUZZ_OPS:+--ops "$FUZZ_OPS"} >"$OUT/fuzz.log" 2>&1
    frc=$?; rc=$(( rc || frc ))
    grep FAIL "$OUT/fuzz.log" | head -10
    summary+="$(tail -1 "$OUT/fuzz.log")"$'\n'
  fi
fi
if [[ $what == reliability ]]; then
  # Each step under its own time limit (a hang in one leaves the others their
  # time); each log's last line is its summary.
  limit=${RELIABILITY_TIMEOUT:-170} deadline=${RELIABILITY_DEADLINE:-540}
  step() {  # step NAME LOG COMMAND...
    local name=$1 log=$2; shift 2
    local t0=$(date +%s) line
    local left=$(( deadline - (t0 - start) )) lim=$limit
    (( left < lim )) && lim=$left
    if (( lim < 20 )); then
      line="$name: SKIPPED (the ${deadline} s deadline is near)"
    else
      timeout "$lim" "$@" >"$log" 2>&1
      local src=$?; rc=$(( rc || src ))
      grep -E "^(FAILED|ERROR)|FAIL|NOT CLEAN|Traceback" "$log" | head -8
      local last=$(tail -1 "$log")
      [[ $src == 124 ]] && last="TIMED OUT after $lim s: $last"
      line="$name ($(( $(date +%s) - t0 )) s, rc $src): $last"
    fi
    echo "$line"
    summary+="$line"$'\n'
  }
  step "test_reliability (CUDA)" "$OUT/reliability-tests.log" \
    python3 -m pytest -q -p no:cacheprovider tests/test_reliability.py -k "cuda and not fuzz" ${PYTEST_ARGS:-}
  step "huge" "$OUT/huge.log" python3 tools/reliability/huge.py
  if [[ ${SANITIZE_TOOLS:-} != none ]]; then
    mkdir -p "$OUT/sanitize"
    for tool in ${SANITIZE_TOOLS:-memcheck initcheck racecheck}; do
      step "sanitize $tool" "$OUT/sanitize/run-$tool.log" env OUT="$OUT/sanitize" tools/reliability/sanitize.sh "$tool"
      rm -f "$OUT/sanitize/run-$tool.log"  # its summary is above; the tool's own log stays
    done
  fi
  [[ ${FUZZ_CASES:-300} != 0 ]] && step "fuzz" "$OUT/fuzz.log" python3 tools/reliability/fuzz.py --device cuda --cases "${FUZZ_CASES:-300}"
  echo "--- reliability summary"
fi
if [[ $what == bench || $what == all ]]; then
  python3 -m benchmarks.run --out "$OUT" "$@" 2>"$OUT/bench-progress.log" >"$OUT/bench.txt"
  tail -5 "$OUT/bench-progress.log"
fi
if [[ $what == e2e ]]; then
  python3 -c "import transformers" 2>/dev/null \
    || python3 -m pip install -q --no-index --find-links .whl/hf-py312 transformers >"$OUT/hf-install.log" 2>&1 \
    || { tail -20 "$OUT/hf-install.log"; echo "NO TRANSFORMERS"; exit 1; }
  # The training example: the plain and patched loss curves in bf16 (the convergence comparison).
  python3 examples/train.py --out "$OUT/train" >"$OUT/train.log" 2>&1 || rc=1
  tail -4 "$OUT/train.log"
  python3 -m benchmarks.bench_e2e --out "$OUT" "$@" 2>"$OUT/e2e-progress.log" >"$OUT/e2e.txt" || rc=1
  tail -5 "$OUT/e2e-progress.log"
fi
echo "$summary"
[[ -f $OUT/bench.txt ]] && cat "$OUT/bench.txt"
[[ -f $OUT/e2e.txt ]] && cat "$OUT/e2e.txt"
exit $rc
