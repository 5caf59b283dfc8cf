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


def glu(gate, up, activation="silu"):
    """act(gate) * up: SwiGLU (silu) or GeGLU (gelu_tanh)."""
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"activation {activation!r}, expected 'silu' or 'gelu_tanh'")


def glu_packed(gate_up, activation="silu"):
    """glu of the two halves of the last dimension, [gate | up]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return glu(gate, up, activation)


def glu_mlp(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, activation="silu"):
    """The Llama MLP: down_proj(act(gate_proj(x)) * up_proj(x))."""
    h = glu(F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up), activation)
    return F.linear(h, w_down, b_down)


def rope(q, k, cos, sin, unsqueeze_dim=1):
    """Hugging Face's apply_rotary_pos_emb: x * cos + rotate_half(x) * sin for
    x in (q, k), rotate_half(x) = cat(-x2, x1) of x's halves; cos and sin
    unsqueezed at unsqueeze_dim to broadcast over the heads."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def attention(q, k, v, causal=False, scale=None, return_lse=False):
    """softmax(scale * q k^T) v on (B, S, H, D) tensors, the S x S matrix
    materialised, in the inputs' dtype. k and v have Hkv heads, Hq a multiple
    of Hkv: q head h reads k/v head h // (Hq // Hkv). causal: torch SDPA's
    is_causal, the top-left mask tril(ones(Sq, Sk)). Returns out (B, Sq, Hq, D),
    and with return_lse the logsumexp of each score row, (B, Hq, Sq) (-inf and
    out = 0 for a row with no key)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    out = (s.softmax(-1) @ v).transpose(1, 2)
    return (out, s.logsumexp(-1)) if return_lse else out


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
