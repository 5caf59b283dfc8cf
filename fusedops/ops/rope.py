"""Fake kernel and autograd for fusedops::rope (csrc/rope).

Schema (csrc/library.cpp):
  rope(q, k, cos, sin, inverse=False) -> (q_out, k_out)
  rope_(q!, k!, cos, sin, inverse=False) -> ()      (in place; no gradient)

The rotation is linear in q and k, so the backward is the same op with
inverse=True on the output gradients (cos and sin get no gradient: they are
a function of the positions, built without one in every model we patch;
fusedops.functional.apply_rotary_pos_emb takes the eager formula when they
require grad)."""
import torch

from ._common import check_one_device, register_autograd, register_mutating



def _out_like(x, inverse):  # [B, H, S, D]; with inverse [B, S, H, D] in memory (rope_ops.cpp)
    if not inverse:
        return x.new_empty(x.shape)
    return x.new_empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3]).transpose(1, 2)


@torch.library.register_fake("fusedops::rope")
def _rope_fake(q, k, cos, sin, inverse=False):
    check_one_device("rope", q=q, k=k, cos=cos, sin=sin)
    return _out_like(q, inverse), _out_like(k, inverse)


@torch.library.register_fake("fusedops::rope_")
def _rope_inplace_fake(q, k, cos, sin, inverse=False):
    check_one_device("rope_", q=q, k=k, cos=cos, sin=sin)
    return None


def _setup(ctx, inputs, output):
    _, _, cos, sin, ctx.inverse = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    gq, gk = rope(dq, dk, cos, sin, not ctx.inverse)
    return gq, gk, None, None, None


# The ops as fusedops calls them (_common.eager_call).
rope = register_autograd("rope", _backward, _setup)
rope_ = register_mutating("rope_")
