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


def attention_mask(sq, sk, causal=False, window_size=(-1, -1), bottom_right=False, device=None):
    """The (sq, sk) bool mask of fusedops' attention (csrc/attention/attention.h):
    query i sees key j when i + diag - left <= j <= i + diag + right, a side
    of -1 unbounded, causal meaning right = 0; diag is 0 (top-left, torch
    SDPA's is_causal) or, bottom_right, sk - sq (FlashAttention's varlen)."""
    left, right = window_size
    right = 0 if causal else right
    i = torch.arange(sq, device=device)[:, None] + (sk - sq if bottom_right else 0)
    j = torch.arange(sk, device=device)[None, :]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


def attention(q, k, v, causal=False, scale=None, return_lse=False, window_size=(-1, -1), softcap=0.0,
              bottom_right=False):
    """softmax(scale * q k^T) v on (B, S, H, D) tensors, the S x S matrix
    materialised, in the inputs' dtype. k and v have Hkv heads, Hq a multiple
    of Hkv: q head h reads k/v head h // (Hq // Hkv). causal: torch SDPA's
    is_causal, the top-left mask tril(ones(Sq, Sk)); window_size and
    bottom_right: attention_mask's. softcap > 0: each scaled score s becomes
    softcap * tanh(s / softcap) before the mask. Returns out (B, Sq, Hq, D),
    and with return_lse the logsumexp of each score row, (B, Hq, Sq) (-inf and
    out = 0, with no gradient, for a row that sees no key)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    masked = causal or window_size[0] >= 0 or window_size[1] >= 0
    if masked:
        mask = attention_mask(s.shape[-2], s.shape[-1], causal, window_size, bottom_right, s.device)
        s = s.masked_fill(~mask, float("-inf"))
        # A row that sees no key: out 0 (softmax of all -inf would be NaN).
        seen = mask.any(-1, keepdim=True)
        p = s.masked_fill(~seen, 0.0).softmax(-1) * seen
    else:
        p = s.softmax(-1)
    out = (p @ v).transpose(1, 2)
    return (out, s.logsumexp(-1)) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None, return_lse=False,
                     window_size=(-1, -1), softcap=0.0):
    """attention over packed sequences (FlashAttention's varlen layout): q
    (total_q, Hq, D), k and v (total_k, Hkv, D), sequence b the rows
    cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q (k, v likewise), each
    attending within itself, masks aligned bottom-right. Returns out
    (total_q, Hq, D) and with return_lse lse (Hq, total_q)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(cq) - 1):
        o, lse = attention(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]], causal,
                           scale, True, window_size, softcap, bottom_right=True)
        outs.append(o[0])
        lses.append(lse[0])
    out = torch.cat(outs) if outs else q.new_zeros((0, *q.shape[1:]))
    lse = torch.cat(lses, -1) if lses else q.new_zeros((q.shape[1], 0))
    return (out, lse) if return_lse else out


def linear_cross_entropy(input, weight, target, bias=None, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, softcap=0.0):
    """cross_entropy(linear(input, weight, bias), target), the logits capped
    to softcap * tanh(logits / softcap) first when softcap > 0; input [...,
    hidden], target [...]."""
    logits = F.linear(input, weight, bias)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)
    return loss.reshape(target.shape) if reduction == "none" else loss


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
