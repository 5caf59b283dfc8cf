"""Attention: out = softmax(scale q k^T) v, causal and not, on (B, S, H, D)
tensors (the layout fusedops and FlashAttention use; torch's SDPA gets the
(B, H, S, D) transposed views, which its kernels read in place).

Impls: fusedops.functional.flash_attention (and on CUDA fusedops_det, the same
with deterministic=True, and fusedops_mma, forward and backward on the mma.sync
kernels where the H100 would take the wgmma ones), eager fusedops.reference.attention
(the S x S matrix materialised), torch.compile of the latter (added by common);
on CUDA torch's SDPA with the CUDNN_ATTENTION backend (the yardstick: the first
peer column and its 'vs' ratio) and the FLASH_ATTENTION one; on the CPU torch's
SDPA as dispatched (its C++ flash kernel).

BENCH_ATTN_IMPLS (environment, comma-separated) keeps only the impls named,
e.g. "fusedops,sdpa_flash,sdpa_cudnn" to skip the slow eager baselines when
only the kernels are being compared (run with --no-compile as well).

FLOPs (ANCHORS.md): 4 B H S^2 D forward, halved when causal; fwd+bwd 3.5x the
forward. Judged in TFLOP/s against the matmul rate measured in the same run
(bf16 on a GPU; fp32 on the CPU, where the kernels compute in fp32).

Masks beyond causal (issue 52), causal, one sequence of S tokens: "attention
window" (a sliding window of W keys), "attention varlen" (packed documents of
mixed lengths, flash_attention_varlen) and "attention softcap" (soft-capped
scores, full causal). Their FLOPs count the visible work only (the pairs the
mask keeps). Peers: torch's SDPA with the equivalent dense bool mask, on CUDA
FlexAttention (compiled, with a block mask) where torch has it, and our own
kernel on the unmasked call beside it (fusedops_causal: the full causal
square; fusedops_nocap: the same call without soft-capping) and, on CUDA, the
masked call on the mma.sync kernels (fusedops_mma).
"""
import contextlib
import itertools
import os

import torch
import torch.nn.functional as F

from benchmarks.common import Case, Inputs
from fusedops import functional, reference

FLOP_FACTOR = {"fwd": 1.0, "fwd+bwd": 3.5}
# (B, H, S, D, causal): the ANCHORS.md rows.
GPU_SHAPES = [(16, 16, 1024, 64, False), (16, 16, 1024, 64, True),
              (8, 16, 2048, 128, False), (8, 16, 2048, 128, True),
              (4, 16, 4096, 128, False), (4, 16, 4096, 128, True),
              (2, 16, 8192, 128, False), (1, 16, 16384, 128, True),
              (4, 32, 4096, 64, False), (4, 32, 4096, 64, True)]
# A second or so per call on 2 cores.
CPU_SHAPES = [(2, 8, 1024, 64, False), (2, 8, 1024, 64, True), (1, 8, 1024, 128, False),
              (1, 8, 2048, 64, True)]
# Sequence-length sweep (--sweep): B x S fixed, head dim 128, causal.
SWEEP_SEQ = [512, 1024, 2048, 4096, 8192, 16384]
SWEEP_TOKENS = {"cuda": 32768, "cpu": 4096}
# Also with --sweep on the GPU: head dim 256 (the mma.sync kernels on every GPU).
SWEEP_D256 = [(4, 16, 2048, 256, False), (4, 16, 2048, 256, True)]


def _sdpa(backend):
    """torch's SDPA on (B, S, H, D) tensors, with one backend forced (None:
    torch's own choice)."""
    from torch.nn.attention import sdpa_kernel

    def fn(q, k, v, causal):
        args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        if backend is None:
            return F.scaled_dot_product_attention(*args, is_causal=causal).transpose(1, 2)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(*args, is_causal=causal).transpose(1, 2)
    return fn


@contextlib.contextmanager
def _wgmma_off():
    old = os.environ.get("FUSEDOPS_ATTN_WGMMA")
    os.environ["FUSEDOPS_ATTN_WGMMA"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["FUSEDOPS_ATTN_WGMMA"]
        else:
            os.environ["FUSEDOPS_ATTN_WGMMA"] = old


class _MmaSync(torch.autograd.Function):
    """fusedops on its mma.sync kernels (what GPUs other than the H100 / H200
    run) where the wgmma ones would take it, forward and backward: the op's
    graph (fn(q, k, v)) is kept from the forward and run under the same setting."""

    @staticmethod
    def forward(ctx, fn, q, k, v):
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
        with _wgmma_off(), torch.enable_grad():
            out = fn(*leaves)
        ctx.graph = (out, leaves)
        return out.detach()

    @staticmethod
    def backward(ctx, dout):
        out, leaves = ctx.graph
        with _wgmma_off():
            grads = torch.autograd.grad(out, leaves, dout)
        return (None, *grads)


def _mma_sync(fn):
    """The fusedops call fn(q, k, v, *args) on the mma.sync kernels."""
    return lambda q, k, v, *args: _MmaSync.apply(lambda *t: fn(*t, *args), q, k, v)


def _impls(device):
    # On a GPU the first peer is the yardstick: SDPA's cuDNN backend (what a
    # PyTorch user gets on an H100 / H200), FlashAttention-2 beside it.
    impls = {"fusedops": lambda q, k, v, causal: functional.flash_attention(q, k, v, causal=causal)}
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend
        impls["sdpa_cudnn"] = _sdpa(SDPBackend.CUDNN_ATTENTION)
        impls["sdpa_flash"] = _sdpa(SDPBackend.FLASH_ATTENTION)
        # deterministic=True: the backward's dQ by its own kernel instead of atomics.
        impls["fusedops_det"] = lambda q, k, v, causal: functional.flash_attention(
            q, k, v, causal=causal, deterministic=True)
        impls["fusedops_mma"] = _mma_sync(impls["fusedops"])
    else:
        impls["sdpa"] = _sdpa(None)
    impls["eager"] = lambda q, k, v, causal: reference.attention(q, k, v, causal)
    return _kept(impls)


def _kept(impls):
    """The impls BENCH_ATTN_IMPLS names (all when it is unset)."""
    keep = [n.strip() for n in os.environ.get("BENCH_ATTN_IMPLS", "").split(",") if n.strip()]
    return {n: f for n, f in impls.items() if n in keep} if keep else impls


def _maker(B, H, S, D, causal, dtype, device):
    def make(grad):
        q, k, v = (torch.randn(B, S, H, D, dtype=dtype, device=device).requires_grad_(grad)
                   for _ in range(3))
        grads = (torch.randn(B, S, H, D, dtype=dtype, device=device),) if grad else None
        return Inputs((q, k, v, causal), grads)
    return make


def _shapes(device, quick, sweep):
    gpu = device.type == "cuda"
    shapes = (GPU_SHAPES if gpu else CPU_SHAPES)[:2 if quick else None]
    if sweep:
        tokens = SWEEP_TOKENS["cuda" if gpu else "cpu"]
        shapes = shapes + [(max(1, tokens // s), 16 if gpu else 4, s, 128, True)
                           for s in SWEEP_SEQ if s <= tokens]
        if gpu:
            shapes += SWEEP_D256
    return list(dict.fromkeys(shapes))


def _dtypes(device, quick):
    """bf16 on a GPU; fp32 and bf16 on a CPU, where --quick keeps bf16 (as
    common.shape_grid does): the dtype whose CPU tiles change with the level
    (AVX512-BF16, AMX) and where torch's SDPA runs oneDNN's bf16 kernels."""
    if device.type == "cuda" or quick:
        return [torch.bfloat16]
    return [torch.float32, torch.bfloat16]


# Masks: (kind, S tokens, H, D, W window / documents' length range / softcap).
GPU_MASK_SHAPES = [("window", 16384, 16, 128, 4096), ("varlen", 16384, 16, 128, (256, 4096)),
                   ("softcap", 4096, 16, 128, 50.0)]
CPU_MASK_SHAPES = [("window", 4096, 8, 64, 512), ("varlen", 4096, 8, 64, (64, 1024)),
                   ("softcap", 1024, 8, 64, 50.0)]


def _documents(S, lo, hi):
    """Document lengths in [lo, hi] filling S tokens (a fixed draw)."""
    g = torch.Generator().manual_seed(0)
    lens = []
    while sum(lens) < S:
        lens.append(min(int(torch.randint(lo, hi + 1, (), generator=g)), S - sum(lens)))
    return lens


def _mask_cases(device, quick):
    """The masked cases (see the module's docstring): one sequence (B = 1)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        flex_attention = None
    out = []
    for kind, S, H, D, arg in (GPU_MASK_SHAPES if device.type == "cuda" else CPU_MASK_SHAPES)[:1 if quick else None]:
        pos = torch.arange(S, device=device)
        impls, doc = {}, None
        if kind == "window":
            keep = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= pos[:, None] - arg)
            impls["fusedops"] = lambda q, k, v, W=arg: functional.flash_attention(q, k, v, causal=True,
                                                                                 window_size=(W, 0))
            pairs = sum(min(i, arg) + 1 for i in range(S))
        elif kind == "varlen":
            lens = _documents(S, *arg)
            cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
            doc = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
            keep = (doc[None, :] == doc[:, None]) & (pos[None, :] <= pos[:, None])
            impls["fusedops"] = lambda q, k, v, cu=cu, m=max(lens): functional.flash_attention_varlen(
                q[0], k[0], v[0], cu, cu, m, m, causal=True)[None]
            pairs = sum(n * (n + 1) // 2 for n in lens)
        else:
            keep = pos[None, :] <= pos[:, None]
            impls["fusedops"] = lambda q, k, v, c=arg: functional.flash_attention(q, k, v, causal=True, softcap=c)
            impls["fusedops_nocap"] = lambda q, k, v: functional.flash_attention(q, k, v, causal=True)
            pairs = S * (S + 1) // 2
        if device.type == "cuda":
            impls["fusedops_mma"] = _mma_sync(impls["fusedops"])
        if kind != "softcap":
            impls["fusedops_causal"] = lambda q, k, v: functional.flash_attention(q, k, v, causal=True)
            impls["sdpa_mask"] = lambda q, k, v, m=keep: F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=m).transpose(1, 2)
            if flex_attention is not None and device.type == "cuda":
                if doc is None:
                    def mask_mod(b, h, i, j, W=arg):
                        return (j <= i) & (j >= i - W)
                else:
                    def mask_mod(b, h, i, j, doc=doc):
                        return (doc[i] == doc[j]) & (j <= i)
                block = create_block_mask(mask_mod, None, None, S, S, device=device)
                flex = torch.compile(flex_attention)
                impls["flex"] = lambda q, k, v, bm=block, fx=flex: fx(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm).transpose(1, 2)
        flops_fwd = 4 * H * pairs * D
        for dtype in _dtypes(device, quick):
            make = _maker(1, H, S, D, None, dtype, device)
            n = S * H * D * dtype.itemsize
            out += [Case(f"attention {kind}", (1, H, S, D), dtype, d, (4 if d == "fwd" else 8) * n,
                         _without_causal(make), _kept(impls), flops=int(FLOP_FACTOR[d] * flops_fwd))
                    for d in FLOP_FACTOR]
    return out


def _without_causal(make):
    """Input sets of _maker for the masked impls, which take q, k, v alone."""
    def inner(grad):
        inp = make(grad)
        return Inputs(inp.args[:3], inp.grads)
    return inner


def cases(device, quick, sweep):
    out = []
    impls = _impls(device)
    for B, H, S, D, causal in _shapes(device, quick, sweep):
        flops_fwd = 4 * B * H * S * S * D // (2 if causal else 1)
        for dtype in _dtypes(device, quick):
            make = _maker(B, H, S, D, causal, dtype, device)
            n = B * S * H * D * dtype.itemsize  # one (B, S, H, D) tensor
            op = "attention causal" if causal else "attention"
            # bytes: q, k, v in and out forward; + dout in, dq, dk, dv out backward
            out += [Case(op, (B, H, S, D), dtype, d, (4 if d == "fwd" else 8) * n, make, impls,
                         flops=int(FLOP_FACTOR[d] * flops_fwd))
                    for d in FLOP_FACTOR]
    return out + _mask_cases(device, quick)
