"""Fake kernels and autograd for fusedops::add_norm_fwd / add_norm_bwd.

Schemas (csrc/library.cpp):
  add_norm_fwd(x, residual?, weight?, bias?, eps, rms, residual_in_fp32, stats=True)
      -> (y, s, mean, rstd)
  add_norm_bwd(dy, ds?, s, weight?, bias?, mean, rstd, rms, need_dweight, need_dbias)
      -> (dx, dweight, dbias)

s is stored only when there is something new to store: with no residual and the
stream kept in x's dtype, s is x itself and the op returns an empty tensor in
its place. mean is empty for RMSNorm; mean and rstd are both empty with
stats=False (no backward will run: the kernels then write neither); dweight/dbias
are empty when not asked for.
"""
import torch

from ._common import check_one_device, no_double_backward, register_autograd



def s_dtype(x, residual, residual_in_fp32):
    """The dtype of the residual stream s = x + residual."""
    if residual is not None:
        return residual.dtype
    return torch.float32 if residual_in_fp32 else x.dtype


def stores_s(x, residual, residual_in_fp32):
    return residual is not None or s_dtype(x, residual, residual_in_fp32) != x.dtype


@torch.library.register_fake("fusedops::add_norm_fwd")
def _add_norm_fwd_fake(x, residual, weight, bias, eps, rms, residual_in_fp32, stats=True):
    check_one_device("add_norm_fwd", x=x, residual=residual, weight=weight, bias=bias)
    rows = _rows(x)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if stores_s(x, residual, residual_in_fp32):
        s = x.new_empty(x.shape, dtype=s_dtype(x, residual, residual_in_fp32))
    else:
        s = x.new_empty((0,))
    mean = x.new_empty((0,) if rms or not stats else (rows,), dtype=torch.float32)
    rstd = x.new_empty((rows,) if stats else (0,), dtype=torch.float32)
    return y, s, mean, rstd


@torch.library.register_fake("fusedops::add_norm_bwd")
def _add_norm_bwd_fake(dy, ds, s, weight, bias, mean, rstd, rms, need_dweight, need_dbias):
    check_one_device("add_norm_bwd", s=s, dy=dy, ds=ds, weight=weight, bias=bias, mean=mean,
                     rstd=rstd)
    dx = s.new_empty(s.shape)
    param = weight if weight is not None else bias
    cols = s.shape[-1]
    pdtype = param.dtype if param is not None else dy.dtype
    dw = s.new_empty((cols,) if need_dweight else (0,), dtype=pdtype)
    db = s.new_empty((cols,) if need_dbias else (0,), dtype=pdtype)
    return dx, dw, db


def _rows(x):
    rows = 1
    for d in x.shape[:-1]:
        rows = rows * d
    return rows


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, rms, residual_in_fp32, stats = inputs  # defaults filled in
    if not stats:
        raise RuntimeError("fusedops.add_norm_fwd: stats is False, expected True when a gradient is "
                           "wanted (the backward needs mean and rstd)")
    _, s, mean, rstd = output
    ctx.rms = rms
    ctx.has_residual = residual is not None
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = residual.dtype if residual is not None else None
    ctx.s_is_x = not stores_s(x, residual, residual_in_fp32)
    ctx.has_weight = weight is not None
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x if ctx.s_is_x else s, weight, bias, mean, rstd)
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, ds, dmean, drstd):
    s, weight, bias, mean, rstd = ctx.saved_tensors
    need_x, need_res, need_w, need_b = ctx.needs_input_grad[:4]
    if dy is None:
        dy = torch.zeros_like(s, dtype=ctx.x_dtype)
    if ctx.s_is_x:
        ds = None  # the op returned an empty placeholder for s
    dx, dw, db = add_norm_bwd(
        dy, ds, s, weight, bias, mean, rstd, ctx.rms,
        bool(need_w and ctx.has_weight), bool(need_b and ctx.has_bias))
    gx = gres = None
    if need_x:
        gx = dx if dx.dtype == ctx.x_dtype else dx.to(ctx.x_dtype)
    if need_res:
        gres = dx if dx.dtype == ctx.residual_dtype else dx.to(ctx.residual_dtype)
    gw = dw if (need_w and ctx.has_weight) else None
    gb = db if (need_b and ctx.has_bias) else None
    return gx, gres, gw, gb, None, None, None, None


# The ops as fusedops calls them (_common.eager_call).
add_norm_fwd = register_autograd("add_norm_fwd", _backward, _setup_context)
add_norm_bwd = no_double_backward("add_norm_bwd")
