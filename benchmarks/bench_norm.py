"""Residual-add + norm, pre-norm style: s = x + r; y = norm(s); returns (y, s).

Impls: fusedops.functional.fused_add_{layer,rms}_norm, eager
fusedops.reference.add_norm, and torch.compile of the latter (added by common);
on a GPU also compile_exact, torch.compile with Inductor's
emulate_precision_casts: by default Inductor normalises the unrounded x + r,
with that option it normalises s as stored (bf16), as eager and fusedops do
(docs/perf-notes.md, v21).

Bytes (ANCHORS.md): the forward reads x, r and writes y, s (4N elements); the
backward reads dy, ds, s and writes dx (4N more, so fwd+bwd counts 8N).
Weight-sized terms are ignored: they are one row against T rows.
"""
import torch

from benchmarks.common import Case, Inputs
from fusedops import functional, reference

NORMS = {"add+LayerNorm": False, "add+RMSNorm": True}  # op name -> rms
ELEMENTS_MOVED = {"fwd": 4, "fwd+bwd": 8}  # per element of x

GPU_SHAPES = [(16384, 1024), (16384, 4096), (8192, 8192)]  # the ANCHORS.md rows
SWEEP_HIDDEN = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
# Widths of real models beside the powers of two (GPT-2 / BERT 768, Qwen2 1.5B
# 1536, Phi-2 2560, Llama 3.2 3B 3072, Llama 2 13B 5120): each takes a plan of
# its own (team sizes, chunks a thread), not the neighbouring power of two's.
MODEL_HIDDEN = [768, 1536, 2560, 3072, 5120]
# T x H fixed across the sweep, so only the row length changes: 2^24 elements
# on a GPU; a quarter of that on the CPU, where --sweep is opt-in and the full
# size takes seconds per call.
SWEEP_ELEMENTS = {"cuda": 1 << 24, "cpu": 1 << 22}
# Small enough that the whole CPU run (compile included) stays near a minute on 2 cores.
CPU_SHAPES = [(4096, 1024), (1024, 4096)]


def _fns(rms):
    """(fusedops, eager) as functions of the same args (x, r, w, b); b is None
    for RMSNorm."""
    eps = 1e-6 if rms else 1e-5
    if rms:
        def fused(x, r, w, b):
            return functional.fused_add_rms_norm(x, r, w, eps)
    else:
        def fused(x, r, w, b):
            return functional.fused_add_layer_norm(x, r, w, b, eps)

    def eager(x, r, w, b):
        return reference.add_norm(x, r, w, b, eps, rms)
    return fused, eager


def _maker(shape, dtype, device, rms):
    def make(grad):
        T, H = shape
        x = torch.randn(T, H, dtype=dtype, device=device)
        r = torch.randn(T, H, dtype=dtype, device=device)
        # Weights near 1 and small biases, as a trained norm has.
        w = 1 + 0.1 * torch.randn(H, dtype=dtype, device=device)
        b = None if rms else 0.1 * torch.randn(H, dtype=dtype, device=device)
        args = tuple(a if a is None else a.requires_grad_(grad) for a in (x, r, w, b))
        grads = (torch.randn_like(x), torch.randn_like(x)) if grad else None
        return Inputs(args, grads)
    return make


def _shapes(device, quick, sweep):
    """quick: two shapes; sweep: the hidden-size sweep after the fixed shapes."""
    gpu = device.type == "cuda"
    shapes = (GPU_SHAPES if gpu else CPU_SHAPES)[:2 if quick else None]
    if sweep:
        elements = SWEEP_ELEMENTS["cuda" if gpu else "cpu"]
        shapes = shapes + [(elements // h, h) for h in sorted(SWEEP_HIDDEN + MODEL_HIDDEN)]
    return list(dict.fromkeys(shapes))  # 16384x1024 is in both on a GPU


def _dtypes(device, quick):
    if device.type == "cuda":
        return [torch.bfloat16]
    return [torch.float32] if quick else [torch.float32, torch.bfloat16, torch.float16]


# compile_exact: torch.compile computing eager's y (s rounded before it is
# normalised). Not on the CPU, where each compile takes seconds.
EXACT = {"compile_exact": {"emulate_precision_casts": True}}
EXACT_NOTE = ("compile_exact: torch.compile with emulate_precision_casts, which normalises s as "
              "stored (bf16), as eager and fusedops do; compile normalises the unrounded x + r "
              "(about twice the error in y against float64).")


def cases(device, quick, sweep):
    gpu = device.type == "cuda"
    out = []
    for op, rms in NORMS.items():
        fused, eager = _fns(rms)
        for shape in _shapes(device, quick, sweep):
            for dtype in _dtypes(device, quick):
                make = _maker(shape, dtype, device, rms)
                n = shape[0] * shape[1] * dtype.itemsize
                out += [Case(op, shape, dtype, d, ELEMENTS_MOVED[d] * n, make,
                             {"fusedops": fused, "eager": eager},
                             note=EXACT_NOTE if gpu else "", compile_options=EXACT if gpu else {})
                        for d in ELEMENTS_MOVED]
    return out
