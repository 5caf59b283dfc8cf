"""Tests of the gated-linear-unit ops (csrc/swiglu): torch.ops.fusedops.glu_*,
fusedops.functional.swiglu / geglu / swiglu_packed / geglu_packed / glu_mlp and
fusedops.nn.SwiGLU.

Every output and gradient is checked against fusedops.reference run in float64
by the 2x rule (tests/tolerances.py), with the same reference run in the
inputs' own dtype on the same device as the yardstick."""
import copy
import os

import pytest
import torch

import fusedops
from fusedops import functional as FF, reference
from conftest import bits, maybe_poisoned, raises_unchanged, randn, requires_cuda
from tolerances import assert_close_2x, default_scale

ops = torch.ops.fusedops
LOWP = [torch.float32, torch.float16, torch.bfloat16]
ACTS = ["silu", "gelu_tanh"]
FUSED = {("silu", False): FF.swiglu, ("gelu_tanh", False): FF.geglu,
         ("silu", True): FF.swiglu_packed, ("gelu_tanh", True): FF.geglu_packed}


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


def run(fn, inputs, dout, to=None, poison=False):
    """fn(*inputs) forward and backward on fresh leaves (cast to `to` if given):
    returns [out, grad of each input]. poison: outputs of the forward and of
    the backward start as NaN (conftest.poisoned)."""
    leaves = [t.detach().to(to or t.dtype).requires_grad_() for t in inputs]
    with maybe_poisoned(dout.device, poison):
        out = fn(*leaves)
    with maybe_poisoned(dout.device, poison):
        out.backward(dout.to(out.dtype))
    return [out] + [t.grad for t in leaves]


def check(fn_fused, fn_ref, inputs, dout, what, poison=True, scales=None):
    """The fused fn against fn_ref in float64 by the 2x rule, forward and
    backward, fn_ref in the inputs' dtype as the yardstick. scales: {name:
    the size the result's partial sums reach} for results that are sums whose
    terms outgrow the result (the floor scales with the larger)."""
    got = run(fn_fused, inputs, dout, poison=poison)
    want = run(fn_ref, inputs, dout, to=torch.float64)
    eager = run(fn_ref, inputs, dout)
    for name, g, w, e in zip(["out"] + [f"d{i}" for i in range(len(inputs))], got, want, eager):
        scale = max(default_scale(w.detach()), scales[name]) if scales and name in scales else None
        assert_close_2x(g, w, e, f"{what} {name}", scale=scale)


# --------------------------------------------------------------------------- values

# Widths 1, 3, 4097 (odd: the scalar path), 8 and 1000 (vector paths);
# rows 0, 1, 3 and thousands; ranks 1 to 4.
SHAPES = [(1,), (3,), (4097,), (0, 5), (3, 0), (1, 1), (3, 1), (5, 3), (2, 3, 8), (3, 1000),
          (2, 2, 3, 4097), (3000, 3), (2, 1200, 8)]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", LOWP, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_separate(device, shape, dtype, act):
    g, u, d = (randn(shape, dtype, device) for _ in range(3))
    check(FUSED[act, False], lambda a, b: reference.glu(a, b, act), [g, u], d, f"{act} {shape} {dtype}")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", LOWP, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_packed(device, shape, dtype, act):
    """[gate | up] of width 2F: F odd puts up off the vector alignment."""
    gu = randn((*shape[:-1], 2 * shape[-1]), dtype, device)
    d = randn(shape, dtype, device)
    check(FUSED[act, True], lambda a: reference.glu_packed(a, act), [gu], d, f"packed {act} {shape} {dtype}")


def test_large_magnitudes(device):
    """Gates far out on both tails (sigmoid 0 and 1, exp overflowing) and
    non-finite values: finite where torch is finite, NaN and inf where it is."""
    special = torch.tensor([-1e4, -200., -90., -30., -1e-3, 0., 1e-3, 30., 90., 200., 1e4,
                            float("inf"), -float("inf"), float("nan")], device=device)
    u = torch.full_like(special, 1.5)
    for act in ACTS:
        got = ops.glu_fwd(special, u, act)
        want = reference.glu(special.double(), u.double(), act)
        eager = reference.glu(special, u, act)
        assert_close_2x(got, want, eager, f"{act} tails")
        dg, du = ops.glu_bwd(torch.ones_like(u), special, u, act)
        g64 = special.double().requires_grad_()
        reference.glu(g64, u.double(), act).sum().backward()
        finite = torch.isfinite(special)
        torch.testing.assert_close(dg[finite].double(), g64.grad[finite], rtol=1e-5, atol=1e-6)
        ones = torch.ones_like(u)
        assert_close_2x(du, reference.glu(special.double(), ones.double(), act),
                        reference.glu(special, ones, act), f"{act} tails dup")


# --------------------------------------------------------------------------- layouts

def _strided(kind, shape, dtype, device):
    """A view of `shape` (rank 4) that is not contiguous, of the given kind."""
    b, s, h, f = shape
    if kind == "slice_last":      # a slice of a wider row: one row stride
        return randn((b, s, h, f + 5), dtype, device)[..., 2:2 + f]
    if kind == "slice_seq":       # [B, S, H, F] out of [B, S', H, F]: two row levels
        return randn((b, s + 3, h, f), dtype, device)[:, 1:1 + s]
    if kind == "three_levels":    # sliced along S and H: three levels, copied
        return randn((b, s + 1, h + 1, f), dtype, device)[:, 1:, 1:]
    if kind == "strided_last":    # last dim strided: copied
        return randn((b, s, h, 2 * f), dtype, device)[..., ::2]
    if kind == "expanded":        # a broadcast row
        return randn((1, 1, 1, f), dtype, device).expand(b, s, h, f)
    raise ValueError(kind)


KINDS = ["slice_last", "slice_seq", "three_levels", "strided_last", "expanded"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arg", ["gate", "up", "dout"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("f", [7, 64])
def test_strided_inputs(device, f, dtype, arg, kind):
    shape = (2, 3, 2, f)
    t = {a: randn(shape, dtype, device) for a in ("gate", "up", "dout")}
    t[arg] = _strided(kind, shape, dtype, device)
    before = t[arg].clone()
    check(FF.swiglu, reference.glu, [t["gate"], t["up"]], t["dout"], f"{arg} {kind}")
    assert torch.equal(bits(t[arg]), bits(before)), f"{arg} was modified"


@pytest.mark.parametrize("kind", ["slice_last", "slice_seq", "three_levels", "strided_last"])
@pytest.mark.parametrize("f", [7, 64])
def test_strided_packed(device, f, kind):
    gu = _strided(kind, (2, 3, 2, 2 * f), torch.bfloat16, device)
    check(FF.swiglu_packed, reference.glu_packed, [gu], randn((2, 3, 2, f), torch.bfloat16, device), kind)


def test_chunks_of_packed(device):
    """gate and up as the two halves of one projection, through the separate op."""
    gu = randn((3, 40), torch.bfloat16, device)
    g, u = gu.chunk(2, dim=-1)
    check(FF.swiglu, reference.glu, [g, u], randn((3, 20), torch.bfloat16, device), "chunks")


@requires_cuda
def test_misaligned_pointers():
    """Inputs starting off the 16-byte boundary take the narrower vector paths."""
    for off in range(1, 8):
        g = randn((3, 72), torch.bfloat16, "cuda")[:, off:off + 64]
        u = randn((3, 72), torch.bfloat16, "cuda")[:, 8 - off:72 - off]
        check(FF.swiglu, reference.glu, [g, u], randn((3, 64), torch.bfloat16, "cuda"), f"offset {off}")


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from /proc")
def test_str_argument_keeps_the_heap_flat():
    # torch 2.11-2.13's stable headers leak the unboxed copy of a str argument
    # (fusedops::StrArg, csrc/common/shim.h), and on the CPU each lost block
    # kept the freed outputs' memory from being reused: the resident size grew
    # by the output's size (256 KiB here) every call.
    gate, up = torch.randn(64, 1024), torch.randn(64, 1024)
    calls = {"glu_fwd": lambda: FF.swiglu(gate, up), "glu_packed_fwd": lambda: FF.geglu_packed(
        torch.cat([gate, up], -1))}
    for name, call in calls.items():
        for _ in range(50):
            call()
        before = _rss_bytes()
        for _ in range(400):
            call()
        grown = _rss_bytes() - before
        assert grown < 400 * 64 * 1024 * 4 // 8, f"{name}: the resident size grew by {grown} bytes in 400 calls"


def test_outputs_are_dense(device):
    g = _strided("slice_seq", (2, 3, 2, 8), torch.float16, device)
    out = FF.swiglu(g, randn((2, 3, 2, 8), torch.float16, device))
    assert out.is_contiguous() and out.shape == (2, 3, 2, 8)
    gu = _strided("slice_last", (2, 3, 2, 16), torch.float16, device).requires_grad_()
    out = FF.swiglu_packed(gu)
    assert out.is_contiguous() and out.shape == (2, 3, 2, 8)
    out.sum().backward()
    assert gu.grad.shape == (2, 3, 2, 16)


@pytest.mark.parametrize("act", ACTS)
def test_inplace_backward(device, act):
    """glu_bwd_ writes glu_bwd's results over gate and up and glu_fwd's over
    dout, bit for bit, and refuses inputs it cannot overwrite densely."""
    for dtype in (torch.bfloat16, torch.float32):
        g, u, d = (randn((5, 1000), dtype, device) for _ in range(3))
        dg, du = ops.glu_bwd(d, g, u, act)
        h = ops.glu_fwd(g, u, act)
        ops.glu_bwd_(d, g, u, act)
        assert torch.equal(bits(g), bits(dg)) and torch.equal(bits(u), bits(du))
        assert torch.equal(bits(d), bits(h))
    for arg in ("dout", "gate", "up"):
        t = dict(dout=d.clone(), gate=g.clone(), up=u.clone())
        t[arg] = t[arg].t().contiguous().t()
        raises_unchanged(ops.glu_bwd_, dict(t, activation=act),
                         rf"fusedops\.glu_bwd_: {arg} is not contiguous, expected a contiguous tensor")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
def test_recompute_backward(device, act, strided):
    """glu_bwd_recompute returns glu_fwd's and glu_bwd's results, bit for bit,
    in new dense tensors (poisoned first), leaving its inputs unchanged; on
    dense inputs and on column slices of wider ones."""
    for dtype in LOWP:
        for shape in ((5, 1000), (3, 4, 7), (0, 8)):
            if strided:  # each a slice of a tensor twice as wide: rows strided
                g, u, d = (randn((*shape[:-1], 2 * shape[-1]), dtype, device)[..., :shape[-1]] for _ in range(3))
            else:
                g, u, d = (randn(shape, dtype, device) for _ in range(3))
            before = [t.clone() for t in (d, g, u)]
            dg, du = ops.glu_bwd(d, g, u, act)
            h = ops.glu_fwd(g, u, act)
            with maybe_poisoned(device, True):
                got = ops.glu_bwd_recompute(d, g, u, act)
            for t, want in zip(got, (h, dg, du)):
                assert t.shape == want.shape and t.is_contiguous() and t.dtype == dtype
                assert torch.equal(bits(t), bits(want))
            assert all(torch.equal(bits(t), bits(b)) for t, b in zip((d, g, u), before))
    raises_unchanged(ops.glu_bwd_recompute, dict(dout=randn((3, 7), torch.float32, device),
                                                 gate=randn((3, 8), torch.float32, device),
                                                 up=randn((3, 8), torch.float32, device), activation=act),
                     r"fusedops\.glu_bwd_recompute: dout has shape \[3, 7\], expected the shape of gate \[3, 8\]")


@pytest.mark.parametrize("act", ACTS)
def test_inplace_packed_backward(device, act):
    """glu_packed_bwd_ writes glu_packed_bwd's result over gate_up and
    glu_packed_fwd's over dout, bit for bit, and nothing past them."""
    for dtype in (torch.bfloat16, torch.float32):
        gu = randn((5, 2000), dtype, device)
        buf = randn((2, 5 * 1000), dtype, device)  # dout, then a guard row
        d, guard = buf[0].view(5, 1000), buf[1].clone()
        dgu, h = ops.glu_packed_bwd(d, gu, act), ops.glu_packed_fwd(gu, act)
        ops.glu_packed_bwd_(d, gu, act)
        assert torch.equal(bits(gu), bits(dgu)) and torch.equal(bits(d), bits(h))
        assert torch.equal(bits(buf[1]), bits(guard)), "written past dout"
    raises_unchanged(ops.glu_packed_bwd_, dict(dout=d.t().contiguous().t(), gate_up=gu, activation=act),
                     r"fusedops\.glu_packed_bwd_: dout is not contiguous, expected a contiguous tensor")


def test_mlp_second_backward_raises(device):
    """The MLP's backward overwrites the projections it saved: a second
    backward through the same graph is refused, not silently wrong."""
    mlp = fusedops.nn.SwiGLU(8, 12).to(device)
    y = mlp(randn((3, 8), torch.float32, device))
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_deterministic(device):
    g, u, d = (randn((33, 1000), torch.bfloat16, device) for _ in range(3))
    a = ops.glu_fwd(g, u, "silu"), *ops.glu_bwd(d, g, u, "silu")
    b = ops.glu_fwd(g, u, "silu"), *ops.glu_bwd(d, g, u, "silu")
    for x, y in zip(a, b):
        assert torch.equal(bits(x), bits(y))


# --------------------------------------------------------------------------- bad input

def _args(device, dtype=torch.float32):
    return dict(gate=randn((3, 8), dtype, device), up=randn((3, 8), dtype, device), activation="silu")


FWD = r"fusedops\.glu_fwd: "
BAD_FWD = [
    ("shape", dict(up=((3, 9), torch.float32)), FWD + r"up has shape \[3, 9\], expected the shape of gate \[3, 8\]"),
    ("broadcast", dict(up=((8,), torch.float32)), FWD + r"up has shape \[8\], expected the shape of gate \[3, 8\]"),
    ("dtype_mix", dict(up=((3, 8), torch.bfloat16)),
     FWD + r"up has dtype bfloat16, expected the dtype of gate \(float32\)"),
    ("float64", dict(gate=((3, 8), torch.float64), up=((3, 8), torch.float64)),
     FWD + r"gate has dtype float64, expected float32, float16 or bfloat16"),
    ("scalar", dict(gate=((), torch.float32), up=((), torch.float32)),
     FWD + r"gate has shape \[\], expected at least one dimension"),
]


@pytest.mark.parametrize("over,match", [b[1:] for b in BAD_FWD], ids=[b[0] for b in BAD_FWD])
def test_bad_input_fwd(device, over, match):
    args = _args(device)
    args.update({k: randn(s, dt, device) for k, (s, dt) in over.items()})
    raises_unchanged(ops.glu_fwd, args, match)


def test_bad_input_activation(device):
    raises_unchanged(ops.glu_fwd, {**_args(device), "activation": "relu"},
                     r"fusedops\.glu_fwd: activation is 'relu', expected 'silu' or 'gelu_tanh'")
    with pytest.raises(ValueError, match="activation is 'gelu'"):
        fusedops.nn.SwiGLU(8, 16, activation="gelu")


def test_bad_input_int(device):
    args = dict(gate=torch.ones(3, 8, dtype=torch.int32, device=device),
                up=torch.ones(3, 8, dtype=torch.int32, device=device), activation="silu")
    raises_unchanged(ops.glu_fwd, args, FWD + r"gate has dtype int32, expected float32, float16 or bfloat16")


def test_bad_input_bwd(device):
    a = _args(device)
    raises_unchanged(ops.glu_bwd, {**a, "dout": randn((3, 7), torch.float32, device)},
                     r"fusedops\.glu_bwd: dout has shape \[3, 7\], expected the shape of gate \[3, 8\]")
    raises_unchanged(ops.glu_bwd, {**a, "dout": randn((3, 8), torch.float16, device)},
                     r"fusedops\.glu_bwd: dout has dtype float16, expected the dtype of gate \(float32\)")


def test_bad_input_packed(device):
    raises_unchanged(ops.glu_packed_fwd, dict(gate_up=randn((3, 7), torch.float32, device), activation="silu"),
                     r"fusedops\.glu_packed_fwd: gate_up has shape \[3, 7\], expected an even last dimension")
    raises_unchanged(FF.swiglu_packed, dict(gate_up=randn((3, 7), torch.float32, device)),
                     r"gate_up has shape \[3, 7\], expected an even last dimension")
    gu = randn((3, 8), torch.float32, device)
    raises_unchanged(ops.glu_packed_bwd, dict(dout=randn((3, 8), torch.float32, device), gate_up=gu,
                                              activation="silu"),
                     r"fusedops\.glu_packed_bwd: dout has shape \[3, 8\], expected gate_up's shape with "
                     r"the last dimension halved")


@requires_cuda
@pytest.mark.parametrize("gate_device", ["cuda", "cpu"])
def test_bad_input_mixed_devices(gate_device):
    other = "cpu" if gate_device == "cuda" else "cuda"
    name = {"cuda": "cuda:0", "cpu": "cpu"}
    args = dict(gate=randn((3, 8), torch.float32, gate_device), up=randn((3, 8), torch.float32, other),
                activation="silu")
    raises_unchanged(ops.glu_fwd, args, FWD + f"up is on {name[other]} but gate is on {name[gate_device]}")


# --------------------------------------------------------------------------- registration

@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_opcheck(device, dtype, act):
    g, u, d = (randn((2, 3, 10), dtype, device) for _ in range(3))
    torch.library.opcheck(ops.glu_fwd, (g.requires_grad_(), u.requires_grad_(), act))
    torch.library.opcheck(ops.glu_bwd, (d, g.detach(), u.detach(), act))
    torch.library.opcheck(ops.glu_bwd_, (d.clone(), g.detach().clone(), u.detach().clone(), act))
    torch.library.opcheck(ops.glu_bwd_recompute, (d, g.detach(), u.detach(), act))
    gu = randn((2, 3, 20), dtype, device)
    torch.library.opcheck(ops.glu_packed_fwd, (gu.requires_grad_(), act))
    torch.library.opcheck(ops.glu_packed_bwd, (d, gu.detach(), act))
    torch.library.opcheck(ops.glu_packed_bwd_, (d.clone(), gu.detach().clone(), act))


def test_torch_compile(device):
    """torch.compile(fullgraph=True) around the fused MLP (custom autograd
    Function and the ops inside it): no graph breaks, same results."""
    torch._dynamo.reset()
    mlp = fusedops.nn.SwiGLU(16, 40).to(device)
    compiled = torch.compile(mlp, fullgraph=True)
    for rows in (5, 7):
        x = randn((rows, 16), torch.float32, device)
        outs = []
        for fn in (compiled, mlp):
            mlp.zero_grad()
            xi = x.clone().requires_grad_()
            y = fn(xi)
            y.square().sum().backward()
            outs.append([y, xi.grad] + [p.grad for p in mlp.parameters()])
        for got, want in zip(*outs):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the module

class LlamaMLP(torch.nn.Module):
    """Hugging Face's LlamaMLP, written out (transformers is optional)."""

    def __init__(self, hidden, inter, bias=False, act="silu"):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=bias)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=bias)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=bias)
        self.act_fn = torch.nn.SiLU() if act == "silu" else torch.nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_module_state_dict():
    ref = LlamaMLP(12, 20)
    ours = fusedops.nn.SwiGLU(12, 20)
    assert list(ours.state_dict()) == list(ref.state_dict())
    ours.load_state_dict(ref.state_dict())  # strict: same keys and shapes
    back = LlamaMLP(12, 20)
    back.load_state_dict(ours.state_dict())
    for k, v in back.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k])


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", LOWP, ids=dtype_id)
def test_module_matches_torch(device, dtype, bias, act):
    """fusedops.nn.SwiGLU against the same MLP of torch.nn layers with the same
    weights: output, input gradient and every parameter gradient."""
    ref = LlamaMLP(24, 56, bias, act).to(device)
    ours = fusedops.nn.SwiGLU(24, 56, bias=bias, activation=act).to(device)
    ours.load_state_dict(ref.state_dict())
    x = randn((3, 5, 24), dtype, device)
    dy = randn((3, 5, 24), dtype, device)
    names = [n for n, _ in ours.named_parameters()]

    def results(module, to):
        m = copy.deepcopy(module).to(torch.float64 if to == "float64" else dtype)
        xi = x.detach().to(next(m.parameters()).dtype).requires_grad_()
        y = m(xi)
        y.backward(dy.to(y.dtype))
        return [y, xi.grad] + [dict(m.named_parameters())[n].grad for n in names]

    want = results(ref, "float64")
    eager = results(ref, "lowp")
    got = results(ours, "lowp")
    for name, g, w, e in zip(["y", "dx"] + names, got, want, eager):
        # Weight gradients are sums over 15 rows: their partial sums reach ~4.
        assert_close_2x(g, w, e, f"SwiGLU {name}", scale=max(4.0, float(w.detach().abs().max())))


def _joined(m):
    return fusedops.functional._joint_weight(m.gate_proj.weight, m.up_proj.weight) is not None


@pytest.mark.parametrize("bias", [False, True])
def test_module_joined_gate_up(device, bias):
    """gate_proj's and up_proj's weights share one allocation (one matmul for
    both) from construction, through .to() and load_state_dict; the results
    equal those of the same module with its weights apart, to rounding."""
    ours = fusedops.nn.SwiGLU(24, 56, bias=bias)
    assert _joined(ours)
    ours = ours.to(device, torch.bfloat16)
    assert _joined(ours)
    ours.load_state_dict(LlamaMLP(24, 56, bias).to(device, torch.bfloat16).state_dict())
    assert _joined(ours)
    apart = copy.deepcopy(ours)  # joined again after the copy (test_patch.py checks it)
    for p in (apart.gate_proj.weight, apart.up_proj.weight):
        p.data = p.data.clone()  # each weight in storage of its own
    assert not _joined(apart)
    x, dy = randn((3, 5, 24), torch.bfloat16, device), randn((3, 5, 24), torch.bfloat16, device)
    ref = LlamaMLP(24, 56, bias).to(device, torch.float64)
    ref.load_state_dict(ours.state_dict())
    outs = []
    for m in (ours, apart, ref):
        xi = x.detach().to(next(m.parameters()).dtype).requires_grad_()
        y = m(xi)
        y.backward(dy.to(y.dtype))
        outs.append([y, xi.grad] + [p.grad for p in m.parameters()])
    for name, g, e, w in zip(["y", "dx"] + [n for n, _ in ours.named_parameters()], *outs):
        assert_close_2x(g, w, e, f"joined {name}", scale=max(4.0, float(w.abs().max())))


def test_module_float64_falls_back(device):
    ref = LlamaMLP(8, 12).to(device).double()
    ours = fusedops.nn.SwiGLU(8, 12).to(device).double()
    ours.load_state_dict(ref.state_dict())
    x = randn((4, 8), torch.float64, device)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)


def test_module_autocast(device):
    """Under bf16 autocast the MLP computes in bf16 from fp32 parameters, as
    torch.nn.Linear does there, and the gradients come back in fp32."""
    ref = LlamaMLP(32, 48).to(device)
    ours = fusedops.nn.SwiGLU(32, 48).to(device)
    ours.load_state_dict(ref.state_dict())
    x = randn((4, 32), torch.float32, device)
    grads = []
    for m in (ours, ref):
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            y = m(x)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        grads.append([y] + [p.grad for p in m.parameters()])
    for g, r in zip(*grads):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g.float(), r.float(), rtol=0.05, atol=0.05 * float(r.abs().max()))


def _saved_bytes(fn):
    """Bytes of the tensors autograd keeps for the backward of fn() (by storage)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_module_saves_less_than_eager():
    """Eager keeps x, gate, up, silu(gate) and the product for the backward;
    fusedops.nn.SwiGLU keeps x, gate and up (plus the weights both keep)."""
    hidden, inter, rows = 16, 64, 32
    ref, ours = LlamaMLP(hidden, inter), fusedops.nn.SwiGLU(hidden, inter)
    x = torch.randn(rows, hidden, requires_grad=True)
    weights = sum(p.numel() * 4 for p in ref.parameters())
    eager = _saved_bytes(lambda: ref(x)) - weights
    fused = _saved_bytes(lambda: ours(x)) - weights
    assert eager == 4 * (rows * hidden + 4 * rows * inter)
    assert fused == 4 * (rows * hidden + 2 * rows * inter)


@requires_cuda
def test_module_peak_memory():
    """Peak CUDA memory of forward + backward is below eager's."""
    hidden, inter, rows = 256, 1024, 4096
    ref = LlamaMLP(hidden, inter).cuda().bfloat16()
    ours = fusedops.nn.SwiGLU(hidden, inter).cuda().bfloat16()
    x = randn((rows, hidden), torch.bfloat16, "cuda").requires_grad_()
    peaks = []
    for m in (ref, ours):
        m(x).sum().backward()  # warm-up: gradients allocated
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        m(x).sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    assert peaks[1] < peaks[0], f"peak above the base: fused {peaks[1]} B, eager {peaks[0]} B"


# --------------------------------------------------------------------------- packed gate-up weight
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", LOWP, ids=dtype_id)
def test_glu_mlp_packed_weight(device, dtype, bias, act):
    """glu_mlp with up_weight None and gate_weight the packed [W_gate; W_up]
    (Phi-3's gate_up_proj): output and every gradient against the float64
    reference (its halves as two weights) by the 2x rule; the packed weight's
    gradient is one tensor."""
    h, f = 24, 37
    w = {"gu": randn((2 * f, h), torch.float32, device) / h ** 0.5, "d": randn((h, f), torch.float32, device) / f ** 0.5}
    if bias:
        w.update(bgu=randn((2 * f,), torch.float32, device), bd=randn((h,), torch.float32, device))
    x, dy = randn((3, 5, h), dtype, device), randn((3, 5, h), dtype, device)

    def run(to, fused):
        ws = {k: v.detach().to(to).requires_grad_() for k, v in w.items()}
        xi = x.detach().to(to).requires_grad_()
        if fused:
            y = FF.glu_mlp(xi, ws["gu"], None, ws["d"], ws.get("bgu"), None, ws.get("bd"), act)
        else:
            bg, bu = ws["bgu"].chunk(2) if bias else (None, None)
            y = reference.glu_mlp(xi, *ws["gu"].chunk(2), ws["d"], bg, bu, ws.get("bd"), act)
        y.backward(dy.to(to))
        return {"y": y, "dx": xi.grad, **{k: v.grad for k, v in ws.items()}}
    got, eager, want = run(dtype, True), run(dtype, False), run(torch.float64, False)
    for k in want:
        assert_close_2x(got[k], want[k], eager[k], f"packed {k}", scale=max(4.0, float(want[k].detach().abs().max())))


@pytest.mark.parametrize("over, match", [
    (dict(gate_weight=(9, 8)), r"fusedops\.glu_mlp: gate_weight has shape \[9, 8\], expected \[2F, 8\]"),
    (dict(down_weight=(8, 5)), r"fusedops\.glu_mlp: down_weight has shape \[8, 5\], expected \[H, 6\] \(6: half the rows"),
    (dict(gate_bias=(6,)), r"fusedops\.glu_mlp: gate_bias has shape \[6\], expected \[12\]"),
    (dict(up_bias=(6,)), r"fusedops\.glu_mlp: up_bias is given without up_weight"),
])
def test_glu_mlp_packed_bad_input(device, over, match):
    args = dict(x=randn((3, 8), torch.float32, device), gate_weight=randn((12, 8), torch.float32, device),
                up_weight=None, down_weight=randn((8, 6), torch.float32, device))
    for k, shape in over.items():
        args[k] = randn(shape, torch.float32, device)
    raises_unchanged(FF.glu_mlp, args, match)
