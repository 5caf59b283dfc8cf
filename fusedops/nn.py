"""Drop-in modules. Each subclasses the torch.nn module it replaces, so the
constructor, parameters, state_dict and repr are torch's own; only forward
changes, and it gains an optional residual:

    y = norm(x)                      # as torch.nn.LayerNorm / RMSNorm
    y, s = norm(x, residual)         # s = x + residual, y = norm(s)
"""
import math

import torch

from . import functional as F, reference

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def kernel_dtype(x):
    """Whether the kernels take x (its autocast dtype, under autocast)."""
    return (F.autocast_dtype(x.device.type) or x.dtype) in _KERNEL_DTYPES


def hooked(module):
    """Whether a hook would see module being called: one of its own forward,
    forward-pre or backward hooks, or a global one (torch.nn.modules.module's
    register_module_*_hook). A fused path that skips a module's call (reads
    its weights, or calls its forward with other arguments) is only taken when
    no hook is there to notice."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _global_hooks())


def _global_hooks():
    g = torch.nn.modules.module
    return (g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks
            or g._global_backward_pre_hooks)


def plain_linear(m):
    """Whether m is a torch.nn.Linear whose weights a fused op may read in place
    of calling it: exactly that class (not a subclass, such as an adapter's,
    whose forward adds to it) and no hook on it."""
    return type(m) is torch.nn.Linear and not hooked(m)


def glu_mlp_of(module, x, activation):
    """F.glu_mlp with the weights of a module holding gate_proj, up_proj and
    down_proj (torch.nn.Linear): fusedops.nn.SwiGLU and the patched MLPs."""
    g, u, d = module.gate_proj, module.up_proj, module.down_proj
    return F.glu_mlp(x, g.weight, u.weight, d.weight, g.bias, u.bias, d.bias, activation)


def join_weights(module, names):
    """Put the weights of module's projections `names` (torch.nn.Linear of one
    input size) one after another in one storage, so that they run as one
    matmul (see fusedops.functional._joint_weight): gate and up of the MLPs,
    q, k and v of the attention. The parameters stay separate, with their
    names, values and identities (optimizers holding them are unaffected);
    only where they live changes. To be done again after .to() and the like,
    which give each parameter storage of its own."""
    ws = [getattr(module, n).weight for n in names]
    w0 = ws[0]
    if (any(type(w) is not torch.nn.Parameter or w.dim() != 2 or w.shape[1] != w0.shape[1]
            or w.dtype != w0.dtype or w.device != w0.device or w.numel() == 0 for w in ws)
            or w0.device.type == "meta" or F._joint_weight(*ws) is not None):
        return
    parts = torch.cat([w.detach() for w in ws]).split([w.shape[0] for w in ws])
    for w, part in zip(ws, parts):
        w.data = part


def join_gate_up(module):
    """join_weights of gate_proj and up_proj (fusedops.nn.SwiGLU, the patched MLPs)."""
    if module.gate_proj.weight.shape == module.up_proj.weight.shape:
        join_weights(module, ("gate_proj", "up_proj"))


class JointStorage:
    """A mixin for a module class whose projections self._join() puts in one
    storage (join_weights): .to() and the like give each parameter storage of
    its own, and so do copy.deepcopy and pickle (which copy the parameters one
    by one, then call __setstate__), so both join again after nn.Module's own."""

    def _join(self):
        raise NotImplementedError

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self._join()
        return out

    def __setstate__(self, state):
        super().__setstate__(state)
        self._join()


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


class SwiGLU(JointStorage, torch.nn.Module):
    """The MLP of Llama-family models, down_proj(silu(gate_proj(x)) * up_proj(x)),
    with the parameter names of Hugging Face's LlamaMLP (gate_proj, up_proj,
    down_proj: torch.nn.Linear), so its state_dict loads as is.

    The gated product runs as one fused kernel, and the backward keeps x and
    the two projections only, recomputing the activation instead of storing it
    (eager PyTorch stores silu(gate) and the product as well). gate_proj's and
    up_proj's weights live side by side in one allocation, so that both
    projections are one matmul; the state_dict is unchanged.
    activation="gelu_tanh" gives the GeGLU MLP.

    The fused path reads the projections' weights, so it is taken only while
    they are plain torch.nn.Linear with no hook (plain_linear); an adapter's
    Linear subclass (LoRA) or a hook makes the forward call them as modules."""

    def __init__(self, hidden_size, intermediate_size, bias=False, activation="silu", device=None,
                 dtype=None):
        super().__init__()
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"fusedops.nn.SwiGLU: activation is {activation!r}, "
                             "expected 'silu' or 'gelu_tanh'")
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation = activation
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, **kw)
        self._join()

    _join = join_gate_up

    def forward(self, x):
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        if kernel_dtype(x) and plain_linear(g) and plain_linear(u) and plain_linear(d):
            return glu_mlp_of(self, x, self.activation)
        # float64, say, or a projection that must be called as a module (an
        # adapter's Linear subclass, a hook): the same math, module by module.
        return d(reference.glu(g(x), u(x), self.activation))

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"activation={self.activation!r}")


class LinearCrossEntropy(torch.nn.Module):
    """The loss of a language-model head without its logits: forward(input,
    weight, target, bias=None) is cross_entropy(input @ weight.T + bias,
    target) with the settings of torch.nn.CrossEntropyLoss (ignore_index,
    reduction, label_smoothing) and softcap (> 0: the logits capped to
    softcap * tanh(logits / softcap) first, as Gemma 2's final layer does).
    It holds no parameter: pass the head's weight (lm_head.weight), as
    Liger-Kernel's LigerFusedLinearCrossEntropyLoss takes it.
    fusedops.functional.linear_cross_entropy does the work."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=0.0):
        super().__init__()
        if reduction not in ("none", "mean", "sum"):
            raise ValueError(f"fusedops.nn.LinearCrossEntropy: reduction is {reduction!r}, "
                             "expected 'none', 'mean' or 'sum'")
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.softcap = label_smoothing, softcap

    def forward(self, input, weight, target, bias=None):
        return F.linear_cross_entropy(input, weight, target, bias, self.ignore_index, self.reduction,
                                      self.label_smoothing, self.softcap)

    def extra_repr(self):
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, softcap={self.softcap}")


__all__ = ["LayerNorm", "RMSNorm", "SwiGLU", "LinearCrossEntropy"]
