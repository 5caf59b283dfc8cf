"""Swap the layers of an existing model for fusedops' fused ones, in place, and
undo it:

    model = fusedops.patch(model)      # norms, MLPs, attention, residual adds
    print(model.fusedops_report)       # what was replaced and what could not be
    fusedops.unpatch(model)            # the original layers again

A module is replaced by changing its class to a subclass of its own class whose
forward calls the fused kernels. Parameters, buffers, hooks, devices, dtypes,
state_dict keys and isinstance checks are unchanged, so an optimizer built
before patching keeps working and checkpoints load both ways; unpatch puts the
original class back.

What is replaced is one table, REPLACEMENTS, from a module class (matched
exactly, not its subclasses, whose forward may differ) to a Replacement: the
patch() flag that enables it and make(module), which returns the class to swap
in (and attributes the new forward reads), or a string saying why this module
cannot be replaced. The plain PyTorch entries are here; fusedops/hf.py adds the
Hugging Face transformers ones once transformers has been imported (a
transformers model cannot exist before). register() adds an entry.
"""
import logging
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import nn as fnn
from .nn import hooked

log = logging.getLogger("fusedops")

FLAGS = ("norm", "swiglu", "attention", "fuse_residual", "loss")
_ORIGINAL = "_fusedops_original_class"  # in a patched module's __dict__: the class to restore
_PREFIX = "_fusedops_"                  # every attribute patching adds starts with this


@dataclass
class Replacement:
    """flag: the patch() argument that enables it. make(module) -> the class to
    swap in, or (class, {name: value}) with attributes the new forward reads
    (stored on the module as _fusedops_<name>), or a string: why not."""
    flag: str
    make: Callable


REPLACEMENTS = {
    torch.nn.LayerNorm: Replacement("norm", lambda m: fnn.LayerNorm),
    torch.nn.RMSNorm: Replacement("norm", lambda m: fnn.RMSNorm),
}


def register(cls, flag, make):
    """Replace modules of exactly class `cls` with make(module) when `flag` is on."""
    if flag not in FLAGS:
        raise ValueError(f"fusedops.patch.register: flag is {flag!r}, expected one of {FLAGS}")
    REPLACEMENTS[cls] = Replacement(flag, make)


# --------------------------------------------------------------- fused classes
def fused_class(original, namespace, mixins=()):
    """A subclass of `original` (and of `mixins`, before it) with the given
    methods (a forward, at least), named Fused<Original> and reachable as
    fusedops.patch.<name>, so that a patched model pickles (where its original
    classes do). One per original."""
    name = "Fused" + original.__name__
    while name in globals():  # made before, or another original of the same name
        if globals()[name].__bases__[-1] is original:
            return globals()[name]
        name += "_"
    cls = type(name, (*mixins, original), {"__module__": __name__, "__qualname__": name,
                                           "_fusedops_fused": True, "_fusedops_base": original,
                                           **namespace})
    globals()[name] = cls
    return cls


def __getattr__(name):
    # Unpickling a patched model in a fresh process: the Fused* classes are
    # made when the tables are built, which needs transformers' entries loaded.
    if name.startswith("Fused"):
        for integration in _integrations(force=True):
            integration.replacements()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_fused(module):
    return getattr(type(module), "_fusedops_fused", False) or type(module) in (fnn.LayerNorm, fnn.RMSNorm)


# --------------------------------------------------------------- the report
@dataclass
class PatchReport:
    """What fusedops.patch did: replaced is [(module path, old class, new class)],
    skipped is [(module path, class, why it was not replaced)], attention is
    [(module path, old implementation, new)], loss [(module path, old loss
    function, new)]."""
    replaced: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    attention: list = field(default_factory=list)
    loss: list = field(default_factory=list)

    def __str__(self):
        lines = [f"fusedops.patch: replaced {len(self.replaced)} module(s)"]
        for (old, new), n in Counter((o, n) for _, o, n in self.replaced).items():
            lines.append(f"  {n} x {old} -> {new}")
        for path, old, new in self.attention:
            lines.append(f"  attention of {path or 'the model'}: {old} -> {new}")
        for path, old, new in self.loss:
            lines.append(f"  loss of {path or 'the model'}: {old} -> {new}")
        if self.skipped:
            lines.append(f"not replaced: {len(self.skipped)} module(s)")
            for (cls, why), paths in _group(self.skipped).items():
                lines.append(f"  {len(paths)} x {cls} ({paths[0] or 'the model'}"
                             f"{', ...' if len(paths) > 1 else ''}): {why}")
        return "\n".join(lines)


def _names(old, new):
    """The two class names of a replacement for the report: the new one with its
    module where the names alone are equal (torch.nn.LayerNorm becomes
    fusedops.nn.LayerNorm, not "LayerNorm -> LayerNorm")."""
    same = old.__name__ == new.__name__
    return old.__name__, f"{new.__module__}.{new.__qualname__}" if same else new.__name__


def _group(skipped):
    out = {}
    for path, cls, why in skipped:
        out.setdefault((cls, why), []).append(path)
    return out


# --------------------------------------------------------------- patch / unpatch
def _check_args(model, flags):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fusedops.patch: model is a {type(model).__name__}, expected a torch.nn.Module")
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise TypeError(f"fusedops.patch: {k} is {v!r} ({type(v).__name__}), expected True or False")


# Integrations with other libraries' models (fusedops.hf for transformers)
# register here, so that this module never imports them: (the module whose
# presence makes one worth loading, a function that loads it). A loaded
# integration has replacements() -> {class: Replacement}, set_attention(model,
# report), set_loss(model, report) and restore_attention(module).
_INTEGRATIONS = []
_failed = set()


def register_integration(trigger, load, name):
    """Have patch() and unpatch() use the integration load() returns once the
    module named `trigger` is imported (a model of its can only exist then):
    patching a plain model never imports transformers. name: for messages."""
    _INTEGRATIONS.append((trigger, load, name))


def _integrations(force=False):
    """The integrations whose trigger is imported (force: every one that
    loads); one that fails to load (a transformers too old, or broken) is
    left out with a warning, once: plain models still patch."""
    loaded = []
    for trigger, load, name in _INTEGRATIONS:
        if not force and trigger not in sys.modules:
            continue
        try:
            loaded.append(load())
        except ImportError as e:
            if trigger not in _failed and not force:
                _failed.add(trigger)
                log.warning("fusedops.patch: %s layers not patched: its integration does not import (%s)",
                            name, e)
    return loaded


def _looks_replaceable(module, flags):
    """Why a module of a class that is not in the table looks like one that
    patching would want to replace (None if it does not): so that the report
    says what stayed as it was."""
    cls = type(module)
    name = cls.__name__
    if is_fused(module) or isinstance(module, fnn.SwiGLU):
        return None
    if flags["norm"] and (name.endswith(("LayerNorm", "RMSNorm"))
                          or isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm))):
        return "no fused replacement for this norm class"
    if flags["swiglu"] and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):
        return "no fused replacement for this MLP class"
    if flags["attention"] and isinstance(module, torch.nn.MultiheadAttention):
        return "torch.nn.MultiheadAttention is not replaced (call fusedops.functional.scaled_dot_product_attention)"
    if flags["fuse_residual"] and name.endswith("DecoderLayer"):
        return "no fused-residual forward for this layer class"
    return None


def _swap(module, made):
    cls, attrs = made if isinstance(made, tuple) else (made, {})
    old = type(module)
    module.__dict__[_ORIGINAL] = old
    for k, v in attrs.items():
        module.__dict__[_PREFIX + k] = v
    module.__class__ = cls
    if hasattr(cls, "_fusedops_patched"):  # what the replacement sets up in the module
        module._fusedops_patched()
    return old


def patch(model, norm=True, swiglu=True, attention=True, fuse_residual=True, loss=True):
    """Replace the layers of `model` that fusedops has fused kernels for, in
    place, and return the model.

    norm: torch.nn.LayerNorm / RMSNorm and the RMSNorms of Hugging Face Llama,
    Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and Gemma 3 (fusedops.hf.FAMILIES).
    swiglu: their gated MLPs. attention: a Hugging
    Face model's attention implementation becomes "fusedops"
    (fusedops.functional.scaled_dot_product_attention). fuse_residual: in their
    decoder layers, the residual add before the post-attention norm and the one
    before the next layer's input norm (or the final norm) become fused
    add+norm calls. loss: a Hugging Face causal LM's loss (ForCausalLMLoss)
    becomes fusedops.hf.causal_lm_loss, the cross-entropy kernel on the logits
    in their own dtype, and the LM heads of those families compute the loss
    of a forward with labels from the last hidden states and lm_head's weight
    without the logits (fusedops.functional.linear_cross_entropy; the
    output's logits are then None).

    The report (model.fusedops_report, also logged to the "fusedops" logger)
    lists what is replaced (by this call or an earlier one) and what was not,
    and why. Patching twice changes nothing more; fusedops.unpatch(model)
    undoes it.

    Patch before wrapping the model (torch.compile, FSDP, LoRA adapters):
    classes a wrapper made (FSDP's, say) are not in the table, and an MLP
    whose projections an adapter wraps runs its original forward."""
    flags = dict(norm=norm, swiglu=swiglu, attention=attention, fuse_residual=fuse_residual, loss=loss)
    _check_args(model, flags)
    integrations = _integrations()
    table = dict(REPLACEMENTS)
    for integration in integrations:
        table.update(integration.replacements())
    report = PatchReport()
    for path, module in model.named_modules():
        if _ORIGINAL in module.__dict__:  # patched before: still in the report
            report.replaced.append((path, *_names(module.__dict__[_ORIGINAL], type(module))))
            continue
        rule = table.get(type(module))
        if rule is None:
            why = _looks_replaceable(module, flags)
            if why:
                report.skipped.append((path, type(module).__name__, why))
            continue
        if not flags[rule.flag]:
            continue
        made = rule.make(module)
        if isinstance(made, str):
            report.skipped.append((path, type(module).__name__, made))
            continue
        old = _swap(module, made)
        report.replaced.append((path, *_names(old, type(module))))
    if fuse_residual:
        _link_residual_chains(model)
    for integration in integrations:
        if attention:
            integration.set_attention(model, report)
        if loss:
            integration.set_loss(model, report)
    model.__dict__["fusedops_report"] = report
    log.info("%s", report)
    for path, cls, why in report.skipped:
        log.debug("fusedops.patch: not replaced: %s (%s): %s", path, cls, why)
    return model


def unpatch(model):
    """Put back every layer fusedops.patch replaced in `model` (and its
    attention implementation and loss function); returns the model."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fusedops.unpatch: model is a {type(model).__name__}, expected a torch.nn.Module")
    integrations = _integrations()
    for module in model.modules():
        original = module.__dict__.get(_ORIGINAL)
        if original is not None:
            module.__class__ = original
        for integration in integrations:
            integration.restore_attention(module)
        for k in [k for k in module.__dict__ if k.startswith(_PREFIX)]:
            del module.__dict__[k]
    model.__dict__.pop("fusedops_report", None)
    return model


# --------------------------------------------------------------- residual chains
def _link_residual_chains(model):
    """Give each fused decoder layer in a ModuleList the norm that reads its
    output next: the next layer's input norm, or for the last layer its
    owner's final norm (and the next layer, whose hooks can_hand_on checks).
    The layer then returns x + residual computed by that norm's fused add+norm
    and hands the norm's output along (see take_prenormed). Only fused norms
    are linked (an unfused one could not use what is handed along)."""
    for owner in model.modules():
        for child in owner.children():
            if not isinstance(child, torch.nn.ModuleList):
                continue
            layers = [m for m in child if getattr(type(m), "_fusedops_input_norm", None)]
            if len(layers) != len(child) or not layers:
                continue
            following = [(getattr(m, m._fusedops_input_norm), m) for m in layers[1:]]
            following.append((getattr(owner, layers[-1]._fusedops_final_norm, None), None))
            for layer, (nxt, nxt_layer) in zip(layers, following):
                if nxt is not None and is_fused(nxt):
                    # not submodules: no new state_dict key
                    layer.__dict__[_PREFIX + "next_norm"] = nxt
                    layer.__dict__[_PREFIX + "next_layer"] = nxt_layer


_HANDED = "_fusedops_prenormed"  # on a residual-stream tensor: (norm module, norm(tensor), its version)


def can_hand_on(layer=None, norm=None):
    """Whether `layer` may hand its next norm's output along with its own.

    Not where a hook could tell: a hook on the layer (a forward hook may edit
    its output in place or return another: the norm must then see that), on
    the norm (called once, with one argument, as unpatched) or on the layer
    after (a pre-hook may change its input). The norm's output handed along is
    also dropped if the tensor it goes with was changed since (take_prenormed).

    Not under saved-tensor hooks: non-reentrant activation checkpointing
    (torch.utils.checkpoint, FSDP's wrapper) recomputes a layer and requires
    the same ops as in its forward, so a norm taken from the layer before in
    the forward and computed in the recomputation fails its check. (Reentrant
    checkpointing runs the forward under no_grad: take_prenormed refuses what
    was made there.) Nor from a layer that FSDP2 shards as a unit of its own
    (fully_shard): the next norm's weight is then a sharded DTensor (FSDP2
    gathers a unit's parameters for its own forward only), or, kept gathered,
    would get its gradient after its unit has reduced its gradients. Nor to a
    norm whose weight is a DTensor, whoever sharded it."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None or top(False) is not None:
        return False
    if layer is not None:
        nxt_layer = layer.__dict__.get(_PREFIX + "next_layer")
        if hooked(layer) or (norm is not None and hooked(norm)) or (nxt_layer is not None and hooked(nxt_layer)):
            return False
    fsdp = sys.modules.get("torch.distributed.fsdp")  # imported wherever fully_shard was called
    if layer is not None and fsdp is not None and isinstance(layer, getattr(fsdp, "FSDPModule", ())):
        return False
    dt = sys.modules.get("torch.distributed.tensor")  # imported wherever a DTensor was made
    return norm is None or dt is None or not any(isinstance(p, dt.DTensor) for p in norm.parameters(recurse=False))


def hand_on(s, norm, y):
    """Attach y = norm(s), computed in a fused add+norm, to the stream tensor s
    for `norm` to take when it is called on s (unchanged: its version counter
    says whether it was written in place since)."""
    setattr(s, _HANDED, (norm, y, s._version))
    return s


def take_prenormed(norm, x):
    """norm(x) if it was computed already for this very tensor, as it is now,
    and norm module (handed on by the layer before) and can be taken here,
    else None. Taken once."""
    handed = getattr(x, _HANDED, None)
    if handed is None or handed[0] is not norm:
        return None
    delattr(x, _HANDED)
    _, y, version = handed
    # x written in place since (by a hook, say): y is stale. y made without
    # autograd while x has it (the layer before ran under no_grad, as
    # reentrant checkpointing runs it): y would cut the graph.
    if x._version != version or y.requires_grad != x.requires_grad:
        return None
    return y if can_hand_on() else None


def add_norm(norm, x, residual):
    """(norm(residual + x), residual + x): one fused call where norm is a fused
    module that no hook watches (a hook sees the norm called as unpatched: once,
    on the sum), the plain add and the module call otherwise."""
    if is_fused(norm) and not hooked(norm):
        return norm.forward(x, residual)
    s = residual + x
    return norm(s), s
