"""Linear + cross-entropy: the loss of a language-model head,
cross_entropy(h @ W.T, target) with h [tokens, hidden], W [vocab, hidden],
mean over the targets that are not ignored (~5 % are).

Impls (columns):
  fusedops   fusedops.functional.linear_cross_entropy (chunked, no logits)
  eager      as transformers does it: the logits, upcast to fp32, torch's
             cross_entropy (ForCausalLMLoss)
  compile    torch.compile of eager
  unfused    h @ W.T, then fusedops.functional.cross_entropy on the logits
             in their own dtype (fusedops before the fused op)
  liger      Liger-Kernel's fused linear cross-entropy, where it imports

Counted in FLOPs: the logits' matmul, 2 N H V, forward; with the gradients
of h and W two more, 6 N H V for forward+backward. The point of the fused op
is its peak-memory column (on a GPU: memory one call allocates beyond its
inputs, the returned gradients included): the logits and their gradient
(N V each) are never whole.
"""
import torch
import torch.nn.functional as TF

from benchmarks.common import Case, Inputs, shape_grid
from fusedops import functional

FLOPS = {"fwd": 2, "fwd+bwd": 6}  # x N*H*V
IGNORE = -100

# tokens x hidden x vocab: Llama 3's head (8B: hidden 4096, 128256 words) at
# the e2e batch (8192 tokens), then 32000 (Llama 2) and 262144 (Gemma 3)
# words, and 2048 and 32768 tokens.
GPU_SHAPES = [(8192, 4096, 128256), (8192, 4096, 32000), (8192, 4096, 262144), (2048, 4096, 128256),
              (32768, 4096, 128256)]
# Seconds a case on 2 cores.
CPU_SHAPES = [(512, 128, 32000)]


def _eager(h, w, target):
    return TF.cross_entropy((h @ w.t()).float(), target, ignore_index=IGNORE)


def _unfused(h, w, target):
    return functional.cross_entropy(h @ w.t(), target, ignore_index=IGNORE)


def _fused(h, w, target):
    return functional.linear_cross_entropy(h, w, target, ignore_index=IGNORE)


def _liger():
    """Liger-Kernel's fused linear cross-entropy as (h, w, target) -> loss, or
    None where it does not import (it needs Triton and a GPU)."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as f
    except Exception:  # noqa: BLE001  (not installed, or no Triton)
        return None
    # (input, weight, target, bias, ce_weight, ignore_index): positional, as
    # both its autograd.Function.apply (older releases) and its function take them
    return lambda h, w, target: f(h, w, target, None, None, IGNORE)


def _case(shape, dtype, device):
    N, H, V = shape

    def make(grad):
        h = torch.randn(N, H, device=device, dtype=dtype).requires_grad_(grad)
        w = (torch.randn(V, H, device=device) * H ** -0.5).to(dtype).requires_grad_(grad)
        target = torch.randint(0, V, (N,), device=device)
        target[torch.rand(N, device=device) < 0.05] = IGNORE
        return Inputs((h, w, target), (torch.ones((), device=device),) if grad else None)

    impls = {"fusedops": _fused, "eager": _eager, "unfused": _unfused}
    liger = _liger() if device.type == "cuda" else None
    if liger is not None:
        impls["liger"] = liger
    return [Case("linear+cross-entropy", shape, dtype, d, None, make, impls, flops=FLOPS[d] * N * H * V,
                 min_sets=1, note="linear+cross-entropy: eager upcasts the logits to fp32 (as transformers' "
                 "ForCausalLMLoss); unfused = h @ W.T, then fusedops' cross_entropy.")
            for d in FLOPS]


def cases(device, quick, sweep):
    return shape_grid(device, quick, GPU_SHAPES, CPU_SHAPES, _case)
