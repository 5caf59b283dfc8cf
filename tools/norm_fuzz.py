"""Seeded random cases of fused add+norm against the float64 reference by the
2x rule, forward and backward, on any device: random widths (aligned and not),
rows, dtypes, residual/weight/bias presence, strided views.
    python tools/norm_fuzz.py [--device cuda] [--cases 200] [--seed 0]"""
import argparse
import random

import torch

import fusedops
from fusedops import reference


def err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def run_case(rng, device):
    dt = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    cols = rng.choice([1, 3, 8, 64, 256, 1000, 1024, 2048, 4096, 4097, 8192, 12288, 16384, 32768, 65536])
    rows = rng.choice([1, 3, 17, 300]) if cols <= 16384 else rng.choice([1, 5])
    rms = rng.random() < 0.5
    res = rng.choice([None, dt, torch.float32])
    wdt = rng.choice([None, dt, torch.float32])
    bias = (not rms) and wdt is not None and rng.random() < 0.7
    strided = rng.random() < 0.3
    g = torch.Generator(device="cpu").manual_seed(rng.randrange(1 << 30))

    def rand(shape, dtype):
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)

    x = rand((rows, cols + 5 if strided else cols), dt)[:, :cols] if strided else rand((rows, cols), dt)
    r = rand((rows, cols), res) if res is not None else None
    w = rand((cols,), wdt) if wdt is not None else None
    b = rand((cols,), wdt) if bias else None
    gy, gs = rand((rows, cols), dt), rand((rows, cols), res or dt)
    eps = 1e-5

    def grads(impl, cast):
        leaves = [t.detach().to(cast or t.dtype).requires_grad_() if t is not None else None for t in (x, r, w, b)]
        if impl == "fused":
            fn = fusedops.functional.fused_add_rms_norm if rms else fusedops.functional.fused_add_layer_norm
            args = (leaves[0], leaves[1], leaves[2]) if rms else tuple(leaves[:4])
            y, s = fn(*args, eps=eps)
        else:
            y, s = reference.add_norm(*leaves, eps, rms)
        outs = [y, s]
        gouts = [gy.to(y.dtype), gs.to(s.dtype)]
        if r is None:  # s is x itself: its gradient flows into x like y's
            outs, gouts = [y], [gy.to(y.dtype)]
        torch.autograd.backward(outs, gouts)
        return [y, s] + [t.grad if t is not None else None for t in leaves]

    got, low, ref = grads("fused", None), grads("ref", None), grads("ref", torch.float64)
    names = ["y", "s", "dx", "dres", "dw", "db"]
    floor = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dt]
    bad = []
    for n, a, l, rf in zip(names, got, low, ref):
        if rf is None:
            continue
        scale = max(1.0, rf.abs().max().item()) if rf.numel() else 1.0
        e, el = err(a, rf), err(l, rf)
        if not (e <= 2 * el + floor * scale):
            bad.append(f"{n}: err {e:.3g} vs eager {el:.3g}")
    desc = f"{rows}x{cols} {str(dt)[6:]} {'rms' if rms else 'ln'} res={res} w={wdt} bias={bias} strided={strided}"
    return desc, bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    fails = 0
    for i in range(a.cases):
        desc, bad = run_case(rng, a.device)
        if bad:
            fails += 1
            print(f"FAIL [{i}] {desc}: {'; '.join(bad)}")
    print(f"norm_fuzz: {a.cases - fails} passed, {fails} failed ({a.device}, seed {a.seed})")
    raise SystemExit(1 if fails else 0)


if __name__ == "__main__":
    main()
