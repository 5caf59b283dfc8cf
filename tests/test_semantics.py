"""What the public functions and modules promise beyond their values (issue 50):

- double backward: a gradient taken with create_graph=True, then a gradient
  of it, either raises naming the function or op, or is right (against
  torch's math in float64): never a gradient without a graph, which made a
  gradient penalty silently add nothing;
- empty tensors: the drop-ins give torch's result (shape, dtype, values,
  gradients) on zero-size inputs; the other functions give the reference's
  or raise a clear error;
- autocast: each drop-in returns the dtype torch's own op returns under
  torch.autocast on the same device, with values by the 2x rule;
- messages: an unsupported dtype is named, a message starts with the op's
  words (no source path), an allocation that cannot be had raises an
  out-of-memory error naming the op."""
import re

import pytest
import torch
import torch.nn.functional as TF

import fusedops
from fusedops import functional as FF, reference
from conftest import randn, raises_unchanged
from tolerances import assert_close_2x
import test_swiglu

ops = torch.ops.fusedops
# Ours, or torch's own where a call its kernels do not take ran torch's ops
# (CUDA SDPA's backends have no double backward either: an error, not a silent zero).
DOUBLE_BACKWARD = (r"fusedops\.\w+: double backward is not supported"
                   r"|derivative for aten::_scaled_dot_product_\w+_backward is not implemented")


def cuda_ok(device, dtype):
    """The dtype the CUDA attention kernels take (no fp32 there)."""
    return torch.float16 if device == "cuda" and dtype == torch.float32 else dtype


def _outputs(out):
    return out if isinstance(out, (tuple, list)) else (out,)


def second_order(fn, xs, loss):
    """The gradient of sum(|g|^2) over the gradients g of loss(fn(*xs)) taken
    with create_graph=True: one tensor or None per input; None for all when no
    gradient depends on the inputs."""
    out = _outputs(fn(*xs))
    gs = torch.autograd.grad(sum(loss(o.float()) for o in out), xs, create_graph=True, allow_unused=True)
    penalty = [(g.float() ** 2).sum() for g in gs if g is not None and g.requires_grad]
    if not penalty:
        return [None] * len(xs)
    return list(torch.autograd.grad(sum(penalty), xs, allow_unused=True))


def _rope_fn(q, k, cos, sin):
    return FF.apply_rotary_pos_emb(q, k, cos, sin)


def _mlp_joint(x, wg, wu, wd):
    """glu_mlp on gate and up weights stored one after the other (the packed path)."""
    w = torch.cat([wg.detach(), wu.detach()]).requires_grad_()
    return FF.glu_mlp(x, w[: wg.shape[0]], w[wg.shape[0]:], wd) + 0 * (wg.sum() + wu.sum())


def _module(make):
    """(fn of (x, *parameters), the module) for a module whose parameters are
    the test's inputs after x."""
    m = make()

    def fn(x, *params):
        return torch.func.functional_call(m, dict(zip([n for n, _ in m.named_parameters()], params)), (x,))
    return fn, m


def _qkv(x, wq, wk, wv, cos, sin):
    return FF.qkv_attention(x, wq, wk, wv, cos, sin, 4, 2)


# (id, fused fn, reference fn (torch's math), input shapes, which inputs take
# gradients). The reference runs in float64 and in the inputs' dtype.
H = 16
PUBLIC = [
    ("layer_norm", lambda x, w, b: FF.layer_norm(x, w, b),
     lambda x, w, b: TF.layer_norm(x, (H,), w, b), [(3, H), (H,), (H,)]),
    ("rms_norm", lambda x, w: FF.rms_norm(x, w), lambda x, w: TF.rms_norm(x, (H,), w, 1e-6), [(3, H), (H,)]),
    ("fused_add_layer_norm", lambda x, r, w: FF.fused_add_layer_norm(x, r, w),
     lambda x, r, w: (TF.layer_norm(x + r, (H,), w), x + r), [(3, H), (3, H), (H,)]),
    ("fused_add_rms_norm", lambda x, r, w: FF.fused_add_rms_norm(x, r, w),
     lambda x, r, w: (TF.rms_norm(x + r, (H,), w, 1e-6), x + r), [(3, H), (3, H), (H,)]),
    ("swiglu", FF.swiglu, reference.glu, [(3, H), (3, H)]),
    ("geglu", FF.geglu, lambda g, u: reference.glu(g, u, "gelu_tanh"), [(3, H), (3, H)]),
    ("swiglu_packed", FF.swiglu_packed, reference.glu_packed, [(3, 2 * H)]),
    ("geglu_packed", FF.geglu_packed, lambda t: reference.glu_packed(t, "gelu_tanh"), [(3, 2 * H)]),
    ("glu_mlp", FF.glu_mlp, reference.glu_mlp, [(3, H), (24, H), (24, H), (H, 24)]),
    ("glu_mlp_joint_weights", _mlp_joint, reference.glu_mlp, [(3, H), (24, H), (24, H), (H, 24)]),
    ("flash_attention", lambda q, k, v: FF.flash_attention(q, k, v, causal=True),
     lambda q, k, v: reference.attention(q, k, v, causal=True), [(2, 5, 4, 32), (2, 5, 2, 32), (2, 5, 2, 32)]),
    ("scaled_dot_product_attention", lambda q, k, v: FF.scaled_dot_product_attention(q, k, v, enable_gqa=True),
     lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, enable_gqa=True),
     [(2, 4, 5, 32), (2, 2, 5, 32), (2, 2, 5, 32)]),
    ("apply_rotary_pos_emb", _rope_fn, reference.rope, [(2, 4, 5, 32), (2, 2, 5, 32), (1, 5, 32), (1, 5, 32)], 2),
    ("qkv_attention", _qkv, lambda *a: _qkv(*a), [(2, 5, 64), (64, 64), (32, 64), (32, 64), (1, 5, 16), (1, 5, 16)], 4),
    ("cross_entropy", lambda x: FF.cross_entropy(x, torch.arange(5, device=x.device) % 7),
     lambda x: TF.cross_entropy(x, torch.arange(5, device=x.device) % 7), [(5, 7)]),
]
MODULES = [
    ("nn.LayerNorm", lambda: fusedops.nn.LayerNorm(H), lambda: torch.nn.LayerNorm(H)),
    ("nn.RMSNorm", lambda: fusedops.nn.RMSNorm(H, eps=1e-6), lambda: torch.nn.RMSNorm(H, eps=1e-6)),
    ("nn.SwiGLU", lambda: fusedops.nn.SwiGLU(H, 24), lambda: test_swiglu.LlamaMLP(H, 24)),
]


def _public_case(case, device, dtype=torch.float32):
    """(fused fn, reference fn, inputs that require grad) of a PUBLIC or MODULES entry."""
    if len(case) == 3:  # a module: x and its parameters
        _, ours, theirs = case
        fused, m = _module(ours)
        m.to(device)
        ref, r = _module(theirs)
        r.to(device)
        xs = [randn((3, H), dtype, device)] + [p.detach().to(dtype) for p in m.parameters()]
        xs = [x.requires_grad_() for x in xs]
        return fused, ref, xs
    _, fused, ref, shapes, *n_grad = case
    n_grad = n_grad[0] if n_grad else len(shapes)
    xs = [randn(s, dtype, device) for s in shapes]
    return fused, ref, [x.requires_grad_(i < n_grad) for i, x in enumerate(xs)]


@pytest.mark.parametrize("loss", ["sum", "square"])
@pytest.mark.parametrize("case", PUBLIC + MODULES, ids=[c[0] for c in PUBLIC + MODULES])
def test_double_backward_raises_or_is_right(device, case, loss):
    """torch.autograd.grad(out.sum(), inputs, create_graph=True), then a
    gradient of those gradients: a clear error, or torch's answer."""
    dtype = cuda_ok(device, torch.float32) if "attention" in case[0] else torch.float32
    fused, ref, xs = _public_case(case, device, dtype)
    grad_xs = [x for x in xs if x.requires_grad]
    lossf = (lambda o: o.sum()) if loss == "sum" else (lambda o: (o ** 2).sum())

    def with_all(fn):  # fn of the inputs that take gradients, the others fixed
        def call(*gx):
            it = iter(gx)
            return fn(*[next(it) if x.requires_grad else x for x in xs])
        return call
    try:
        got = second_order(with_all(fused), grad_xs, lossf)
    except RuntimeError as e:
        assert re.search(DOUBLE_BACKWARD, str(e)), f"{case[0]}: unclear error: {e}"
        return
    # No error: the second-order gradients must be torch's, in float64 by the 2x rule.
    x64 = [x.detach().double().requires_grad_(x.requires_grad) for x in xs]
    want = second_order(with_all(ref), [x for x in x64 if x.requires_grad], lossf)
    xlo = [x.detach().requires_grad_(x.requires_grad) for x in xs]
    eager = second_order(with_all(ref), [x for x in xlo if x.requires_grad], lossf)
    for i, (g, w, e) in enumerate(zip(got, want, eager)):
        assert (g is None) == (w is None) or (g if w is None else w).abs().max() == 0, (
            f"{case[0]}: second-order gradient of input {i}: {'none' if g is None else 'one'} where "
            f"torch's math has {'none' if w is None else 'one'}")
        if g is not None and w is not None:
            assert_close_2x(g, w, e, f"{case[0]} second-order d{i}")


# --------------------------------------------------------------------------- empty tensors

SDPA_EMPTY = {  # q, k (= v) shapes (B, H, S, D)
    "no_queries": ((2, 3, 0, 8), (2, 3, 5, 8)),
    "no_keys": ((2, 3, 4, 8), (2, 3, 0, 8)),
    "no_heads": ((2, 0, 4, 8), (2, 0, 5, 8)),
    "no_batch": ((0, 3, 4, 8), (0, 3, 5, 8)),
    "no_keys_gqa": ((2, 4, 3, 8), (2, 2, 0, 8)),
    "head_dim_0": ((2, 3, 4, 0), (2, 3, 5, 0)),
    "3d_no_keys": ((3, 4, 8), (3, 0, 8)),
}


def _fwd_bwd(fn, xs, dtype=None):
    leaves = [x.detach().to(dtype or x.dtype).requires_grad_() for x in xs]
    out = fn(*leaves)
    out.backward(torch.ones_like(out))
    return [out] + [x.grad for x in leaves]


def _assert_same(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (
            f"{what} [{i}]: {tuple(g.shape)} {g.dtype}, torch gives {tuple(w.shape)} {w.dtype}")
        torch.testing.assert_close(g, w, equal_nan=True, msg=f"{what} [{i}]: values differ from torch's")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", list(SDPA_EMPTY))
def test_sdpa_empty_as_torch(device, kind, causal):
    qs, ks = SDPA_EMPTY[kind]
    dtype = cuda_ok(device, torch.float32)
    xs = [randn(qs, dtype, device), randn(ks, dtype, device), randn(ks, dtype, device)]
    gqa = qs[-3] != ks[-3]

    def call(f):
        return lambda q, k, v: f(q, k, v, is_causal=causal, enable_gqa=gqa)
    def torch_sdpa(q, k, v, **kw):
        out = TF.scaled_dot_product_attention(q, k, v, **kw)
        if out is None:  # torch 2.11's CUDA SDPA on an empty result: its math written out
            out = (q @ k.transpose(-2, -1)).softmax(-1) @ v
        return out
    _assert_same(_fwd_bwd(call(FF.scaled_dot_product_attention), xs),
                 _fwd_bwd(call(torch_sdpa), xs), f"sdpa {kind}")


# (id, fused fn, reference fn, input shapes): zero-size inputs of the other
# functions, forward and backward against the reference (torch's math).
EMPTY = [
    ("flash_attention_no_queries", FF.flash_attention, reference.attention, [(2, 0, 3, 64), (2, 5, 3, 64), (2, 5, 3, 64)]),
    ("flash_attention_no_keys", FF.flash_attention, reference.attention, [(2, 4, 3, 64), (2, 0, 3, 64), (2, 0, 3, 64)]),
    ("flash_attention_no_batch", FF.flash_attention, reference.attention, [(0, 4, 3, 64), (0, 5, 3, 64), (0, 5, 3, 64)]),
    ("qkv_attention_no_tokens", _qkv, _qkv, [(2, 0, 64), (64, 64), (32, 64), (32, 64), (1, 0, 16), (1, 0, 16)]),
    ("qkv_attention_no_batch", _qkv, _qkv, [(0, 5, 64), (64, 64), (32, 64), (32, 64), (1, 5, 16), (1, 5, 16)]),
    ("cross_entropy_no_rows_mean", lambda x: FF.cross_entropy(x, torch.zeros(0, dtype=torch.long, device=x.device)),
     lambda x: TF.cross_entropy(x, torch.zeros(0, dtype=torch.long, device=x.device)), [(0, 7)]),
    ("cross_entropy_no_rows_none", lambda x: FF.cross_entropy(x, torch.zeros(0, dtype=torch.long, device=x.device),
                                                              reduction="none"),
     lambda x: TF.cross_entropy(x, torch.zeros(0, dtype=torch.long, device=x.device), reduction="none"), [(0, 7)]),
    ("layer_norm_no_rows", FF.layer_norm, lambda x, w, b: TF.layer_norm(x, (8,), w, b), [(0, 8), (8,), (8,)]),
    ("layer_norm_no_cols", FF.layer_norm, lambda x, w, b: TF.layer_norm(x, (0,), w, b), [(4, 0), (0,), (0,)]),
    ("fused_add_rms_norm_no_rows", lambda x, r, w: sum(t.sum() for t in FF.fused_add_rms_norm(x, r, w)),
     lambda x, r, w: TF.rms_norm(x + r, (8,), w, 1e-6).sum() + (x + r).sum(), [(0, 8), (0, 8), (8,)]),
    ("swiglu_no_rows", FF.swiglu, reference.glu, [(0, 8), (0, 8)]),
    ("swiglu_packed_no_cols", FF.swiglu_packed, reference.glu_packed, [(3, 0)]),
    ("glu_mlp_no_intermediate", FF.glu_mlp, reference.glu_mlp, [(3, 8), (0, 8), (0, 8), (8, 0)]),
    ("rope_no_tokens", _rope_fn, reference.rope, [(2, 3, 0, 8), (2, 3, 0, 8), (1, 0, 8), (1, 0, 8)]),
    ("rope_no_heads", _rope_fn, reference.rope, [(2, 0, 4, 8), (2, 0, 4, 8), (1, 4, 8), (1, 4, 8)]),
]


@pytest.mark.parametrize("case", EMPTY, ids=[c[0] for c in EMPTY])
def test_empty_as_reference(device, case):
    name, fused, ref, shapes = case
    dtype = cuda_ok(device, torch.float32)
    xs = [randn(s, dtype, device) for s in shapes]

    def scalar(fn):  # one output tensor, for _fwd_bwd
        return lambda *a: torch.cat([o.reshape(-1) for o in _outputs(fn(*a))])
    _assert_same(_fwd_bwd(scalar(fused), xs), _fwd_bwd(scalar(ref), xs), name)


@pytest.mark.parametrize("shapes,match", [
    ([(2, 4, 0, 64), (2, 5, 0, 64), (2, 5, 0, 64)], r"^fusedops\.attn_fwd: k has 0 heads, expected at least 1"),
    # (CUDA says so before the kernel's own check: no CUDA kernel takes head dim 0)
    ([(2, 4, 3, 0), (2, 5, 3, 0), (2, 5, 3, 0)], r"^fusedops\.(attn_fwd: q has head_dim 0, expected at least 1"
                                                 r"|flash_attention: not supported: head dim 0 on CUDA)"),
], ids=["no_heads", "head_dim_0"])
def test_flash_attention_empty_raises(device, shapes, match):
    """flash_attention (which never falls back) on what its kernels do not take."""
    xs = [randn(s, cuda_ok(device, torch.float32), device) for s in shapes]
    raises_unchanged(FF.flash_attention, dict(q=xs[0], k=xs[1], v=xs[2]), match)


def test_cross_entropy_no_classes_raises(device):
    x, t = randn((4, 0), torch.float32, device), torch.zeros(4, dtype=torch.long, device=device)
    raises_unchanged(FF.cross_entropy, dict(input=x, target=t),
                     r"^fusedops\.xent_fwd: logits has shape \[4, 0\], expected at least one class")


# --------------------------------------------------------------------------- autocast

def _autocast_check(device, fused, ref, xs, what, cast=None):
    """fused(*xs) and ref(*xs) under autocast (bf16) on device: the same output
    and gradient dtypes, values by the 2x rule against ref in float64 on the
    inputs as autocast hands them to the op (`cast`: the dtype it casts them
    to, None for none), with torch's own op under autocast as the yardstick."""
    with torch.autocast(device, torch.bfloat16):
        got = _fwd_bwd(fused, xs)
        eager = _fwd_bwd(ref, xs)
    want = _fwd_bwd(ref, [x.to(cast) if cast else x for x in xs], torch.float64)
    for i, (g, w, e) in enumerate(zip(got, want, eager)):
        assert g.dtype == e.dtype, f"{what} [{i}]: dtype {g.dtype} under autocast, torch's op gives {e.dtype}"
        assert_close_2x(g, w.to(g.device), e, f"{what} autocast [{i}]")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_autocast_sdpa(device, dtype):
    """torch's SDPA is on autocast's lower-precision list: computed in bf16."""
    xs = [randn((2, 3, 9, 32), dtype, device) for _ in range(3)]
    _autocast_check(device, lambda q, k, v: FF.scaled_dot_product_attention(q, k, v, is_causal=True),
                    lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, is_causal=True), xs, "sdpa",
                    cast=torch.bfloat16)


def test_autocast_flash_attention(device):
    xs = [randn((2, 9, 3, 32), torch.float32, device) for _ in range(3)]

    def sdpa(q, k, v):  # torch's, on (B, S, H, D)
        return TF.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    _autocast_check(device, FF.flash_attention, sdpa, xs, "flash_attention", cast=torch.bfloat16)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_autocast_cross_entropy(device, dtype, reduction):
    """cross_entropy is on autocast's fp32 list: an fp32 loss whatever the logits."""
    t = torch.randint(0, 50, (7,), device=device)
    _autocast_check(device, lambda x: FF.cross_entropy(x, t, reduction=reduction),
                    lambda x: TF.cross_entropy(x, t, reduction=reduction), [randn((7, 50), dtype, device)],
                    f"cross_entropy {reduction}", cast=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_autocast_norm(device, rms, dtype):
    """layer_norm and rms_norm: on autocast's fp32 list on CUDA, on none on the CPU."""
    xs = [randn((5, 40), dtype, device), randn((40,), torch.float32, device)]
    fused = (lambda x, w: FF.rms_norm(x, w)) if rms else (lambda x, w: FF.layer_norm(x, w))
    ref = (lambda x, w: TF.rms_norm(x, (40,), w, 1e-6)) if rms else (lambda x, w: TF.layer_norm(x, (40,), w))
    _autocast_check(device, fused, ref, xs, "rms_norm" if rms else "layer_norm",
                    cast=torch.float32 if device == "cuda" else None)


@pytest.mark.parametrize("rms", [False, True], ids=["LayerNorm", "RMSNorm"])
def test_autocast_norm_modules(device, rms):
    ours, m = _module(lambda: (fusedops.nn.RMSNorm if rms else fusedops.nn.LayerNorm)(40))
    theirs, _ = _module(lambda: (torch.nn.RMSNorm if rms else torch.nn.LayerNorm)(40))
    # bf16 parameters: torch's CPU LayerNorm refuses bf16 x with fp32 ones.
    params = [randn(p.shape, torch.bfloat16, device) for p in m.parameters()]
    _autocast_check(device, ours, theirs, [randn((5, 40), torch.bfloat16, device), *params],
                    type(m).__name__, cast=torch.float32 if device == "cuda" else None)


def test_autocast_swiglu_module(device):
    """Linear layers compute in the autocast dtype: so does the fused MLP."""
    ours = fusedops.nn.SwiGLU(32, 48).to(device)
    theirs = test_swiglu.LlamaMLP(32, 48).to(device)
    theirs.load_state_dict(ours.state_dict())
    x = randn((5, 32), torch.float32, device)
    with torch.autocast(device, torch.bfloat16):
        got, want = ours(x), theirs(x)
    assert got.dtype == want.dtype == torch.bfloat16


def test_autocast_elementwise_keep_dtype(device):
    """swiglu and RoPE are elementwise, on no autocast list: their inputs' dtype."""
    g, u = randn((3, 8), torch.float32, device), randn((3, 8), torch.float32, device)
    q, cs = randn((1, 2, 3, 8), torch.float32, device), randn((1, 3, 8), torch.float32, device)
    with torch.autocast(device, torch.bfloat16):
        assert FF.swiglu(g, u).dtype == reference.glu(g, u).dtype == torch.float32
        assert FF.apply_rotary_pos_emb(q, q, cs, cs)[0].dtype == reference.rope(q, q, cs, cs)[0].dtype


# --------------------------------------------------------------------------- messages

UNSUPPORTED = [torch.int8, torch.uint8, torch.int16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", UNSUPPORTED, ids=lambda d: str(d)[6:])
def test_unsupported_dtype_named(device, dtype):
    name = str(dtype)[6:]
    x = torch.zeros((3, 8), device=device).to(dtype)
    q = torch.zeros((1, 2, 1, 8), device=device).to(dtype)
    calls = [
        (ops.glu_fwd, dict(gate=x, up=x, activation="silu"), "glu_fwd: gate"),
        (ops.add_norm_fwd, dict(x=x, residual=None, weight=None, bias=None, eps=1e-5, rms=True,
                                residual_in_fp32=False), "add_norm_fwd: x"),
        (ops.attn_fwd, dict(q=q, k=q, v=q, scale=1.0, causal=False), "attn_fwd: q"),
        (ops.xent_fwd, dict(logits=x, target=torch.zeros(3, dtype=torch.long, device=device), ignore_index=-100),
         "xent_fwd: logits"),
    ]
    for op, args, what in calls:
        raises_unchanged(op, args, rf"^fusedops\.{what} has dtype {name}, expected ")


def test_messages_start_with_the_op(device):
    """No C++ function name or build-machine path in front of the op's words."""
    with pytest.raises(RuntimeError) as e:
        ops.glu_fwd(randn((3, 8), torch.float32, device), randn((3, 9), torch.float32, device), "silu")
    assert str(e.value).startswith("fusedops.glu_fwd: up has shape [3, 9]"), str(e.value)
    assert "shim.h" not in str(e.value) and "_ops.cpp" not in str(e.value)


# A huge view of one element: the ops' outputs (or copies) of it cannot be had.
HUGE = 1 << 46  # elements: 2^48 bytes of fp32 and more


@pytest.mark.parametrize("call", [
    ("glu_fwd", lambda t: ops.glu_fwd(t.expand(HUGE, 4), t.expand(HUGE, 4), "silu")),
    ("glu_packed_fwd", lambda t: ops.glu_packed_fwd(t.expand(HUGE, 8), "silu")),
    ("attn_fwd", lambda t: ops.attn_fwd(*[t.reshape(1, 1, 1, 1).expand(HUGE, 1, 1, 32)] * 3, 1.0, False)),
    ("add_norm_fwd", lambda t: ops.add_norm_fwd(t.expand(HUGE, 4), None, None, None, 1e-5, True, False)),
    ("rope", lambda t: ops.rope(*[t.reshape(1, 1, 1, 1).expand(HUGE, 1, 1, 4)] * 2,
                                *[t.reshape(1, 1, 1).expand(1, 1, 4)] * 2)),
], ids=lambda c: c[0])
def test_out_of_memory_names_the_op(device, call):
    name, fn = call
    t = randn((1, 1), cuda_ok(device, torch.float32) if name == "attn_fwd" else torch.float32, device)
    with pytest.raises(RuntimeError, match=rf"^fusedops\.{name}: out of memory: could not allocate .* bytes on "):
        fn(t)
