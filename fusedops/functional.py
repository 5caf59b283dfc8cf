"""Public functions of fusedops. Each is one custom op call plus argument
handling; autograd and torch.compile support come from fusedops/ops."""
import torch

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
