"""Reliability of every op, across the public API (issue 7):

- bad input: one table over the public functions, modules, the optimizer and
  the raw ops (mixed devices, unsupported and mixed dtypes, wrong shapes,
  tensors that require grad where none may, double backward): each raises a
  clear RuntimeError naming the op and the argument, and changes no input.
  A second table of edge inputs that must work (zero-size tensors, strided
  views) checks them against the float64 reference by the 2x rule. The
  per-op files hold each raw op's own argument checks (test_<op>.py,
  test_bad_input_*); these tables do not repeat them.
- the fuzzer (tools/reliability/fuzz.py), CI-sized: a few hundred seeded cases per op.
- NaN and inf propagate as in eager PyTorch, forward and backward; a
  GradScaler step whose gradients hold an inf (from the forward) is skipped.
- every forward is bitwise repeatable (on the CPU also with another thread
  count), and so is every backward that promises it (docs/reliability.md, Determinism).
- a whole training step captured in a CUDA graph and replayed matches the
  same steps run eagerly (CUDA only).
- torch.compile(fullgraph=True) of a patched Llama with the batch size
  dynamic: one graph, no graph break, no recompile."""
import copy
import os
import re
import sys

import pytest
import torch
import torch._dynamo.testing

import fusedops
from fusedops import functional as FF, reference
from conftest import assert_unchanged, bits, raises_unchanged, randn, requires_cuda, snapshot
from tolerances import assert_close_2x
import test_adam
import test_attention
import test_norm
import test_rope
import test_swiglu
import test_xent
from test_adam import PARITY_ULPS, ulps_apart

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "reliability"))
import fuzz  # noqa: E402

ops = torch.ops.fusedops


def cuda_ok(device, dtype):
    """The dtype the attention kernels take on `device` (fp32 is CPU only)."""
    return torch.float16 if device == "cuda" and dtype == torch.float32 else dtype


# --------------------------------------------------------------------------- bad input: raises

def _dbl(fn, *shapes, dtype=torch.float32):
    """A call that takes a gradient of fn with create_graph=True, then a
    gradient of that gradient."""
    def make(d):
        xs = [randn(s, cuda_ok(d, dtype), d).requires_grad_() for s in shapes]

        def call(**_):
            y = fn(*xs)
            gs = torch.autograd.grad((y.float() ** 2).sum(), xs, create_graph=True)
            sum(g.float().sum() for g in gs).backward()
        return call, {f"x{i}": x for i, x in enumerate(xs)}
    return make


def _mlp(d, dtype=torch.float32, h=8, f=12, **over):
    a = dict(x=randn((3, h), dtype, d), gate_weight=randn((f, h), dtype, d),
             up_weight=randn((f, h), dtype, d), down_weight=randn((h, f), dtype, d))
    a.update(over)
    return a


def _adam(d, params_rg=False):
    ps = [randn((4,), torch.float32, d).requires_grad_(params_rg), randn((3, 2), torch.float32, d)]
    z = [torch.zeros_like(p) for p in ps]
    return dict(params=ps, grads=[torch.ones_like(p) for p in ps], exp_avgs=z,
                exp_avg_sqs=[t.clone() for t in z], max_exp_avg_sqs=[], master_params=[],
                steps=[torch.zeros((), device=d) for _ in ps], lr=0.1, beta1=0.9, beta2=0.999,
                eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True, amsgrad=False,
                maximize=False)


def _with_grads(ts):
    ps = [torch.nn.Parameter(t) for t in ts]
    for p in ps:
        p.grad = torch.ones_like(p)
    return ps


def _call(fn, make_args):
    return lambda d: (fn, make_args(d))


def _module(cls, args, x_shape, dtype=torch.float32):
    def make(d):
        m = cls(*args).to(d)
        return (lambda m, x: m(x)), dict(m=m, x=randn(x_shape, dtype, d))
    return make


ONE_DEVICE = "; all tensors must be on one device"
# (id, make(device) -> (fn, kwargs), message). Inputs and parameters are
# checked bitwise unchanged after the raise.
BAD = [
    # unsupported and mixed dtypes
    ("rms_norm_x_int32", _call(FF.rms_norm, lambda d: dict(x=torch.ones(3, 8, dtype=torch.int32, device=d))),
     r"fusedops\.add_norm_fwd: x has dtype int32, expected float32, float16 or bfloat16"),
    ("fused_add_rms_norm_mixed", _call(FF.fused_add_rms_norm, lambda d: dict(
        x=randn((3, 8), torch.bfloat16, d), residual=randn((3, 8), torch.float16, d))),
     r"fusedops\.add_norm_fwd: residual has dtype float16, expected the dtype of x or float32"),
    ("geglu_mixed", _call(FF.geglu, lambda d: dict(gate=randn((3, 8), torch.float32, d),
                                                   up=randn((3, 8), torch.float16, d))),
     r"fusedops\.glu_fwd: up has dtype float16, expected the dtype of gate \(float32\)"),
    ("swiglu_packed_float64", _call(FF.swiglu_packed, lambda d: dict(gate_up=randn((3, 8), torch.float64, d))),
     r"fusedops\.glu_packed_fwd: gate_up has dtype float64, expected float32, float16 or bfloat16"),
    ("geglu_packed_bool", _call(FF.geglu_packed, lambda d: dict(gate_up=torch.ones(3, 8, dtype=torch.bool, device=d))),
     r"fusedops\.glu_packed_fwd: gate_up has dtype bool, expected float32, float16 or bfloat16"),
    ("glu_mlp_mixed", _call(FF.glu_mlp, lambda d: _mlp(d, x=randn((3, 8), torch.bfloat16, d))),
     r"fusedops\.glu_mlp: gate_weight has dtype float32, expected the dtype of x \(bfloat16\)"),
    ("glu_mlp_float64", _call(FF.glu_mlp, lambda d: _mlp(d, torch.float64)),
     r"fusedops\.glu(_packed)?_fwd: gate(_up)? has dtype float64, expected float32, float16 or bfloat16"),
    ("flash_attention_v_int", _call(FF.flash_attention, lambda d: dict(
        q=randn((1, 5, 2, 32), torch.bfloat16, d), k=randn((1, 5, 2, 32), torch.bfloat16, d),
        v=torch.ones(1, 5, 2, 32, dtype=torch.int32, device=d))),
     r"fusedops\.attn_fwd: v has dtype int32, expected bfloat16"),
    # wrong shapes
    ("rms_norm_weight", _call(FF.rms_norm, lambda d: dict(x=randn((3, 8), torch.float32, d),
                                                         weight=randn(7, torch.float32, d))),
     r"fusedops\.add_norm_fwd: weight has shape \[7\], expected \[8\]"),
    ("fused_add_rms_norm_residual", _call(FF.fused_add_rms_norm, lambda d: dict(
        x=randn((3, 8), torch.float32, d), residual=randn((4, 8), torch.float32, d))),
     r"fusedops\.add_norm_fwd: residual has shape \[4, 8\], expected the shape of x \[3, 8\]"),
    ("geglu_shapes", _call(FF.geglu, lambda d: dict(gate=randn((3, 8), torch.float32, d),
                                                   up=randn((8,), torch.float32, d))),
     r"fusedops\.glu_fwd: up has shape \[8\], expected the shape of gate \[3, 8\]"),
    ("glu_mlp_gate_weight", _call(FF.glu_mlp, lambda d: _mlp(d, gate_weight=randn((12, 9), torch.float32, d))),
     r"fusedops\.glu_mlp: gate_weight has shape \[12, 9\], expected \[F, 8\]"),
    ("glu_mlp_up_weight", _call(FF.glu_mlp, lambda d: _mlp(d, up_weight=randn((13, 8), torch.float32, d))),
     r"fusedops\.glu_mlp: up_weight has shape \[13, 8\], expected the shape of gate_weight"),
    ("glu_mlp_down_weight", _call(FF.glu_mlp, lambda d: _mlp(d, down_weight=randn((8, 11), torch.float32, d))),
     r"fusedops\.glu_mlp: down_weight has shape \[8, 11\], expected \[H, 12\]"),
    ("glu_mlp_down_bias", _call(FF.glu_mlp, lambda d: _mlp(d, down_bias=randn((12,), torch.float32, d))),
     r"fusedops\.glu_mlp: down_bias has shape \[12\], expected \[H\]"),
    ("glu_mlp_activation", _call(FF.glu_mlp, lambda d: _mlp(d, activation="relu")),
     r"fusedops\.glu_mlp: activation is 'relu', expected 'silu' or 'gelu_tanh'"),
    ("SwiGLU_module_width", _module(fusedops.nn.SwiGLU, (8, 12), (3, 9)),
     r"fusedops\.glu_mlp: gate_weight has shape \[12, 8\], expected \[F, 9\] \(9: the last dimension of x\)"),
    # the optimizer
    ("FusedAdamW_float64", lambda d: (lambda ps: (lambda params: fusedops.optim.FusedAdamW(params).step(),
                                                  dict(params=ps)))(_with_grads([randn((3,), torch.float32, d),
                                                                                 randn((4,), torch.float64, d)])),
     r"FusedAdamW: parameter 1 of its group has dtype torch\.float64"),
    # tensors that require grad where the op has no gradient; memory shared by in-place arguments
    ("glu_bwd__gate_requires_grad", _call(ops.glu_bwd_, lambda d: dict(
        dout=randn((3, 8), torch.float32, d), gate=randn((3, 8), torch.float32, d).requires_grad_(),
        up=randn((3, 8), torch.float32, d), activation="silu")),
     r"fusedops\.glu_bwd_: gate requires grad and would be written in place"),
    ("glu_packed_bwd__dout_requires_grad", _call(ops.glu_packed_bwd_, lambda d: dict(
        dout=randn((3, 8), torch.float32, d).requires_grad_(), gate_up=randn((3, 16), torch.float32, d),
        activation="gelu_tanh")),
     r"fusedops\.glu_packed_bwd_: dout requires grad and would be written in place"),
    ("adam_step_params_require_grad", _call(ops.adam_step, lambda d: _adam(d, params_rg=True)),
     r"fusedops\.adam_step: params\[0\] requires grad and would be written in place"),
    ("glu_bwd__shared_memory", lambda d: (ops.glu_bwd_, (lambda t: dict(
        dout=t[0], gate=t[0], up=t[1], activation="silu"))(randn((2, 3, 8), torch.float32, d))),
     r"fusedops\.glu_bwd_: dout and gate share memory, expected separate tensors"),
    # double backward: every differentiable entry point refuses a second order
    ("layer_norm_double_backward", _dbl(lambda x, w: FF.layer_norm(x, w), (3, 8), (8,)),
     r"fusedops\.add_norm_bwd: double backward is not supported"),
    ("fused_add_rms_norm_double_backward",
     _dbl(lambda x, r: FF.fused_add_rms_norm(x, r)[0], (3, 8), (3, 8)),
     r"fusedops\.add_norm_bwd: double backward is not supported"),
    ("swiglu_double_backward", _dbl(FF.swiglu, (3, 8), (3, 8)),
     r"fusedops\.glu_bwd: double backward is not supported"),
    ("geglu_packed_double_backward", _dbl(FF.geglu_packed, (3, 8)),
     r"fusedops\.glu_packed_bwd: double backward is not supported"),
    ("flash_attention_double_backward",
     _dbl(lambda q, k, v: FF.flash_attention(q, k, v, causal=True), *[(1, 5, 2, 32)] * 3,
          dtype=torch.bfloat16),
     r"fusedops\.attn_bwd: double backward is not supported"),
    ("glu_mlp_double_backward",
     _dbl(lambda x, wg, wu, wd: FF.glu_mlp(x, wg, wu, wd), (3, 8), (12, 8), (12, 8), (8, 12)),
     r"fusedops\.glu_mlp: double backward is not supported"),
]


@pytest.mark.parametrize("make,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(device, make, match):
    fn, args = make(device)
    raises_unchanged(fn, args, match)


def _swap(args, key, device):
    """args with args[key] (a tensor, or the second tensor of a list) on `device`."""
    args = dict(args)
    if isinstance(args[key], list):
        args[key] = [args[key][0], args[key][1].to(device)]
    else:
        args[key] = args[key].to(device)
    return args


# (id, make(device) -> (fn, kwargs), the argument moved to the other device, the op named)
MIXED = [
    ("fused_add_layer_norm", _call(FF.fused_add_layer_norm, lambda d: dict(
        x=randn((3, 8), torch.bfloat16, d), residual=randn((3, 8), torch.bfloat16, d),
        weight=randn(8, torch.bfloat16, d), bias=randn(8, torch.bfloat16, d))), "residual", "add_norm_fwd"),
    ("rms_norm", _call(FF.rms_norm, lambda d: dict(x=randn((3, 8), torch.float32, d),
                                                   weight=randn(8, torch.float32, d))), "weight", "add_norm_fwd"),
    ("swiglu", _call(FF.swiglu, lambda d: dict(gate=randn((3, 8), torch.float32, d),
                                               up=randn((3, 8), torch.float32, d))), "up", "glu_fwd"),
    ("glu_mlp", _call(FF.glu_mlp, _mlp), "down_weight", "glu_mlp"),
    ("flash_attention", _call(FF.flash_attention, lambda d: dict(
        q=randn((1, 5, 2, 32), torch.bfloat16, d), k=randn((1, 5, 2, 32), torch.bfloat16, d),
        v=randn((1, 5, 2, 32), torch.bfloat16, d))), "v", "attn_fwd"),
    ("RMSNorm_module", _module(fusedops.nn.RMSNorm, (8,), (3, 8)), "x", "add_norm_fwd"),
    ("SwiGLU_module", _module(fusedops.nn.SwiGLU, (8, 12), (3, 8)), "x", "glu_mlp"),
    ("add_norm_bwd", lambda d: (ops.add_norm_bwd, (lambda x: (lambda y, s, mean, rstd: dict(
        dy=torch.ones_like(x), ds=None, s=x, weight=None, bias=None, mean=mean, rstd=rstd, rms=False,
        need_dweight=False, need_dbias=False))(*ops.add_norm_fwd(x, None, None, None, 1e-5, False, False)))(
        randn((3, 8), torch.float32, d))), "rstd", "add_norm_bwd"),
    ("glu_packed_bwd", _call(ops.glu_packed_bwd, lambda d: dict(
        dout=randn((3, 8), torch.float32, d), gate_up=randn((3, 16), torch.float32, d),
        activation="silu")), "dout", "glu_packed_bwd"),
    ("glu_bwd_", _call(ops.glu_bwd_, lambda d: dict(
        dout=randn((3, 8), torch.float32, d), gate=randn((3, 8), torch.float32, d),
        up=randn((3, 8), torch.float32, d), activation="silu")), "up", "glu_bwd_"),
    ("attn_bwd", lambda d: (ops.attn_bwd, (lambda q: (lambda out, lse: dict(
        dout=torch.ones_like(q), q=q, k=q, v=q, out=out, lse=lse, scale=0.2, causal=True,
        deterministic=False))(*ops.attn_fwd(q, q, q, 0.2, True)))(randn((1, 5, 2, 32), torch.bfloat16, d))),
     "lse", "attn_bwd"),
    ("adam_step", _call(ops.adam_step, _adam), "exp_avg_sqs", "adam_step"),
]
DEVICE_PAIRS = [("cpu", "meta"), pytest.param("cuda", "meta", marks=requires_cuda),
                pytest.param("cuda", "cpu", marks=requires_cuda), pytest.param("cpu", "cuda", marks=requires_cuda)]


@pytest.mark.parametrize("device,other", DEVICE_PAIRS)
@pytest.mark.parametrize("make,arg,op", [m[1:] for m in MIXED], ids=[m[0] for m in MIXED])
def test_bad_input_mixed_devices(device, other, make, arg, op):
    """One argument on another device (a meta tensor among real ones too):
    a RuntimeError naming the op, on any device pair."""
    fn, args = make(device)
    args = _swap(args, arg, other)
    raises_unchanged(fn, args, rf"fusedops\.{op}: \S+ is on \S+ but \S+ is on \S+{ONE_DEVICE}")


# --------------------------------------------------------------------------- edge input: works

def _fn_call(module):
    """module as a function of (x, *parameters), for test_swiglu.check."""
    names = [n for n, _ in module.named_parameters()]

    def call(x, *params):
        return torch.func.functional_call(module, dict(zip(names, params)), (x,))
    return call, [p.detach() for p in module.parameters()]


def _modules(ours, theirs, x_of, dtype=torch.float32):
    """(fused fn, reference fn, inputs, dout) for a fusedops module against the
    torch module it replaces, with the same parameters, on x_of(device)."""
    def make(d):
        m = ours().to(d)
        ref = theirs().to(d)
        ref.load_state_dict(m.state_dict())
        fused, params = _fn_call(m)
        want, _ = _fn_call(ref)
        x = x_of(d)
        return fused, want, [x, *params], randn(x.shape, dtype, d)
    return make


def _fns(fused, ref, shapes, dtype=torch.float32, layout=None, dout_shape=None):
    def make(d):
        xs = [randn(s, dtype, d) for s in shapes]
        if layout:
            xs = layout(xs)
        return fused, ref, xs, randn(dout_shape or xs[0].shape, dtype, d)
    return make


def _t(x):  # the same values, transposed in memory (last dim not unit-stride)
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


def _glu_mlp_ref(x, wg, wu, wd):
    return reference.glu_mlp(x, wg, wu, wd)


def _glu_mlp(x, wg, wu, wd):
    return FF.glu_mlp(x, wg, wu, wd)


# (id, make(device) -> (fused fn, reference fn, inputs, upstream gradient)):
# forward and backward against the reference in float64 by the 2x rule; no
# input changed.
WORKS = [
    # zero-size tensors
    ("LayerNorm_module_rows0", _modules(lambda: fusedops.nn.LayerNorm(8), lambda: torch.nn.LayerNorm(8),
                                        lambda d: randn((2, 0, 8), torch.float32, d))),
    ("RMSNorm_module_cols0", _modules(lambda: fusedops.nn.RMSNorm((3, 0)), lambda: torch.nn.RMSNorm((3, 0)),
                                      lambda d: randn((4, 3, 0), torch.float32, d))),
    ("SwiGLU_module_rows0", _modules(lambda: fusedops.nn.SwiGLU(8, 12), lambda: test_swiglu.LlamaMLP(8, 12),
                                     lambda d: randn((0, 8), torch.float32, d))),
    ("glu_mlp_rows0", _fns(_glu_mlp, _glu_mlp_ref, [(3, 0, 8), (12, 8), (12, 8), (8, 12)])),
    ("geglu_packed_cols0", _fns(FF.geglu_packed, lambda t: reference.glu_packed(t, "gelu_tanh"), [(3, 0)])),
    ("rms_norm_rows0", _fns(FF.rms_norm, lambda x, w: reference.add_norm(x, None, w, None, 1e-6, True)[0],
                            [(0, 5), (5,)])),
    # strided views
    ("RMSNorm_module_transposed", _modules(lambda: fusedops.nn.RMSNorm(33), lambda: torch.nn.RMSNorm(33),
                                           lambda d: _t(randn((4, 33), torch.float32, d)))),
    ("LayerNorm_module_broadcast_rows", _modules(
        lambda: fusedops.nn.LayerNorm(16), lambda: torch.nn.LayerNorm(16),
        lambda d: randn((1, 16), torch.float32, d).expand(5, 16))),
    ("SwiGLU_module_transposed", _modules(lambda: fusedops.nn.SwiGLU(16, 24), lambda: test_swiglu.LlamaMLP(16, 24),
                                          lambda d: _t(randn((5, 16), torch.float32, d)))),
    ("glu_mlp_transposed_weights", _fns(_glu_mlp, _glu_mlp_ref, [(4, 8), (12, 8), (12, 8), (8, 12)],
                                        layout=lambda xs: [xs[0], _t(xs[1]), _t(xs[2]), _t(xs[3])])),
    ("flash_attention_permuted", _fns(lambda q, k, v: FF.flash_attention(q, k, v),
                                      lambda q, k, v: reference.attention(q, k, v),
                                      [(1, 2, 7, 32)] * 3, dtype=torch.bfloat16,
                                      layout=lambda xs: [t.permute(0, 2, 1, 3) for t in xs])),
]


@pytest.mark.parametrize("make", [w[1] for w in WORKS], ids=[w[0] for w in WORKS])
def test_edge_input_works(device, make):
    fused, ref, inputs, dout = make(device)
    args = {str(i): t for i, t in enumerate(inputs)}
    before = snapshot(args)
    test_swiglu.check(fused, ref, inputs, dout, "edge input")
    assert_unchanged(args, before)


# A CPU kernel's own scratch (malloc'd outside torch's allocator) that cannot
# be had: the norm kernels take an fp32 copy of a weight row, as long as the
# row. Under an address-space limit that leaves room for torch's output and
# half of that copy, the op must raise, not crash, and change no input.
OOM_SCRIPT = r"""
import resource, torch, fusedops
n = 1 << 24
x, w, dy = torch.randn(1, n), torch.randn(n), torch.randn(1, n)
y, s, mean, rstd = torch.ops.fusedops.add_norm_fwd(x, None, w, None, 1e-6, True, False)
before = [t.clone() for t in (x, w, dy, rstd)]
calls = {"add_norm_fwd": lambda: torch.ops.fusedops.add_norm_fwd(x, None, w, None, 1e-6, True, False),
         "add_norm_bwd": lambda: torch.ops.fusedops.add_norm_bwd(dy, None, x, w, None, mean, rstd, True,
                                                                 False, False)}
def mapped():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
for name, call in calls.items():
    resource.setrlimit(resource.RLIMIT_AS, (mapped() + 6 * n, resource.RLIM_INFINITY))  # output + half
    try:
        call()
        print(name, "ran")
    except RuntimeError as e:
        print(name, str(e).splitlines()[-1])
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print("unchanged", all(torch.equal(a, b) for a, b in zip(before, (x, w, dy, rstd))))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status: Linux")
def test_cpu_scratch_out_of_memory_raises():
    import subprocess
    env = dict(os.environ, MALLOC_ARENA_MAX="1", OMP_NUM_THREADS="2")  # no 64 MiB arena a thread
    proc = subprocess.run([sys.executable, "-c", OOM_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.splitlines()
    for op in ("add_norm_fwd", "add_norm_bwd"):
        said = [line for line in lines if line.startswith(op + " ")]
        assert len(said) == 1 and f"fusedops.{op}: out of memory for the CPU kernel's scratch" in said[0], lines
    assert "unchanged True" in lines, lines


# Parameters of (6, 5) values: the layout of each kind, made from a fresh copy
# of the same storage for each optimizer.
EDGE_PARAMS = {"empty": ((0, 5), lambda s: s),
               "transposed": ((5, 6), lambda s: s.t()),  # dense, not contiguous: updated in place
               "gaps": ((6, 10), lambda s: s[:, ::2])}   # not dense: through a contiguous copy


@pytest.mark.parametrize("kind", list(EDGE_PARAMS))
def test_optimizer_edge_params(device, kind):
    """FusedAdamW on an empty parameter, a transposed one or a view with gaps,
    beside a plain one, against torch.optim.AdamW over 3 steps."""
    shape, view = EDGE_PARAMS[kind]
    source = [randn(shape, torch.float32, device), randn((7,), torch.float32, device)]
    grads = [[randn(view(source[0]).shape, torch.float32, device), randn((7,), torch.float32, device)]
             for _ in range(3)]
    results = []
    for cls in (fusedops.optim.FusedAdamW, torch.optim.AdamW):
        ps = [torch.nn.Parameter(view(source[0].clone())), torch.nn.Parameter(source[1].clone())]
        opt = cls(ps, lr=0.05, weight_decay=0.1)
        for g in grads:
            for p, gi in zip(ps, g):
                p.grad = gi.clone()
            opt.step()
        assert ps[0].stride() == view(source[0]).stride()
        results.append([p.detach() for p in ps])
    for a, b in zip(*results):
        assert ulps_apart(a, b) <= PARITY_ULPS


def test_inplace_ops_bump_versions(device):
    """The ops that write their inputs bump the version counters, so autograd
    refuses a backward through a graph that saved a tensor since overwritten
    (here: a parameter stepped by the optimizer before the backward)."""
    w = torch.nn.Parameter(randn((5,), torch.float32, device))
    y = (w * w).sum()
    w.grad = torch.ones_like(w)
    fusedops.optim.FusedAdamW([w]).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    g, u, dout = (randn((3, 8), torch.float32, device) for _ in range(3))
    versions = [t._version for t in (g, u, dout)]
    ops.glu_bwd_(dout, g, u, "silu")
    assert [t._version for t in (g, u, dout)] == [v + 1 for v in versions]


# --------------------------------------------------------------------------- fuzzing

FUZZ_CASES = {"cpu": 200, "cuda": 40}  # per op; tools/reliability/fuzz.py runs thousands on a GPU


@pytest.mark.parametrize("op", list(fuzz.OPS))
def test_fuzz(device, op):
    """tools/reliability/fuzz.py's seeded random cases (shapes, layouts, dtypes, options),
    forward and backward against float64 by the 2x rule; small tensors on the
    CPU, GPU-sized ones on CUDA."""
    res = fuzz.fuzz([op], FUZZ_CASES[device], device, seed=0, log=lambda line: None)
    passed, failures = res[op]
    assert not failures, f"{len(failures)} of {passed + len(failures)} cases failed:\n" + "\n".join(failures[:10])


def test_sanitize_driver_dry_run():
    """tools/reliability/sanitize_kernels.py (what tools/reliability/sanitize.sh runs under
    compute-sanitizer) on the CPU: it drives every op and reaches its last
    line, so that a GPU run's verdict is about the kernels, not the driver."""
    import subprocess
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "reliability", "sanitize_kernels.py")
    proc = subprocess.run([sys.executable, script], env=dict(os.environ, SANITIZE_DEVICE="cpu"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    done = [line for line in proc.stdout.splitlines() if line.startswith("sanitize_kernels: done")]
    assert done, proc.stdout[-2000:]
    for op in ("norm", "glu", "attention", "rope", "xent", "adam"):
        assert re.search(rf"\b{op} [1-9]", done[0]), done[0]


# --------------------------------------------------------------------------- NaN and inf

NAN, INF = float("nan"), float("inf")


def nonfinite(t):
    t = t.detach().double()
    return torch.stack([t.isnan(), t == INF, t == -INF])


def _norm_case(device, dtype, rms):
    """add + norm with NaN / inf in x and the residual (rows 0-2), in a weight
    column (RMSNorm) and in the upstream gradient."""
    c = (test_norm.rms if rms else test_norm.ln)((6, 40), dtype)
    inp = test_norm.make_inputs(c, device)
    inp["x"][0, 3] = NAN
    inp["residual"][1, 2] = INF
    inp["x"][2, 5], inp["residual"][2, 5] = INF, -INF  # inf - inf
    if rms:
        inp["weight"][7] = NAN
    inp["gy"][4, 1] = -INF

    def results(impl, to=None):
        got = test_norm.forward_backward(c, inp, impl or test_norm.fused, to)
        return {k: v for k, v in got.items() if v is not None}
    return results(None), results(reference.add_norm), results(reference.add_norm, torch.float64)


def _glu_case(device, dtype, act, packed):
    """gate and up holding NaN, +-inf, large values and zeros; an inf upstream."""
    g, u, d = (randn((4, 8), dtype, device) for _ in range(3))
    g[0, :5] = torch.tensor([NAN, INF, -INF, 100.0, -100.0])
    u[1, :4] = torch.tensor([NAN, INF, -INF, 0.0])
    g[1, 2], u[2, 0], g[2, 0] = INF, 0.0, -INF
    d[3, 6] = INF
    if packed:
        fused, ref, inputs = test_swiglu.FUSED[act, True], lambda t: reference.glu_packed(t, act), [torch.cat([g, u], -1)]
    else:
        fused, ref, inputs = test_swiglu.FUSED[act, False], lambda a, b: reference.glu(a, b, act), [g, u]
    names = ["out"] + [f"d{i}" for i in range(len(inputs))]
    return [dict(zip(names, test_swiglu.run(fn, inputs, d, to))) for fn, to in
            ((fused, None), (ref, None), (ref, torch.float64))]


def _attention_case(device, dtype, causal):
    """NaN in a query row and in a key, inf in a value and the upstream
    gradient. Causal: all of them where no key is masked out (the last query
    row, the last key): eager's masked softmax spreads a row's NaN over the
    masked keys' gradients too, the kernels (like torch's flash SDPA) leave
    masked keys out (docs/reliability.md, NaN and inf)."""
    c = test_attention.Case(B=1, Sq=6, Sk=6, Hq=2, Hkv=2, D=32, causal=causal, dtype=cuda_ok(device, dtype))
    q, k, v, dout = test_attention.make_inputs(c, device)
    row, key = (5, 5) if causal else (1, 4)
    q[0, row, 0, 3] = NAN
    k[0, key, 1, 2] = NAN
    v[0, 5 if causal else 2, 0, 5] = INF
    dout[0, 5 if causal else 3, 1, 0] = -INF
    got = test_attention.run("fused", c, q, k, v, dout)
    eager = test_attention.run("reference", c, q, k, v, dout)
    eager["lse"] = eager["lse"].float()
    return got, eager, test_attention.run("reference", c, q, k, v, dout, to=torch.float64)


def _adam_case(device, dtype):
    """NaN and +-inf in params and grads (and so in the states)."""
    c = test_adam.Case(dtype, "param" if dtype == torch.float32 else "master", amsgrad=True,
                       shapes=((4097,),))
    inp = test_adam.op_inputs(c, device)
    p, g = inp["params"][0], inp["grads"][0]
    p[:3] = torch.tensor([NAN, INF, -INF])
    g[3:6] = torch.tensor([NAN, INF, -INF])
    if inp["master_params"]:
        inp["master_params"][0][:3] = torch.tensor([NAN, INF, -INF])
    got = test_adam.run_op(c, inp)
    eager = test_adam.run_reference(c, inp, torch.float32)
    ref = test_adam.run_reference(c, inp, torch.float64)
    flat = lambda d: {f"{k}[{i}]": t for k, ts in d.items() if k in ref for i, t in enumerate(ts)}  # noqa: E731
    eager = {k: t.to(v.dtype) for (k, t), v in zip(flat(eager).items(), flat(got).values())}
    return flat(got), eager, flat(ref)


def _xent_case(device, dtype):
    """Logits with a NaN (row 0), a +inf (row 1), -inf classes (row 2, finite
    loss); an inf upstream gradient (row 3); per-row losses."""
    x, t = test_xent.make(6, 40, dtype, device, ignored=0.0)
    x[0, 3], x[1, 7] = NAN, INF
    x[2, :5] = -INF
    t[2] = 30
    g = torch.randn(6, device=device)
    g[3] = INF
    names = ["loss", "dlogits"]
    return [dict(zip(names, test_xent.run(fn, x, t, "none", g, to))) for fn, to in
            ((FF.cross_entropy, None), (torch.nn.functional.cross_entropy, None),
             (torch.nn.functional.cross_entropy, torch.float64))]


def _rope_case(device, dtype):
    """q with a NaN and an inf, k with -inf, cos with an inf; an inf upstream
    gradient of q."""
    q, k = test_rope.qk(1, 2, 1, 5, 8, dtype, device, "bshd")
    cos, sin = test_rope.tables(1, 5, 8, dtype, device, "rope")
    q[0, 0, 1, 2], q[0, 1, 3, 6], k[0, 0, 2, 1] = NAN, INF, -INF
    cos[0, 4, 3] = INF
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    dq[0, 1, 0, 5] = INF
    names = ["q_out", "k_out", "dq", "dk"]
    return [dict(zip(names, test_rope.run(fn, q, k, cos, sin, dq, dk, to))) for fn, to in
            ((FF.apply_rotary_pos_emb, None), (reference.rope, None), (reference.rope, torch.float64))]


NONFINITE_CASES = {
    "layer_norm": lambda d, dt: _norm_case(d, dt, False), "rms_norm": lambda d, dt: _norm_case(d, dt, True),
    "swiglu": lambda d, dt: _glu_case(d, dt, "silu", False), "geglu": lambda d, dt: _glu_case(d, dt, "gelu_tanh", False),
    "swiglu_packed": lambda d, dt: _glu_case(d, dt, "silu", True),
    "attention": lambda d, dt: _attention_case(d, dt, False),
    "attention_causal": lambda d, dt: _attention_case(d, dt, True),
    "rope": _rope_case,
    "cross_entropy": _xent_case,
    "adam": _adam_case,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(NONFINITE_CASES))
def test_nan_inf_propagate_as_eager(device, case, dtype):
    """Every output is NaN, +inf and -inf exactly where eager PyTorch's (the
    reference math in the same dtype) is; every gradient is non-finite exactly
    where eager's is; the finite rest passes the 2x rule against float64.

    Gradients: where a backward meets inf - inf, whether NaN or an inf comes
    out depends on the order of its terms, which differs between any two
    implementations (eager's LayerNorm backward, dx = a dy w + b x + c, gives
    NaN for an infinite upstream gradient where the kernel's, dx = rstd (g -
    mean(g) - xhat mean(g xhat)), can give an inf; eager's own CPU and CUDA
    kernels differ too): there, only the places are compared."""
    got, eager, ref = NONFINITE_CASES[case](device, dtype)
    assert got.keys() == eager.keys()
    for name, t in got.items():
        want, have = nonfinite(eager[name]), nonfinite(t)
        assert want.any(), f"{case} {name}: the case puts no NaN or inf here"
        if name.startswith("d"):  # a gradient
            want, have = want.any(0, keepdim=True), have.any(0, keepdim=True)
        diff = (have != want).any(0)
        assert not diff.any(), (f"{case} {name}: {int(diff.sum())} elements differ in NaN / inf from eager, "
                                f"first at {tuple(diff.nonzero()[0].tolist())}: got {t.flatten()[diff.flatten()][:4].tolist()}, "
                                f"eager {eager[name].flatten()[diff.flatten()][:4].tolist()}")
        assert_close_2x(t, ref[name], eager[name].to(t.dtype), f"{case} {name}")


def test_grad_scaler_skips_inf_step(device):
    """Under autocast and a GradScaler, a batch holding an inf makes every
    gradient non-finite through the fused backward kernels; scaler.step then
    changes nothing (params and optimizer state bitwise as before), the scale
    halves, and the next step trains again. (test_adam.test_grad_scaler: the
    same with an inf written into one gradient.)"""
    dt = torch.bfloat16 if device == "cpu" else torch.float16
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), fusedops.nn.RMSNorm(32), fusedops.nn.SwiGLU(32, 48),
                                fusedops.nn.LayerNorm(32), torch.nn.Linear(32, 8)).to(device)
    opt = fusedops.optim.FusedAdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 8)
    for step in range(4):
        x = randn((6, 16), torch.float32, device)
        if step == 2:
            x[1, 3] = INF
        with torch.autocast(device, dtype=dt):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        watched = dict(params=list(model.parameters()),
                       state=[t for s in opt.state.values() for t in s.values()])
        before, scale = snapshot(watched), scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if step == 2:
            assert not finite, "the inf did not reach the gradients"
            assert_unchanged(watched, before, "the skipped step changed ")
            assert scaler.get_scale() == scale / 2
        else:
            assert finite
            assert not torch.equal(bits(watched["params"][0].detach()), before["params[0]"])
    assert all(float(s["step"]) == 3 for s in opt.state.values())


# --------------------------------------------------------------------------- determinism

def _det_inputs(d):
    t = lambda shape, dt=torch.bfloat16: randn(shape, dt, d)  # noqa: E731
    return dict(x=t((300, 1000)), r=t((300, 1000), torch.float32), w=t(1000, torch.float32), b=t(1000, torch.float32),
                dy=t((300, 1000)), g=t((257, 4097)), u=t((257, 4097)), dh=t((257, 4097)),
                gu=t((33, 2 * 1000)), dhp=t((33, 1000)), q=t((2, 300, 4, 64)), k=t((2, 300, 2, 64)),
                v=t((2, 300, 2, 64)), do=t((2, 300, 4, 64)), mx=t((2, 50, 64)), wg=t((96, 64)),
                wu=t((96, 64)), wd=t((64, 96)), xl=t((65, 32003)),
                xt=torch.randint(0, 32003, (65,), device=d), xg=t(65, torch.float32),
                rq=t((2, 4, 37, 64)), rk=t((2, 2, 37, 64)), rc=t((1, 37, 64)), rs=t((1, 37, 64)))


def _norm_bwd(a, out):
    y, s, mean, rstd = out
    return ops.add_norm_bwd(a["dy"], torch.ones_like(s), s, a["w"], a["b"], mean, rstd, False, True, True)


def _adam_once(a):
    c = test_adam.Case(torch.bfloat16, "master", amsgrad=True, shapes=((4097,), (64, 33), (3,)))
    torch.manual_seed(0)
    return test_adam.run_op(c, test_adam.op_inputs(c, a["x"].device))["master_params"]


def _attention_in_deterministic_mode(a):
    """flash_attention forward and backward under torch.use_deterministic_algorithms(True)
    (head dim 64: on CUDA the backward would otherwise add dQ with atomics)."""
    saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        q, k, v = (a[n].detach().requires_grad_() for n in ("q", "k", "v"))
        out = FF.flash_attention(q, k, v, causal=True)
        out.backward(a["do"])
        return [out, q.grad, k.grad, v.grad]
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


# (id, fn(inputs) -> tensors, the same with another CPU thread count). The
# CPU's norm backward sums dweight / dbias per thread: bitwise repeatable at
# one thread count only (its dx does not depend on it).
DETERMINISTIC = [
    ("add_norm_fwd", lambda a: ops.add_norm_fwd(a["x"], a["r"], a["w"], a["b"], 1e-5, False, False), True),
    ("add_norm_fwd_rms", lambda a: ops.add_norm_fwd(a["g"], None, None, None, 1e-6, True, True), True),
    ("add_norm_bwd_dx", lambda a: _norm_bwd(a, ops.add_norm_fwd(a["x"], a["r"], a["w"], a["b"], 1e-5, False, False))[:1], True),
    ("add_norm_bwd", lambda a: _norm_bwd(a, ops.add_norm_fwd(a["x"], a["r"], a["w"], a["b"], 1e-5, False, False)), False),
    ("glu_fwd", lambda a: [ops.glu_fwd(a["g"], a["u"], "gelu_tanh")], True),
    ("glu_bwd", lambda a: ops.glu_bwd(a["dh"], a["g"], a["u"], "silu"), True),
    ("glu_packed_fwd", lambda a: [ops.glu_packed_fwd(a["gu"], "silu")], True),
    ("glu_packed_bwd", lambda a: [ops.glu_packed_bwd(a["dhp"], a["gu"], "gelu_tanh")], True),
    ("glu_mlp_fwd", lambda a: [FF.glu_mlp(a["mx"], a["wg"], a["wu"], a["wd"])], True),
    ("attn_fwd", lambda a: ops.attn_fwd(a["q"], a["k"], a["v"], 0.125, True), True),
    ("attn_bwd_deterministic", lambda a: ops.attn_bwd(a["do"], a["q"], a["k"], a["v"],
                                                      *ops.attn_fwd(a["q"], a["k"], a["v"], 0.125, True),
                                                      0.125, True, True), True),
    ("flash_attention_deterministic_mode", _attention_in_deterministic_mode, True),
    ("rope", lambda a: ops.rope(a["rq"], a["rk"], a["rc"], a["rs"]), True),
    ("rope_inverse", lambda a: ops.rope(a["rq"], a["rk"], a["rc"], a["rs"], True), True),
    ("xent_fwd", lambda a: ops.xent_fwd(a["xl"], a["xt"], -100), True),
    ("xent_bwd", lambda a: [ops.xent_bwd(a["xg"], a["xl"], a["xt"], ops.xent_fwd(a["xl"], a["xt"], -100)[1], -100)],
     True),
    ("adam_step", _adam_once, True),
]


@pytest.mark.parametrize("fn,any_threads", [d[1:] for d in DETERMINISTIC], ids=[d[0] for d in DETERMINISTIC])
def test_deterministic(device, fn, any_threads):
    """Bitwise the same results on a second run and, where promised, with
    another CPU thread count."""
    a = _det_inputs(device)
    first = [t.clone() for t in fn(a)]
    runs = [fn(a)]
    if device == "cpu" and any_threads:
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            runs.append(fn(a))
        finally:
            torch.set_num_threads(threads)
    for again in runs:
        for i, (x, y) in enumerate(zip(first, again)):
            assert torch.equal(bits(x), bits(y)), f"result {i} differs between runs"


# --------------------------------------------------------------------------- autograd kernels

# (id, make(device, o) -> (fn(*tensors) -> differentiable outputs, tensors), the
# subsets of the tensors that require grad, the widest first); o is torch.ops.fusedops
# or EAGER. Each op's Autograd kernel is fusedops.ops._common.register_autograd's.
AUTOGRAD = [
    ("add_norm_fwd", lambda d, o: (lambda x, r, w, b: o.add_norm_fwd(x, r, w, b, 1e-5, False, False)[:2],
                                [randn((5, 33), torch.float32, d), randn((5, 33), torch.float32, d),
                                 randn(33, torch.float32, d), randn(33, torch.float32, d)]),
     [(0, 1, 2, 3), (2, 3), (1,), (0, 3)]),
    ("add_norm_fwd_rms_defaults", lambda d, o: (lambda x, w: o.add_norm_fwd(x, None, w, None, 1e-6, True, False)[:1],
                                             [randn((5, 33), torch.bfloat16, d), randn(33, torch.float32, d)]),
     [(0, 1), (1,)]),
    ("glu_fwd", lambda d, o: (lambda g, u: [o.glu_fwd(g, u, "silu")],
                           [randn((5, 33), torch.float32, d), randn((5, 33), torch.float32, d)]),
     [(0, 1), (1,)]),
    ("glu_packed_fwd", lambda d, o: (lambda gu: [o.glu_packed_fwd(gu, "gelu_tanh")], [randn((5, 66), torch.float32, d)]),
     [(0,)]),
    ("xent_fwd", lambda d, o: (lambda x: o.xent_fwd(x, torch.arange(5, device=d) % 3 - 1, -1)[:1],
                            [randn((5, 7), torch.float32, d)]),
     [(0,)]),
    ("attn_fwd", lambda d, o: (lambda q, k, v: o.attn_fwd(q, k, v, 0.25, True, True)[:1],
                            [randn((1, 9, 2, 32), cuda_ok(d, torch.float32), d) for _ in range(3)]),
     [(0, 1, 2), (1,)]),
    ("rope_defaults", lambda d, o: (lambda q, k, c, s: o.rope(q, k, c, s),
                                 [randn((1, 2, 9, 16), torch.float32, d), randn((1, 1, 9, 16), torch.float32, d),
                                  randn((1, 9, 16), torch.float32, d), randn((1, 9, 16), torch.float32, d)]),
     [(0, 1), (1,)]),
]


# The ops as fusedops' functions call them (fusedops.ops._common.eager_call):
# outside torch.compile, not through the dispatcher's Python Autograd kernel.
EAGER = type("Eager", (), {"add_norm_fwd": fusedops.ops.norm.add_norm_fwd, "glu_fwd": fusedops.ops.swiglu.glu_fwd,
                           "glu_packed_fwd": fusedops.ops.swiglu.glu_packed_fwd,
                           "xent_fwd": fusedops.ops.xent.xent_fwd, "attn_fwd": fusedops.ops.attention.attn_fwd,
                           "rope": fusedops.ops.rope.rope})
ROUTES = {"dispatcher": ops, "eager_call": EAGER}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("make,subsets", [a[1:] for a in AUTOGRAD], ids=[a[0] for a in AUTOGRAD])
def test_autograd_kernel(device, make, subsets, route):
    """Gradients for just the inputs that require grad, the same as when all
    of them do; a second backward through the same graph (retain_graph) gives
    them again, bitwise; under no_grad the op records no graph. Arguments left
    at their defaults reach setup_context filled in (the _defaults cases)."""
    torch.manual_seed(0)
    fn, ts = make(device, ROUTES[route])
    outs = fn(*ts)
    weights = [torch.randn(o.shape, device=device) for o in outs]

    def grads(needed, twice=False):
        xs = [t.detach().requires_grad_(i in needed) for i, t in enumerate(ts)]
        loss = sum((o.float() * w).sum() for o, w in zip(fn(*xs), weights))
        wanted = [xs[i] for i in needed]
        first = torch.autograd.grad(loss, wanted, retain_graph=twice)
        if twice:
            again = torch.autograd.grad(loss, wanted)
            for i, g, h in zip(needed, first, again):
                assert torch.equal(bits(g), bits(h)), f"input {i}: the second backward differs"
        return dict(zip(needed, first))

    every = grads(subsets[0])  # the widest subset
    for needed in subsets:
        got = grads(needed, twice=True)
        for i in needed:
            torch.testing.assert_close(got[i], every[i], msg=f"input {i} with {needed} requiring grad")
    with torch.no_grad():
        assert all(o.grad_fn is None for o in fn(*[t.detach().requires_grad_() for t in ts]))


@pytest.mark.parametrize("make,subsets", [a[1:] for a in AUTOGRAD], ids=[a[0] for a in AUTOGRAD])
def test_eager_call_is_the_op(device, make, subsets):
    """The op as fusedops' functions call it and as torch.ops calls it: the
    same outputs and gradients, bitwise, and the same autograd node."""
    results = []
    for o in ROUTES.values():
        torch.manual_seed(0)
        fn, ts = make(device, o)
        xs = [t.detach().requires_grad_(i in subsets[0]) for i, t in enumerate(ts)]
        outs = fn(*xs)
        torch.manual_seed(1)
        loss = sum((out.float() * torch.randn(out.shape, device=device)).sum() for out in outs)
        grads = torch.autograd.grad(loss, [xs[i] for i in subsets[0]])
        results.append((outs, grads, [type(out.grad_fn).__name__ for out in outs]))
    (outs, grads, nodes), (outs2, grads2, nodes2) = results
    assert nodes == nodes2
    for a, b in zip([*outs, *grads], [*outs2, *grads2]):
        assert torch.equal(bits(a), bits(b))


# --------------------------------------------------------------------------- CUDA graphs

class TinyLlama(torch.nn.Module):
    """Pre-norm decoder blocks of fusedops' modules: RMSNorm (the second with the
    fused residual add), causal flash attention (deterministic backward), the
    SwiGLU MLP."""

    def __init__(self, dim=64, heads=2, ffn=96, layers=2, vocab=10):
        super().__init__()
        self.heads = heads
        self.inp = torch.nn.Linear(16, dim)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict(dict(
            norm1=fusedops.nn.RMSNorm(dim), qkv=torch.nn.Linear(dim, 3 * dim, bias=False),
            proj=torch.nn.Linear(dim, dim, bias=False), norm2=fusedops.nn.RMSNorm(dim),
            mlp=fusedops.nn.SwiGLU(dim, ffn))) for _ in range(layers))
        self.norm = fusedops.nn.RMSNorm(dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, x):
        x = self.inp(x)
        B, S, dim = x.shape
        for blk in self.blocks:
            q, k, v = blk.qkv(blk.norm1(x)).view(B, S, 3, self.heads, -1).unbind(2)
            a = blk.proj(FF.flash_attention(q, k, v, causal=True, deterministic=True).reshape(B, S, dim))
            h, x = blk.norm2(a, x)  # x <- x + a; h = norm(x)
            x = x + blk.mlp(h)
        return self.out(self.norm(x))


def _loss(model, x, target):
    return torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), target.flatten())


@requires_cuda
def test_cuda_graph_training_step():
    """forward, backward and FusedAdamW(capturable=True, master weights, lr a
    device tensor) captured once in a CUDA graph; replays on new batches match
    the same steps run eagerly on a copy of the model."""
    model = TinyLlama().cuda().bfloat16()
    eager = copy.deepcopy(model)
    for m in eager.modules():  # deepcopy gives each weight its own storage: one gate+up matmul again
        if isinstance(m, fusedops.nn.SwiGLU):
            fusedops.nn.join_gate_up(m)
    start = [p.detach().float() for p in model.parameters()]
    data = [(randn((4, 24, 16), torch.bfloat16, "cuda"), torch.randint(0, 10, (4, 24), device="cuda"))
            for _ in range(8)]

    def optimizer(m):
        return fusedops.optim.FusedAdamW(m.parameters(), lr=torch.tensor(3e-3, device="cuda"),
                                         weight_decay=0.1, capturable=True, master_weights=True)
    opt, eager_opt = optimizer(model), optimizer(eager)
    eager_losses = []
    for x, t in data:
        eager_opt.zero_grad(set_to_none=True)
        loss = _loss(eager, x, t)
        loss.backward()
        eager_opt.step()
        eager_losses.append(float(loss.detach()))

    static_x, static_t = data[0][0].clone(), data[0][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the first two steps, eagerly (state made here)
        for x, t in data[:2]:
            static_x.copy_(x)
            static_t.copy_(t)
            opt.zero_grad(set_to_none=True)
            _loss(model, static_x, static_t).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = _loss(model, static_x, static_t)
        static_loss.backward()
        opt.step()
    losses = []
    for x, t in data[2:]:
        static_x.copy_(x)
        static_t.copy_(t)
        graph.replay()
        losses.append(float(static_loss))
    torch.cuda.synchronize()
    # The same kernels on the same data: equal up to the rounding of any
    # kernel whose choices differ under capture (Adam turns a rounding of a
    # near-zero gradient into a step of up to lr either way, so the masters are
    # compared by their distance against how far the steps moved them).
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses[2:]), rtol=1e-2, atol=1e-3)
    for (name, p), q, p0 in zip(model.named_parameters(), eager.parameters(), start):
        ours, theirs = opt.state[p]["master_param"], eager_opt.state[q]["master_param"]
        moved, apart = float((theirs - p0).norm()), float((ours - theirs).norm())
        assert moved > 0 and apart <= 0.1 * moved, f"{name}: {apart:.3g} apart, moved {moved:.3g}"
        assert float(opt.state[p]["step"]) == len(data)


# --------------------------------------------------------------------------- torch.compile

def test_compile_dynamic_batch_no_recompiles(device):
    """A patched Hugging Face Llama, compiled whole (fullgraph) with the batch
    dimension dynamic: batches of 2, 3 and 5 run forward and backward on one
    graph (one frame compiled, no graph break, no recompile) and match the
    uncompiled model."""
    from test_patch import _hf_model, _hf_run
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = fusedops.patch(_hf_model("Llama", dtype, head_dim=32)).to(device)  # a CUDA head dim
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    def close(got, want):  # fp32: to rounding; bf16: AOT's decompositions round otherwise
        rel = 1e-5 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(got, want, rtol=0, atol=rel * max(1.0, float(want.abs().max())))

    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in (2, 3, 5):
            ids = torch.randint(0, 96, (batch, 9), device=device)
            torch._dynamo.mark_dynamic(ids, 0)
            logits, grads = _hf_run(compiled, ids)
            want, want_grads = _hf_run(ref, ids)
            close(logits, want)
            for n, g in want_grads.items():
                close(grads["_orig_mod." + n], g)
    assert counter.frame_count == 1, f"{counter.frame_count} frames compiled"
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
