"""Where the time of the SwiGLU MLP goes: the GPU kernels of fusedops'
glu_mlp, eager PyTorch and torch.compile, forward and forward+backward, from
torch.profiler (time per call, per kernel name, largest first); then the matmuls of the
MLP alone in the layouts it could use them in (gate and up as one [2F, H]
weight; weight gradients as dW = dZ^T X or (X^T dZ)^T).

    python tools/probes/mlp_profile.py [--T 16384 --H 4096 --F 11008] [--iters 10]"""
import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from fusedops import functional, reference


def kernels(fn, iters):
    """{kernel name: (calls per iteration, ms per iteration)} of fn()."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    acc = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            acc[e.name][0] += 1
            acc[e.name][1] += e.device_time_total / 1e3
    return {k: (n / iters, ms / iters) for k, (n, ms) in acc.items()}


def gemm_ms(fn, reps=20):
    """Median ms of fn() by CUDA events, after a warm-up."""
    for _ in range(3):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[reps // 2]


def gemm_layouts(x, wg, wu, wd, dy):
    """The MLP's matmuls, each layout timed alone."""
    with torch.no_grad():
        T, H, F = x.shape[0], x.shape[1], wg.shape[0]
        wgu = torch.cat([wg, wu])
        g = torch.randn(T, F, device=x.device, dtype=x.dtype)
        gu = torch.randn(T, 2 * F, device=x.device, dtype=x.dtype)
        one = 2 * T * H * F / 1e9
        cases = {
            "gate, up: two x Wg^T": (lambda: (x @ wg.t(), x @ wu.t()), 2 * one),
            "gate|up: x [Wg;Wu]^T": (lambda: x @ wgu.t(), 2 * one),
            "down: h Wd^T": (lambda: g @ wd.t(), one),
            "dh = dy Wd": (lambda: dy @ wd, one),
            "dx = dg Wg + du Wu": (lambda: torch.addmm(g @ wg, g, wu), 2 * one),
            "dx = [dg|du] [Wg;Wu]": (lambda: gu @ wgu, 2 * one),
            "dWg = dg^T x": (lambda: g.t() @ x, one),
            "dWg^T = x^T dg": (lambda: x.t() @ g, one),
            "dWgu = [dg|du]^T x": (lambda: gu.t() @ x, 2 * one),
            "dWd = dy^T h": (lambda: dy.t() @ g, one),
        }
        print("\nmatmuls alone (CUDA events, median of 20):")
        for name, (fn, gflop) in cases.items():
            ms = gemm_ms(fn)
            print(f"  {name:24s} {ms:7.3f} ms  {gflop / ms:6.0f} TFLOP/s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--H", type=int, default=4096)
    ap.add_argument("--F", type=int, default=11008)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(a.T, a.H, device=dev, dtype=dt, requires_grad=True)
    # gate's and up's weights side by side, as fusedops.nn.SwiGLU keeps them
    ws = [w.detach().requires_grad_() for w in (torch.randn(2 * a.F, a.H, device=dev, dtype=dt)
                                                * a.H ** -0.5).chunk(2)]
    ws.append((torch.randn(a.H, a.F, device=dev, dtype=dt) * a.F ** -0.5).requires_grad_())
    dy = torch.randn(a.T, a.H, device=dev, dtype=dt)
    impls = {"fusedops": functional.glu_mlp, "eager": reference.glu_mlp,
             "compile": torch.compile(reference.glu_mlp)}
    flops = {"fwd": 6 * a.T * a.H * a.F, "fwd+bwd": 18 * a.T * a.H * a.F}
    for direction in ("fwd", "fwd+bwd"):
        for name, f in impls.items():
            if direction == "fwd":
                def call():
                    with torch.no_grad():
                        f(x, *ws)
            else:
                def call():
                    f(x, *ws).backward(dy)
            ks = kernels(call, a.iters)
            total = sum(ms for _, ms in ks.values())
            print(f"\n{name} {direction}: {total:.3f} ms of kernels per call, "
                  f"{flops[direction] / total / 1e9:.0f} TFLOP/s")
            for k, (n, ms) in sorted(ks.items(), key=lambda kv: -kv[1][1])[:12]:
                print(f"  {ms:8.3f} ms  x{n:4.1f}  {k[:110]}")
    gemm_layouts(x.detach(), *(w.detach() for w in ws), dy)


if __name__ == "__main__":
    main()
