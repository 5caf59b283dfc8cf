"""Fake kernels and autograd for fusedops::xent_fwd / xent_bwd (cross-entropy).

Schemas (csrc/library.cpp):
  xent_fwd(logits, target, ignore_index) -> (loss, lse)
  xent_bwd(dloss, logits, target, lse, ignore_index) -> dlogits

logits [rows, classes] (fp32, fp16 or bf16), target [rows] int64; loss and lse
are fp32 [rows]. The backward reads the saved logits and lse again: nothing of
the size of the logits is kept beyond the logits themselves. lse takes no
gradient; target none either."""
import torch

from ._common import check_one_device, no_double_backward, register_autograd

_ops = torch.ops.fusedops


@torch.library.register_fake("fusedops::xent_fwd")
def _xent_fwd_fake(logits, target, ignore_index):
    check_one_device("xent_fwd", logits=logits, target=target)
    rows = logits.shape[0]
    return logits.new_empty((rows,), dtype=torch.float32), logits.new_empty((rows,), dtype=torch.float32)


@torch.library.register_fake("fusedops::xent_bwd")
def _xent_bwd_fake(dloss, logits, target, lse, ignore_index):
    check_one_device("xent_bwd", dloss=dloss, logits=logits, target=target, lse=lse)
    return logits.new_empty(logits.shape)


def _setup_context(ctx, inputs, output):
    logits, target, ctx.ignore_index = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(logits, target, lse)


def _backward(ctx, dloss, dlse):
    logits, target, lse = ctx.saved_tensors
    if dloss is None or not ctx.needs_input_grad[0]:
        return None, None, None
    return _ops.xent_bwd(dloss, logits, target, lse, ctx.ignore_index), None, None


register_autograd("xent_fwd", _backward, _setup_context)
no_double_backward("xent_bwd")
