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


def adam_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, *, lr, beta1, beta2, eps,
              weight_decay=0.0, decoupled_weight_decay=False, amsgrad=False, maximize=False,
              grad_scale=None):
    """One Adam (or, with decoupled_weight_decay, AdamW) step of one tensor, out of
    place, computed in the tensors' own dtype: the math of torch.optim.Adam's
    for-loop implementation. step is the count including this step (1 on the
    first); grad_scale divides the gradient (GradScaler's scale). Returns
    (param, exp_avg, exp_avg_sq, max_exp_avg_sq), the last None without amsgrad."""
    lr = float(lr)
    g = grad if grad_scale is None else grad / float(grad_scale)
    if maximize:
        g = -g
    if weight_decay != 0:
        if decoupled_weight_decay:
            param = param * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * param
    exp_avg = exp_avg + (1 - beta1) * (g - exp_avg)
    exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * g * g
    v = exp_avg_sq
    if amsgrad:
        max_exp_avg_sq = v = torch.maximum(max_exp_avg_sq, exp_avg_sq)
    else:
        max_exp_avg_sq = None
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    denom = v.sqrt() / bias_correction2 ** 0.5 + eps
    param = param - (lr / bias_correction1) * exp_avg / denom
    return param, exp_avg, exp_avg_sq, max_exp_avg_sq
