"""Where a training step of benchmarks/bench_e2e.py goes, per mode: the GPU
kernels of a few steps from torch.profiler, summed into kinds (matmul,
attention, fusedops' own kernels, Triton from inductor, other elementwise and
reductions, the optimizer, copies), then the largest kernels by name.

    python tools/ci/e2e_profile.py [--modes compile,fusedops,fusedops+compile] [--steps 3]

The gap between two modes' step times shows up here as kinds of kernels, and
as idle GPU time (step time minus the kernels' sum: launches, host work)."""
import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.bench_e2e import ANCHOR, build, make_batch, train_step  # noqa: E402

KINDS = (  # first match wins
    ("attention", r"attn|flash|fmha|attention"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    # fusedops' own kernels live in an anonymous namespace at the top (torch's in at::...)
    ("fusedops", r"^fo_|fusedops|^void \(anonymous namespace\)::"),
    ("triton", r"^triton"),
    ("copy", r"copy|Memcpy|Memset|cat|fill"),
    ("reduce", r"reduce|softmax|nll|log_softmax|cross"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
)


def kind(name):
    for k, pat in KINDS:
        if re.search(pat, name, re.I):
            return k
    return "other"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="compile,fusedops,fusedops+compile")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--no-cache", dest="use_cache", action="store_false", help="as bench_e2e's")
    a = p.parse_args()
    dev, cfg = torch.device("cuda"), ANCHOR
    batch = make_batch(cfg, "padded", dev)
    summary = {}
    for mode in a.modes.split(","):
        torch._dynamo.reset()
        model, run, opt = build(cfg, mode, torch.bfloat16, dev, use_cache=a.use_cache)

        def step():
            train_step(run, opt, batch)

        for _ in range(a.warmup):
            step()
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ev[0].record()
            for _ in range(a.steps):
                step()
            ev[1].record()
            torch.cuda.synchronize()
        step_ms = ev[0].elapsed_time(ev[1]) / a.steps
        by_name, by_kind = defaultdict(lambda: [0, 0.0]), defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                ms = e.device_time_total / 1e3 / a.steps
                by_name[e.name][0] += 1
                by_name[e.name][1] += ms
                by_kind[kind(e.name)] += ms
        busy = sum(by_kind.values())
        summary[mode] = (step_ms, busy, dict(by_kind))
        print(f"\n## {mode}: {step_ms:.1f} ms a step, kernels {busy:.1f} ms, idle {step_ms - busy:.1f} ms")
        for name, (n, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:a.top]:
            print(f"  {ms:7.2f} ms {n // a.steps:4d}x  [{kind(name)}] {name[:110]}")
        del model, run, opt
        torch.cuda.empty_cache()
    kinds = [k for k, _ in KINDS] + ["other"]
    print("\n| mode | step ms | idle | " + " | ".join(kinds) + " |")
    print("|---" * (len(kinds) + 3) + "|")
    for mode, (step_ms, busy, bk) in summary.items():
        print(f"| {mode} | {step_ms:.1f} | {step_ms - busy:.1f} | "
              + " | ".join(f"{bk.get(k, 0.0):.1f}" for k in kinds) + " |")


if __name__ == "__main__":
    main()
