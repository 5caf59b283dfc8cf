"""Host time of one call of each fusedops op beside eager PyTorch's, at shapes
so small that the kernels take no time: what a call costs the Python thread
(argument handling, the dispatcher, the stable-ABI boxed call, autograd).

    python tools/ci/host_overhead.py [--device cuda] [--rounds 5] [--calls 3000]

Each figure is the best of --rounds loops of --calls calls, in microseconds a
call; fwd+bwd is the forward, then torch.autograd.backward with given output
gradients. With FUSEDOPS_TORCH_AUTOGRAD=1 in the environment fusedops
registers each op's autograd formula through torch.library.register_autograd
instead of its own kernel (fusedops.ops._common.register_autograd), for
comparison. On CUDA a loop ends with a synchronize, and the kernels of these
shapes are shorter than the host's work, so the loop measures the host.

Not a test: the suite's "fusedops wall" column (benchmarks/) shows the same
cost at real shapes, where it is hidden behind the GPU or not."""
import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import fusedops  # noqa: E402
from fusedops import functional as FF, reference  # noqa: E402


def cases(d):
    """(name, fusedops fn, eager fn, inputs that require grad): fn(*inputs) -> outputs."""
    t = lambda *shape: torch.randn(*shape, device=d)  # noqa: E731
    H = 64
    ln = lambda x, r, w, b: (F.layer_norm(x + r, (H,), w, b), x + r)  # noqa: E731
    rms = lambda x, r, w: (F.rms_norm(x + r, (H,), w, 1e-6), x + r)  # noqa: E731
    adt = torch.float32 if d == "cpu" else torch.bfloat16
    qkv = [t(1, 16, 2, 32).to(adt) for _ in range(3)]
    cos, sin = t(1, 16, 32), t(1, 16, 32)
    tgt = torch.randint(0, 100, (8,), device=d)
    return [
        ("add+layer_norm", FF.fused_add_layer_norm, ln, [t(4, H), t(4, H), t(H), t(H)]),
        ("add+rms_norm", FF.fused_add_rms_norm, rms, [t(4, H), t(4, H), t(H)]),
        ("swiglu", FF.swiglu, lambda g, u: F.silu(g) * u, [t(4, 128), t(4, 128)]),
        ("rope", lambda q, k: FF.apply_rotary_pos_emb(q, k, cos, sin),
         lambda q, k: reference.rope(q, k, cos, sin), [t(1, 2, 16, 32), t(1, 2, 16, 32)]),
        ("cross_entropy", lambda x: FF.cross_entropy(x, tgt), lambda x: F.cross_entropy(x, tgt), [t(8, 100)]),
        ("flash_attention", lambda q, k, v: FF.flash_attention(q, k, v, causal=True),
         lambda q, k, v: F.scaled_dot_product_attention(*(a.transpose(1, 2) for a in (q, k, v)),
                                                        is_causal=True).transpose(1, 2), qkv),
    ]


def per_call(fn, calls, rounds, sync):
    for _ in range(min(calls, 300)):
        fn()
    sync()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    kernel = ("torch.library.register_autograd" if os.environ.get("FUSEDOPS_TORCH_AUTOGRAD") == "1"
              else "fusedops' register_autograd")
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    print(f"host us a call, {a.device}, torch {torch.__version__}, fusedops {fusedops.__version__}, "
          f"autograd kernels: {kernel}")
    print("| op | impl | no_grad fwd | fwd | fwd+bwd |\n|---|---|---:|---:|---:|")
    for name, ours, eager, xs in cases(a.device):
        leaves = [x.requires_grad_() for x in xs]
        outs = ours(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        douts = [torch.randn_like(o) for o in outs]
        for impl, fn in (("fusedops", ours), ("eager", eager)):
            def fwd_ng():
                with torch.no_grad():
                    fn(*leaves)

            def fwd_bwd():
                o = fn(*leaves)
                torch.autograd.backward(o if isinstance(o, tuple) else (o,), douts)

            r = [per_call(f, a.calls, a.rounds, sync) for f in (fwd_ng, lambda: fn(*leaves), fwd_bwd)]
            print(f"| {name} | {impl} | {r[0]:.1f} | {r[1]:.1f} | {r[2]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
