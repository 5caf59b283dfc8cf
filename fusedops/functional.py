"""Public functions of fusedops. Each is one custom op call plus argument
handling; autograd and torch.compile support come from fusedops/ops."""
import warnings

import torch
import torch.nn.functional as F

_ops = torch.ops.fusedops


def _param(t, x):
    # Parameters may be in x's dtype or fp32. Anything else (an fp16 weight under
    # bf16 autocast, say) is widened to fp32, which is exact for fp16/bf16.
    if t is None or t.dtype in (x.dtype, torch.float32):
        return t
    return t.float()


def _add_norm(x, residual, weight, bias, eps, rms, residual_in_fp32):
    y, s, _, _ = _ops.add_norm_fwd(
        x, residual, _param(weight, x), _param(bias, x), float(eps), rms, residual_in_fp32)
    if s.numel() == 0 and s.shape != x.shape:  # s was not stored: it is x
        s = x
    return y, s


def fused_add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, residual_in_fp32=False):
    """s = x + residual; out = layer_norm(s) * weight + bias. Returns (out, s).

    residual may be None (s = x). The stream s keeps residual's dtype, which may
    be x's or fp32; with residual None and residual_in_fp32, s is x in fp32."""
    return _add_norm(x, residual, weight, bias, eps, False, residual_in_fp32)


def fused_add_rms_norm(x, residual, weight=None, eps=1e-6, residual_in_fp32=False):
    """s = x + residual; out = rms_norm(s) * weight. Returns (out, s)."""
    return _add_norm(x, residual, weight, None, eps, True, residual_in_fp32)


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """LayerNorm over the last dimension of x."""
    return _add_norm(x, None, weight, bias, eps, False, False)[0]


def rms_norm(x, weight=None, eps=1e-6):
    """RMSNorm over the last dimension of x."""
    return _add_norm(x, None, weight, None, eps, True, False)[0]


# --------------------------------------------------------------------------- attention

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Head dims the CUDA kernels take (csrc/attention/attention_fwd_cuda.cu), and
# below whether each direction is built; the CPU kernels take every head dim
# and dtype above.
CUDA_HEAD_DIMS = (64, 128)


def _has_cuda_kernel(op):
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"fusedops::{op}", "CUDA")


_CUDA_FWD, _CUDA_BWD = _has_cuda_kernel("attn_fwd"), _has_cuda_kernel("attn_bwd")


def _needs_grad(*ts):
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _cuda_gap(dtype, head_dim, needs_grad):
    """Why the CUDA kernels cannot take a call (None if they can)."""
    if not _CUDA_FWD:
        return "no CUDA attention kernels in this build"
    if dtype == torch.float32:
        return "float32 on CUDA (the CUDA kernels take float16 and bfloat16)"
    if head_dim not in CUDA_HEAD_DIMS:
        return f"head dim {head_dim} on CUDA (the CUDA kernels take {CUDA_HEAD_DIMS})"
    if needs_grad and not _CUDA_BWD:
        return "backward on CUDA (no CUDA attention backward kernel in this build)"
    return None


def _default_scale(q):
    return q.shape[-1] ** -0.5 if q.shape[-1] else 1.0


def flash_attention(q, k, v, causal=False, scale=None, deterministic=False):
    """softmax(scale * q k^T) v on (batch, seq, heads, head_dim) tensors, without
    materialising the seq x seq matrix. Returns (B, Sq, Hq, D).

    k and v are (B, Sk, Hkv, D) with Hq a multiple of Hkv (grouped-query and
    multi-query attention, K/V not repeated). Inputs are read through their
    strides (unit stride along head_dim; transposed (B, H, S, D) views need no
    copy). causal: torch SDPA's is_causal, the top-left mask tril(ones(Sq, Sk)).
    scale defaults to 1/sqrt(head_dim). deterministic: bitwise-repeatable
    gradients. Raises where the kernels do not apply (never falls back)."""
    if q.device.type == "cuda":
        gap = _cuda_gap(q.dtype, q.shape[-1], _needs_grad(q, k, v))
        if gap is not None:
            raise RuntimeError(f"fusedops.flash_attention: not supported: {gap}")
    if scale is None:
        scale = _default_scale(q)
    out, _ = _ops.attn_fwd(q, k, v, float(scale), bool(causal), bool(deterministic))
    return out


_warned = set()


def _sdpa_gap(q, k, v, attn_mask, dropout_p, enable_gqa):
    """Why fusedops' kernels cannot take this scaled_dot_product_attention call
    (None if they can); torch's function then runs it (and raises what it raises)."""
    if attn_mask is not None:
        return "attn_mask"
    if dropout_p > 0.0:
        return "dropout_p > 0"
    if q.dim() < 3 or not (q.dim() == k.dim() == v.dim()):
        return "inputs of rank below 3 or of different ranks"
    if q.dtype not in _KERNEL_DTYPES or not (q.dtype == k.dtype == v.dtype):
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}"
    if not (q.device == k.device == v.device) or q.device.type not in ("cpu", "cuda"):
        return f"devices {q.device}, {k.device}, {v.device}"
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-1] != v.shape[:-1]:
        return "batch dims that differ (broadcasting)"
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]) or q.shape[-1] == 0:
        return "head dims that differ between q, k and v, or are 0"
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq != hkv and not (enable_gqa and hkv > 0 and hq % hkv == 0):
        return "q and k head counts that differ without enable_gqa (or do not divide)"
    if q.device.type == "cuda":
        return _cuda_gap(q.dtype, q.shape[-1], _needs_grad(q, k, v))
    return None


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention, same signature and
    results, on (..., heads, seq, head_dim) tensors. Calls fusedops' kernels
    where they apply (on the CPU: float32, float16 and bfloat16, any head dim;
    no mask, no dropout) and torch's function otherwise, with a warning the
    first time for each reason."""
    q, k, v = query, key, value
    gap = _sdpa_gap(q, k, v, attn_mask, dropout_p, enable_gqa)
    if gap is not None:
        if gap not in _warned:
            _warned.add(gap)
            warnings.warn(f"fusedops.functional.scaled_dot_product_attention: {gap} is not "
                          "supported by fusedops' kernels; calling torch's", stacklevel=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    lead = q.shape[:-3]

    def bshd(t):  # (..., H, S, D) -> (B, S, H, D): a view for 3-D and 4-D tensors
        return t.reshape(-1, *t.shape[-3:]).transpose(1, 2)
    if scale is None:
        scale = _default_scale(q)
    out, _ = _ops.attn_fwd(bshd(q), bshd(k), bshd(v), float(scale), bool(is_causal), False)
    out = out.transpose(1, 2)  # (B, H, S, D), a view
    return out.reshape(*lead, *out.shape[1:])
