"""Hugging Face transformers integration (pip install fusedops[hf]).

Importing this module registers "fusedops" in transformers' attention registry,
so that

    import fusedops.hf
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fusedops")

runs attention on fusedops' kernels (flash_attention with sliding windows and
soft-capping, flash_attention_varlen for packed documents; see
attention_forward), and adds the entries of fusedops.patch's table for the
Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and Gemma 3 (text) families
(FAMILIES), each a forward of fusedops' own, the layout (gate / up apart or
packed, four norms a layer or two, q / k / v apart or packed) read from the
module's structure:

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
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import functional as F
from .nn import (_KERNEL_DTYPES, JointStorage, glu_mlp_of, hooked, join_gate_up, join_weights, kernel_dtype,
                 plain_linear)
from .patch import Replacement, add_norm, can_hand_on, fused_class, hand_on, take_prenormed

NAME = "fusedops"  # the attn_implementation


@dataclass(frozen=True)
class Family:
    """A family's modules (transformers.models.<module>.modeling_<module>.
    <prefix>RMSNorm, MLP, DecoderLayer, Attention) and what they compute that
    their structure does not show. norm_offset: the RMSNorm scales by
    norm_offset + weight (Gemma: 1 + w, its weights start at 0).
    attention_args: ((argument, attribute), ...) that the attention module
    hands the attention function besides those all families hand it (Gemma 2:
    softcap, its attn_logit_softcapping; Gemma 3's attention has the attribute
    but hands nothing on). qk_norm_late: the attention calls q_norm and k_norm
    after all three projections, on (B, H, S, D) heads (Gemma 3), not each
    after its own, on (B, S, H, D) (Qwen3); hooks see the difference."""
    prefix: str
    norm_offset: float = 0.0
    attention_args: tuple = ()
    qk_norm_late: bool = False


FAMILIES = {"llama": Family("Llama"), "mistral": Family("Mistral"), "qwen2": Family("Qwen2"),
            "qwen3": Family("Qwen3"), "phi3": Family("Phi3"),
            "gemma2": Family("Gemma2", 1.0, (("softcap", "attn_logit_softcapping"),)),
            "gemma3": Family("Gemma3", 1.0, qk_norm_late=True)}


# --------------------------------------------------------------- attention
_warned = set()


def _unsupported(kwargs):
    """transformers' attention arguments among kwargs that fusedops' attention
    has no equivalent for."""
    return [k for k in ("position_bias", "cache", "output_attentions")
            if kwargs.get(k) is not None and kwargs.get(k) is not False]


_PACKED_ARGS = ("cu_seq_lens_q", "cu_seq_lens_k")  # (with max_length_q / _k) DataCollatorWithFlattening's


def _packed_kwargs(kwargs):
    """Whether kwargs describe packed sequences (their lengths, as
    DataCollatorWithFlattening(return_flash_attn_kwargs=True) passes them)."""
    return any(kwargs.get(k) is not None for k in _PACKED_ARGS)


def _window_mask(q_len, kv_len, window, device):
    """The (1, 1, Sq, Sk) bool mask of causal attention within a sliding window
    of `window` keys (transformers': 0 <= q - k < window), the queries the last
    Sq of the Sk positions."""
    q = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    d = q - torch.arange(kv_len, device=device)
    return ((d >= 0) & (d < window))[None, None]


def _softcapped_attention(query, key, value, mask, scale, softcap, dropout):
    """Attention with each scaled score s replaced by softcap * tanh(s / softcap)
    (Gemma 2), as transformers' eager attention computes it: the scores in the
    inputs' dtype, softmax in fp32; mask None or (B or 1, 1, Sq, Sk) bool."""
    group = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(group, 1) for t in (key, value))
    s = query @ key.transpose(-1, -2) * scale
    s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
    p = torch.softmax(s, -1, dtype=torch.float32).to(query.dtype)
    if dropout:
        p = torch.nn.functional.dropout(p, dropout)
    return p @ value


def _packed_sequences(attention_mask, kwargs, query, key, window):
    """(cu_seqlens, max_seqlen) of documents packed along each row, for the
    varlen kernel, or None. From cu_seq_lens_q (DataCollatorWithFlattening's
    flash-attention arguments, trusted where no mask came, as transformers'
    FlashAttention trusts them), or from position_ids restarting per document
    (the same collator without them). A mask transformers made is used only
    once checked to be exactly causal attention within the documents (and the
    sliding window): anything else it holds keeps it. The check reads values:
    not while torch.compile traces (the mask then goes to torch's SDPA)."""
    b, _, s, _ = query.shape
    if key.shape[2] != s or s < 2 or torch.compiler.is_compiling():
        return None
    cu = kwargs.get("cu_seq_lens_q")
    pos = kwargs.get("position_ids")
    if cu is None and (attention_mask is None or pos is None):
        return None
    if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.dim() != 4):
        return None
    # Every layer gets the same mask (or offsets) tensor: worked out once (the
    # checks read values, which on a GPU waits for the stream).
    holder = attention_mask if attention_mask is not None else cu
    memo = getattr(holder, "_fusedops_packed", None)
    if memo is not None and memo[0] == (holder._version, window, b, s):
        return memo[1]
    if cu is not None:
        if (kwargs.get("cu_seq_lens_k") is not None and not torch.equal(kwargs["cu_seq_lens_k"], cu)) or (
                int(cu[-1]) != b * s):
            return None
        starts = torch.zeros(b * s, dtype=torch.bool, device=query.device)
        starts[cu[:-1].long()] = True
    else:
        pos = pos.expand(b, -1) if pos.shape[0] != b else pos
        if tuple(pos.shape) != (b, s):
            return None
        new = torch.ones(b, s, dtype=torch.bool, device=query.device)
        new[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        starts = new.reshape(-1)
    starts[::s] = True  # (no document spans two rows)
    result = None
    if attention_mask is None or _packed_mask_is(attention_mask, starts.view(b, s), window):
        cu = torch.cat([starts.nonzero().view(-1), torch.tensor([b * s], device=query.device)])
        result = cu.to(torch.int32), int(cu.diff().max())
    holder._fusedops_packed = ((holder._version, window, b, s), result)
    return result


def _packed_mask_is(mask, starts, window):
    """Whether mask (B or 1, 1, S, S) is causal attention within the documents
    that `starts` (B, S) opens, and within the window (None: none)."""
    doc = starts.cumsum(-1)
    s = starts.shape[1]
    d = torch.arange(s, device=mask.device)
    d = d[:, None] - d
    want = (doc[:, :, None] == doc[:, None, :]) & (d >= 0)
    if window is not None:
        want &= d < window
    return torch.equal(mask, want[:, None].expand_as(mask)) if mask.shape[0] in (1, starts.shape[0]) and \
        mask.shape[1:] == (1, s, s) and (mask.shape[0] == starts.shape[0] or not starts.any(0)[1:].any()) else False


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, softcap=None, sliding_window=None, **kwargs):
    """transformers' attention interface (as its sdpa_attention_forward):
    query (B, Hq, Sq, D), key and value (B, Hkv, Sk, D) -> ((B, Sq, Hq, D), None).

    Runs fusedops' kernels: flash_attention where the causal flag and the
    sliding window (sliding_window, which the families' attention modules
    hand on as for FlashAttention: transformers' q - k < W is the window
    (W - 1, 0)) say it all, with softcap (Gemma 2's attn_logit_softcapping);
    flash_attention_varlen for packed sequences (_packed_sequences). Masks are
    made by causal_mask (registered below), as for "sdpa" but None under
    torch.compile and for sliding windows too. A padding mask, dropout or what
    the kernels lack goes to torch's SDPA (a warning the first time, from
    fusedops.functional), or with softcap to the soft-capped math. Features of
    transformers' own function that this one has no equivalent for
    (position_bias, a paged cache, output_attentions) go to it whole."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    # As transformers' sdpa: one query token attends to every key (decoding).
    causal = query.shape[2] > 1 and attention_mask is None and causal
    q_len, kv_len = query.shape[2], key.shape[2]
    window = sliding_window if causal and _restricting_window(sliding_window, kv_len) else None
    extra = _unsupported(kwargs)
    if extra:
        if tuple(extra) not in _warned and not torch.compiler.is_compiling():
            _warned.add(tuple(extra))
            warnings.warn(f"fusedops attention: {', '.join(extra)} not supported; calling "
                          "transformers' sdpa_attention_forward", stacklevel=2)
        if window:
            attention_mask, causal = _window_mask(q_len, kv_len, window, query.device), False
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=causal, softcap=softcap, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    q, k, v = F._lower_precision(query, key, value)
    if not dropout and min(q.numel(), k.numel()) and F._sdpa_gap(q, k, v, None, 0.0, True) is None:
        bshd = [t.transpose(1, 2) for t in (q, k, v)]
        packed_window = sliding_window if _restricting_window(sliding_window, kv_len) else None
        packed = _packed_sequences(attention_mask, kwargs, q, k, packed_window)
        if packed is not None:
            cu, longest = packed
            b, s = q.shape[0], q_len
            out = F.flash_attention_varlen(*(t.reshape(b * s, *t.shape[2:]) for t in bshd), cu, cu, longest, longest,
                                           causal=True, scale=scale, softcap=softcap or 0.0,
                                           window_size=(-1, -1) if packed_window is None else (packed_window - 1, 0))
            return out.view(b, s, *out.shape[1:]), None
        if attention_mask is None:
            out = F.flash_attention(*bshd, causal=causal, scale=scale, softcap=softcap or 0.0,
                                    window_size=(-1, -1) if window is None else (window - 1, 0))
            return out, None
    if window:
        attention_mask, causal = _window_mask(q_len, kv_len, window, query.device), False
    if softcap:
        if causal:
            attention_mask = _window_mask(q_len, kv_len, kv_len, query.device)
        out = _softcapped_attention(query, key, value, attention_mask, scale, softcap, dropout)
    else:
        gqa = query.shape[1] != key.shape[1]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             is_causal=causal, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


_SDPA_MASK_ARGS = inspect.signature(sdpa_mask)


def causal_mask(*args, **kwargs):
    """transformers' sdpa_mask (same arguments, which differ between its
    versions), except that it also returns None -- the attention's causal flag
    instead of a (B, 1, Sq, Sk) mask -- while torch.compile traces, where
    sdpa_mask materializes the mask (it cannot tell tracing for torch.export
    from torch.compile before torch 2.14), and for a causal sliding window
    that hides keys, which the attention then applies itself. A mask takes the
    attention to torch's SDPA, which then computes every score of the square.

    None only where that depends on shapes alone, as sdpa_mask's own skip in
    eager: the caller allows it (no packed sequences, no extra mask functions,
    no compileable cache), no padding mask, an int query offset, and as many
    keys as queries or one query; a window (local_size) that the keys reach
    past only with as many keys as queries, and only where it is the
    config's sliding_window (the one the attention modules hand on), not its
    attention_chunk_size (chunked attention, which transformers passes the
    same way). A padding mask, even all ones, still becomes a mask: its values
    are not read while tracing."""
    a = _SDPA_MASK_ARGS.bind(*args, **kwargs)
    a.apply_defaults()
    p = a.arguments
    q_len = p["q_length"] if "q_length" in p else p["cache_position"].shape[0]
    kv_len, local = p["kv_length"], p.get("local_size")
    config = p.get("kwargs", {}).get("config")
    window_ok = local is None or kv_len < local or (
        q_len == kv_len and local == getattr(config, "sliding_window", None)
        and local != getattr(config, "attention_chunk_size", None))
    if (p.get("allow_is_causal_skip") and p.get("attention_mask") is None
            and not isinstance(p.get("q_offset", 0), torch.Tensor)
            and window_ok and (q_len == 1 or q_len == kv_len)):
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

    def forward(self, *args, **kwargs):
        return _causal_lm_forward(self, *args, **kwargs)

    # The original's signature: generation reads it to decide which arguments
    # the forward takes (logits_to_keep, for one).
    forward.__signature__ = inspect.signature(cls.forward)
    forward.__doc__ = _causal_lm_forward.__doc__
    return {"forward": forward,
            "_fusedops_arg_names": [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]}


def _make_causal_lm(module):
    params = _forward_params(type(module))
    if not {"labels", "logits_to_keep"} <= {p.name for p in params} or params[-1].kind != params[-1].VAR_KEYWORD:
        return (f"forward{inspect.signature(inspect.unwrap(type(module).forward))}: fusedops' forward takes "
                "labels, logits_to_keep and **kwargs")
    have = sorted(n for n, _ in module.named_children())
    if have != ["lm_head", "model"]:
        return f"loss not fused: submodules {have}; fusedops' forward calls ['lm_head', 'model']"
    if not isinstance(module.lm_head, torch.nn.Linear):
        return f"lm_head is a {type(module.lm_head).__name__}, not a torch.nn.Linear"
    return fused_class(type(module), _causal_lm_namespace(type(module)))


# --------------------------------------------------------------- RMSNorm
def _rms_norm_forward(self, hidden_states, residual=None):
    """As the original's forward; with a residual, (norm(x + residual), x + residual)
    in one fused call. The families' two kinds of RMSNorm:
      weight * norm(x) rounded to x's dtype first (Llama, Qwen, Mistral, Phi-3),
        the product in the promoted dtype of weight and x;
      norm(x) * (1 + weight) in fp32, rounded once to x's dtype (Gemma 2 / 3,
        _fusedops_offset 1): the kernel's fp32 math with an fp32 weight 1 + w."""
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
    eps = getattr(self, self._fusedops_eps)
    if self._fusedops_offset:
        w = w.float() + self._fusedops_offset
    if residual is None:
        y, s = F.rms_norm(x, w, eps), x
    else:
        y, s = F.fused_add_rms_norm(x, residual, w, eps)
    # (the original multiplies in this dtype)
    out_dtype = s.dtype if self._fusedops_offset else torch.promote_types(self.weight.dtype, x.dtype)
    y = y if y.dtype == out_dtype else y.to(out_dtype)
    return y if residual is None else (y, s)


def _norm_namespace(family):
    return {"forward": _rms_norm_forward, "_fusedops_offset": family.norm_offset}


_EPS = ("variance_epsilon", "eps")  # what the families call their norms' epsilon


def _make_rms_norm(module, family):
    if not isinstance(getattr(module, "weight", None), torch.nn.Parameter) or module.weight.dim() != 1:
        return "weight is not a 1-D parameter"
    eps = next((n for n in _EPS if isinstance(getattr(module, n, None), float)), None)
    if eps is None:
        return f"no float epsilon ({' or '.join(_EPS)})"
    if any(True for _ in module.children()):
        return f"submodules {[n for n, _ in module.named_children()]}; fusedops' forward calls none"
    return fused_class(type(module), _norm_namespace(family)), {"eps": eps}


# --------------------------------------------------------------- MLP
# transformers' activation modules (ACT2FN) the fused MLP computes exactly.
ACTIVATIONS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUTanh": "gelu_tanh",
               "PytorchGELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh"}
# The projections of the two MLP layouts: gate and up apart (Llama, Gemma), or
# packed as one [gate | up] projection (Phi-3); each has one more child, its
# activation.
_MLP_LAYOUTS = (("gate_proj", "up_proj", "down_proj"), ("gate_up_proj", "down_proj"))


def _mlp_forward(self, x):
    """down_proj(act(gate) * up) in fusedops.functional.glu_mlp, gate and up
    from gate_proj and up_proj, or the halves of gate_up_proj; while the
    projections are plain torch.nn.Linear with no hook, nor one on the
    activation (a LoRA wrapper or a hook added after patching makes it the
    original's forward again)."""
    projections = [getattr(self, p) for p in self._fusedops_projections]
    if not (kernel_dtype(x) and all(plain_linear(p) for p in projections)
            and not hooked(getattr(self, self._fusedops_act))):
        return self._fusedops_base.forward(self, x)
    if len(projections) == 2:  # [gate | up] packed: one weight, one gradient
        gu, d = projections
        return F.glu_mlp(x, gu.weight, None, d.weight, gu.bias, None, d.bias, self._fusedops_activation)
    return glu_mlp_of(self, x, self._fusedops_activation)


def _join_mlp(self):
    if hasattr(self, "up_proj"):  # (a packed gate_up_proj is one storage already)
        join_gate_up(self)


_MLP = {"forward": _mlp_forward, "_join": _join_mlp, "_fusedops_patched": _join_mlp}


def _make_mlp(module):
    children = dict(module.named_children())
    layout = next((lay for lay in _MLP_LAYOUTS if set(lay) <= children.keys()
                   and len(children) == len(lay) + 1), None)
    if layout is None:
        return (f"submodules {sorted(children)}; fusedops' forward calls "
                f"{' or '.join(str(list(lay)) for lay in _MLP_LAYOUTS)} and an activation")
    act_name = next(n for n in children if n not in layout)
    act = ACTIVATIONS.get(type(children[act_name]).__name__)
    if act is None:
        return (f"activation {type(children[act_name]).__name__} (the fused MLP "
                f"takes {sorted(set(ACTIVATIONS))})")
    for p in layout:
        if not plain_linear(children[p]):
            return f"{p} is a {type(children[p]).__name__}, not a plain torch.nn.Linear"
    if len(layout) == 2 and children[layout[0]].out_features != 2 * children[layout[1]].in_features:
        return f"{layout[0]} has {children[layout[0]].out_features} outputs, not twice down_proj's inputs"
    return fused_class(type(module), _MLP, (JointStorage,)), {"activation": act, "act": act_name,
                                                               "projections": layout}


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


# --------------------------------------------------------------- decoder layer
def _decoder_forward(self, hidden_states, *args, **kwargs):
    """The decoder layer with its residual adds moved into the norms after
    them. In the layouts of _DECODER_LAYOUTS (after_attn, mid_norm, after_mlp;
    a missing step does nothing):

        h = input_layernorm(x)                 # computed by the layer before, if linked
        a = after_attn(self_attn(h, **the other arguments))
        h, r = mid_norm(a, x)                  # r = x + a, fused
        m = after_mlp(mlp(h))
        return next_norm(m, r) -> (y, s)       # s = r + m, fused; y goes along with s
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
    after_attn, mid_norm, after_mlp = self._fusedops_layout
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    if after_attn:
        hidden_states = getattr(self, after_attn)(hidden_states)
    hidden_states, residual = add_norm(getattr(self, mid_norm), hidden_states, residual)
    hidden_states = self.mlp(hidden_states)
    if after_mlp:
        hidden_states = getattr(self, after_mlp)(hidden_states)
    nxt = self.__dict__.get("_fusedops_next_norm")
    if (nxt is None or (getattr(self, "gradient_checkpointing", False) and self.training)
            or torch.compiler.is_compiling() or residual.is_inference() or not can_hand_on(self, nxt)):
        return residual + hidden_states
    y, s = nxt.forward(hidden_states, residual)  # no hook on nxt (can_hand_on): not called as a module
    return hand_on(s, nxt, y)


_DECODER_PARTS = ("input_layernorm", "self_attn", "mlp")
# The layouts, told apart by the layer's submodules besides _DECODER_PARTS:
# {their names: (after_attn, mid_norm, after_mlp)}. Llama's post-attention norm
# reads the residual sum; Gemma's norms the attention's output before the add,
# its pre-feedforward norm reads the sum and its post-feedforward norm the
# MLP's output (four norms, two of which take a residual add); Phi-3 has
# dropout on each branch before its add.
_DECODER_LAYOUTS = {
    ("post_attention_layernorm",): (None, "post_attention_layernorm", None),
    ("post_attention_layernorm", "post_feedforward_layernorm", "pre_feedforward_layernorm"):
        ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    ("post_attention_layernorm", "resid_attn_dropout", "resid_mlp_dropout"):
        ("resid_attn_dropout", "post_attention_layernorm", "resid_mlp_dropout"),
}


def _decoder_namespace(cls):
    params = _forward_params(cls)
    named = [p for p in params[1:] if p.kind == p.POSITIONAL_OR_KEYWORD]
    return {"forward": _decoder_forward, "_fusedops_input_norm": "input_layernorm",
            "_fusedops_final_norm": "norm", "_fusedops_cache_arg": _cache_name(cls),
            "_fusedops_arg_names": [p.name for p in named],
            "_fusedops_arg_defaults": {p.name: p.default for p in named if p.default is not p.empty}}


def _make_decoder(module):
    params = _forward_params(type(module))
    if not params or params[0].name != "hidden_states" or params[-1].kind != params[-1].VAR_KEYWORD:
        return (f"decoder layer not fused: forward{inspect.signature(inspect.unwrap(type(module).forward))}: "
                "fusedops' forward takes hidden_states first and passes the rest, **kwargs included, to self_attn")
    children = {n for n, _ in module.named_children()}
    layout = _DECODER_LAYOUTS.get(tuple(sorted(children - set(_DECODER_PARTS))))
    if layout is None or not set(_DECODER_PARTS) <= children:
        wanted = " or ".join(str(sorted({*_DECODER_PARTS, *k})) for k in _DECODER_LAYOUTS)
        return f"decoder layer not fused: submodules {sorted(children)}; fusedops' forward calls {wanted}"
    return fused_class(type(module), _decoder_namespace(type(module))), {"layout": layout}


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


def _restricting_window(window, kv_len):
    """Whether a causal sliding window of `window` keys (transformers' mask:
    q - k < window) hides any of kv_len keys from the last query."""
    return window is not None and kv_len > window


def _qkv_heads(self, x):
    """q, k, v of x as (B, H, S, D) heads, q and k normed where the module has
    q_norm and k_norm: from q_proj, k_proj and v_proj, or the parts of a
    packed qkv_proj ([q | k | v] along its outputs, Phi-3). The modules are
    called in the family's order, on the family's layout (hooks see both):
    each norm right after its projection, on (B, S, H, D) (Qwen3), or after
    all three projections, on (B, H, S, D) (Gemma 3)."""
    heads = (*x.shape[:-1], -1, self.head_dim)
    if self._fusedops_packed_qkv:
        q, k, v = self.qkv_proj(x).split(_packed_rows(self), dim=-1)
    elif self._fusedops_qk_norm and not self._fusedops_qk_norm_late:
        q = self.q_norm(self.q_proj(x).view(heads))
        k = self.k_norm(self.k_proj(x).view(heads))
        v = self.v_proj(x)
    else:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))
    if self._fusedops_qk_norm and self._fusedops_qk_norm_late:
        q, k = self.q_norm(q), self.k_norm(k)
    return q, k, v


def _packed_rows(self):
    """The rows of q, k and v in a packed qkv_proj."""
    hq, hkv = self.config.num_attention_heads, self.num_key_value_heads
    return [hq * self.head_dim, hkv * self.head_dim, hkv * self.head_dim]


def _rope(q, k, cos, sin):
    """RoPE of (B, H, S, D) q and k; cos and sin may cover the first dims only
    (a partial rotary factor, Phi-3's): the rest pass unrotated."""
    d = cos.shape[-1]
    if d == q.shape[-1]:
        return F.apply_rotary_pos_emb(q, k, cos, sin)
    qr, kr = F.apply_rotary_pos_emb(q[..., :d], k[..., :d], cos, sin)
    return torch.cat([qr, q[..., d:]], -1), torch.cat([kr, k[..., d:]], -1)


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
    """The attention module of the families above:

        q, k, v = q_proj(x), k_proj(x), v_proj(x)     # or the parts of qkv_proj(x) (Phi-3)
        q, k = q_norm(q), k_norm(k)                   # Qwen3, Gemma 3 (per head, before RoPE)
        q, k = RoPE(q, k)                             # fusedops.functional.apply_rotary_pos_emb
        k, v = cache.update(k, v)                     # if a cache is given
        o = attention(q, k, v, mask, scaling, sliding_window, dropout, **family's arguments)
        return o_proj(o), attention weights (or None)

    The attention is the config's implementation; the family's arguments are
    Gemma 2's softcap. Or, where it computes the same, one call to
    fusedops.functional.qkv_attention: the q, k, v projections as one matmul,
    RoPE in place, our attention kernels, a backward that sums nothing. That
    is when attention is fusedops' and causal without a mask (a sliding
    window and soft-capping go to the kernel), no dropout, no q / k norms,
    the cache (if any) has no tokens of this layer yet (training, or a
    prompt's first forward) and the projections are plain torch.nn.Linear
    with no hook. transformers' cache then receives K and V outside autograd
    (see qkv_attention)."""
    if args:
        kwargs[self._fusedops_cache_arg] = args[0]
    cache = _take_cache_name(self, kwargs).pop(self._fusedops_cache_arg, None)
    x = hidden_states
    extra = {name: getattr(self, attr) for name, attr in self._fusedops_attention_args}
    window = _sliding_window(self)
    projections = ("qkv_proj",) if self._fusedops_packed_qkv else _QKV
    fast = (self.config._attn_implementation == NAME and attention_mask is None
            and position_embeddings is not None and not (self.training and self.attention_dropout)
            and getattr(self, "is_causal", True) and x.dim() == 3 and not self._fusedops_qk_norm
            and not _unsupported(kwargs) and not _packed_kwargs(kwargs)
            and all(v is None for k, v in extra.items() if k != "softcap")
            and all(plain_linear(getattr(self, p)) for p in projections)
            and _cache_empty(cache, self.layer_idx))
    if fast:
        cos, sin = position_embeddings
        if self._fusedops_packed_qkv:
            p = self.qkv_proj
            ws, bs = p.weight.split(_packed_rows(self)), (None,) * 3 if p.bias is None else p.bias.split(
                _packed_rows(self))
            joint = (p.weight, None, None), (p.bias, None, None)
        else:
            ps = [getattr(self, n) for n in _QKV]
            ws, bs = [p.weight for p in ps], [p.bias for p in ps]
            joint = ws, bs
        hq, hkv = ws[0].shape[0] // self.head_dim, ws[1].shape[0] // self.head_dim
        if F._qkv_gap(x, *ws, *bs, cos, sin, hq, hkv) is None:
            (wq, wk, wv), (bq, bk, bv) = joint
            res = F._qkv_fused(x, wq, wk, wv, cos, sin, hq, hkv, bq, bk, bv,
                               scale=self.scaling, causal=x.shape[1] > 1, return_kv=cache is not None,
                               softcap=extra.get("softcap") or 0.0,
                               window_size=(window - 1, 0) if _restricting_window(window, x.shape[1]) else (-1, -1))
            if cache is not None:
                res, kc, vc = res
                _cache_put(cache, self.layer_idx, kc, vc, kwargs)
            return self.o_proj(res), None

    input_shape = x.shape[:-1]
    q, k, v = _qkv_heads(self, x)
    cos, sin = position_embeddings
    q, k = _rope(q, k, cos, sin)
    if cache is not None:
        k, v = _cache_update(cache, self.layer_idx, k, v, kwargs)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._fusedops_eager)
    out, weights = attend(self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                          scaling=self.scaling, sliding_window=window, **extra, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _join_qkv(self):
    """q, k and v in one storage, for the joint path (not taken with q / k
    norms; a packed qkv_proj is one already)."""
    if not self._fusedops_qk_norm and not self._fusedops_packed_qkv:
        join_weights(self, _QKV)


def _attention_namespace(cls, eager, family):
    """The fused class's attributes for attention class cls; eager: the
    family's eager_attention_forward (what transformers' forward calls for
    attn_implementation "eager")."""
    return {"forward": _attention_forward, "_join": _join_qkv, "_fusedops_patched": _join_qkv,
            "_fusedops_cache_arg": _cache_name(cls), "_fusedops_eager": staticmethod(eager),
            "_fusedops_attention_args": family.attention_args, "_fusedops_qk_norm_late": family.qk_norm_late,
            "_fusedops_qk_norm": False, "_fusedops_packed_qkv": False}


_ATTENTION_ARGS = ["hidden_states", "position_embeddings", "attention_mask"]
_ATTENTION_NUMBERS = {"head_dim": int, "layer_idx": int, "scaling": (int, float), "attention_dropout": (int, float)}
# The attention layouts: {submodules: what _qkv_heads reads}; q_norm and
# k_norm (Qwen3, Gemma 3: an RMSNorm of each head's q and k before RoPE) may
# come with the first.
_ATTENTION_LAYOUTS = {(*_QKV, "o_proj"): "split", ("qkv_proj", "o_proj"): "packed"}


def _attention_problem(module, family):
    cls = type(module)
    params = _forward_params(cls)
    names = [p.name for p in params]
    if names[:-1] != [*_ATTENTION_ARGS, _cache_name(cls)] or params[-1].kind != params[-1].VAR_KEYWORD:
        return (f"forward{inspect.signature(inspect.unwrap(cls.forward))}: fusedops' forward takes "
                f"{', '.join(_ATTENTION_ARGS)}, the cache (cache or past_key_values), **kwargs")
    numbers = dict(_ATTENTION_NUMBERS)
    if hasattr(module, "qkv_proj"):  # the packed rows (_packed_rows)
        numbers["num_key_value_heads"] = int
    for name, kind in numbers.items():
        if not isinstance(getattr(module, name, None), kind) or isinstance(getattr(module, name), bool):
            return f"{name} is {getattr(module, name, None)!r}, fusedops' forward needs a number"
    for _, attr in family.attention_args:
        if not hasattr(module, attr):
            return f"no {attr} (the family's attention hands it on)"
    if not hasattr(getattr(module, "config", None), "_attn_implementation"):
        return "no config with an _attn_implementation"
    children = {n for n, _ in module.named_children()}
    plain = children - set(_QK_NORMS)
    if tuple(sorted(plain)) not in {tuple(sorted(k)) for k in _ATTENTION_LAYOUTS} or (
            children & set(_QK_NORMS) and children & set(_QK_NORMS) != set(_QK_NORMS)):
        want = " or ".join(str(list(k)) for k in _ATTENTION_LAYOUTS)
        return f"submodules {sorted(children)}; fusedops' forward calls {want}, optionally with {list(_QK_NORMS)}"
    if hasattr(module, "qkv_proj") and (children & set(_QK_NORMS) or not isinstance(
            getattr(module.config, "num_attention_heads", None), int)
            or module.qkv_proj.out_features != sum(_packed_rows(module))):
        return "a packed qkv_proj whose rows are not num_attention_heads + 2 num_key_value_heads heads"
    return None


def _make_attention(module, eager, family):
    why = _attention_problem(module, family)
    if why:
        return f"attention not fused: {why}"
    cls = fused_class(type(module), _attention_namespace(type(module), eager, family), (JointStorage,))
    return cls, {"qk_norm": hasattr(module, "q_norm"), "packed_qkv": hasattr(module, "qkv_proj")}


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
    for module_name, family in FAMILIES.items():
        try:
            mod = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
        except ImportError:
            continue
        norm, mlp, decoder, attn, head = (getattr(mod, family.prefix + s, None)
                                          for s in ("RMSNorm", "MLP", "DecoderLayer", "Attention", "ForCausalLM"))
        eager = getattr(mod, "eager_attention_forward", None)
        entries = [(norm, "norm", lambda m, f=family: _make_rms_norm(m, f), _norm_namespace(family), ()),
                   (mlp, "swiglu", _make_mlp, _MLP, (JointStorage,))]
        if decoder is not None:
            entries.append((decoder, "fuse_residual", _make_decoder, _decoder_namespace(decoder), ()))
        if attn is not None and eager is not None:
            entries.append((attn, "attention", lambda m, e=eager, f=family: _make_attention(m, e, f),
                            _attention_namespace(attn, eager, family), (JointStorage,)))
        if head is not None:
            entries.append((head, "loss", _make_causal_lm, _causal_lm_namespace(head), ()))
        for cls, flag, make, namespace, mixins in entries:
            if cls is not None:
                table[cls] = Replacement(flag, make)
                fused_class(cls, namespace, mixins)  # made now, so that unpickling finds it
    _table = table
    return table
