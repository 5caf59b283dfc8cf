"""Public functions of fusedops. Each is one custom op call plus argument
handling; autograd and torch.compile support come from fusedops/ops."""
import contextlib
import math
import warnings

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from . import reference
from .ops import attention as _attn, linear_xent as _linear_xent_ops, norm as _norm, rope as _rope
from .ops import swiglu as _glu, xent as _xent
from .ops._common import function_apply, once_only

# Looked up once: each is called on every call of a function below.
_grad_enabled = torch._C.is_grad_enabled
_any_requires_grad = torch._C._any_requires_grad
_is_compiling = torch.compiler.is_compiling
_autocast_available = torch._C._is_autocast_available
_autocast_enabled = torch.is_autocast_enabled


def autocast_dtype(device_type):
    """The dtype torch.autocast computes in on device_type, or None where
    autocast is off there (or has no such device: meta tensors; under
    torch.compile tensors are on real devices, and the availability check is
    left out of the trace)."""
    if not _is_compiling() and not _autocast_available(device_type):
        return None
    return torch.get_autocast_dtype(device_type) if _autocast_enabled(device_type) else None


def device_type(t):
    """t.device.type, without making a torch.device for the common two."""
    return "cuda" if t.is_cuda else "cpu" if t.is_cpu else t.device.type


# What torch.autocast does to the torch ops these functions stand for (ATen's
# autocast lists), so that each returns the dtype torch's op would:
# - scaled_dot_product_attention: cast to the autocast dtype (lower-precision
#   list) on every device; so flash_attention, qkv_attention and glu_mlp too
#   (attention and linear layers).
# - cross_entropy: computed in fp32 (fp32 list) on every device: an fp32 loss.
# - layer_norm, rms_norm: computed in fp32 on CUDA where the release lists them
#   (fp32 list; _cuda_autocast_fp32); on no list on the CPU, where they stay
#   in x's dtype.
# The fused residual forms (fused_add_*_norm) are no torch op: they keep their
# inputs' dtypes.
def _lower_precision(*ts):
    """ts cast to their device's autocast dtype, as autocast casts the inputs of
    an op of its lower-precision list; as they are when autocast is off or one
    is not a kernel dtype (float64, which autocast leaves alone)."""
    dt = autocast_dtype(device_type(ts[0]))
    if dt is None or any(t.dtype not in _KERNEL_DTYPES for t in ts):
        return ts
    return tuple(t.to(dt) for t in ts)


_CUDA_AUTOCAST_FP32 = {}


def _cuda_autocast_fp32(op):
    """Whether CUDA autocast runs torch's `op` (layer_norm, rms_norm) in fp32.
    Its lists change between releases (rms_norm joined the fp32 list after
    2.11), so torch is asked once, on a tiny tensor; under torch.compile, where
    no such call may be traced, before that answer the fp32 list is assumed."""
    if op not in _CUDA_AUTOCAST_FP32:
        if torch.compiler.is_compiling():
            return True
        x = torch.ones(1, 8, device="cuda", dtype=torch.float16)
        with torch.autocast("cuda", dtype=torch.float16):
            _CUDA_AUTOCAST_FP32[op] = getattr(F, op)(x, (8,)).dtype == torch.float32
    return _CUDA_AUTOCAST_FP32[op]


def _norm_input(x, op):
    """x as CUDA autocast hands it to torch's `op`: in fp32 where that op is
    on autocast's fp32 list."""
    if (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and autocast_dtype("cuda")
            and _cuda_autocast_fp32(op)):
        return x.float()
    return x


def _add_norm(x, residual, weight, bias, eps, rms, residual_in_fp32):
    # Parameters may be in x's dtype or fp32. Anything else (an fp16 weight under
    # bf16 autocast, say) is widened to fp32, which is exact for fp16/bf16.
    if weight is not None and weight.dtype != x.dtype and weight.dtype != torch.float32:
        weight = weight.float()
    if bias is not None and bias.dtype != x.dtype and bias.dtype != torch.float32:
        bias = bias.float()
    # The per-row statistics are for the backward: none without one (what an
    # inference graph of torch.compile computes too).
    stats = _needs_grad(x, residual, weight, bias)
    y, s, _, _ = _norm.add_norm_fwd(x, residual, weight, bias, float(eps), rms, residual_in_fp32, stats)
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
    """LayerNorm over the last dimension of x (in fp32 under CUDA autocast, as torch's)."""
    return _add_norm(_norm_input(x, "layer_norm"), None, weight, bias, eps, False, False)[0]


def rms_norm(x, weight=None, eps=1e-6):
    """RMSNorm over the last dimension of x (in fp32 under CUDA autocast where torch's is)."""
    return _add_norm(_norm_input(x, "rms_norm"), None, weight, None, eps, True, False)[0]


def swiglu(gate, up):
    """silu(gate) * up, in one pass; the backward recomputes silu from gate."""
    return _glu.glu_fwd(gate, up, "silu")


def geglu(gate, up):
    """gelu(gate, approximate="tanh") * up, in one pass."""
    return _glu.glu_fwd(gate, up, "gelu_tanh")


def swiglu_packed(gate_up):
    """swiglu of [gate | up] packed along the last dimension (the output of one
    fused gate+up projection): [..., 2F] -> [..., F]. Its gradient is one
    [..., 2F] tensor, written in place of the two halves."""
    return _glu.glu_packed_fwd(gate_up, "silu")


def geglu_packed(gate_up):
    """geglu of [gate | up] packed along the last dimension."""
    return _glu.glu_packed_fwd(gate_up, "gelu_tanh")


def _rows(t):
    """t as a [rows, last dim] matrix (a view of a contiguous t; also when empty,
    where reshape(-1, n) is ambiguous)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _joint_weight(*ws):
    """[W0; W1; ...] as one tensor without a copy, when each weight directly
    follows the one before in one storage (as fusedops.nn.join_weights puts
    them): the projections are then one matmul (gate and up: 8% faster than
    two at 16384 x 4096 x 11008 on an H100). Else None. Not under
    torch.compile, which sees separate parameters and plans its own matmuls."""
    w0 = ws[0]
    if (torch.compiler.is_compiling() or type(w0) not in (torch.Tensor, torch.nn.Parameter)
            or w0.dim() != 2 or w0.numel() == 0):
        return None
    addr, item = w0.data_ptr(), w0.element_size()
    for w in ws:  # each at the address where the one before ends: a cheap test, which weights apart fail
        if type(w) is not type(w0) or w.data_ptr() != addr:
            return None
        addr += w.numel() * item
    end = w0.storage_offset()
    for w in ws:
        if (type(w) is not type(w0) or w.dim() != 2 or w.shape[1] != w0.shape[1]
                or w.dtype != w0.dtype or w.device != w0.device or not w.is_contiguous()
                or w.numel() == 0 or w.storage_offset() != end
                or w.untyped_storage().data_ptr() != w0.untyped_storage().data_ptr()):
            return None
        end += w.numel()
    return w0.detach().as_strided((sum(w.shape[0] for w in ws), w0.shape[1]), w0.stride())


class _GLUMLP(torch.autograd.Function):
    """down(act(x Wg^T + bg) * (x Wu^T + bu)) Wd^T + bd, saving x and the two
    projections only: the activation h is recomputed in the backward (in the
    elementwise pass that computes its gradients) instead of being kept from
    forward to backward. With Wg and Wu adjacent in memory (_joint_weight) the
    two projections are one matmul giving [gate | up] packed, and so are their
    input gradients.

    Under autocast the inputs are cast to the autocast dtype here, as
    torch.nn.Linear's would be, and the gradients cast back to each
    parameter's own dtype."""

    @staticmethod
    def forward(ctx, x, wg, wu, wd, bg, bu, bd, activation):  # ctx None: no autograd (glu_mlp)
        orig = (x, wg, wu, wd, bg, bu, bd)
        dev = device_type(x)
        given_packed = wu is None  # wg is [Wg; Wu] and bg [bg; bu] (glu_mlp's packed form)
        wgu = wg if given_packed else _joint_weight(wg, wu)
        dt = autocast_dtype(dev)
        if dt is not None:
            x, wg, wu, wd, bg, bu, bd = (t if t is None else t.to(dt) for t in orig)
            if given_packed:
                wgu = wg
            elif wgu is not None:  # one cast, and Wg, Wu its halves
                wgu = wgu.to(dt)
                wg, wu = wgu.chunk(2)
        with torch.autocast(dev, enabled=False) if dt is not None else contextlib.nullcontext():
            if wgu is not None:
                bgu = bg if given_packed else None if bg is None and bu is None else torch.cat(
                    [b if b is not None else torch.zeros_like(wg[:, 0]) for b in (bg, bu)])
                gate_up = torch.nn.functional.linear(x, wgu, bgu)
                h = _glu.glu_packed_fwd(gate_up, activation)
                saved = (x, gate_up, wgu, wd)
            else:
                gate = torch.nn.functional.linear(x, wg, bg)
                up = torch.nn.functional.linear(x, wu, bu)
                h = _glu.glu_fwd(gate, up, activation)
                saved = (x, gate, up, wg, wu, wd)
            y = torch.nn.functional.linear(h, wd, bd)
        if ctx is None:
            return y
        ctx.save_for_backward(*saved)
        ctx.packed, ctx.given_packed = wgu is not None, given_packed
        ctx.activation = activation
        ctx.dtypes = [None if t is None else t.dtype for t in orig]
        return y

    @staticmethod
    @once_only("glu_mlp")  # the in-place kernels have no gradient
    def backward(ctx, dy):
        need = ctx.needs_input_grad
        if ctx.packed:
            x, gate_up, wgu, wd = ctx.saved_tensors
        else:
            x, gate, up, wg, wu, wd = ctx.saved_tensors
        f = wd.shape[1]
        x2 = _rows(x)
        dy2 = _rows(dy.to(wd.dtype))
        # One pass turns dh = dy Wd into h (the activation, recomputed, for
        # dWd) and the projections into their gradients, all in place: the
        # projections are needed no more. A second backward through this graph
        # finds them changed (the ops bump their versions) and raises.
        h2 = dy2 @ wd
        if ctx.packed:
            _glu.glu_packed_bwd_(h2, _rows(gate_up), ctx.activation)
        elif torch.compiler.is_compiling():
            # New tensors: gate and up are inputs of the compiled backward,
            # which inductor copies before an op writes them (1.46 ms a step
            # of the ANCHORS Llama on an H100, for nothing).
            h2, gate, up = _glu.glu_bwd_recompute(h2.view(gate.shape), gate, up, ctx.activation)
            h2 = _rows(h2)
        else:
            _glu.glu_bwd_(h2.view(gate.shape), gate, up, ctx.activation)
        dwd = dy2.t() @ h2 if need[3] else None
        del h2
        if ctx.packed:
            # One matmul for the gate and up weights' gradients: the packed
            # weight's, or (adjacent weights) two views of it.
            dgu2 = _rows(gate_up)
            dx = (dgu2 @ wgu).reshape(x.shape) if need[0] else None
            dwgu = dgu2.t() @ x2 if need[1] or need[2] else None
            dbgu = dgu2.sum(0) if need[4] or need[5] else None
            if ctx.given_packed:
                dwg, dwu, dbg, dbu = dwgu, None, dbgu, None
            else:
                dwg, dwu = (None, None) if dwgu is None else (dwgu[:f], dwgu[f:])
                dbg, dbu = (None, None) if dbgu is None else (dbgu[:f], dbgu[f:])
        else:
            dgate2, dup2 = _rows(gate), _rows(up)
            dx = torch.addmm(dgate2 @ wg, dup2, wu).reshape(x.shape) if need[0] else None
            dwg, dwu = dgate2.t() @ x2 if need[1] else None, dup2.t() @ x2 if need[2] else None
            dbg, dbu = dgate2.sum(0) if need[4] else None, dup2.sum(0) if need[5] else None
        grads = [dx, dwg if need[1] else None, dwu if need[2] else None, dwd,
                 dbg if need[4] else None, dbu if need[5] else None, dy2.sum(0) if need[6] else None]
        return (*(g if g is None or g.dtype == t else g.to(t) for g, t in zip(grads, ctx.dtypes)), None)


def _check_mlp(x, wg, wu, wd, bg, bu, bd, activation):
    """glu_mlp's arguments, checked before any matmul: a RuntimeError naming
    the argument, what was given and what is expected. (The messages are
    made only for an argument that fails.)"""
    def fail(what):
        raise RuntimeError(f"fusedops.glu_mlp: {what}")

    if activation not in ("silu", "gelu_tanh"):
        fail(f"activation is {activation!r}, expected 'silu' or 'gelu_tanh'")
    if x.dim() < 1:
        fail(f"x has shape {list(x.shape)}, expected at least one dimension")
    packed = wu is None
    if packed and bu is not None:
        fail("up_bias is given without up_weight; with gate_weight packed as [gate; up], gate_bias holds both")
    h, f = x.shape[-1], wg.shape[0] // (2 if packed else 1) if wg.dim() == 2 else None
    args = (("gate_weight", wg, wg.dim() == 2 and wg.shape[1] == h and not (packed and wg.shape[0] % 2)),
            ("up_weight", wu, packed or wu.shape == wg.shape),
            ("down_weight", wd, wd.dim() == 2 and wd.shape[1] == f),
            ("gate_bias", bg, bg is None or (bg.dim() == 1 and wg.dim() == 2 and bg.shape[0] == wg.shape[0])),
            ("up_bias", bu, bu is None or (bu.dim() == 1 and bu.shape[0] == f)),
            ("down_bias", bd, bd is None or (bd.dim() == 1 and wd.dim() == 2 and bd.shape[0] == wd.shape[0])))
    xdev, xdt, autocast = x.device, x.dtype, None
    for name, t, shape_ok in args:
        if t is None:
            continue
        if t.device != xdev:
            fail(f"{name} is on {t.device} but x is on {xdev}; all tensors must be on one device")
        if not shape_ok:
            rows = "half the rows" if packed else "the rows"
            expected = {"gate_weight": f"[{'2F' if packed else 'F'}, {h}] ({h}: the last dimension of x)",
                        "up_weight": "the shape of gate_weight",
                        "down_weight": f"[H, {f}] ({f}: {rows} of gate_weight)",
                        "gate_bias": f"[{wg.shape[0] if wg.dim() == 2 else None}]", "up_bias": f"[{f}]",
                        "down_bias": "[H] (H: the rows of down_weight)"}[name]
            fail(f"{name} has shape {list(t.shape)}, expected {expected}")
        if t.dtype != xdt:
            if autocast is None:
                autocast = autocast_dtype(device_type(x)) is not None
            if not autocast:
                fail(f"{name} has dtype {str(t.dtype)[6:]}, expected the dtype of x ({str(xdt)[6:]}), "
                     "or a call under torch.autocast")


_glu_mlp_apply = function_apply(_GLUMLP)


def glu_mlp(x, gate_weight, up_weight, down_weight, gate_bias=None, up_bias=None, down_bias=None,
            activation="silu"):
    """The Llama-family MLP, down_proj(act(gate_proj(x)) * up_proj(x)), with
    torch.nn.functional.linear's weight layout ([out, in]). Keeps x and the two
    projections for the backward, not the activation; activation "silu"
    (SwiGLU) or "gelu_tanh" (GeGLU). up_weight None: gate_weight is the packed
    [W_gate; W_up] of one gate-up projection ([2F, H], Phi-3's gate_up_proj),
    gate_bias (if any) [b_gate; b_up], and its gradient comes as one tensor."""
    _check_mlp(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation)
    args = (x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation)
    if _is_compiling() or _needs_grad(*args[:7]):
        return _glu_mlp_apply(*args)
    return _GLUMLP.forward(None, *args)  # nothing to record: the same forward, without autograd.Function


# --------------------------------------------------------------------------- attention

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Head dims the CUDA kernels take (csrc/attention/attention_{fwd,bwd}_cuda.cu),
# and below whether each direction is built; the CPU kernels take every head
# dim and dtype above.
CUDA_HEAD_DIMS = (32, 64, 96, 128, 256)


def _has_cuda_kernel(op):
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"fusedops::{op}", "CUDA")


_CUDA_FWD, _CUDA_BWD = _has_cuda_kernel("attn_fwd"), _has_cuda_kernel("attn_bwd")


def _needs_grad(*ts):
    """Whether autograd records a call on ts (tensors or None). (torch.compile
    cannot trace _any_requires_grad, a C function.)"""
    if not _grad_enabled():
        return False
    if _is_compiling():
        return any(t is not None and t.requires_grad for t in ts)
    return _any_requires_grad(*ts)


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


def _kernel_call(name, q, k, v):
    """q, k, v as flash_attention and flash_attention_varlen hand them to the
    kernels (cast as autocast casts SDPA's inputs); raises where the device's
    kernels do not take the call (never falls back)."""
    q, k, v = _lower_precision(q, k, v)
    if q.is_cuda:
        gap = _cuda_gap(q.dtype, q.shape[-1], _needs_grad(q, k, v))
        if gap is not None:
            raise RuntimeError(f"fusedops.{name}: not supported: {gap}")
    return q, k, v


def _window(window_size):
    left, right = window_size
    return int(left), int(right)


def flash_attention(q, k, v, causal=False, scale=None, deterministic=False, window_size=(-1, -1), softcap=0.0):
    """softmax(scale * q k^T) v on (batch, seq, heads, head_dim) tensors, without
    materialising the seq x seq matrix. Returns (B, Sq, Hq, D).

    k and v are (B, Sk, Hkv, D) with Hq a multiple of Hkv (grouped-query and
    multi-query attention, K/V not repeated). Inputs are read through their
    strides (unit stride along head_dim; transposed (B, H, S, D) views need no
    copy). scale defaults to 1/sqrt(head_dim).

    Masks, aligned top-left (query i against key i, as torch SDPA's is_causal,
    for Sq != Sk too): window_size = (left, right) lets query i see the keys j
    with i - left <= j <= i + right, -1 leaving that side unbounded (Mistral's
    and Gemma's sliding windows: (W - 1, 0) with causal). causal is right = 0,
    the mask tril(ones(Sq, Sk)); it overrides window_size's right. A query
    that sees no key gets out 0 (and no gradient). softcap > 0 replaces each
    scaled score s by softcap * tanh(s / softcap) before the softmax (Gemma 2's
    attn_logit_softcapping). Key tiles a window masks whole are skipped: the
    cost follows the visible work.

    deterministic: bitwise-repeatable gradients (also on whenever
    torch.use_deterministic_algorithms(True) is). Under torch.autocast q, k and
    v are cast to its dtype, as for torch's scaled_dot_product_attention.
    Raises where the kernels do not apply (never falls back)."""
    q, k, v = _kernel_call("flash_attention", q, k, v)
    if scale is None:
        scale = _default_scale(q)
    deterministic = bool(deterministic) or torch.are_deterministic_algorithms_enabled()
    out, _ = _attn.attn_fwd(q, k, v, float(scale), bool(causal), deterministic, *_window(window_size),
                           float(softcap))
    return out


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           scale=None, deterministic=False, window_size=(-1, -1), softcap=0.0):
    """flash_attention over packed sequences (documents concatenated without
    padding), as FlashAttention's flash_attn_varlen_func. Returns (total_q, Hq, D).

    q is (total_q, Hq, D), k and v (total_k, Hkv, D); cu_seqlens_q and
    cu_seqlens_k are int32 prefix sums of the sequences' lengths, batch + 1
    values on q's device (sequence b has queries cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1] - 1 and keys likewise); max_seqlen_q / _k are the
    longest lengths (ints). No attention crosses a sequence boundary, and each
    sequence costs its own work: packed documents cost the sum of their own
    squares. A sequence may be empty, of queries or of keys.

    Within a sequence of sq queries and sk keys, causal and window_size are
    aligned bottom-right, as FlashAttention's: the last query sees the last
    key, query i sees keys j with i + sk - sq - left <= j <= i + sk - sq + right
    (causal: right = 0). (flash_attention, on padded batches, aligns top-left
    as torch SDPA does; the two agree where sq = sk.) softcap, scale,
    deterministic and autocast as for flash_attention.

    The offsets are checked for dtype (int32), shape and device everywhere,
    and for their values (first 0, non-decreasing, last the number of tokens,
    no sequence longer than max_seqlen) on the CPU. On a GPU the values are
    the caller's to keep, as FlashAttention's: reading them would make the op
    wait for the stream."""
    q, k, v = _kernel_call("flash_attention_varlen", q, k, v)
    if scale is None:
        scale = _default_scale(q)
    deterministic = bool(deterministic) or torch.are_deterministic_algorithms_enabled()
    out, _ = _attn.attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                  float(scale), bool(causal), deterministic, *_window(window_size),
                                  float(softcap))
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


def _torch_sdpa(q, k, v, **kwargs):
    """torch's scaled_dot_product_attention. Where it returns no tensor (torch
    2.11's CUDA SDPA on an empty batch, no heads or head dim 0, inputs whose
    result is empty), the result of its math: the empty tensor, with its
    gradients."""
    out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    if out is None:
        if 0 < k.shape[-3] != q.shape[-3]:  # grouped-query heads
            k, v = (t.repeat_interleave(q.shape[-3] // k.shape[-3], -3) for t in (k, v))
        out = (q @ k.transpose(-2, -1)).softmax(-1) @ v
    return out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention, same signature and
    results, on (..., heads, seq, head_dim) tensors. Calls fusedops' kernels
    where they apply (on the CPU: float32, float16 and bfloat16, any head dim;
    no mask, no dropout) and torch's function otherwise, with a warning the
    first time for each reason. The backward is bitwise repeatable under
    torch.use_deterministic_algorithms(True)."""
    q, k, v = query, key, value
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        # Nothing to compute (no queries, keys, heads or batch): torch's function
        # gives torch's shape, and for no keys its backend's values.
        return _torch_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)
    q, k, v = _lower_precision(q, k, v)
    gap = _sdpa_gap(q, k, v, attn_mask, dropout_p, enable_gqa)
    if gap is not None:
        # Not while dynamo traces: warnings.warn would break the graph at every
        # attention call (compiled code falls back without saying so).
        if gap not in _warned and not torch.compiler.is_compiling():
            _warned.add(gap)
            warnings.warn(f"fusedops.functional.scaled_dot_product_attention: {gap} is not "
                          "supported by fusedops' kernels; calling torch's", stacklevel=2)
        return _torch_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)
    lead = q.shape[:-3]

    def bshd(t):  # (..., H, S, D) -> (B, S, H, D): a view for 3-D and 4-D tensors
        return t.reshape(-1, *t.shape[-3:]).transpose(1, 2)
    if scale is None:
        scale = _default_scale(q)
    out, _ = _attn.attn_fwd(bshd(q), bshd(k), bshd(v), float(scale), bool(is_causal),
                           torch.are_deterministic_algorithms_enabled())
    out = out.transpose(1, 2)  # (B, H, S, D), a view
    return out.reshape(*lead, *out.shape[1:])


# --------------------------------------------------------------- RoPE
_CUDA_ROPE = _has_cuda_kernel("rope")


def _rope_gap(q, k, cos, sin, unsqueeze_dim):
    """Why fusedops' rope kernel cannot take this apply_rotary_pos_emb call
    (None if it can)."""
    if unsqueeze_dim not in (1, 2, -3, -2):
        return f"unsqueeze_dim {unsqueeze_dim}"
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.dim() != 3:
        return "q, k not 4-D or cos, sin not 3-D"
    if q.dtype not in _KERNEL_DTYPES or not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        return f"dtypes {q.dtype}, {k.dtype}, {cos.dtype}, {sin.dtype}"
    if not (q.device == k.device == cos.device == sin.device) or q.device.type not in ("cpu", "cuda"):
        return f"devices {q.device}, {k.device}, {cos.device}, {sin.device}"
    if q.device.type == "cuda" and not _CUDA_ROPE:
        return "no CUDA rope kernel in this build"
    if _needs_grad(cos, sin):
        return "cos or sin that require grad"
    return None


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Hugging Face's apply_rotary_pos_emb (the rotate-half RoPE of the Llama,
    Mistral and Qwen families), same signature and results up to rounding:
    q * cos + rotate_half(q) * sin, and the same for k, in one kernel call for
    both and one for their gradients. q (B, Hq, S, D) and k (B, Hk, S, D), or
    (B, S, H, D) with unsqueeze_dim=2; cos and sin (B or 1, S, D). What the
    kernel does not take (other ranks or shapes, mixed dtypes, cos or sin that
    require grad) runs the eager formula (fusedops.reference.rope)."""
    bshd = unsqueeze_dim in (2, -2)
    if _rope_gap(q, k, cos, sin, unsqueeze_dim) is None:
        qh, kh = (q.transpose(1, 2), k.transpose(1, 2)) if bshd else (q, k)
        if _rope_shapes_fit(qh, kh, cos, sin):
            qo, ko = _rope.rope(qh, kh, cos, sin)
            return (qo.transpose(1, 2), ko.transpose(1, 2)) if bshd else (qo, ko)
    return reference.rope(q, k, cos, sin, unsqueeze_dim)


def _rope_shapes_fit(q, k, cos, sin):
    """(B, H, S, D) q and k of one batch, seq and even head dim, and cos, sin
    (B or 1, S, D)."""
    b, _, s, d = q.shape
    return (k.shape[0] == b and k.shape[2:] == q.shape[2:] and d % 2 == 0 and cos.shape == sin.shape
            and cos.shape[0] in (1, b) and cos.shape[1:] == (s, d))


# --------------------------------------------------------------- q / k / v projection, RoPE, attention
def _qkv_gap(x, wq, wk, wv, bq, bk, bv, cos, sin, num_heads, num_kv_heads):
    """Why qkv_attention's fused path cannot take this call (None if it can)."""
    dt = autocast_dtype(x.device.type) or x.dtype
    if not all(isinstance(t, torch.Tensor) for t in (x, wq, wk, wv, cos, sin)):
        return "arguments that are not tensors"
    if x.dim() != 3:
        return f"x of shape {tuple(x.shape)} (the fused path takes [batch, seq, hidden])"
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"{num_heads} query heads over {num_kv_heads} key / value heads"
    if any(w.dim() != 2 or w.shape[1] != x.shape[-1] for w in (wq, wk, wv)):
        return "weights that are not [out, hidden]"
    d = wq.shape[0] // num_heads
    if (d == 0 or d % 2 or wq.shape[0] != num_heads * d or wk.shape[0] != num_kv_heads * d
            or wv.shape[0] != num_kv_heads * d):
        return "projections whose rows are not heads x an even head dim"
    if any(b is not None and tuple(b.shape) != (w.shape[0],) for w, b in ((wq, bq), (wk, bk), (wv, bv))):
        return "biases not of their projection's rows"
    ts = [t for t in (x, wq, wk, wv, bq, bk, bv) if t is not None]
    if dt not in _KERNEL_DTYPES:
        return f"dtype {dt}"
    if dt is x.dtype and any(t.dtype != dt for t in ts):  # (autocast casts them all to dt)
        return "mixed dtypes"
    if any(t.device != x.device for t in (*ts, cos, sin)) or x.device.type not in ("cpu", "cuda"):
        return "tensors on different devices, or a device without kernels"
    if cos.dim() != 3 or cos.shape != sin.shape or cos.shape[0] not in (1, x.shape[0]) or tuple(
            cos.shape[1:]) != (x.shape[1], d):
        return f"cos / sin of shape {tuple(cos.shape)} (expected [batch or 1, seq, head_dim])"
    if _needs_grad(cos, sin):
        return "cos or sin that require grad"
    if x.device.type == "cuda":
        if not _CUDA_ROPE:
            return "no CUDA rope kernel in this build"
        return _cuda_gap(dt, d, _needs_grad(*ts))
    return None


def _mode_may_hold_outputs():
    """Whether a Python dispatch mode sees the ops called here, outside
    torch.compile: such a mode may keep an op's output and hand it back later,
    as selective activation checkpointing (torch.utils.checkpoint's
    create_selective_checkpoint_contexts) does with the matmuls it saves,
    returning them in place of the recomputation. An op that writes in place
    must then not write into another op's output: the kept one would change
    with it (a matmul's 2-D output reshaped to 3-D is no view that shares its
    version counter, so the mode cannot tell)."""
    return not torch.compiler.is_compiling() and is_in_torch_dispatch_mode(include_infra_modes=False)


class _QKVAttention(torch.autograd.Function):
    """attention(rope(x Wq^T + bq), rope(x Wk^T + bk), x Wv^T + bv) with the
    three projections as one matmul into a packed [B, S, Hq + 2 Hkv, D]
    tensor, RoPE applied to its q and k heads in place, and attention reading
    q, k and v from it. The backward mirrors it: attn_bwd_packed writes dq,
    dk and dv side by side into one tensor, RoPE's inverse turns dq and dk in
    place, and one matmul gives dx (where three projections took three and two
    adds), one more the three weight gradients.

    With `cache`, K (rotated) and V are returned as well, [B, Hkv, S, D]
    views of the packed tensor for a KV cache: outside autograd (no gradient flows
    back through them), as the cache of a training step is filled but never
    differentiated through, and torch.compile would otherwise add a zero
    gradient for each of them in the backward."""

    @staticmethod
    def forward(ctx, x, wq, wk, wv, bq, bk, bv, cos, sin, hq, hkv, scale, causal, cache, window, softcap):
        orig = (x, wq, wk, wv, bq, bk, bv)
        dev = x.device.type
        given_packed = wk is None  # wq is [Wq; Wk; Wv] and bq [bq; bk; bv] (one qkv projection)
        w = wq if given_packed else _joint_weight(wq, wk, wv)
        dt = autocast_dtype(dev)
        if dt is not None:
            x, wq, wk, wv, bq, bk, bv = (t if t is None else t.to(dt) for t in orig)
            w = wq if given_packed else None if w is None else w.to(dt)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        with torch.autocast(dev, enabled=False) if dt is not None else contextlib.nullcontext():
            if w is None:
                w = torch.cat([wq, wk, wv])
            b = bq if given_packed else None if bq is None and bk is None and bv is None else torch.cat(
                [t if t is not None else wr.new_zeros(wr.shape[0]) for t, wr in ((bq, wq), (bk, wk), (bv, wv))])
            bsz, seq = x.shape[:2]
            qkv = torch.nn.functional.linear(x, w, b).view(bsz, seq, hq + 2 * hkv, w.shape[0] // (hq + 2 * hkv))
            if _mode_may_hold_outputs():
                qkv = qkv.clone()  # RoPE below writes qkv: not the matmul's output, which the mode may keep
            q, k, v = qkv.split([hq, hkv, hkv], dim=2)
            _rope.rope_(q.transpose(1, 2), k.transpose(1, 2), cos, sin, False)
            det = torch.are_deterministic_algorithms_enabled()
            out, lse = _attn.attn_fwd(q, k, v, scale, causal, det, *window, softcap)
        ctx.save_for_backward(x, qkv, w, out, lse, cos, sin)
        ctx.heads, ctx.scale, ctx.causal, ctx.det = (hq, hkv), scale, causal, det
        ctx.mask = (*window, softcap)
        ctx.given_packed = given_packed
        ctx.dtypes = [None if t is None else t.dtype for t in orig]
        out = out.view(bsz, seq, hq * out.shape[-1])
        if not cache:
            return out
        # Views of qkv, which the backward keeps anyway: a cache may hold them as
        # they are (fusedops.hf's _cache_put) or copy them.
        kc, vc = k.transpose(1, 2), v.transpose(1, 2)
        ctx.mark_non_differentiable(kc, vc)
        return out, kc, vc

    @staticmethod
    @once_only("qkv_attention")  # the in-place rope has no gradient
    def backward(ctx, dout, *_):
        x, qkv, w, out, lse, cos, sin = ctx.saved_tensors
        hq, hkv = ctx.heads
        need = ctx.needs_input_grad
        q, k, v = qkv.split([hq, hkv, hkv], dim=2)
        dqkv = _attn.attn_bwd_packed(dout.to(out.dtype).reshape(out.shape), q, k, v, out, lse, ctx.scale,
                                    ctx.causal, ctx.det, *ctx.mask)
        dq, dk, _ = dqkv.split([hq, hkv, hkv], dim=2)
        _rope.rope_(dq.transpose(1, 2), dk.transpose(1, 2), cos, sin, True)
        g = dqkv.view(-1, w.shape[0])
        rows = [hq * q.shape[3], hkv * q.shape[3], hkv * q.shape[3]]
        dx = (g @ w).view(x.shape) if need[0] else None
        dw = g.t() @ _rows(x) if any(need[1:4]) else None
        db = g.sum(0) if any(need[4:7]) else None
        if ctx.given_packed:  # one gradient for the packed weight (and bias)
            dws, dbs = (dw, None, None), (db, None, None)
        else:
            dws = dw.split(rows) if dw is not None else (None,) * 3
            dbs = db.split(rows) if db is not None else (None,) * 3
        grads = [dx, *(d if n else None for d, n in zip(dws, need[1:4])),
                 *(d if n else None for d, n in zip(dbs, need[4:7]))]
        return (*(gr if gr is None or gr.dtype == t else gr.to(t) for gr, t in zip(grads, ctx.dtypes)),
                *(None,) * 9)


def _qkv_fused(x, wq, wk, wv, cos, sin, num_heads, num_kv_heads, bq=None, bk=None, bv=None, scale=None,
               causal=True, return_kv=False, window_size=(-1, -1), softcap=0.0):
    """qkv_attention on the kernels, for a call _qkv_gap has cleared (with wq,
    wk, wv; here wk and wv None and wq, bq packed as [Wq; Wk; Wv], [bq; bk; bv]
    is the same call). window_size and softcap as for flash_attention (the
    Hugging Face forwards' sliding windows and Gemma 2's soft-capping)."""
    heads = num_heads + (2 * num_kv_heads if wk is None else 0)
    scale = (wq.shape[0] // heads) ** -0.5 if scale is None else float(scale)
    res = _QKVAttention.apply(x, wq, wk, wv, bq, bk, bv, cos, sin, num_heads, num_kv_heads, scale,
                              bool(causal), bool(return_kv), _window(window_size), float(softcap))
    if not return_kv:
        return res
    # Detached again: torch 2.11's AOTAutograd loses mark_non_differentiable on
    # an output that is a view, and then fails to trace the backward.
    out, k, v = res
    return out, k.detach(), v.detach()


def qkv_attention(x, q_weight, k_weight, v_weight, cos, sin, num_heads, num_kv_heads, q_bias=None,
                  k_bias=None, v_bias=None, scale=None, causal=True, return_kv=False):
    """The attention of a Llama-family layer up to its output projection: x
    [B, S, hidden] projected to q, k, v (torch.nn.Linear's weights and
    biases), q and k rotated by Hugging Face's rotate-half RoPE (cos, sin
    [B or 1, S, head_dim]), then scaled_dot_product_attention with
    num_heads / num_kv_heads (grouped-query). Returns [B, S, num_heads *
    head_dim]; with return_kv also K (rotated) and V as [B, num_kv_heads, S,
    head_dim] for a KV cache, which do not take gradients.

    One matmul for the three projections (one storage for the three weights,
    fusedops.nn.join_weights, saves a copy of them), RoPE in place, and a
    backward that sums nothing (see _QKVAttention). Calls that the kernels do
    not take run the same math in torch's ops."""
    if _qkv_gap(x, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, cos, sin, num_heads,
                num_kv_heads) is None:
        return _qkv_fused(x, q_weight, k_weight, v_weight, cos, sin, num_heads, num_kv_heads, q_bias,
                          k_bias, v_bias, scale, causal, return_kv)
    if scale is None:
        scale = (q_weight.shape[0] // max(num_heads, 1)) ** -0.5
    lin = torch.nn.functional.linear

    def heads(t, n):
        return t.view(*x.shape[:-1], n, t.shape[-1] // n).transpose(1, 2)
    q, k = reference.rope(heads(lin(x, q_weight, q_bias), num_heads),
                          heads(lin(x, k_weight, k_bias), num_kv_heads), cos, sin, 1)
    v = heads(lin(x, v_weight, v_bias), num_kv_heads)
    out = _torch_sdpa(
        q, k, v, is_causal=causal, scale=scale, enable_gqa=num_heads != num_kv_heads)
    out = out.transpose(1, 2).reshape(*x.shape[:-1], num_heads * out.shape[-1])
    return (out, k.detach(), v.detach()) if return_kv else out


# --------------------------------------------------------------------------- cross-entropy
_CUDA_XENT = _has_cuda_kernel("xent_fwd")


def _xent_gap(logits, target, weight, label_smoothing):
    """Why fusedops' cross-entropy kernel cannot take this call (None if it can)."""
    if logits.dim() != 2:
        return f"input of shape {tuple(logits.shape)} (the kernel takes [rows, classes])"
    if target.dim() != 1 or target.dtype != torch.int64:
        return "targets that are not int64 class indices"
    if weight is not None:
        return "class weights"
    if logits.dtype not in _KERNEL_DTYPES:
        return f"{logits.dtype} input"
    return _xent_device_gap(logits)


def _xent_device_gap(x):
    """Why the cross-entropy kernels cannot run on x's device (None if they can)."""
    if x.is_cuda:
        return None if _CUDA_XENT else "no CUDA cross-entropy kernel in this build"
    return None if x.is_cpu else f"{x.device.type} tensors"


def _xent_f32(logits, target, ignore_index, reduction, num_items=None, label_smoothing=0.0):
    """The loss in fp32, reduced as asked (in the kernel); num_items replaces
    the mean's count of non-ignored targets (Hugging Face's
    num_items_in_batch: the sum divided by it)."""
    if num_items is None or reduction == "none":
        return _xent.xent_fwd(logits, target, ignore_index, float(label_smoothing), 0.0, reduction)[0]
    total = _xent.xent_fwd(logits, target, ignore_index, float(label_smoothing), 0.0, "sum")[0]
    return total / (num_items.to(total.device) if torch.is_tensor(num_items) else num_items)


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """torch.nn.functional.cross_entropy, same signature and results up to
    rounding, for [rows, classes] logits and int64 class indices: one pass
    over the logits forward (an online logsumexp in fp32, whatever their
    dtype) and one backward, without the fp32 copy of 16-bit logits that
    upcasting first makes. Other calls (class weights, label smoothing,
    probabilities as targets, other ranks) go to torch's function, with a
    warning the first time. On CUDA a target out of range gives a NaN loss
    (torch's kernel asserts); on the CPU it raises."""
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"fusedops.functional.cross_entropy: label_smoothing is {label_smoothing}, "
                         "expected a number in [0, 1]")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"fusedops.functional.cross_entropy: reduction is {reduction!r}, "
                         "expected 'none', 'mean' or 'sum'")
    gap = _xent_gap(input, target, weight, label_smoothing)
    if gap is not None:
        if gap not in _warned and not torch.compiler.is_compiling():
            _warned.add(gap)
            warnings.warn(f"fusedops.functional.cross_entropy: {gap} is not supported by fusedops' "
                          "kernel; calling torch's", stacklevel=2)
        return F.cross_entropy(input, target, weight=weight, ignore_index=ignore_index,
                               reduction=reduction, label_smoothing=label_smoothing)
    loss = _xent_f32(input, target, ignore_index, reduction, None, label_smoothing)
    # Under autocast torch computes cross_entropy in fp32 and returns that.
    return loss if input.dtype == torch.float32 or autocast_dtype(device_type(input)) else loss.to(input.dtype)


# --------------------------------------------------------------------------- linear + cross-entropy
def _linear_xent_gap(input, weight, bias):
    """Why the fused linear cross-entropy cannot take this call (None if it
    can): what is not an error but goes to torch's two-step form."""
    ts = [t for t in (input, weight, bias) if t is not None]
    if any(t.dtype not in _KERNEL_DTYPES for t in ts):  # (autocast leaves float64 as it is)
        return f"{', '.join(sorted({str(t.dtype)[6:] for t in ts}))} input"
    return _xent_device_gap(input)


def _linear_xent_f32(input, weight, target, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                     softcap=0.0, num_items=None):
    """linear_cross_entropy's loss in fp32 (before the cast to input's dtype),
    input [..., hidden] and target [...]; num_items as in _xent_f32 (the
    op's mean divides by it). Under autocast input, weight and bias in its dtype, as
    torch's linear takes them."""
    op = "linear_cross_entropy"
    if input.dim() < 1 or target.shape != input.shape[:-1]:
        raise RuntimeError(f"fusedops.{op}: input has shape {list(input.shape)} and target {list(target.shape)}, "
                           "expected [..., hidden] and [...] (a class index a row of input)")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"fusedops.{op}: reduction is {reduction!r}, expected 'none', 'mean' or 'sum'")
    x = input.reshape(-1, input.shape[-1])
    t = target.reshape(-1)
    if bias is None:
        x, weight = _lower_precision(x, weight)
    else:
        x, weight, bias = _lower_precision(x, weight, bias)
    _linear_xent_ops.check_args(op, x, weight, bias, t, None, float(label_smoothing), float(softcap))
    grads = [_needs_grad(a) for a in (x, weight)] + [bias is not None and _needs_grad(bias)]
    if num_items is not None:  # the mean over num_items, in the op: its gradients then need no scaling
        reduction = "mean"
        num_items = torch.as_tensor(num_items)
    loss = _linear_xent_ops.linear_xent_fwd(x, weight, bias, t, ignore_index, reduction, float(label_smoothing),
                                            float(softcap), *grads, num_items)[0]
    return loss.reshape(input.shape[:-1]) if reduction == "none" else loss


def linear_cross_entropy(input, weight, target, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                         softcap=0.0):
    """cross_entropy(linear(input, weight, bias), target), with softcap > 0
    the logits first capped to softcap * tanh(logits / softcap) (Gemma 2's
    final layer), without the [tokens, classes] logits in memory: input
    [..., hidden], weight [classes, hidden], bias [classes] or None, target
    [...] int64 class indices; ignore_index, reduction and label_smoothing as
    torch.nn.functional.cross_entropy's. The loss in input's dtype (fp32
    under autocast, which also casts input, weight and bias as torch's linear
    does), as the two-step form gives it.

    A chunk of tokens at a time: its logits, then its loss and their gradient
    in one pass, then the gradients of input, weight and bias from it, in
    the forward (docs/linear-cross-entropy.md); the backward scales them.
    What the kernels do not take (float64, say) runs the two-step form in
    torch, with a warning the first time. On CUDA a target out of range gives
    a NaN loss; on the CPU it raises."""
    gap = _linear_xent_gap(input, weight, bias)
    if gap is not None:
        if gap not in _warned and not torch.compiler.is_compiling():
            _warned.add(gap)
            warnings.warn(f"fusedops.functional.linear_cross_entropy: {gap} is not supported by fusedops' "
                          "kernels; calling torch's linear and cross_entropy", stacklevel=2)
        return reference.linear_cross_entropy(input, weight, target, bias, ignore_index, reduction,
                                              label_smoothing, softcap)
    loss = _linear_xent_f32(input, weight, target, bias, ignore_index, reduction, label_smoothing, softcap)
    return loss if autocast_dtype(device_type(input)) else loss.to(input.dtype)
