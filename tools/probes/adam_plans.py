"""The AdamW launch plans (csrc/adam/adam_cuda.cu, plan_for; forced by the
tuning knob adam_plan of csrc/common/tune.h: 0 the plan this GPU gets, 1
registers on a persistent grid, 2 registers one block a tile, 3 the
shared-memory ring) timed in one process on the benchmark's GPU parameter list
(1.21 B parameters in 54 Llama-shaped tensors, 28 bytes a parameter), fp32
and bf16 with fp32 master weights, beside torch's copy_ of a same-size fp32
buffer (8 bytes an element) and torch.optim.AdamW(fused=True) (fp32)
measured in the same rounds.

Each figure is the median over rounds of `steps` back-to-back calls between
two CUDA events (the host runs ahead of the GPU, so host time is not in it);
the plans' order is rotated each round, and the copy and torch's step are
timed in every round, so drift of the GPU's clocks reaches all alike.

    python tools/probes/adam_plans.py [--rounds 5] [--steps 4] [--only 0,3]"""
import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import fusedops  # noqa: E402
from benchmarks.bench_adam import SHAPES  # noqa: E402
from fusedops.optim import FusedAdamW  # noqa: E402

LR, WD = 1e-4, 0.01
PLANS = {0: "by this GPU", 1: "registers, persistent grid", 2: "registers, one block a tile", 3: "ring"}


def timed(fn, steps):
    """Seconds a call: `steps` calls back to back between two events."""
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(steps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / steps


def make_opt(shapes, dtype, kind):
    ps = [torch.nn.Parameter(0.02 * torch.randn(s, device="cuda", dtype=dtype)) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p)
    if kind == "torch":
        opt = torch.optim.AdamW(ps, lr=LR, weight_decay=WD, fused=True)
    else:
        opt = FusedAdamW(ps, lr=LR, weight_decay=WD, master_weights=kind == "master")
    opt.step()  # the state, outside the timing
    return opt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--only", default="", help="comma-separated adam_plan values (default: all)")
    a = ap.parse_args()
    pick = [int(x) for x in a.only.split(",")] if a.only else list(PLANS)

    shapes = SHAPES["cuda"]
    n = sum(torch.Size(s).numel() for s in shapes)
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    opts = {"fp32": make_opt(shapes, torch.float32, "fp32"), "master": make_opt(shapes, torch.bfloat16, "master"),
            "torch": make_opt(shapes, torch.float32, "torch")}
    for v in pick:  # each plan's first launch (attributes, occupancy) outside the timing
        fusedops._C._tune("adam_plan", v)
        opts["fp32"].step()
        opts["master"].step()
    times = {("copy",): [], ("torch",): []}
    for r in range(a.rounds):
        order = pick[r % len(pick):] + pick[:r % len(pick)]
        times[("copy",)].append(timed(lambda: y.copy_(x), a.steps))
        times[("torch",)].append(timed(opts["torch"].step, a.steps))
        for v in order:
            fusedops._C._tune("adam_plan", v)
            for mode in ("fp32", "master"):
                times.setdefault((v, mode), []).append(timed(opts[mode].step, a.steps))
        times[("copy",)].append(timed(lambda: y.copy_(x), a.steps))
    fusedops._C._tune("adam_plan", None)

    med = {k: statistics.median(t) for k, t in times.items()}
    copy = 8 * n / med[("copy",)] / 1e9
    gbs = lambda t: 28 * n / t / 1e9  # noqa: E731
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, commit {commit}; {n / 1e9:.3f} B params "
          f"in {len(shapes)} tensors; {a.rounds} rounds x {a.steps} steps; copy range "
          f"{8 * n / max(times[('copy',)]) / 1e9:.0f}-{8 * n / min(times[('copy',)]) / 1e9:.0f} GB/s")
    print(f"copy_ (fp32, same size)           {copy:7.0f} GB/s  1.000")
    tt = gbs(med[("torch",)])
    print(f"torch AdamW(fused=True) fp32      {tt:7.0f} GB/s  {tt / copy:.3f}")
    print(f"{'adam_plan':34s} {'fp32 GB/s':>9s} {'frac':>6s} {'xtorch':>6s} | {'master GB/s':>11s} {'frac':>6s}")
    for v in pick:
        f, m = gbs(med[(v, "fp32")]), gbs(med[(v, "master")])
        print(f"{v:2d} {PLANS[v]:31s} {f:9.0f} {f / copy:6.3f} {f / tt:6.3f} | {m:11.0f} {m / copy:6.3f}")


if __name__ == "__main__":
    main()
