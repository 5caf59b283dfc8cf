"""RoPE: Hugging Face's apply_rotary_pos_emb of q and k (the rotate-half
layout), on the (B, H, S, D) views of (B, S, H, D) projections models hand
over.

Impls: fusedops.functional.apply_rotary_pos_emb (one kernel for q and k, one
for their gradients); eager fusedops.reference.rope (HF's formula:
rotate_half's cat, two products and a sum per tensor); torch.compile of it.

Bytes: the forward reads q, k, cos, sin and writes q_out, k_out; the backward
reads their gradients and cos, sin and writes dq, dk. cos and sin are
(B, S, D), read once a direction however many heads use them.
"""
import torch

from benchmarks.common import Case, Inputs, shape_grid
from fusedops import functional, reference

# B x Hq x Hk x S x D: the ANCHORS.md end-to-end model's attention (4 x 2048
# tokens, 16 heads of 128), and a grouped-query one (8 k heads of 32 q).
GPU_SHAPES = [(4, 16, 16, 2048, 128), (2, 32, 8, 4096, 128)]
CPU_SHAPES = [(1, 8, 8, 512, 64)]


def _case(shape, dtype, device):
    b, hq, hk, s, d = shape

    def make(grad):
        q = torch.randn(b, s, hq, d, dtype=dtype, device=device).transpose(1, 2)
        k = torch.randn(b, s, hk, d, dtype=dtype, device=device).transpose(1, 2)
        ang = torch.rand(b, s, d // 2, device=device) * 6.28
        cos, sin = (torch.cat([f(ang)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
        args = (q.requires_grad_(grad), k.requires_grad_(grad), cos, sin)
        grads = (torch.randn_like(q), torch.randn_like(k)) if grad else None
        return Inputs(args, grads)

    qk = b * (hq + hk) * s * d * dtype.itemsize
    table = 2 * b * s * d * dtype.itemsize
    nbytes = {"fwd": 2 * qk + table, "fwd+bwd": 4 * qk + 2 * table}
    fns = {"fusedops": functional.apply_rotary_pos_emb, "eager": reference.rope}
    return [Case("RoPE", shape, dtype, direction, n, make, fns) for direction, n in nbytes.items()]


def cases(device, quick, sweep):
    return shape_grid(device, quick, GPU_SHAPES, CPU_SHAPES, _case)
