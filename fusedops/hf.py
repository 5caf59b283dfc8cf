"""Hugging Face transformers integration (pip install fusedops[hf]).

Importing this module registers "fusedops" in transformers' attention registry,
so that

    import fusedops.hf
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fusedops")

runs attention through fusedops.functional.scaled_dot_product_attention, and
adds the entries of fusedops.patch's table for the Llama, Mistral, Qwen2 and
Qwen3 families (their decoder layers are one code: transformers generates the
others from Llama's), each a forward of fusedops' own:

  <Family>RMSNorm       forward(x) -> fused RMSNorm; forward(x, residual) ->
                        (out, x + residual), the fused add+norm (called so only
                        by the fused decoder layer, where no hook watches)
  <Family>MLP           the fused gated MLP (fusedops.functional.glu_mlp),
                        activations silu and gelu-tanh
  <Family>DecoderLayer  fuse_residual: the residual adds go into the norms after
                        them (see _decoder_forward)
  <Family>Attention     attention: RoPE of q and k in one fused call
                        (fusedops.functional.apply_rotary_pos_emb), or q / k / v
                        projection, RoPE and attention in one (qkv_attention)

and, with fusedops.patch(model, loss=True), a causal LM's loss function
becomes causal_lm_loss: transformers' ForCausalLMLoss on fusedops'
cross-entropy kernel, without the fp32 copy of the logits; and the families'
<Family>ForCausalLM get a forward that, given labels, computes the loss from
the last hidden states and lm_head's weight without the logits at all
(fusedops.functional.linear_cross_entropy; the output's logits are None).

fusedops.patch(model) uses them; nothing here needs calling by hand.
"""
import importlib
import inspect
import warnings

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import functional as F
from .nn import _KERNEL_DTYPES, JointStorage, glu_mlp_of, join_gate_up, join_weights, kernel_dtype, plain_linear
from .patch import Replacement, add_norm, can_hand_on, fused_class, hand_on, take_prenormed

NAME = "fusedops"  # the attn_implementation
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


# --------------------------------------------------------------- attention
_warned = set()


def _unsupported(kwargs):
    """transformers' attention arguments among kwargs that fusedops' attention
    has no equivalent for."""
    return [k for k in ("softcap", "position_bias", "cache", "output_attentions")
            if kwargs.get(k) is not None and kwargs.get(k) is not False]


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention interface (as its sdpa_attention_forward):
    query (B, Hq, Sq, D), key and value (B, Hkv, Sk, D) -> ((B, Sq, Hq, D), None).

    Masks are made by causal_mask (registered below), as for "sdpa" but also
    under torch.compile: None where the causal flag says it all, which is the
    case fusedops' kernels take; a padding
    mask, dropout or what the kernels lack goes to torch's SDPA (a warning the
    first time, from fusedops.functional). Features of transformers' own
    function that this one has no equivalent for (softcap, position_bias, a
    paged cache, output_attentions) go to it whole."""
    extra = _unsupported(kwargs)
    if extra:
        if tuple(extra) not in _warned and not torch.compiler.is_compiling():
            _warned.add(tuple(extra))
            warnings.warn(f"fusedops attention: {', '.join(extra)} not supported; calling "
                          "transformers' sdpa_attention_forward", stacklevel=2)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    # As transformers' sdpa: one query token attends to every key (decoding).
    causal = query.shape[2] > 1 and attention_mask is None and causal
    gqa = query.shape[1] != key.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         is_causal=causal, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


_SDPA_MASK_ARGS = inspect.signature(sdpa_mask)


def causal_mask(*args, **kwargs):
    """transformers' sdpa_mask (same arguments, which differ between its
    versions), except that it also returns None -- the attention's causal flag
    instead of a (B, 1, Sq, Sk) mask -- while torch.compile traces, where
    sdpa_mask materializes the mask (it cannot tell tracing for torch.export
    from torch.compile before torch 2.14). A mask takes the attention to
    torch's SDPA, which then computes every score of the causal square.

    None only where that depends on shapes alone, as sdpa_mask's own skip in
    eager: the caller allows it (no packed sequences, no extra mask functions,
    no compileable cache), no padding mask, no sliding window that the keys
    reach past, an int query offset, and as many keys as queries or one query.
    A padding mask, even all ones, still becomes a mask: its values are not
    read while tracing."""
    a = _SDPA_MASK_ARGS.bind(*args, **kwargs)
    a.apply_defaults()
    p = a.arguments
    q_len = p["q_length"] if "q_length" in p else p["cache_position"].shape[0]
    kv_len, local = p["kv_length"], p.get("local_size")
    if (p.get("allow_is_causal_skip") and p.get("attention_mask") is None
            and not isinstance(p.get("q_offset", 0), torch.Tensor)
            and (local is None or kv_len < local) and (q_len == 1 or q_len == kv_len)):
        return None
    return sdpa_mask(*args, **kwargs)


def register():
    """Make attn_implementation="fusedops" known to transformers (done on import)."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, causal_mask)


register()


def set_attention(model, report):
    """Every Hugging Face (sub)model in `model` to attn_implementation="fusedops",
    remembering the one it had for unpatch."""
    done = set()
    for path, m in model.named_modules():
        if not isinstance(m, PreTrainedModel) or id(m.config) in done:
            continue
        done.update(id(c) for c in _configs(m))
        old = m.config._attn_implementation
        if old == NAME:
            if "_fusedops_attn_implementation" in m.__dict__:  # patched before: still in the report
                report.attention.append((path, m.__dict__["_fusedops_attn_implementation"], NAME))
            continue
        try:
            m.set_attn_implementation(NAME)
        except (ValueError, KeyError) as e:
            report.skipped.append((path, type(m).__name__, f"attention not set: {e}"))
            continue
        if m.config._attn_implementation != NAME:  # transformers declined (and logged why)
            report.skipped.append((path, type(m).__name__, "attention not set: the model does not "
                                   "take an attention implementation from transformers' registry"))
            continue
        m.__dict__["_fusedops_attn_implementation"] = old
        report.attention.append((path, old, NAME))


# --------------------------------------------------------------- the loss
def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                   shift_labels=None, **kwargs):
    """transformers' ForCausalLMLoss (same arguments, same result up to
    rounding: the fp32 mean over the targets that are not ignore_index, or the
    sum over num_items_in_batch) through fusedops.functional's cross-entropy
    kernel, which reads the logits in their own dtype instead of an fp32 copy
    of them. What the kernel does not take goes to ForCausalLMLoss."""
    if shift_labels is None:
        target = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    else:
        target = shift_labels
    flat = logits.reshape(-1, vocab_size)
    target = target.reshape(-1).to(flat.device)
    if F._xent_gap(flat, target, None, 0.0) is not None:
        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index,
                               shift_labels=shift_labels, **kwargs)
    return F._xent_f32(flat, target, ignore_index, "sum" if num_items_in_batch is not None else "mean",
                       num_items_in_batch)


def causal_lm_linear_loss(hidden_states, weight, bias, labels, num_items_in_batch=None, ignore_index=-100,
                          shift_labels=None, softcap=0.0, **kwargs):
    """causal_lm_loss of the logits hidden_states @ weight.T + bias (capped
    by softcap > 0 first, as Gemma 2's final_logit_softcapping) without the
    logits: the same targets (labels shifted by one, or shift_labels), the
    fp32 mean over those that are not ignore_index, or the sum over
    num_items_in_batch."""
    if shift_labels is None:
        target = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    else:
        target = shift_labels
    h = hidden_states.reshape(-1, hidden_states.shape[-1])
    return F._linear_xent_f32(h, weight, target.reshape(-1).to(h.device), bias, ignore_index, "mean",
                              softcap=float(softcap or 0.0), num_items=num_items_in_batch)


def _computes_loss(model):
    """Whether model computes a loss from its logits: a head (LlamaForCausalLM)
    has output embeddings (lm_head) and does; the base model inside it
    (LlamaModel), whose loss_function property also answers ForCausalLMLoss,
    has none and does not."""
    return model.get_output_embeddings() is not None


def set_loss(model, report):
    """Every Hugging Face (sub)model in `model` that computes its loss with
    ForCausalLMLoss to causal_lm_loss, remembering what it had for unpatch."""
    for path, m in model.named_modules():
        if not isinstance(m, PreTrainedModel):
            continue
        if "_fusedops_loss" in m.__dict__:  # patched before: still in the report
            report.loss.append((path, "ForCausalLMLoss", "fusedops.hf.causal_lm_loss"))
            continue
        if not _computes_loss(m) or m.loss_function is not ForCausalLMLoss:
            continue
        m.__dict__["_fusedops_loss"] = m.__dict__.get("_loss_function")
        m.loss_function = causal_lm_loss
        report.loss.append((path, "ForCausalLMLoss", "fusedops.hf.causal_lm_loss"))


def _configs(model):
    return [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]


def restore_attention(module):
    old = module.__dict__.get("_fusedops_attn_implementation")
    if old is not None and isinstance(module, PreTrainedModel):
        module.set_attn_implementation(old)
    if "_fusedops_loss" in module.__dict__:
        old = module.__dict__.pop("_fusedops_loss")
        if old is None:
            module.__dict__.pop("_loss_function", None)
        else:
            module.loss_function = old


# --------------------------------------------------------------- the loss without logits
def _causal_lm_forward(self, *args, **kwargs):
    """The causal LM head given labels: the base model (self.model) with the
    arguments of the original forward but labels and logits_to_keep, then
    causal_lm_linear_loss from its last hidden states and lm_head's weight;
    the output as the original's with logits None. The original forward
    where that is not the same computation: no labels, logits_to_keep, a
    tuple asked for, a loss function other than causal_lm_loss, an lm_head
    that must be called as a module (an adapter, a hook) or whose weight the
    kernels do not take (float64, a sharded DTensor)."""
    kw = {**dict(zip(self._fusedops_arg_names, args)), **kwargs}
    head = self.lm_head
    if (kw.get("labels") is None or kw.get("logits_to_keep", 0) not in (0, None)
            or not kw.get("return_dict", getattr(self.config, "return_dict", True))
            or self.loss_function is not causal_lm_loss or not plain_linear(head)
            or type(head.weight) not in (torch.Tensor, torch.nn.Parameter)
            or F._linear_xent_gap(head.weight, head.weight, head.bias) is not None):
        return self._fusedops_base.forward(self, *args, **kwargs)
    labels = kw.pop("labels")
    kw.pop("logits_to_keep", None)
    outputs = self.model(**kw)
    loss = causal_lm_linear_loss(outputs.last_hidden_state, head.weight, head.bias, labels,
                                 softcap=getattr(self.config, "final_logit_softcapping", None), **kw)
    rest = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
    return CausalLMOutputWithPast(loss=loss, logits=None, **rest)


def _causal_lm_namespace(cls):
    params = _forward_params(cls)
    return {"forward": _causal_lm_forward,
            "_fusedops_arg_names": [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]}


def _make_causal_lm(module):
    params = _forward_params(type(module))
    if not {"labels", "logits_to_keep"} <= {p.name for p in params} or params[-1].kind != params[-1].VAR_KEYWORD:
        return (f"forward{inspect.signature(inspect.unwrap(type(module).forward))}: fusedops' forward takes "
                "labels, logits_to_keep and **kwargs")
    why = _children_problem(module, ("model", "lm_head"))
    if why:
        return f"loss not fused: {why}"
    if not isinstance(module.lm_head, torch.nn.Linear):
        return f"lm_head is a {type(module.lm_head).__name__}, not a torch.nn.Linear"
    return fused_class(type(module), _causal_lm_namespace(type(module)))


# --------------------------------------------------------------- RMSNorm
def _rms_norm_forward(self, hidden_states, residual=None):
    """As the original's forward; with a residual, (norm(x + residual), x + residual)
    in one fused call."""
    x = hidden_states
    if residual is None:
        y = take_prenormed(self, x)
        if y is not None:
            return y
    w = self.weight
    if x.dtype not in _KERNEL_DTYPES or w.dtype not in _KERNEL_DTYPES:  # float64, say: its own math
        s = x if residual is None else residual + x
        y = self._fusedops_base.forward(self, s)
        return y if residual is None else (y, s)
    out_dtype = torch.promote_types(w.dtype, x.dtype)  # the original multiplies in this dtype
    if residual is None:
        y = F.rms_norm(x, w, self.variance_epsilon)
    else:
        y, s = F.fused_add_rms_norm(x, residual, w, self.variance_epsilon)
    y = y if y.dtype == out_dtype else y.to(out_dtype)
    return y if residual is None else (y, s)


_NORM = {"forward": _rms_norm_forward}


def _make_rms_norm(module):
    if not isinstance(getattr(module, "weight", None), torch.nn.Parameter) or module.weight.dim() != 1:
        return "weight is not a 1-D parameter"
    if not isinstance(getattr(module, "variance_epsilon", None), float):
        return "no float variance_epsilon"
    return fused_class(type(module), _NORM)


# --------------------------------------------------------------- MLP
# transformers' activation modules (ACT2FN) the fused MLP computes exactly.
ACTIVATIONS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUTanh": "gelu_tanh",
               "PytorchGELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh"}
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _mlp_forward(self, x):
    """down_proj(act(gate_proj(x)) * up_proj(x)) in fusedops.functional.glu_mlp,
    while the projections are plain torch.nn.Linear with no hook (a LoRA
    wrapper or a hook added after patching makes it the original's forward
    again)."""
    if not (kernel_dtype(x) and all(plain_linear(getattr(self, p)) for p in _PROJECTIONS)):
        return self._fusedops_base.forward(self, x)
    return glu_mlp_of(self, x, self._fusedops_activation)


_MLP = {"forward": _mlp_forward, "_join": join_gate_up, "_fusedops_patched": join_gate_up}


def _make_mlp(module):
    act = ACTIVATIONS.get(type(getattr(module, "act_fn", None)).__name__)
    if act is None:
        return (f"activation {type(getattr(module, 'act_fn', None)).__name__} (the fused MLP "
                f"takes {sorted(set(ACTIVATIONS))})")
    for p in _PROJECTIONS:
        if not plain_linear(getattr(module, p, None)):
            return f"{p} is a {type(getattr(module, p, None)).__name__}, not a plain torch.nn.Linear"
    return fused_class(type(module), _MLP, (JointStorage,)), {"activation": act}


# --------------------------------------------------------------- what the forwards rely on
# The forwards below are fusedops' own, one per module kind of the families
# above (transformers generates the others from Llama's). Whether one fits a
# module is decided from its structure -- its submodules, attributes and the
# arguments of its class's forward -- never from transformers' source text;
# tests/test_patch.py checks each against the installed transformers' module
# (logits and gradients), and CI runs it on the newest transformers and the
# oldest supported. A module that does not fit keeps its own forward and the
# report says why.

def _forward_params(cls):
    """cls.forward's parameters after self (its decorators unwrapped)."""
    return list(inspect.signature(inspect.unwrap(cls.forward)).parameters.values())[1:]


def _cache_name(cls):
    """What cls.forward calls the KV cache argument: `cache` from transformers
    5.24, `past_key_values` before (None: neither)."""
    names = [p.name for p in _forward_params(cls)]
    return next((n for n in ("cache", "past_key_values") if n in names), None)


def _take_cache_name(self, kwargs):
    """kwargs with the KV cache under the name self's original forward takes:
    where that is `cache`, one passed as `past_key_values` (transformers'
    deprecated name, which its forwards still take) is renamed."""
    if self._fusedops_cache_arg == "cache" and "past_key_values" in kwargs:
        old = kwargs.pop("past_key_values")
        if kwargs.get("cache") is None:
            kwargs["cache"] = old
    return kwargs


def _children_problem(module, wanted, optional=()):
    """Why module's submodules are not `wanted` (plus, all or none, `optional`):
    our forward calls exactly those. None when they are."""
    have = {n for n, _ in module.named_children()}
    if have == set(wanted) or have == set(wanted) | set(optional):
        return None
    want = sorted(wanted) + ([f"optionally {sorted(optional)}"] if optional else [])
    return f"submodules {sorted(have)}; fusedops' forward calls {want}"


# --------------------------------------------------------------- decoder layer
def _decoder_forward(self, hidden_states, *args, **kwargs):
    """The decoder layer (input norm, attention, residual add, post-attention
    norm, MLP, residual add) with its residual adds moved into the norms:

        h = input_norm(x)                     # computed by the layer before, if linked
        a = self_attn(h, **the other arguments)
        h, r = post_attention_norm(a, x)      # r = x + a, fused
        m = mlp(h)
        return next_norm(m, r) -> (y, s)      # s = r + m, fused; y goes along with s
                                              # to the next layer's input norm

    The attention gets every argument of the original forward, by name, with
    the original's defaults for those not given (as the original passes them
    on). The last step needs the next norm (linked by fusedops.patch) and is
    plain `r + m` without it, under activation checkpointing, where a hook
    could tell the difference or FSDP2 shards the layer (patch.can_hand_on),
    in inference mode (no version counter to check the hand-over by) and
    under torch.compile (which fuses that add itself)."""
    names = self._fusedops_arg_names
    if len(args) > len(names):
        raise TypeError(f"{type(self).__name__}.forward: {len(args) + 1} positional arguments, "
                        f"expected at most {len(names) + 1}")
    kwargs = _take_cache_name(self, {**self._fusedops_arg_defaults, **dict(zip(names, args)), **kwargs})
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    hidden_states, residual = add_norm(self.post_attention_layernorm, hidden_states, residual)
    hidden_states = self.mlp(hidden_states)
    nxt = self.__dict__.get("_fusedops_next_norm")
    if (nxt is None or (getattr(self, "gradient_checkpointing", False) and self.training)
            or torch.compiler.is_compiling() or residual.is_inference() or not can_hand_on(self, nxt)):
        return residual + hidden_states
    y, s = nxt.forward(hidden_states, residual)  # no hook on nxt (can_hand_on): not called as a module
    return hand_on(s, nxt, y)


_DECODER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def _decoder_namespace(cls):
    params = _forward_params(cls)
    named = [p for p in params[1:] if p.kind == p.POSITIONAL_OR_KEYWORD]
    return {"forward": _decoder_forward, "_fusedops_input_norm": "input_layernorm",
            "_fusedops_final_norm": "norm", "_fusedops_cache_arg": _cache_name(cls),
            "_fusedops_arg_names": [p.name for p in named],
            "_fusedops_arg_defaults": {p.name: p.default for p in named if p.default is not p.empty}}


def _decoder_problem(module):
    params = _forward_params(type(module))
    if not params or params[0].name != "hidden_states" or params[-1].kind != params[-1].VAR_KEYWORD:
        return f"forward{inspect.signature(inspect.unwrap(type(module).forward))}: fusedops' forward " \
               "takes hidden_states first and passes the rest, **kwargs included, to self_attn"
    return _children_problem(module, _DECODER_PARTS)


def _make_decoder(module):
    why = _decoder_problem(module)
    if why:
        return f"decoder layer not fused: {why}"
    return fused_class(type(module), _decoder_namespace(type(module)))


# --------------------------------------------------------------- attention module
_QKV = ("q_proj", "k_proj", "v_proj")
_ATTENTION_PARTS = (*_QKV, "o_proj")
_QK_NORMS = ("q_norm", "k_norm")  # Qwen3: an RMSNorm of each head's q and k before RoPE


def _cache_empty(cache, layer_idx):
    """Whether layer layer_idx of a transformers cache (None: no cache) holds no
    token yet and takes K and V through update(): a DynamicCache (the default,
    filled in training too) whose layer is empty."""
    if cache is None:
        return True
    return isinstance(cache, DynamicCache) and cache.get_seq_length(layer_idx) == 0


def _cache_put(cache, layer_idx, k, v, kwargs):
    """Hand K and V to layer layer_idx of a cache that _cache_empty found
    empty. A layer as DynamicCache makes them by default (a DynamicLayer,
    whose update() would cat K and V onto empty tensors: a copy of each)
    takes the tensors as they are: views of the packed q / k / v tensor that
    the backward keeps anyway (the copies cost 2.7 ms a step of the ANCHORS
    Llama on an H100, 1.5 ms as inductor's clone). Any other layer or cache
    (offloading, a sliding window, a subclass) gets its own update()."""
    if type(cache) is DynamicCache and type(cache).update is Cache.update and not getattr(
            cache, "offloading", True):
        if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
            while len(cache.layers) <= layer_idx:  # what Cache.update does first
                cache.layers.append(DynamicLayer())
        layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
        if type(layer) is DynamicLayer:
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            return
    _cache_update(cache, layer_idx, k, v, kwargs)


def _cache_update(cache, layer_idx, k, v, kwargs):
    # The attention's other arguments go along as `kwargs` (transformers 5.24's
    # call: a paged cache reads them; every cache's update() takes **kwargs).
    return cache.update(k, v, layer_idx, kwargs=kwargs)


def _sliding_window(self):
    """The sliding_window argument the family's attention hands the attention
    function: Qwen2's and Qwen3's hold it per layer (None on full-attention
    layers), Mistral's config holds it, Llama's neither (None)."""
    if hasattr(self, "sliding_window"):
        return self.sliding_window
    return getattr(self.config, "sliding_window", None)


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
    """The attention module of the Llama, Mistral, Qwen2 and Qwen3 families:

        q, k, v = q_proj(x), k_proj(x), v_proj(x)     # as (B, H, S, D) heads
        q, k = q_norm(q), k_norm(k)                   # Qwen3 only (per head, before RoPE)
        q, k = RoPE(q, k)                             # fusedops.functional.apply_rotary_pos_emb
        k, v = cache.update(k, v)                     # if a cache is given
        o = attention(q, k, v, mask)                  # the config's attention implementation
        return o_proj(o), attention weights (or None)

    or, where it computes the same, one call to fusedops.functional.qkv_attention:
    the q, k, v projections as one matmul, RoPE in place, our attention
    kernels, a backward that sums nothing. That is when attention is
    fusedops' and causal without a mask, no dropout, no q / k norms, the
    cache (if any) has no tokens of this layer yet (training, or a prompt's
    first forward) and the projections are plain torch.nn.Linear with no
    hook. transformers' cache then receives K and V outside autograd (see
    qkv_attention)."""
    if args:
        kwargs[self._fusedops_cache_arg] = args[0]
    cache = _take_cache_name(self, kwargs).pop(self._fusedops_cache_arg, None)
    x = hidden_states
    fast = (self.config._attn_implementation == NAME and attention_mask is None
            and position_embeddings is not None and not (self.training and self.attention_dropout)
            and getattr(self, "is_causal", True) and x.dim() == 3 and not self._fusedops_qk_norm
            and not _unsupported(kwargs)
            and all(plain_linear(getattr(self, p)) for p in _QKV)
            and _cache_empty(cache, self.layer_idx))
    if fast:
        cos, sin = position_embeddings
        q, k, v = (getattr(self, p) for p in _QKV)
        hq, hkv = q.out_features // self.head_dim, k.out_features // self.head_dim
        if F._qkv_gap(x, q.weight, k.weight, v.weight, q.bias, k.bias, v.bias, cos, sin, hq, hkv) is None:
            res = F._qkv_fused(x, q.weight, k.weight, v.weight, cos, sin, hq, hkv, q.bias, k.bias, v.bias,
                               scale=self.scaling, causal=x.shape[1] > 1, return_kv=cache is not None)
            if cache is not None:
                res, kc, vc = res
                _cache_put(cache, self.layer_idx, kc, vc, kwargs)
            return self.o_proj(res), None

    input_shape = x.shape[:-1]
    heads = (*input_shape, -1, self.head_dim)
    q = self.q_proj(x).view(heads)
    q = self.q_norm(q) if self._fusedops_qk_norm else q
    k = self.k_proj(x).view(heads)
    k = self.k_norm(k) if self._fusedops_qk_norm else k
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), self.v_proj(x).view(heads).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = F.apply_rotary_pos_emb(q, k, cos, sin)
    if cache is not None:
        k, v = _cache_update(cache, self.layer_idx, k, v, kwargs)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._fusedops_eager)
    out, weights = attend(self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                          scaling=self.scaling, sliding_window=_sliding_window(self), **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _join_qkv(self):
    """q, k and v in one storage, for the joint path (not taken with q / k norms)."""
    if not self._fusedops_qk_norm:
        join_weights(self, _QKV)


def _attention_namespace(cls, eager):
    """The fused class's attributes for attention class cls; eager: the
    family's eager_attention_forward (what transformers' forward calls for
    attn_implementation "eager")."""
    return {"forward": _attention_forward, "_join": _join_qkv, "_fusedops_patched": _join_qkv,
            "_fusedops_cache_arg": _cache_name(cls), "_fusedops_eager": staticmethod(eager),
            "_fusedops_qk_norm": False}


_ATTENTION_ARGS = ["hidden_states", "position_embeddings", "attention_mask"]
_ATTENTION_NUMBERS = {"head_dim": int, "layer_idx": int, "scaling": (int, float), "attention_dropout": (int, float)}


def _attention_problem(module):
    cls = type(module)
    params = _forward_params(cls)
    names = [p.name for p in params]
    if names[:-1] != [*_ATTENTION_ARGS, _cache_name(cls)] or params[-1].kind != params[-1].VAR_KEYWORD:
        return (f"forward{inspect.signature(inspect.unwrap(cls.forward))}: fusedops' forward takes "
                f"{', '.join(_ATTENTION_ARGS)}, the cache (cache or past_key_values), **kwargs")
    for name, kind in _ATTENTION_NUMBERS.items():
        if not isinstance(getattr(module, name, None), kind) or isinstance(getattr(module, name), bool):
            return f"{name} is {getattr(module, name, None)!r}, fusedops' forward needs a number"
    if not hasattr(getattr(module, "config", None), "_attn_implementation"):
        return "no config with an _attn_implementation"
    return _children_problem(module, _ATTENTION_PARTS, _QK_NORMS)


def _make_attention(module, eager):
    why = _attention_problem(module)
    if why:
        return f"attention not fused: {why}"
    qk_norm = hasattr(module, "q_norm")
    return fused_class(type(module), _attention_namespace(type(module), eager), (JointStorage,)), {"qk_norm": qk_norm}


# --------------------------------------------------------------- the table
_table = None


def replacements():
    """{class: Replacement} for the families above that this transformers has.
    Whether a module fits its fused forward is checked per module when
    patching (the _make_* functions); a report line says why not where not."""
    global _table
    if _table is not None:
        return _table
    table = {}
    for module_name, prefix in FAMILIES.items():
        try:
            mod = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
        except ImportError:
            continue
        norm, mlp, decoder, attn, head = (getattr(mod, prefix + s, None)
                                          for s in ("RMSNorm", "MLP", "DecoderLayer", "Attention", "ForCausalLM"))
        eager = getattr(mod, "eager_attention_forward", None)
        entries = [(norm, "norm", _make_rms_norm, _NORM, ()), (mlp, "swiglu", _make_mlp, _MLP, (JointStorage,))]
        if decoder is not None:
            entries.append((decoder, "fuse_residual", _make_decoder, _decoder_namespace(decoder), ()))
        if attn is not None and eager is not None:
            entries.append((attn, "attention", lambda m, eager=eager: _make_attention(m, eager),
                            _attention_namespace(attn, eager), (JointStorage,)))
        if head is not None:
            entries.append((head, "loss", _make_causal_lm, _causal_lm_namespace(head), ()))
        for cls, flag, make, namespace, mixins in entries:
            if cls is not None:
                table[cls] = Replacement(flag, make)
                fused_class(cls, namespace, mixins)  # made now, so that unpickling finds it
    _table = table
    return table
