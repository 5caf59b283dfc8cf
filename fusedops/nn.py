"""Drop-in modules. Each subclasses the torch.nn module it replaces, so the
constructor, parameters, state_dict and repr are torch's own; only forward
changes, and it gains an optional residual:

    y = norm(x)                      # as torch.nn.LayerNorm / RMSNorm
    y, s = norm(x, residual)         # s = x + residual, y = norm(s)
"""
import math

import torch

from . import functional as F

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _flatten(module, x):
    """View x as [..., prod(normalized_shape)], checking the trailing shape as
    torch does."""
    shape = tuple(module.normalized_shape)
    if tuple(x.shape[x.dim() - len(shape):]) != shape or x.dim() < len(shape):
        raise RuntimeError(
            f"fusedops.nn.{type(module).__name__}: input of shape {tuple(x.shape)} does not end "
            f"with normalized_shape {shape}")
    if len(shape) == 1:
        return x, lambda t: t
    lead = x.shape[:x.dim() - len(shape)]
    return x.reshape(*lead, math.prod(shape)), lambda t: t.reshape(*lead, *shape)


def _flat(p):
    return None if p is None else p.reshape(-1)


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm backed by fusedops' fused residual-add + LayerNorm."""

    def forward(self, x, residual=None):
        if x.dtype not in _KERNEL_DTYPES:  # e.g. float64: torch's own math
            s = x if residual is None else x + residual
            y = torch.nn.functional.layer_norm(s, self.normalized_shape, self.weight, self.bias, self.eps)
            return y if residual is None else (y, s)
        xf, unflat = _flatten(self, x)
        if residual is None:
            return unflat(F.layer_norm(xf, _flat(self.weight), _flat(self.bias), self.eps))
        rf, _ = _flatten(self, residual)
        y, s = F.fused_add_layer_norm(xf, rf, _flat(self.weight), _flat(self.bias), self.eps)
        return unflat(y), unflat(s)


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm backed by fusedops' fused residual-add + RMSNorm.
    eps=None means torch.finfo(dtype).eps of the normalised tensor, as in torch."""

    def forward(self, x, residual=None):
        if x.dtype not in _KERNEL_DTYPES:
            s = x if residual is None else x + residual
            y = torch.nn.functional.rms_norm(s, self.normalized_shape, self.weight, self.eps)
            return y if residual is None else (y, s)
        s_dtype = x.dtype if residual is None else residual.dtype
        eps = self.eps if self.eps is not None else torch.finfo(s_dtype).eps
        xf, unflat = _flatten(self, x)
        if residual is None:
            return unflat(F.rms_norm(xf, _flat(self.weight), eps))
        rf, _ = _flatten(self, residual)
        y, s = F.fused_add_rms_norm(xf, rf, _flat(self.weight), eps)
        return unflat(y), unflat(s)


__all__ = ["LayerNorm", "RMSNorm"]
