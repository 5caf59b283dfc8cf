"""Cross-entropy of a language model's logits: [tokens, vocab] against class
indices, mean over the targets that are not ignored (~5 % are).

Impls: fusedops.functional.cross_entropy; eager torch.nn.functional.
cross_entropy on the same logits; torch.compile of it.

Bytes: the forward reads the logits once (N V elements; the targets and the
per-row results are noise beside them); the backward reads them again and
writes their gradient, so forward+backward counts 3 N V. Eager's log-softmax
writes and rereads an N V tensor each way besides.
"""
import torch
import torch.nn.functional as TF

from benchmarks.common import Case, Inputs, shape_grid
from fusedops import functional

ELEMENTS_MOVED = {"fwd": 1, "fwd+bwd": 3}  # per logit
IGNORE = -100

# tokens x vocab: the ANCHORS.md e2e batch (4 x 2048) at Llama-2's and
# Llama-3's vocabularies.
GPU_SHAPES = [(8192, 32000), (8192, 128256)]
CPU_SHAPES = [(512, 32000)]


def _eager(logits, target):
    return TF.cross_entropy(logits, target, ignore_index=IGNORE)


def _fused(logits, target):
    return functional.cross_entropy(logits, target, ignore_index=IGNORE)


def _case(shape, dtype, device):
    N, V = shape

    def make(grad):
        logits = (torch.randn(N, V, device=device) * 2).to(dtype).requires_grad_(grad)
        target = torch.randint(0, V, (N,), device=device)
        target[torch.rand(N, device=device) < 0.05] = IGNORE
        return Inputs((logits, target), (torch.ones((), dtype=dtype, device=device),) if grad else None)

    n = N * V * dtype.itemsize
    return [Case("cross-entropy", shape, dtype, d, ELEMENTS_MOVED[d] * n, make,
                 {"fusedops": _fused, "eager": _eager}, min_sets=1) for d in ELEMENTS_MOVED]


def cases(device, quick, sweep):
    return shape_grid(device, quick, GPU_SHAPES, CPU_SHAPES, _case)
