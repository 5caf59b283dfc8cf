"""add + LayerNorm of fusedops and of eager PyTorch alternated call by call in
one process, on the CPU: the forward, or with --backward the forward and
backward (dx, d residual, dweight, dbias). On a shared VM the memory bandwidth
drifts between the suite's back-to-back timings of each implementation, and
stalls of the host put single readings at a fifth of the rest; alternating the
calls makes both see the same machine, and a low percentile of each one's
times skips the stalls. GB/s by the suite's byte counts (4 matrices forward,
8 forward and backward).

    OMP_NUM_THREADS=2 python tools/probes/norm_alternate.py 4096x1024 float32 [--backward]

Compare settings read once per process (FUSEDOPS_CPU_STREAM, FUSEDOPS_CPU_ISA)
by running it once per setting, in turn."""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fusedops import functional as F  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", help="rows x cols, e.g. 4096x1024")
    ap.add_argument("dtype", help="float32, bfloat16 or float16")
    ap.add_argument("--backward", action="store_true", help="time forward and backward")
    ap.add_argument("--calls", type=int, default=200, help="calls of each implementation")
    ap.add_argument("--percentile", type=float, default=10)
    a = ap.parse_args()
    rows, cols = map(int, a.shape.split("x"))
    dt = getattr(torch, a.dtype)
    grad = a.backward
    sets = [tuple(torch.randn(rows, cols, dtype=dt, requires_grad=grad and k < 2) for k in range(4))
            for _ in range(8)]  # x, residual, and the gradients of y and s
    w = torch.randn(cols, dtype=dt, requires_grad=grad)
    b = torch.randn(cols, dtype=dt, requires_grad=grad)

    def ours(x, r):
        return F.fused_add_layer_norm(x, r, w, b, 1e-5)

    def eager(x, r):
        s = x + r
        return torch.nn.functional.layer_norm(s, (cols,), w, b, 1e-5), s

    times = {ours: [], eager: []}
    for i in range(2 * a.calls):
        x, r, gy, gs = sets[i % len(sets)]
        fn = ours if i % 2 == 0 else eager
        for t in (x, r, w, b):
            t.grad = None
        t0 = time.perf_counter()
        y, s = fn(x, r)
        if grad:
            torch.autograd.backward((y, s), (gy, gs))
        times[fn].append(time.perf_counter() - t0)
    nbytes = (8 if grad else 4) * rows * cols * dt.itemsize
    at = {fn: sorted(v)[int(len(v) * a.percentile / 100)] for fn, v in times.items()}
    print(f"{'fwd+bwd' if grad else 'fwd'} {a.shape} {a.dtype} (p{a.percentile:g} of {a.calls}): "
          f"fusedops {nbytes / at[ours] / 1e9:5.1f} GB/s, eager {nbytes / at[eager] / 1e9:5.1f}, "
          f"{at[eager] / at[ours]:.2f}x eager")


if __name__ == "__main__":
    main()
