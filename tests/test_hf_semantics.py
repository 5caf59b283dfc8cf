"""A patched model behaves as the unpatched one under what users attach to it
(fusedops/patch.py, fusedops/hf.py, fusedops/nn.py; issue 50): module hooks
(forward hooks, pre-hooks, hooks that return a new output or edit one in
place), adapters on the projections (PEFT's LoRA, a LoRA-like Linear
subclass), copies (copy.deepcopy keeps the joint q / k / v and gate / up
storage), and a transformers module that our forward does not fit (reported,
left as it is).

Tolerances: logits and gradients of a patched model against the unpatched
model in float64 by the 2x rule (tests/tolerances.py), with the unpatched
model in the same dtype as the yardstick. Hook call counts and the shapes of
what hooks are given must be equal."""
import copy
import inspect
import pickle
import sys

import pytest
import torch

import fusedops
from fusedops import functional as F, nn as fnn, reference
from test_patch import FAMILIES, NEW_FAMILIES, _grads, _hf_model, _hf_run
from tolerances import assert_close_2x

pytest.importorskip("transformers")


def _patched_and_refs(family="Llama", layers=3, loss=True, **extra):
    """(patched fp32 model, unpatched fp32 copy, unpatched float64 copy)."""
    m = _hf_model(family, layers=layers, **extra)
    ref, ref64 = copy.deepcopy(m), copy.deepcopy(m).double()
    return fusedops.patch(m, loss=loss), ref, ref64


def _check_same(models, hook, name, ids=None):
    """hook(model) on each of (patched, unpatched, unpatched float64), then a
    forward and backward of each: the patched logits and gradients against
    float64 by the 2x rule."""
    ids = torch.randint(0, 96, (2, 13)) if ids is None else ids
    for m in models:
        hook(m)
    (logits, g), (logits0, g0), (logits64, g64) = (_hf_run(m, ids, use_cache=False) for m in models)
    assert_close_2x(logits, logits64, logits0, f"{name}: logits")
    for n in g0:
        assert_close_2x(g[n], g64[n], g0[n], f"{name}: grad {n}")


def _signature(args, out):
    """What a hook is given, as shapes: comparable between the two models."""
    def shape(t):
        return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
    return (tuple(shape(a) for a in args), shape(out) if not isinstance(out, tuple) else tuple(map(shape, out)))


# --------------------------------------------------------------- hooks
def test_forward_hook_edits_layer_output_in_place():
    """Activation steering: a forward hook adds a vector to a decoder layer's
    output in place (every layer, the last one included). The next layer's
    input norm, and the final norm, must see the edited stream (on main they
    saw the value before the edit)."""
    models = _patched_and_refs()
    steer = torch.randn(64)

    def hook(model):
        for layer in model.model.layers:
            layer.register_forward_hook(lambda m, i, o: o.add_(steer.to(o.dtype)))
    _check_same(models, hook, "in-place steering")


def test_forward_hook_returns_new_layer_output():
    models = _patched_and_refs()

    def hook(model):
        model.model.layers[1].register_forward_hook(lambda m, i, o: o * 0.5)
    _check_same(models, hook, "layer output * 0.5")


def test_forward_pre_hooks_change_layer_input():
    """A pre-hook that returns a new input, and one that edits it in place."""
    models = _patched_and_refs()

    def scale_in_place(module, args):
        args[0].mul_(0.75)

    def hook(model):
        model.model.layers[1].register_forward_pre_hook(lambda m, args: (args[0] * 1.5, *args[1:]))
        model.model.layers[2].register_forward_pre_hook(scale_in_place)
    _check_same(models, hook, "layer pre-hooks")


def test_final_norm_hook_returning_new_output():
    """lambda m, i, o: o * 2 on model.norm (failed on main with 'too many
    values to unpack': the last layer called the norm with a residual)."""
    models = _patched_and_refs()

    def hook(model):
        model.model.norm.register_forward_hook(lambda m, i, o: o * 2)
    _check_same(models, hook, "final norm * 2")


@pytest.mark.parametrize("norm", ["input_layernorm", "post_attention_layernorm", "final"])
def test_norm_hooks_called_as_unpatched(norm):
    """A forward hook and a pre-hook on a norm are called once a forward each,
    with one argument of the stream's shape, as unpatched (on main an
    input_layernorm's hook was called twice, once with (x, residual)). The
    head without its loss patch: with it, _hf_run takes the logits from a
    second forward, whose calls would count too."""
    models = _patched_and_refs(loss=False)
    seen = {}

    def hook(model):
        calls = seen.setdefault(id(model), [])
        mods = [model.model.norm] if norm == "final" else [getattr(lay, norm) for lay in model.model.layers]
        for i, mod in enumerate(mods):
            mod.register_forward_pre_hook(lambda m, args, i=i: calls.append(("pre", i, _signature(args, None))))
            mod.register_forward_hook(lambda m, args, out, i=i: calls.append(("fwd", i, _signature(args, out))))
    _check_same(models, hook, f"hooks on {norm}")
    patched, plain, _ = (seen[id(m)] for m in models)
    assert patched == plain and len(plain) == 2 * (1 if norm == "final" else 3)


def test_global_hooks_see_the_unpatched_calls():
    """A global forward hook (torch.nn.modules.module.register_module_forward_hook)
    sees every module call: patched, the same modules are called, in the same
    order, with the same shapes (every fused path that skips a module call
    steps back)."""
    models = _patched_and_refs("Qwen3", layers=2)
    calls = {}
    names = {id(m): {id(mod): n for n, mod in m.named_modules()} for m in models}

    def record(module, args, out):
        for key, table in names.items():
            if id(module) in table:
                calls.setdefault(key, []).append((table[id(module)], _signature(args, out)))
    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        _check_same(models, lambda m: None, "global forward hook")
    finally:
        handle.remove()
    patched, plain, _ = (calls[id(m)] for m in models)
    assert patched == plain


def test_hooked_projection_in_patched_attention_and_mlp():
    """A forward hook on q_proj and on up_proj (returning a new output) takes
    the attention and the MLP off their fused paths: the hook's effect shows
    as unpatched."""
    models = _patched_and_refs()

    def hook(model):
        model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: o * 1.25)
        model.model.layers[1].mlp.up_proj.register_forward_hook(lambda m, i, o: o * 0.5)
    _check_same(models, hook, "hooked projections")


def test_hooks_removed_fuse_again():
    """Fusing is decided at call time: once the hooks are gone, the residual
    chain hands the next norm along again (one plain RMSNorm a forward)."""
    m, _, _ = _patched_and_refs()
    handle = m.model.layers[0].register_forward_hook(lambda mod, i, o: None)
    counts = []
    wrapped = F.rms_norm

    def counting(*a, **kw):
        counts[-1] += 1
        return wrapped(*a, **kw)
    ids = torch.randint(0, 96, (1, 9))
    try:
        F.rms_norm = counting
        for _ in range(2):
            counts.append(0)
            m(ids)
            handle.remove()
    finally:
        F.rms_norm = wrapped
    assert counts == [2, 1]  # layer 1's input norm computed on its own while layer 0 was hooked


# --------------------------------------------------------------- adapters
class LoRALinear(torch.nn.Linear):
    """A LoRA-like adapter as a Linear subclass: W x + b + B A x."""

    def __init__(self, base, r=4):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.load_state_dict(base.state_dict())
        self.lora_a = torch.nn.Parameter(torch.randn(r, base.in_features) / r)
        self.lora_b = torch.nn.Parameter(torch.randn(base.out_features, r) / r)

    def forward(self, x):
        return super().forward(x) + x @ self.lora_a.t() @ self.lora_b.t()


def _call(m, x):
    return m(x)


def _mlp_reference(m, x):
    """fusedops.nn.SwiGLU's math with its projections called as modules."""
    return m.down_proj(reference.glu(m.gate_proj(x), m.up_proj(x), m.activation))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swiglu_with_lora_linear_subclass(dtype):
    """nn.SwiGLU with a Linear subclass on gate_proj and down_proj: the adapter's
    term is in the output and its parameters get their gradients (on main the
    fused path read the weights and ignored the adapter)."""
    m = fnn.SwiGLU(24, 40)
    m.gate_proj, m.down_proj = LoRALinear(m.gate_proj), LoRALinear(m.down_proj)
    m64, m = copy.deepcopy(m).double(), m.to(dtype)
    x = torch.randn(3, 7, 24)
    outs = []
    for mod, fn, dt in ((m, _call, dtype), (m, _mlp_reference, dtype), (m64, _mlp_reference, torch.float64)):
        mod.zero_grad(set_to_none=True)
        xi = x.detach().to(dt).requires_grad_()
        y = fn(mod, xi)
        y.backward(torch.ones_like(y))
        outs.append((y, xi.grad, _grads(mod)))
    (y, dx, g), (y0, dx0, g0), (y64, dx64, g64) = outs
    assert {"gate_proj.lora_a", "gate_proj.lora_b", "down_proj.lora_a", "down_proj.lora_b"} <= g.keys()
    assert_close_2x(y, y64, y0, "y")
    assert_close_2x(dx, dx64, dx0, "dx")
    for n in g64:
        assert_close_2x(g[n], g64[n], g0[n], f"grad {n}")


def test_swiglu_hooked_projection():
    """A forward hook on a projection of nn.SwiGLU is called and its returned
    output used; a backward hook gets its gradient."""
    m = fnn.SwiGLU(16, 24)
    x = torch.randn(5, 16, requires_grad=True)
    want = m.down_proj(reference.glu(m.gate_proj(x), m.up_proj(x) * 3, "silu"))
    grads = []
    m.up_proj.register_forward_hook(lambda mod, i, o: o * 3)
    m.up_proj.register_full_backward_hook(lambda mod, gi, go: grads.append(go[0].shape))
    y = m(x)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    y.sum().backward()
    assert grads == [(5, 24)]


def _peft_model(model):
    """LoRA on every projection; init_lora_weights=False: B random, not zero,
    so that A has a gradient from the first step."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return peft.get_peft_model(model, cfg)


def test_peft_lora_trains_as_unpatched():
    """PEFT's LoRA on a patched tiny Llama: the adapters' gradients equal the
    unpatched model's (2x rule against float64), and five AdamW steps give the
    same losses."""
    base = _hf_model("Llama", layers=2)
    plain = _peft_model(copy.deepcopy(base))
    patched = _peft_model(fusedops.patch(copy.deepcopy(base)))
    patched.load_state_dict(plain.state_dict())  # the same adapter weights
    models = [patched, plain, copy.deepcopy(plain).double()]
    ids = torch.randint(0, 96, (2, 13))
    (logits, g), (logits0, g0), (logits64, g64) = (_hf_run(m, ids, use_cache=False) for m in models)
    assert g0 and all("lora_" in n for n in g0)  # only the adapters train
    assert g.keys() == g0.keys()
    assert_close_2x(logits, logits64, logits0, "LoRA logits")
    for n in g0:
        assert_close_2x(g[n], g64[n], g0[n], f"LoRA grad {n}")

    losses = []
    for m in models[:2]:
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        curve = []
        for _ in range(5):
            loss = m(ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            curve.append(loss.item())
        losses.append(torch.tensor(curve))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)
    assert losses[1][-1] < losses[1][0]


# --------------------------------------------------------------- copies
def _joint(*ws):
    return F._joint_weight(*ws) is not None


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_joint_storage(how):
    """copy.deepcopy (and pickle) of a patched model and of nn.SwiGLU keep the
    q / k / v and gate / up weights in one storage each (on main a copy paid
    a torch.cat every forward), with the same outputs; a state_dict round
    trip still loads."""
    clone = copy.deepcopy if how == "deepcopy" else (lambda m: pickle.loads(pickle.dumps(m)))
    m = fusedops.patch(_hf_model("Llama"))
    c = clone(m)
    for layer in c.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        assert _joint(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)
        assert _joint(mlp.gate_proj.weight, mlp.up_proj.weight)
    ids = torch.randint(0, 96, (2, 9))
    torch.testing.assert_close(c(ids).logits, m(ids).logits, rtol=0, atol=0)
    c.load_state_dict({k: v + 1 for k, v in m.state_dict().items()})
    assert all(torch.equal(v, m.state_dict()[k] + 1) for k, v in c.state_dict().items())
    assert _joint(c.model.layers[0].mlp.gate_proj.weight, c.model.layers[0].mlp.up_proj.weight)

    s = fnn.SwiGLU(16, 24, bias=True)
    sc = clone(s)
    assert _joint(sc.gate_proj.weight, sc.up_proj.weight) and sc.gate_proj.weight is not s.gate_proj.weight
    x = torch.randn(3, 16)
    torch.testing.assert_close(sc(x), s(x), rtol=0, atol=0)
    fresh = fnn.SwiGLU(16, 24, bias=True)
    fresh.load_state_dict(sc.state_dict())
    torch.testing.assert_close(fresh(x), s(x), rtol=0, atol=0)


# --------------------------------------------------------------- structure, not source text
def test_fusing_never_reads_transformers_source(monkeypatch):
    """The table and the patch decide by structure: with inspect.getsource
    unavailable everything still fuses (main hashed transformers' forward
    source and stopped fusing on 5.24)."""
    from fusedops import hf

    get_source = inspect.getsource

    def no_source(*a, **kw):  # (transformers reads its own source: that may go on)
        if sys._getframe(1).f_globals.get("__name__", "").startswith("fusedops"):
            raise AssertionError("fusedops read another project's source text")
        return get_source(*a, **kw)
    models = {family: _hf_model(family) for family in FAMILIES + NEW_FAMILIES}
    monkeypatch.setattr(inspect, "getsource", no_source)
    monkeypatch.setattr(hf, "_table", None)
    for family, m in models.items():
        fusedops.patch(m)
        kinds = {old.removeprefix(family) for _, old, _ in m.fusedops_report.replaced}
        assert kinds == {"RMSNorm", "MLP", "DecoderLayer", "Attention", "ForCausalLM"} and not m.fusedops_report.skipped


def test_module_our_forward_does_not_fit_is_reported():
    """A decoder layer with a submodule our forward would not call, and an
    attention module with one more, keep their own forwards, with a report
    line each; the model's results are the unpatched ones."""
    m = _hf_model("Llama")
    m.model.layers[0].extra_norm = torch.nn.Identity()
    m.model.layers[1].self_attn.extra = torch.nn.Identity()
    ref = copy.deepcopy(m)
    fusedops.patch(m)
    skipped = {(path, why.split(":")[0]) for path, _, why in m.fusedops_report.skipped}
    assert skipped == {("model.layers.0", "decoder layer not fused"),
                       ("model.layers.1.self_attn", "attention not fused")}
    assert "extra_norm" in str(m.fusedops_report)
    assert type(m.model.layers[0]).__name__ == "LlamaDecoderLayer"
    ids = torch.randint(0, 96, (2, 11))
    torch.testing.assert_close(m(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)


def test_patch_twice_keeps_the_report():
    m = fusedops.patch(_hf_model("Qwen2"))
    first = str(m.fusedops_report)
    assert "replaced 12 module(s)" in first and "attention of the model" in first
    fusedops.patch(m)
    assert str(m.fusedops_report) == first
