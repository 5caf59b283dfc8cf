"""Tests of the rotary position embedding op (csrc/rope): torch.ops.fusedops.rope
and fusedops.functional.apply_rotary_pos_emb.

Outputs and the gradients of q and k are checked against
fusedops.reference.rope (Hugging Face's formula) run in float64 by the 2x
rule (tests/tolerances.py), with the same formula in the inputs' own dtype as
the yardstick."""
import pytest
import torch

from fusedops import functional as FF, reference
from conftest import assert_unchanged, maybe_poisoned, raises_unchanged, randn, requires_cuda, snapshot
from tolerances import assert_close_2x

ops = torch.ops.fusedops
LOWP = [torch.float32, torch.float16, torch.bfloat16]


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


def tables(batch, seq, dim, dtype, device, kind):
    """cos and sin (batch, seq, dim): "rope" as the models build them (angles
    position * theta^(-2i/dim), each half the same), or "random" (halves that
    differ: the general formula)."""
    if kind == "random":
        return randn((batch, seq, dim), dtype, device), randn((batch, seq, dim), dtype, device)
    inv = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    pos = torch.randint(0, 4096, (batch, seq, 1)).double()
    ang = torch.cat([pos * inv, pos * inv], dim=-1)
    return ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)


def qk(batch, hq, hk, seq, dim, dtype, device, layout):
    """q (batch, hq, seq, dim) and k: contiguous ("bhsd") or the transposed
    views of (batch, seq, heads, dim) projections that models hand over ("bshd")."""
    def one(h):
        if layout == "bshd":
            return randn((batch, seq, h, dim), dtype, device).transpose(1, 2)
        return randn((batch, h, seq, dim), dtype, device)
    return one(hq), one(hk)


def run(fn, q, k, cos, sin, dq, dk, to=None, poison=False):
    """[q_out, k_out, dq, dk] of fn forward and backward on fresh leaves q, k
    (cast to `to` if given, as cos and sin are). poison: the outputs of both
    directions start as NaN."""
    to = to or q.dtype
    lq, lk = (t.detach().to(to).requires_grad_() for t in (q, k))
    with maybe_poisoned(q.device, poison):
        qo, ko = fn(lq, lk, cos.to(to), sin.to(to))
    with maybe_poisoned(q.device, poison):
        torch.autograd.backward([qo, ko], [dq.to(to), dk.to(to)])
    return [qo, ko, lq.grad, lk.grad]


def check(q, k, cos, sin, what, fn=FF.apply_rotary_pos_emb, ref=reference.rope):
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    args = dict(q=q, k=k, cos=cos, sin=sin)
    before = snapshot(args)
    got = run(fn, q, k, cos, sin, dq, dk, poison=True)
    assert_unchanged(args, before, f"{what}: ")
    want = run(ref, q, k, cos, sin, dq, dk, to=torch.float64)
    eager = run(ref, q, k, cos, sin, dq, dk)
    for name, g, w, e in zip(["q_out", "k_out", "dq", "dk"], got, want, eager):
        assert_close_2x(g, w, e, f"{what} {name}")


# (batch, q heads, k heads, seq, head dim): head dims whose half is a multiple
# of 8 (16-byte vectors at 16 bits), of 2 only (6: two-element vectors), odd
# (3, 1: one element); seq 1 to 300; GQA and MQA.
SHAPES = [(1, 1, 1, 1, 2), (2, 4, 2, 9, 12), (3, 8, 8, 33, 64), (2, 16, 4, 17, 128), (1, 2, 1, 300, 256),
          (2, 3, 3, 5, 6), (1, 5, 1, 7, 10)]


@pytest.mark.parametrize("kind", ["rope", "random"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", LOWP, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_values(device, shape, dtype, layout, kind):
    b, hq, hk, s, d = shape
    q, k = qk(b, hq, hk, s, d, dtype, device, layout)
    cos, sin = tables(1 if kind == "rope" else b, s, d, dtype, device, kind)
    check(q, k, cos, sin, f"{shape} {dtype} {layout} {kind}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_bshd_with_unsqueeze_dim_2(device, dtype):
    """(B, S, H, D) tensors with cos unsqueezed at dim 2, as some models call it."""
    b, h, s, d = 2, 3, 11, 16
    q, k = (randn((b, s, h, d), dtype, device) for _ in range(2))
    cos, sin = tables(b, s, d, dtype, device, "random")
    check(q, k, cos, sin, "unsqueeze_dim=2",
          fn=lambda *a: FF.apply_rotary_pos_emb(*a, unsqueeze_dim=2),
          ref=lambda *a: reference.rope(*a, unsqueeze_dim=2))


def test_strided_tables_and_heads(device):
    """cos / sin sliced from a longer table with a wider row, q a slice of a
    packed qkv projection, k with a padded head dim: read in place through
    their strides."""
    b, h, s, d = 2, 4, 13, 32
    big = randn((b, 40, 2 * d), torch.bfloat16, device)
    cos, sin = big[:, 5:5 + s, :d], big[:, 7:7 + s, d:]
    qkv = randn((b, s, 3 * h, d), torch.bfloat16, device)
    q = qkv[:, :, :h].transpose(1, 2)
    k = randn((b, h, s, d + 8), torch.bfloat16, device)[..., :d]
    assert not q.is_contiguous() and not k.is_contiguous() and not cos.is_contiguous()
    check(q, k, cos, sin, "strided")


def test_empty(device):
    for b, h, s in [(0, 2, 3), (2, 0, 3), (2, 2, 0)]:
        q = torch.empty(b, h, s, 8, device=device)
        cos = torch.empty(b, s, 8, device=device)
        qo, ko = ops.rope(q, q, cos, cos)
        assert qo.shape == ko.shape == q.shape


def test_inverse_undoes_forward(device):
    """inverse=True is the transposed rotation: with real rotations (each cos,
    sin pair on the unit circle) it undoes the forward."""
    q, k = qk(2, 4, 2, 20, 64, torch.float32, device, "bshd")
    cos, sin = tables(2, 20, 64, torch.float32, device, "rope")
    qo, ko = ops.rope(q, k, cos, sin)
    qb, kb = ops.rope(qo, ko, cos, sin, True)
    torch.testing.assert_close(qb, q, rtol=0, atol=1e-5)
    torch.testing.assert_close(kb, k, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_output_layout(device, layout):
    """The forward's outputs are contiguous (B, H, S, D), whatever the inputs'
    layout (a KV cache copies them fastest so); the inverse's, the backward's,
    are (B, H, S, D) views of (B, S, H, D) memory, the projections' layout the
    gradients flow into; the fake kernel says the same."""
    q, k = qk(2, 4, 2, 5, 8, torch.bfloat16, device, layout)
    cos, sin = tables(1, 5, 8, torch.bfloat16, device, "rope")
    for inverse in (False, True):
        outs = ops.rope(q, k, cos, sin, inverse)
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fakes = ops.rope(*(mode.from_tensor(t) for t in (q, k, cos, sin)), inverse)
        for o, f in zip(outs, fakes):
            assert (o.transpose(1, 2) if inverse else o).is_contiguous()
            assert o.stride() == f.stride()


def test_falls_back_to_the_formula(device):
    """Calls the kernel does not take run the eager formula: float64, cos that
    requires grad (whose gradient then flows), a head dim that is odd."""
    q, k = qk(2, 2, 2, 5, 8, torch.float64, device, "bhsd")
    cos, sin = tables(2, 5, 8, torch.float64, device, "random")
    for got, want in zip(FF.apply_rotary_pos_emb(q, k, cos, sin), reference.rope(q, k, cos, sin)):
        assert torch.equal(got, want)
    q32, k32, sin32 = q.float(), k.float(), sin.float()
    cos32 = cos.float().requires_grad_()
    qo, ko = FF.apply_rotary_pos_emb(q32, k32, cos32, sin32)
    (qo.sum() + ko.sum()).backward()
    assert cos32.grad is not None and cos32.grad.abs().sum() > 0
    qo, _ = FF.apply_rotary_pos_emb(q32[..., :7], k32[..., :7], cos32.detach()[..., :7], sin32[..., :7])
    assert qo.shape == (2, 2, 5, 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_opcheck(device, dtype):
    q, k = qk(2, 4, 2, 5, 8, dtype, device, "bshd")
    cos, sin = tables(2, 5, 8, dtype, device, "random")
    torch.library.opcheck(ops.rope, (q.requires_grad_(), k.requires_grad_(), cos, sin))
    torch.library.opcheck(ops.rope, (q.detach(), k.detach(), cos[:1], sin[:1], True))


def test_torch_compile(device):
    q, k = qk(2, 4, 2, 6, 16, torch.float32, device, "bshd")
    cos, sin = tables(1, 6, 16, torch.float32, device, "rope")
    torch._dynamo.reset()
    fn = torch.compile(FF.apply_rotary_pos_emb, backend="aot_eager", fullgraph=True)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    got = run(fn, q, k, cos, sin, dq, dk)
    want = run(FF.apply_rotary_pos_emb, q, k, cos, sin, dq, dk)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _args(device, **over):
    q, k = qk(2, 4, 2, 5, 8, torch.float32, device, "bhsd")
    cos, sin = tables(2, 5, 8, torch.float32, device, "random")
    args = dict(q=q, k=k, cos=cos, sin=sin)
    args.update({n: (v(args[n]) if callable(v) else v) for n, v in over.items()})
    return args


BAD = [
    (dict(q=lambda t: t[0]), r"fusedops.rope: q has shape \[4, 5, 8\], expected 4 dimensions"),
    (dict(q=lambda t: t[..., :7], k=lambda t: t[..., :7], cos=lambda t: t[..., :7], sin=lambda t: t[..., :7]),
     r"fusedops.rope: q has shape \[2, 4, 5, 7\], expected an even head_dim"),
    (dict(k=lambda t: t[:, :, :4]), r"fusedops.rope: k has shape \[2, 2, 4, 8\], expected q's batch, seq and head_dim"),
    (dict(k=lambda t: t.half()), r"fusedops.rope: k has dtype float16, expected the dtype of q \(float32\)"),
    (dict(cos=lambda t: t[:, :4]), r"fusedops.rope: cos has shape \[2, 4, 8\], expected \[2 or 1, 5, 8\]"),
    (dict(sin=lambda t: t[None]), r"fusedops.rope: sin has shape \[1, 2, 5, 8\], expected \[2 or 1, 5, 8\]"),
    (dict(sin=lambda t: t.double()), r"fusedops.rope: sin has dtype float64, expected the dtype of q"),
    (dict(q=lambda t: t.double(), k=lambda t: t.double(), cos=lambda t: t.double(), sin=lambda t: t.double()),
     r"fusedops.rope: q has dtype float64, expected float32, float16 or bfloat16"),
]


@pytest.mark.parametrize("over,match", BAD, ids=range(len(BAD)))
def test_bad_input(device, over, match):
    raises_unchanged(ops.rope, _args(device, **over), match)


@requires_cuda
def test_bad_device():
    raises_unchanged(ops.rope, _args("cuda", cos=lambda t: t.cpu()),
                     r"fusedops.rope: cos is on cpu but q is on cuda:0; all tensors must be on one device")
