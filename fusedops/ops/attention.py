"""Fake kernels and autograd for fusedops::attn_fwd / attn_bwd.

Schemas (csrc/library.cpp):
  attn_fwd(q, k, v, scale, causal, deterministic=False) -> (out, lse)
  attn_bwd(dout, q, k, v, out, lse, scale, causal, deterministic) -> (dq, dk, dv)
  attn_bwd_packed(dout, q, k, v, out, lse, scale, causal, deterministic) -> dqkv

q, out, dout, dq are (B, Sq, Hq, D); k, v, dk, dv (B, Sk, Hkv, D); lse is fp32
(B, Hq, Sq); dqkv is (B, S, Hq + 2 Hkv, D), dq, dk and dv side by side (Sq = Sk).
The forward ignores `deterministic`: it carries the flag to the
backward, which autograd calls with the saved q, k, v, out and lse. lse is an
output for the backward only: it takes no gradient.
"""
import torch

from ._common import check_one_device, no_double_backward, register_autograd

_ops = torch.ops.fusedops


@torch.library.register_fake("fusedops::attn_fwd")
def _attn_fwd_fake(q, k, v, scale, causal, deterministic=False):
    check_one_device("attn_fwd", q=q, k=k, v=v)
    B, Sq, Hq, D = q.shape
    return q.new_empty((B, Sq, Hq, D)), q.new_empty((B, Hq, Sq), dtype=torch.float32)


@torch.library.register_fake("fusedops::attn_bwd")
def _attn_bwd_fake(dout, q, k, v, out, lse, scale, causal, deterministic):
    check_one_device("attn_bwd", q=q, k=k, v=v, dout=dout, out=out, lse=lse)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("fusedops::attn_bwd_packed")
def _attn_bwd_packed_fake(dout, q, k, v, out, lse, scale, causal, deterministic):
    check_one_device("attn_bwd_packed", q=q, k=k, v=v, dout=dout, out=out, lse=lse)
    B, S, Hq, D = q.shape
    return q.new_empty((B, S, Hq + 2 * k.shape[2], D))


def _setup_context(ctx, inputs, output):
    q, k, v, scale, causal, *rest = inputs
    out, lse = output
    ctx.scale, ctx.causal = scale, causal
    ctx.deterministic = bool(rest[0]) if rest else False
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _ops.attn_bwd(dout, q, k, v, out, lse, ctx.scale, ctx.causal, ctx.deterministic)
    return dq, dk, dv, None, None, None


register_autograd("attn_fwd", _backward, _setup_context)
no_double_backward("attn_bwd")
no_double_backward("attn_bwd_packed")
