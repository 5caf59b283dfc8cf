"""Multi-tensor AdamW: one optimizer.step() over a list of parameters that have
grads (direction "step").

Impls, one optimizer each over the same parameters and grads (its state made in
the untimed warm-up):
  fusedops  fusedops.optim.FusedAdamW
  eager     torch.optim.AdamW as torch picks it by default: foreach on CUDA, the
            for-loop on the CPU
  compile   torch.optim.AdamW(fused=True), torch's fastest AdamW, in the column
            that holds torch.compile for the other ops (compiling an optimizer
            step is not run: minutes of compile for 54 tensors, and fused=True
            is what torch recommends for speed)
lr 1e-4, weight decay 0.01 (AdamW's decoupled decay: one multiply more).

Parameter lists
  GPU: the ANCHORS.md list, 1.21 B parameters in 54 tensors: six decoder layers
       of Llama-2-7B shape (hidden 4096, MLP 11008), per layer q, k, v, o
       [4096, 4096], gate, up [11008, 4096], down [4096, 11008] and two RMSNorm
       weights [4096]: 6 x 202.4 M = 1.214 B.
  CPU: two such layers at hidden 512, MLP 1376 (18 tensors, 6.3 M parameters),
       a step of a few tens of ms on 2 cores.

Bytes (ANCHORS.md): read p, g, m, v and write p, m, v: 28 bytes a parameter in
fp32, 14 for bf16 (or, on the CPU, fp16) params and states. bf16 params with
fp32 master weights (a fusedops-only case; torch has no such mode): read g (2),
master, m, v (12), write master, m, v (12) and the rounded param (2): 28 bytes
too.
"""
import weakref

import torch

from benchmarks.common import Case, Inputs
from fusedops.optim import FusedAdamW

LR, WD = 1e-4, 0.01
NOTE = ("adam: eager = torch.optim.AdamW default (foreach on CUDA, for-loop on CPU); "
        "compile column = torch.optim.AdamW(fused=True); GB/s at 28 B/param (fp32, bf16+master), "
        "14 B/param (bf16, fp16)")


def llama_layers(layers, hidden, mlp):
    """The parameter shapes of `layers` Llama decoder layers."""
    one = [(hidden, hidden)] * 4 + [(mlp, hidden)] * 2 + [(hidden, mlp)] + [(hidden,)] * 2
    return one * layers


SHAPES = {"cuda": llama_layers(6, 4096, 11008), "cpu": llama_layers(2, 512, 1376)}


class _Params(list):
    """A parameter list the impls can key their optimizers on weakly (by
    identity): when the runner drops an input set, the optimizers (and their
    state) go with it, though the Case and its impls live on."""
    __hash__ = object.__hash__
    __eq__ = object.__eq__


def _stepper(make_opt):
    """An impl: the optimizer make_opt(params) over each input set, created at its
    first call (the warm-up), then one step() per call."""
    opts = weakref.WeakKeyDictionary()

    def step(params, grads):
        opt = opts.get(params)
        if opt is None:
            for p, g in zip(params, grads):
                p.grad = g
            opt = opts[params] = make_opt(list(params))
        opt.step()
    return step


def _maker(shapes, dtype, device):
    def make(grad):
        params = [torch.nn.Parameter(0.02 * torch.randn(s, device=device, dtype=dtype)) for s in shapes]
        grads = [torch.randn(s, device=device, dtype=dtype) for s in shapes]
        return Inputs((_Params(params), grads))
    return make


def _label(shapes):
    n = sum(torch.Size(s).numel() for s in shapes)
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    return (f"{size}/{len(shapes)}t",)


def cases(device, quick, sweep):
    shapes = SHAPES["cuda" if device.type == "cuda" else "cpu"]
    n = sum(torch.Size(s).numel() for s in shapes)

    def impls():
        return {"fusedops": _stepper(lambda ps: FusedAdamW(ps, lr=LR, weight_decay=WD)),
                "eager": _stepper(lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD)),
                "compile": _stepper(lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD, fused=True))}
    master = {"fusedops": _stepper(lambda ps: FusedAdamW(ps, lr=LR, weight_decay=WD, master_weights=True))}
    # One input set on a GPU: 10 GB of params and grads, with three optimizers' state 40 GB.
    sets = 1 if device.type == "cuda" else 2
    label = _label(shapes)
    out = [Case("AdamW", label, torch.float32, "step", 28 * n, _maker(shapes, torch.float32, device),
                impls(), min_sets=sets, note=NOTE)]
    if not quick:
        # fp16 on the CPU only, where its conversions are a path of their own (F16C)
        half = (torch.bfloat16,) if device.type == "cuda" else (torch.bfloat16, torch.float16)
        out += [Case("AdamW", label, dt, "step", 14 * n, _maker(shapes, dt, device), impls(), min_sets=sets,
                     note=NOTE) for dt in half]
        out += [Case("AdamW+master", label, torch.bfloat16, "step", 28 * n,
                     _maker(shapes, torch.bfloat16, device), master, min_sets=sets, note=NOTE)]
    return out
