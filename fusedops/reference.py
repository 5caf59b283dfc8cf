"""The plain-PyTorch math of every fusedops op.

Tests run these in float64 as the ground truth and in the kernels' own low
precision as the error yardstick (the 2x rule); benchmarks run them as the
eager baseline and under torch.compile."""
import torch
import torch.nn.functional as F


def add_norm(x, residual, weight, bias, eps, rms, residual_in_fp32=False):
    """s = x + residual (in residual's dtype); y = norm(s) in x's dtype.
    Returns (y, s)."""
    if residual is not None:
        s = x.to(residual.dtype) + residual
    else:
        s = x.float() if residual_in_fp32 else x
    h = (s.shape[-1],)
    # Mixed dtypes (bf16 s, fp32 weight) compute in the wider one, as eager
    # torch does under autocast; some backends reject the mix outright.
    ct = s.dtype
    for p in (weight, bias):
        if p is not None:
            ct = torch.promote_types(ct, p.dtype)
    cast = (lambda t: t if t is None or t.dtype == ct else t.to(ct))
    if rms:
        y = F.rms_norm(cast(s), h, cast(weight), eps)
    else:
        y = F.layer_norm(cast(s), h, cast(weight), cast(bias), eps)
    return y.to(x.dtype), s
