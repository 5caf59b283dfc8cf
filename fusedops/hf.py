"""Hugging Face transformers integration (pip install fusedops[hf]).

Importing this module registers "fusedops" in transformers' attention registry,
so that

    import fusedops.hf
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fusedops")

runs attention through fusedops.functional.scaled_dot_product_attention, and
adds the entries of fusedops.patch's table for the Llama, Mistral, Qwen2 and
Qwen3 families (their decoder layers are one code: transformers generates the
others from Llama's):

  <Family>RMSNorm       forward(x) -> fused RMSNorm; forward(x, residual) ->
                        (out, x + residual), the fused add+norm
  <Family>MLP           the fused gated MLP (fusedops.functional.glu_mlp),
                        activations silu and gelu-tanh
  <Family>DecoderLayer  fuse_residual: the residual adds go into the norms after
                        them (see _decoder_forward)
  <Family>Attention     attention: its own forward, with RoPE of q and k in one
                        fused call (fusedops.functional.apply_rotary_pos_emb)

and, with fusedops.patch(model, loss=True), a causal LM's loss function
becomes causal_lm_loss: transformers' ForCausalLMLoss on fusedops'
cross-entropy kernel, without the fp32 copy of the logits.

fusedops.patch(model) uses them; nothing here needs calling by hand.
"""
import hashlib
import importlib
import inspect
import re
import types
import warnings

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import functional as F
from .nn import _KERNEL_DTYPES, glu_mlp_of, join_gate_up, join_weights, kernel_dtype
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


def _computes_loss(cls):
    """Whether cls.forward calls self.loss_function: a head (LlamaForCausalLM)
    does, the base model inside it (LlamaModel), whose loss_function property
    also answers ForCausalLMLoss, does not."""
    f = inspect.unwrap(cls.forward)
    return "loss_function" in getattr(getattr(f, "__code__", None), "co_names", ())


def set_loss(model, report):
    """Every Hugging Face (sub)model in `model` that computes its loss with
    ForCausalLMLoss to causal_lm_loss, remembering what it had for unpatch."""
    for path, m in model.named_modules():
        if not isinstance(m, PreTrainedModel) or "_fusedops_loss" in m.__dict__:
            continue
        if not _computes_loss(type(m)) or m.loss_function is not ForCausalLMLoss:
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


def _plain_linear(m):
    return type(m) is torch.nn.Linear and not m._forward_hooks and not m._forward_pre_hooks


def _mlp_forward(self, x):
    """down_proj(act(gate_proj(x)) * up_proj(x)) in fusedops.functional.glu_mlp,
    while the projections are plain torch.nn.Linear (a LoRA wrapper or a hook
    added after patching makes it the original's forward again)."""
    if not (kernel_dtype(x) and all(_plain_linear(getattr(self, p)) for p in _PROJECTIONS)):
        return self._fusedops_base.forward(self, x)
    return glu_mlp_of(self, x, self._fusedops_activation)


def _apply_then(join):
    """An _apply for a fused class: nn.Module._apply (.to() and the like, which
    give each parameter storage of its own), then join(self) again."""
    def _apply(self, fn, *args, **kwargs):
        out = self._fusedops_base._apply(self, fn, *args, **kwargs)
        join(self)
        return out
    return _apply


_MLP = {"forward": _mlp_forward, "_apply": _apply_then(join_gate_up), "_fusedops_patched": join_gate_up}


def _make_mlp(module):
    act = ACTIVATIONS.get(type(getattr(module, "act_fn", None)).__name__)
    if act is None:
        return (f"activation {type(getattr(module, 'act_fn', None)).__name__} (the fused MLP "
                f"takes {sorted(set(ACTIVATIONS))})")
    for p in _PROJECTIONS:
        if not _plain_linear(getattr(module, p, None)):
            return f"{p} is a {type(getattr(module, p, None)).__name__}, not a plain torch.nn.Linear"
    return fused_class(type(module), _MLP), {"activation": act}


# --------------------------------------------------------------- decoder layer
def _decoder_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                     use_cache=False, position_embeddings=None, **kwargs):
    """LlamaDecoderLayer.forward with its residual adds moved into the norms:

        h = input_norm(x)                     # computed by the layer before, if linked
        a = self_attn(h)
        h, r = post_attention_norm(a, x)      # r = x + a, fused
        m = mlp(h)
        return next_norm(m, r) -> (y, s)      # s = r + m, fused; y goes along with s
                                              # to the next layer's input norm

    The last step needs the next norm (linked by fusedops.patch) and is plain
    `r + m` without it, under activation checkpointing, in a layer FSDP2
    shards as a unit (patch.can_hand_on) and under torch.compile (which fuses
    that add itself)."""
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=past_key_values, use_cache=use_cache, position_embeddings=position_embeddings,
        **kwargs)
    hidden_states, residual = add_norm(self.post_attention_layernorm, hidden_states, residual)
    hidden_states = self.mlp(hidden_states)
    nxt = self.__dict__.get("_fusedops_next_norm")
    if (nxt is None or (self.gradient_checkpointing and self.training) or torch.compiler.is_compiling()
            or not can_hand_on(self, nxt)):
        return residual + hidden_states
    y, s = nxt(hidden_states, residual)
    return hand_on(s, nxt, y)


_DECODER_ARGS = ["self", "hidden_states", "attention_mask", "position_ids", "past_key_values",
                 "use_cache", "position_embeddings", "kwargs"]
_DECODER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


_DECODER = {"forward": _decoder_forward, "_fusedops_input_norm": "input_layernorm",
            "_fusedops_final_norm": "norm"}


def _make_decoder(module):
    missing = [p for p in _DECODER_PARTS if not isinstance(getattr(module, p, None), torch.nn.Module)]
    if missing:
        return f"no {', '.join(missing)}"
    return fused_class(type(module), _DECODER)


def _decoder_source(cls):
    return inspect.getsource(inspect.unwrap(cls.forward)).split(":", 1)[1]  # without the def line


# --------------------------------------------------------------- attention module
def _rope_forward(cls):
    """cls.forward with the name apply_rotary_pos_emb in it bound to
    fusedops.functional.apply_rotary_pos_emb: the same code over a copy of its
    module's globals, so that nothing changes for unpatched models. None when
    the forward does not call that name."""
    f = cls.forward
    if "apply_rotary_pos_emb" not in getattr(getattr(f, "__code__", None), "co_names", ()):
        return None
    g = dict(f.__globals__, apply_rotary_pos_emb=F.apply_rotary_pos_emb)
    fused = types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, f.__closure__)
    fused.__kwdefaults__, fused.__doc__, fused.__qualname__ = f.__kwdefaults__, f.__doc__, f.__qualname__
    return fused


_QKV = ("q_proj", "k_proj", "v_proj")


def _cache_empty(cache, layer_idx):
    """Whether layer layer_idx of a transformers cache (None: no cache) holds no
    token yet and takes K and V through update(): a DynamicCache (the default,
    filled in training too) whose layer is empty."""
    if cache is None:
        return True
    return isinstance(cache, DynamicCache) and cache.get_seq_length(layer_idx) == 0


def _cache_put(cache, layer_idx, k, v):
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
    cache.update(k, v, layer_idx)


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                       past_key_values=None, **kwargs):
    """The attention module's forward (transformers' own, RoPE fused: the
    class's _fusedops_rope_forward) or, where it computes the same, one call to
    fusedops.functional.qkv_attention: the q, k, v projections as one matmul,
    RoPE in place, our attention kernels, a backward that sums nothing. That
    is when attention is fusedops' and causal without a mask, no dropout, the
    cache (if any) has no tokens of this layer yet (training, or a prompt's
    first forward) and the projections are plain torch.nn.Linear. transformers'
    cache then receives K and V outside autograd (see qkv_attention)."""
    x = hidden_states
    fast = (self.config._attn_implementation == NAME and attention_mask is None
            and position_embeddings is not None and not (self.training and self.attention_dropout)
            and getattr(self, "is_causal", True) and x.dim() == 3
            and not _unsupported(kwargs)
            and all(_plain_linear(getattr(self, p)) for p in _QKV)
            and _cache_empty(past_key_values, self.layer_idx))
    if fast:
        cos, sin = position_embeddings
        q, k, v = (getattr(self, p) for p in _QKV)
        hq, hkv = q.out_features // self.head_dim, k.out_features // self.head_dim
        if F._qkv_gap(x, q.weight, k.weight, v.weight, q.bias, k.bias, v.bias, cos, sin, hq, hkv) is None:
            cache = past_key_values is not None
            res = F._qkv_fused(x, q.weight, k.weight, v.weight, cos, sin, hq, hkv, q.bias, k.bias, v.bias,
                               scale=self.scaling, causal=x.shape[1] > 1, return_kv=cache)
            if cache:
                res, kc, vc = res
                _cache_put(past_key_values, self.layer_idx, kc, vc)
            return self.o_proj(res), None
    return self._fusedops_rope_forward(hidden_states, position_embeddings, attention_mask, past_key_values,
                                       **kwargs)


def _join_qkv(self):
    join_weights(self, _QKV)


def _attention_namespace(cls):
    """The fused class's methods for attention class cls, or None when its
    forward does not call apply_rotary_pos_emb. The joint q / k / v path only
    for forwards whose source is Llama's (Mistral and Qwen2 pass a sliding
    window, which takes effect only through the mask: our path requires none);
    Qwen3 normalises q and k first and keeps transformers' forward, RoPE fused."""
    rope = _rope_forward(cls)
    if rope is None:
        return None
    if not _llama_like_attention(cls):
        return {"forward": rope}
    return {"forward": _attention_forward, "_fusedops_rope_forward": rope, "_apply": _apply_then(_join_qkv),
            "_fusedops_patched": _join_qkv}


# What the joint path reimplements: the body of LlamaAttention.forward in
# transformers 5.17 to 5.23 (also Mistral's and Qwen2's, whose one difference,
# a sliding_window argument, is left out), whitespace-normalised, as a sha256
# prefix. Another body (a later transformers, Qwen3's q / k norms) keeps
# transformers' forward, with RoPE fused.
_LLAMA_ATTENTION_SHA = "af161e6671c2fb09"
_ATTENTION_ARGS = ["self", "hidden_states", "position_embeddings", "attention_mask", "past_key_values", "kwargs"]


def _llama_like_attention(cls):
    f = inspect.unwrap(cls.forward)
    if list(inspect.signature(f).parameters) != _ATTENTION_ARGS:
        return False
    src = inspect.getsource(f)
    src = re.sub(r"\n\s*sliding_window=[^\n]*", "", src[src.find("input_shape = hidden_states.shape[:-1]"):])
    return hashlib.sha256(" ".join(src.split()).encode()).hexdigest()[:16] == _LLAMA_ATTENTION_SHA


def _make_attention(module):
    ns = _attention_namespace(type(module))
    if ns is None:
        return "its forward does not call apply_rotary_pos_emb"
    return fused_class(type(module), ns)


# --------------------------------------------------------------- the table
_table = None


def replacements():
    """{class: Replacement} for the families above that this transformers has.
    A decoder layer is only listed when its forward is the one _decoder_forward
    reimplements: same arguments, same source as Llama's."""
    global _table
    if _table is not None:
        return _table
    table, llama_decoder = {}, None
    for module_name, prefix in FAMILIES.items():
        try:
            mod = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
        except ImportError:
            continue
        norm, mlp, decoder, attn = (getattr(mod, prefix + s, None)
                                    for s in ("RMSNorm", "MLP", "DecoderLayer", "Attention"))
        entries = [(norm, "norm", _make_rms_norm, _NORM), (mlp, "swiglu", _make_mlp, _MLP)]
        attn_ns = None if attn is None else _attention_namespace(attn)
        if attn_ns is not None:
            entries.append((attn, "attention", _make_attention, attn_ns))
        if decoder is not None:
            args = list(inspect.signature(inspect.unwrap(decoder.forward)).parameters)
            llama_decoder = llama_decoder or _decoder_source(decoder)
            if args == _DECODER_ARGS and _decoder_source(decoder) == llama_decoder:
                entries.append((decoder, "fuse_residual", _make_decoder, _DECODER))
        for cls, flag, make, namespace in entries:
            if cls is not None:
                table[cls] = Replacement(flag, make)
                fused_class(cls, namespace)  # made now, so that unpickling finds it
    _table = table
    return table
