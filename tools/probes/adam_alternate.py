"""fp32 AdamW steps of fusedops and torch's fused=True alternated in one
process, on the benchmark's parameter list of this device (CPU: 6.3 M
parameters in 18 tensors). On a shared VM the memory bandwidth drifts between
the suite's back-to-back timings of each implementation; alternating the
steps makes both see the same machine.

    OMP_NUM_THREADS=2 python tools/probes/adam_alternate.py [--steps 60] [--tune adam_grid=2]

--tune sets the CUDA plan's tuning knobs (csrc/common/tune.h: adam_per_thread
8, 16 or 32; adam_grid 1 a block a tile, 2 persistent) in this process."""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import fusedops  # noqa: E402
from benchmarks.bench_adam import SHAPES  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tune", default="", help="tuning knobs name=value,... (csrc/common/tune.h)")
    a = ap.parse_args()
    for kv in filter(None, a.tune.split(",")):
        name, value = kv.split("=")
        fusedops._C._tune(name, int(value))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = SHAPES[dev.type]

    def make():
        ps = [torch.nn.Parameter(0.02 * torch.randn(s, device=dev)) for s in shapes]
        for p in ps:
            p.grad = torch.randn_like(p)
        return ps
    ours = fusedops.optim.FusedAdamW(make(), lr=1e-3, weight_decay=0.1)
    theirs = torch.optim.AdamW(make(), lr=1e-3, weight_decay=0.1, fused=True)
    times = {ours: [], theirs: []}
    for i in range(a.steps):
        for opt in (ours, theirs) if i % 2 else (theirs, ours):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times[opt].append(time.perf_counter() - t0)
    n = sum(torch.Size(s).numel() for s in shapes)
    warm = a.steps // 6
    t_ours, t_theirs = (statistics.median(times[o][warm:]) for o in (ours, theirs))
    print(f"{n / 1e6:.1f} M params on {dev.type}: fusedops {t_ours * 1e3:.2f} ms ({28 * n / t_ours / 1e9:.1f} GB/s), "
          f"torch fused {t_theirs * 1e3:.2f} ms ({28 * n / t_theirs / 1e9:.1f} GB/s), "
          f"fusedops speedup {t_theirs / t_ours:.3f}")


if __name__ == "__main__":
    main()
