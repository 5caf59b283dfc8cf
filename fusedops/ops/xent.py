"""Fake kernels and autograd for fusedops::xent_fwd / xent_bwd (cross-entropy).

Schemas (csrc/library.cpp):
  xent_fwd(logits, target, ignore_index, label_smoothing=0, softcap=0, reduction="none")
      -> (loss, lse, count)
  xent_bwd(dloss, logits, target, lse, ignore_index, label_smoothing=0, softcap=0, count=None) -> dlogits
  xent_fwd_bwd_(logits!, target, dloss, ignore_index, label_smoothing=0, softcap=0) -> loss
      # xent_bwd's dlogits written over the logits (fusedops/ops/linear_xent.py)

logits [rows, classes] (fp32, fp16 or bf16), target [rows] int64; lse is fp32
[rows]; loss is fp32 [rows] with reduction "none", else the mean or sum of the
rows (0-d), reduced in the kernel, with count (0-d fp32) the rows not
ignored, by which the mean's backward divides ("none": count is empty). The
backward reads the saved logits and lse again: nothing of the size of the
logits is kept beyond the logits themselves. lse and count take no
gradient; target none either."""
import torch

from ._common import check_one_device, no_double_backward, register_autograd, register_mutating

REDUCTIONS = ("none", "mean", "sum")


def check_reduction(op, reduction):
    """Raise a RuntimeError naming op unless reduction is one of REDUCTIONS."""
    if reduction not in REDUCTIONS:
        raise RuntimeError(f"fusedops.{op}: reduction is {reduction!r}, expected 'none', 'mean' or 'sum'")


@torch.library.register_fake("fusedops::xent_fwd")
def _xent_fwd_fake(logits, target, ignore_index, label_smoothing=0.0, softcap=0.0, reduction="none"):
    check_one_device("xent_fwd", logits=logits, target=target)
    check_reduction("xent_fwd", reduction)
    rows = logits.shape[0]
    reduced = reduction != "none"
    return (logits.new_empty(() if reduced else (rows,), dtype=torch.float32),
            logits.new_empty((rows,), dtype=torch.float32),
            logits.new_empty(() if reduced else (0,), dtype=torch.float32))


@torch.library.register_fake("fusedops::xent_bwd")
def _xent_bwd_fake(dloss, logits, target, lse, ignore_index, label_smoothing=0.0, softcap=0.0, count=None):
    check_one_device("xent_bwd", dloss=dloss, logits=logits, target=target, lse=lse, count=count)
    return logits.new_empty(logits.shape)


@torch.library.register_fake("fusedops::xent_fwd_bwd_")
def _xent_fwd_bwd_fake(logits, target, dloss, ignore_index, label_smoothing=0.0, softcap=0.0):
    check_one_device("xent_fwd_bwd_", logits=logits, target=target, dloss=dloss)
    return logits.new_empty((logits.shape[0],), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    logits, target, ignore_index, label_smoothing, softcap, reduction = inputs
    _, lse, count = output
    ctx.args = ignore_index, label_smoothing, softcap
    ctx.mark_non_differentiable(lse, count)
    ctx.set_materialize_grads(False)  # no zero tensors made for lse's and count's gradients
    ctx.save_for_backward(logits, target, lse, count if reduction == "mean" else None)


def _backward(ctx, dloss, dlse, dcount):
    logits, target, lse, count = ctx.saved_tensors
    if dloss is None or not ctx.needs_input_grad[0]:
        return None, None, None, None, None, None
    return xent_bwd(dloss, logits, target, lse, *ctx.args, count), None, None, None, None, None


# The ops as fusedops calls them (_common.eager_call).
xent_fwd = register_autograd("xent_fwd", _backward, _setup_context)
xent_bwd = no_double_backward("xent_bwd")
xent_fwd_bwd_ = register_mutating("xent_fwd_bwd_")
