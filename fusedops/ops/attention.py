"""Fake kernels and autograd for fusedops::attn_fwd / attn_bwd and their
packed-sequence forms attn_varlen_fwd / attn_varlen_bwd.

Schemas (csrc/library.cpp):
  attn_fwd(q, k, v, scale, causal, deterministic=False, window_left=-1, window_right=-1,
           softcap=0.0) -> (out, lse)
  attn_bwd(dout, q, k, v, out, lse, scale, causal, deterministic, window_left=-1,
           window_right=-1, softcap=0.0) -> (dq, dk, dv)
  attn_bwd_packed(<attn_bwd's arguments>) -> dqkv
  attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                  causal, deterministic=False, window_left=-1, window_right=-1, softcap=0.0)
                  -> (out, lse)
  attn_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, scale, causal, deterministic, window_left=-1, window_right=-1,
                  softcap=0.0) -> (dq, dk, dv)

q, out, dout, dq are (B, Sq, Hq, D); k, v, dk, dv (B, Sk, Hkv, D); lse is fp32
(B, Hq, Sq); dqkv is (B, S, Hq + 2 Hkv, D), dq, dk and dv side by side (Sq = Sk).
Varlen: q (total_q, Hq, D), k and v (total_k, Hkv, D), lse (Hq, total_q).
The forwards ignore `deterministic`: they carry the flag to the backward,
which autograd calls with the saved inputs, out, lse and the mask arguments.
lse is an output for the backward only: it takes no gradient.
"""
import torch

from ._common import check_one_device, no_double_backward, register_autograd



@torch.library.register_fake("fusedops::attn_fwd")
def _attn_fwd_fake(q, k, v, scale, causal, deterministic=False, window_left=-1, window_right=-1,
                   softcap=0.0):
    check_one_device("attn_fwd", q=q, k=k, v=v)
    B, Sq, Hq, D = q.shape
    return q.new_empty((B, Sq, Hq, D)), q.new_empty((B, Hq, Sq), dtype=torch.float32)


@torch.library.register_fake("fusedops::attn_bwd")
def _attn_bwd_fake(dout, q, k, v, out, lse, scale, causal, deterministic, window_left=-1,
                   window_right=-1, softcap=0.0):
    check_one_device("attn_bwd", q=q, k=k, v=v, dout=dout, out=out, lse=lse)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("fusedops::attn_bwd_packed")
def _attn_bwd_packed_fake(dout, q, k, v, out, lse, scale, causal, deterministic, window_left=-1,
                          window_right=-1, softcap=0.0):
    check_one_device("attn_bwd_packed", q=q, k=k, v=v, dout=dout, out=out, lse=lse)
    B, S, Hq, D = q.shape
    return q.new_empty((B, S, Hq + 2 * k.shape[2], D))


@torch.library.register_fake("fusedops::attn_varlen_fwd")
def _attn_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                          deterministic=False, window_left=-1, window_right=-1, softcap=0.0):
    check_one_device("attn_varlen_fwd", q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    T, Hq, D = q.shape
    return q.new_empty((T, Hq, D)), q.new_empty((Hq, T), dtype=torch.float32)


@torch.library.register_fake("fusedops::attn_varlen_bwd")
def _attn_varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          scale, causal, deterministic, window_left=-1, window_right=-1, softcap=0.0):
    check_one_device("attn_varlen_bwd", q=q, k=k, v=v, dout=dout, out=out, lse=lse,
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, causal, deterministic, window_left, window_right, softcap = inputs
    out, lse = output
    ctx.args = (scale, causal, bool(deterministic), window_left, window_right, softcap)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zero tensor made for lse's gradient
    ctx.save_for_backward(q, k, v, out, lse)


def _backward(ctx, dout, dlse):
    if dout is None:  # out took no part in what is differentiated
        return (None,) * 9
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, deterministic, window_left, window_right, softcap = inputs
    out, lse = output
    ctx.args = (max_q, max_k, scale, causal, bool(deterministic), window_left, window_right, softcap)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)


def _varlen_backward(ctx, dout, dlse):
    if dout is None:
        return (None,) * 13
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = attn_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.args)
    return (dq, dk, dv) + (None,) * 10


# The ops as fusedops calls them (_common.eager_call).
attn_fwd = register_autograd("attn_fwd", _backward, _setup_context)
attn_varlen_fwd = register_autograd("attn_varlen_fwd", _varlen_backward, _varlen_setup_context)
attn_bwd = no_double_backward("attn_bwd")
attn_bwd_packed = no_double_backward("attn_bwd_packed")
attn_varlen_bwd = no_double_backward("attn_varlen_bwd")
