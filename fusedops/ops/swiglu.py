"""Fake kernels and autograd for the gated-linear-unit ops (csrc/swiglu).

Schemas (csrc/library.cpp):
  glu_fwd(gate, up, activation) -> out
  glu_bwd(dout, gate, up, activation) -> (dgate, dup)
  glu_bwd_(dout!, gate!, up!, activation)   # dgate over gate, dup over up, act(gate)*up over dout
  glu_bwd_recompute(dout, gate, up, activation) -> (out, dgate, dup)  # glu_bwd_'s results, new
  glu_packed_fwd(gate_up, activation) -> out              # gate_up = [gate | up]
  glu_packed_bwd(dout, gate_up, activation) -> dgate_up
  glu_packed_bwd_(dout!, gate_up!, activation)  # [dgate | dup] over gate_up, act(gate)*up over dout

The forward saves only its inputs (which the caller keeps anyway); the
backward recomputes the activation from them."""
import torch

from ._common import check_one_device, no_double_backward, register_autograd, register_mutating



def _half_shape(gate_up):
    return (*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.register_fake("fusedops::glu_fwd")
def _glu_fwd_fake(gate, up, activation):
    check_one_device("glu_fwd", gate=gate, up=up)
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.register_fake("fusedops::glu_bwd")
def _glu_bwd_fake(dout, gate, up, activation):
    check_one_device("glu_bwd", gate=gate, up=up, dout=dout)
    return (torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(gate, memory_format=torch.contiguous_format))


@torch.library.register_fake("fusedops::glu_bwd_recompute")
def _glu_bwd_recompute_fake(dout, gate, up, activation):
    check_one_device("glu_bwd_recompute", gate=gate, up=up, dout=dout)
    return tuple(torch.empty_like(gate, memory_format=torch.contiguous_format) for _ in range(3))


@torch.library.register_fake("fusedops::glu_bwd_")
def _glu_bwd_inplace_fake(dout, gate, up, activation):
    check_one_device("glu_bwd_", gate=gate, up=up, dout=dout)
    return None


@torch.library.register_fake("fusedops::glu_packed_bwd_")
def _glu_packed_bwd_inplace_fake(dout, gate_up, activation):
    check_one_device("glu_packed_bwd_", gate_up=gate_up, dout=dout)
    return None


@torch.library.register_fake("fusedops::glu_packed_fwd")
def _glu_packed_fwd_fake(gate_up, activation):
    return gate_up.new_empty(_half_shape(gate_up))


@torch.library.register_fake("fusedops::glu_packed_bwd")
def _glu_packed_bwd_fake(dout, gate_up, activation):
    check_one_device("glu_packed_bwd", gate_up=gate_up, dout=dout)
    return torch.empty_like(gate_up, memory_format=torch.contiguous_format)


def _save_inputs(ctx, inputs, output):
    *tensors, ctx.activation = inputs
    ctx.save_for_backward(*tensors)


def _glu_backward(ctx, dout):
    gate, up = ctx.saved_tensors
    dgate, dup = glu_bwd(dout, gate, up, ctx.activation)
    need_gate, need_up = ctx.needs_input_grad[:2]
    return (dgate if need_gate else None), (dup if need_up else None), None


def _glu_packed_backward(ctx, dout):
    (gate_up,) = ctx.saved_tensors
    return glu_packed_bwd(dout, gate_up, ctx.activation), None


# The ops as fusedops calls them (_common.eager_call).
glu_fwd = register_autograd("glu_fwd", _glu_backward, _save_inputs)
glu_packed_fwd = register_autograd("glu_packed_fwd", _glu_packed_backward, _save_inputs)
glu_bwd = no_double_backward("glu_bwd")
glu_bwd_recompute = no_double_backward("glu_bwd_recompute")
glu_packed_bwd = no_double_backward("glu_packed_bwd")
glu_bwd_ = register_mutating("glu_bwd_")
glu_packed_bwd_ = register_mutating("glu_packed_bwd_")
