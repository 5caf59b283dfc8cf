#!/usr/bin/env bash
# Every CUDA kernel of fusedops, forward and backward, at small odd shapes
# (tools/reliability/sanitize_kernels.py) under compute-sanitizer: memcheck (out-of-bounds
# and misaligned accesses), racecheck (shared-memory hazards) and initcheck
# (reads of memory never written). PyTorch's caching allocator is switched off
# so that every tensor is an allocation of its own: an access past a tensor's
# end is past an allocation's end (memcheck), and a fresh output holds
# uninitialised memory until a kernel writes it (initcheck).
#   tools/reliability/sanitize.sh [tool ...]          (default: memcheck racecheck initcheck; synccheck too)
# Needs an installed CUDA build (tools/ci/gpu.sh build). Logs: $OUT/sanitize-<tool>.log
# (or ./sanitize-out). Last line: one summary; exit status 1 if any tool
# reported an error or the program failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/sanitize-out}; mkdir -p "$OUT"
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
[[ -x $CS ]] || { echo "sanitize: compute-sanitizer not found (set COMPUTE_SANITIZER)"; exit 1; }
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONUNBUFFERED=1
tools=("$@"); [[ ${#tools[@]} -gt 0 ]] || tools=(memcheck racecheck initcheck)
status=0 summary=""
for tool in "${tools[@]}"; do
  extra=()
  # memcheck: guard bytes after every allocation, so that an overrun cannot land
  # in the neighbouring tensor unseen.
  [[ $tool == memcheck ]] && extra=(--padding 256)
  t0=$(date +%s)
  # CUDA API errors are PyTorch's to handle (it probes the driver and expects
  # some calls to fail); ours are checked by the ops themselves, which raise.
  "$CS" --tool "$tool" ${extra[@]+"${extra[@]}"} --report-api-errors no --error-exitcode 86 --print-limit 100 \
    python3 tools/reliability/sanitize_kernels.py >"$OUT/sanitize-$tool.log" 2>&1
  rc=$?
  # memcheck / initcheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)"
  line=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$OUT/sanitize-$tool.log" | tail -1 | sed 's/^=* *//')
  done_line=$(grep -c "sanitize_kernels: done" "$OUT/sanitize-$tool.log")
  if [[ $rc != 0 || $done_line == 0 ]]; then
    status=1
    grep -E "^=+ +(Invalid|Uninitialized|Race|Error|ERROR|Warning|Leaked)|Traceback|Error:" "$OUT/sanitize-$tool.log" | head -20
  fi
  summary+="$tool: ${line:-no summary} (rc $rc, $(( $(date +%s) - t0 )) s); "
done
calls=$(grep -h "sanitize_kernels: done" "$OUT"/sanitize-*.log | head -1 | sed 's/sanitize_kernels: done, //')
echo "sanitize: ${summary}kernels driven: ${calls:-none (the driver failed)}; $([[ $status == 0 ]] && echo CLEAN || echo NOT CLEAN)"
exit $status
