"""SwiGLU: the elementwise op out = silu(gate) * up, separate and packed, and the
whole Llama MLP down_proj(silu(gate_proj(x)) * up_proj(x)) around it.

Impls: fusedops.functional.swiglu / swiglu_packed and fusedops.nn.SwiGLU's
function glu_mlp; eager fusedops.reference; torch.compile of the latter.

Bytes (ANCHORS.md): the forward reads gate, up and writes out (3N elements);
the backward reads dout, gate, up and writes dgate, dup (5N), so fwd+bwd
counts 8N. The MLP is counted in FLOPs: three T x H x F matmuls, 2 T H F each,
forward; three times that for forward+backward. Its peak-memory column is the
point of the fused module: it keeps x, gate and up for the backward, eager
keeps silu(gate) and the product as well.
"""
import torch

from benchmarks.common import Case, Inputs
from fusedops import functional, reference

ELEMENTS_MOVED = {"fwd": 3, "fwd+bwd": 8}  # per element of the output
MLP_FLOPS = {"fwd": 6, "fwd+bwd": 18}      # x T*H*F

GPU_SHAPES = [(16384, 11008), (16384, 14336)]  # T x F, the ANCHORS.md rows
GPU_MLP = [(16384, 4096, 11008), (16384, 4096, 14336)]  # T x H x F
# Small enough for seconds per case on 2 cores.
CPU_SHAPES = [(2048, 2816)]
CPU_MLP = [(512, 512, 1408)]


def _elementwise(shape, dtype, device, packed):
    T, F = shape

    def make(grad):
        if packed:
            args = (torch.randn(T, 2 * F, dtype=dtype, device=device).requires_grad_(grad),)
        else:
            args = tuple(torch.randn(T, F, dtype=dtype, device=device).requires_grad_(grad)
                         for _ in range(2))
        return Inputs(args, (torch.randn(T, F, dtype=dtype, device=device),) if grad else None)

    fns = ({"fusedops": functional.swiglu_packed, "eager": reference.glu_packed} if packed else
           {"fusedops": functional.swiglu, "eager": reference.glu})
    n = T * F * dtype.itemsize
    op = "SwiGLU packed" if packed else "SwiGLU"
    return [Case(op, shape, dtype, d, ELEMENTS_MOVED[d] * n, make, fns) for d in ELEMENTS_MOVED]


def _mlp(shape, dtype, device):
    T, H, F = shape

    def make(grad):
        # Weights at Linear's init scale, so that activations stay O(1); gate's
        # and up's side by side in one allocation, as fusedops.nn.SwiGLU keeps
        # them (the same tensors go to every impl).
        x = torch.randn(T, H, dtype=dtype, device=device)
        ws = [w.detach() for w in (torch.randn(2 * F, H, dtype=dtype, device=device) * H**-0.5).chunk(2)]
        ws.append(torch.randn(H, F, dtype=dtype, device=device) * F**-0.5)
        args = tuple(t.requires_grad_(grad) for t in (x, *ws))
        return Inputs(args, (torch.randn(T, H, dtype=dtype, device=device),) if grad else None)

    fns = {"fusedops": functional.glu_mlp, "eager": reference.glu_mlp}
    return [Case("SwiGLU MLP", shape, dtype, d, None, make, fns, flops=MLP_FLOPS[d] * T * H * F)
            for d in MLP_FLOPS]


def cases(device, quick, sweep):
    gpu = device.type == "cuda"
    dtypes = [torch.bfloat16] if gpu else [torch.float32, torch.bfloat16]
    shapes = GPU_SHAPES if gpu else CPU_SHAPES
    out = []
    for dtype in dtypes[:1] if quick else dtypes:
        for shape in shapes[:1] if quick else shapes:
            out += _elementwise(shape, dtype, device, packed=False)
        if not quick:
            out += _elementwise(shapes[0], dtype, device, packed=True)
        for shape in (GPU_MLP if gpu else CPU_MLP)[:1 if quick else None]:
            out += _mlp(shape, dtype, device)
    return out
