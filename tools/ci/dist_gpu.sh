#!/usr/bin/env bash
# One call on a 2-GPU machine: build the CUDA extension (tools/ci/gpu.sh build),
# then examples/train.py (the small Llama, amp-bf16, global batch 8 x 1024
# tokens) four ways, plain PyTorch and patched with fusedops + FusedAdamW each:
#   1 GPU                    python examples/train.py
#   2 GPUs, DDP              torchrun --nproc_per_node 2 examples/train.py --dist ddp
#   2 GPUs, FSDP2            ... --dist fsdp --save-at STEPS/2 (a DCP checkpoint)
#   2 GPUs, FSDP2 resumed    ... --dist fsdp --resume <that checkpoint> (fusedops run)
#   1 GPU, torch AdamW       python examples/train.py --runs pytorch --resume <fusedops' checkpoint>
#                            (FusedAdamW's FSDP2 state, 2 shards, into torch.optim.AdamW on one GPU)
#   2 GPUs, FSDP2 back       ... --dist fsdp --runs fusedops --resume <pytorch's checkpoint>
#                            (torch AdamW's FSDP2 state into FusedAdamW)
#   2 GPUs, FSDP2, batch 16  ... --dist fsdp --batch 16 (weak scaling, WEAK_STEPS steps)
# and prints a table last: tokens/s, peak memory, the loss curves' largest
# difference from the 1-GPU run of the same kind at the end (the mean of the
# last tenth of the steps; PASS within BF16_ATOL), over the first EARLY_STEPS
# steps (PASS within EARLY_ATOL) and step by step (reported only), the
# resumed curves' from the uninterrupted one they continue, fusedops /
# pytorch tokens/s.
# The tolerances are about 10x what rounding alone moved a curve on one H100:
# examples/train.py --micro-batches 2 and 4 (DDP's arithmetic over 2 and 4
# processes) against 1, 400 steps, plain and fusedops: end loss within
# 0.0003-0.0011, the first 15 steps within 4.1e-4; in between, the spike
# after the warm-up (steps 26-37) parted the curves by up to 2.9.
#   tools/ci/dist_gpu.sh            # STEPS=400 WEAK_STEPS=60 BF16_ATOL=0.01 EARLY_STEPS=15 EARLY_ATOL=0.005
#   DRY=1 tools/ci/dist_gpu.sh      # a check of this script: CPU, gloo, the tiny preset, no build
# Logs, summaries and plots go to $OUT/dist.tar.gz ($OUT: the device tool's
# folder, or ./gpu-out);
# checkpoints to $DIST_WORK (default /tmp/fusedops-dist), not $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
OUT=${OUT:-$PWD/gpu-out}; export OUT
STEPS=${STEPS:-400} WEAK_STEPS=${WEAK_STEPS:-60} BF16_ATOL=${BF16_ATOL:-0.01}
EARLY_STEPS=${EARLY_STEPS:-15} EARLY_ATOL=${EARLY_ATOL:-0.005}
WORK=${DIST_WORK:-/tmp/fusedops-dist}; rm -rf "$WORK"; mkdir -p "$WORK" "$OUT/dist"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
where=()
if [[ ${DRY:-0} == 1 ]]; then
  where=(--device cpu --preset tiny); STEPS=16 WEAK_STEPS=8
else
  tools/ci/gpu.sh build || exit 1
  python3 -c "import transformers" 2>/dev/null \
    || python3 -m pip install -q --no-index --find-links .whl/hf-py312 transformers >"$OUT/hf-install.log" 2>&1 \
    || { tail -20 "$OUT/hf-install.log"; echo "NO TRANSFORMERS"; exit 1; }
  ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
  [[ $ngpu -ge 2 ]] || { echo "needs 2 GPUs, found $ngpu"; exit 1; }
fi
half=$((STEPS / 2))
rc=0
step() {  # name, then the command; its output to $OUT/dist/<name>.log, the last lines shown
  local name=$1; shift
  local t0=$(date +%s)
  "$@" ${where[@]+"${where[@]}"} --steps "${RUN_STEPS:-$STEPS}" --out "$WORK/$name" >"$OUT/dist/$name.log" 2>&1 || { rc=1; echo "$name FAILED"; }
  echo "== $name ($(( $(date +%s) - t0 )) s)"; tail -3 "$OUT/dist/$name.log"
  mkdir -p "$OUT/dist/$name"; cp "$WORK/$name"/summary.json "$WORK/$name"/loss.png "$OUT/dist/$name/" 2>/dev/null
}
run2="python3 -m torch.distributed.run --standalone --nproc_per_node 2 examples/train.py"
step single python3 examples/train.py --runs pytorch,fusedops
step ddp $run2 --dist ddp --runs pytorch,fusedops
step fsdp $run2 --dist fsdp --runs pytorch,fusedops --save-at "$half" --ckpt-format dcp
step resume $run2 --dist fsdp --runs fusedops --resume "$WORK/fsdp/fusedops-step$half"
step adamw python3 examples/train.py --runs pytorch --resume "$WORK/fsdp/fusedops-step$half"
step back $run2 --dist fsdp --runs fusedops --resume "$WORK/fsdp/pytorch-step$half"
RUN_STEPS=$WEAK_STEPS step weak $run2 --dist fsdp --runs pytorch,fusedops --batch 16

python3 - "$OUT/dist" "$BF16_ATOL" "$EARLY_STEPS" "$EARLY_ATOL" <<'EOF' || rc=1
import json, sys
from pathlib import Path
out, atol, early, early_atol = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
def load(name):
    p = out / name / "summary.json"
    return {r["run"]: r for r in json.loads(p.read_text())["runs"]} if p.exists() else {}
single, ok = load("single"), True
print(f"\n{'setup':8s} {'GPUs':>4s} {'batch':>9s} {'run':9s} {'k tok/s':>8s} {'x 1 GPU':>8s} "
      f"{'peak GiB':>8s} {'end loss':>8s} {'dend vs 1 GPU':>14s} {'first steps':>11s} {'max|dloss|':>10s}")
def tail(losses):  # the mean loss over the last tenth of the steps
    n = max(1, len(losses) // 10)
    return sum(losses[-n:]) / n
def judge(losses, base, what):
    """The end-loss difference and the first `early` steps' largest one,
    each against its tolerance (printed when it fails); sets ok."""
    global ok
    end = abs(tail(losses) - tail(base))
    first = max(abs(a - b) for a, b in zip(losses[:early], base[:early]))
    if first > early_atol:
        print(f"{what}: the first {early} steps differ by up to {first:.2e} (over {early_atol}): FAIL")
    ok &= end <= atol and first <= early_atol
    return end, first
def config(name):
    p = out / name / "summary.json"
    c = json.loads(p.read_text())["config"] if p.exists() else {}
    return f"{c.get('batch')}x{c.get('seq')}"
for name, label, gpus in (("single", "1 GPU", 1), ("ddp", "DDP", 2), ("fsdp", "FSDP2", 2), ("weak", "FSDP2", 2)):
    batch = config(name)
    for run, r in load(name).items():
        base = single.get(run)
        scale = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base and name != "single" else ""
        d = f1 = m = ""
        if base and name in ("ddp", "fsdp"):
            end, first = judge(r["losses"], base["losses"], f"{label} {run}")
            d = f"{end:.4f} {'PASS' if end <= atol else 'FAIL'}"
            f1 = f"{first:.1e}"
            m = f"{max(abs(a - b) for a, b in zip(r['losses'], base['losses'])):.2f}"
        mem = f"{r['peak_memory_GiB']:.2f}" if r["peak_memory_GiB"] is not None else "-"
        print(f"{label:8s} {gpus:4d} {batch:>9s} {run:9s} {r['tokens_per_s'] / 1e3:8.1f} {scale:>8s} "
              f"{mem:>8s} {tail(r['losses']):8.3f} {d:>14s} {f1:>11s} {m:>10s}")
for name, label in (("single", "1 GPU"), ("ddp", "DDP"), ("fsdp", "FSDP2"), ("weak", "FSDP2 batch 16")):
    rs = load(name)
    if {"pytorch", "fusedops"} <= set(rs):
        print(f"fusedops / pytorch tokens/s, {label}: {rs['fusedops']['tokens_per_s'] / rs['pytorch']['tokens_per_s']:.3f}")
# Each resumed run against the uninterrupted FSDP2 run whose checkpoint it
# took. Not bitwise even where nothing changed: the attention backward sums dQ
# by atomics (deterministic=False), so a resumed curve is judged as DDP's and
# FSDP2's are.
for name, run, source, what in (("resume", "fusedops", "fusedops", "FSDP2 fusedops resumed from DCP"),
                                ("adamw", "pytorch", "fusedops", "1 GPU torch AdamW from FSDP2 FusedAdamW's DCP"),
                                ("back", "fusedops", "pytorch", "FSDP2 FusedAdamW from torch AdamW's DCP")):
    full, resumed = load("fsdp").get(source), load(name).get(run)
    if not (full and resumed):
        print(f"{what}: missing summaries"); ok = False
        continue
    k = resumed["first_step"]
    end, first = judge(resumed["losses"], full["losses"][k:], what)
    diff = max(abs(a - b) for a, b in zip(resumed["losses"], full["losses"][k:]))
    print(f"{what}, after step {k}, against the uninterrupted {source} run: end loss {end:.4f}, "
          f"first {early} steps {first:.2e}, max|dloss| {diff:.2e} ({'PASS' if end <= atol and first <= early_atol else 'FAIL'}; "
          f"bitwise: {resumed['losses'] == full['losses'][k:]})")
rs = load("single")
if {"pytorch", "fusedops"} <= set(rs):
    print(f"1 GPU, fusedops against pytorch: end loss {abs(tail(rs['fusedops']['losses']) - tail(rs['pytorch']['losses'])):.3f}, "
          f"max|dloss| {max(abs(a - b) for a, b in zip(rs['fusedops']['losses'], rs['pytorch']['losses'])):.2f}")
print(f"loss tolerance (bf16): end loss (mean of the last tenth of the steps) within {atol} of the 1-GPU run's, "
      f"the first {early} steps within {early_atol}; {'all PASS' if ok else 'FAILURES above'}. max|dloss|, step by "
      "step, is reported, not judged: the spike after the warm-up is chaotic (on one H100, --micro-batches 2 and 4 "
      "against 1 parted the curves by up to 2.9 there, from rounding alone)")
sys.exit(0 if ok else 1)
EOF
# Everything in one file: the device tool brings back at most 8.
tar czf "$OUT/dist.tar.gz" -C "$OUT" dist && rm -rf "$OUT/dist"
echo "dist_gpu.sh: $(( $(date +%s) - start )) s in all; logs, summaries and plots in $OUT/dist.tar.gz"
exit $rc
