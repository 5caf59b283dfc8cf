"""Tests of the joint q / k / v attention (fusedops.functional.qkv_attention)
and the two ops it is built from: fusedops::rope_ (RoPE in place) and
fusedops::attn_bwd_packed (attention's gradients side by side in one tensor).

Outputs and every gradient (x, the three weights and biases) are checked
against the same math in float64 (torch's linear, fusedops.reference.rope and
fusedops.reference.attention) by the 2x rule (tests/tolerances.py), with that
math in the inputs' own dtype as the yardstick."""
import pytest
import torch

from fusedops import functional as FF, nn as fnn, reference
from conftest import assert_unchanged, maybe_poisoned, raises_unchanged, randn, requires_cuda, snapshot
from test_rope import tables
from tolerances import assert_close_2x

ops = torch.ops.fusedops
LOWP = [torch.float32, torch.float16, torch.bfloat16]


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


def reference_qkv(x, wq, wk, wv, bq, bk, bv, cos, sin, hq, hkv, scale, causal):
    """The unfused math: three projections, HF's RoPE formula, attention with
    the score matrix materialised. Returns (out [B, S, Hq D], k, v [B, Hkv, S, D])."""
    lin = torch.nn.functional.linear
    bsz, seq = x.shape[:2]
    q = lin(x, wq, bq).view(bsz, seq, hq, -1).transpose(1, 2)
    k = lin(x, wk, bk).view(bsz, seq, hkv, -1).transpose(1, 2)
    v = lin(x, wv, bv).view(bsz, seq, hkv, -1).transpose(1, 2)
    q, k = reference.rope(q, k, cos, sin)
    out = reference.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, scale)
    return out.reshape(bsz, seq, -1), k, v


def inputs(bsz, seq, hidden, hq, hkv, d, dtype, device, bias, joint):
    """x, the three weights (adjacent in one storage when joint, as
    fusedops.nn.join_weights leaves them) and biases (or None), cos and sin."""
    x = randn((bsz, seq, hidden), dtype, device)
    scale = hidden ** -0.5  # weights of unit-variance projections
    ws = [randn((h * d, hidden), dtype, device) * scale for h in (hq, hkv, hkv)]
    if joint:
        ws = list(torch.cat(ws).split([w.shape[0] for w in ws]))
    bs = [randn((w.shape[0],), dtype, device) if bias else None for w in ws]
    cos, sin = tables(1, seq, d, dtype, device, "rope")
    return x, ws, bs, cos, sin


def run(fn, x, ws, bs, cos, sin, dout, to=None, poison=False, **kw):
    """[out, k, v, dx, dwq, dwk, dwv, dbq, dbk, dbv] of fn on fresh leaves,
    cast to `to` if given."""
    to = to or x.dtype
    leaves = [t.detach().to(to).requires_grad_() if t is not None else None for t in (x, *ws, *bs)]
    lx, lws, lbs = leaves[0], leaves[1:4], leaves[4:]
    with maybe_poisoned(x.device, poison):
        out, k, v = fn(lx, *lws, *lbs, cos.to(to), sin.to(to), **kw)
    with maybe_poisoned(x.device, poison):
        out.backward(dout.to(to))
    return [out, k, v] + [t.grad if t is not None else None for t in leaves]


def fused(x, wq, wk, wv, bq, bk, bv, cos, sin, hq, hkv, scale, causal):
    return FF.qkv_attention(x, wq, wk, wv, cos, sin, hq, hkv, bq, bk, bv, scale=scale, causal=causal,
                            return_kv=True)


NAMES = ["out", "k", "v", "dx", "dwq", "dwk", "dwv", "dbq", "dbk", "dbv"]


def check(shape, dtype, device, bias, joint, causal, what):
    bsz, seq, hidden, hq, hkv, d = shape
    x, ws, bs, cos, sin = inputs(bsz, seq, hidden, hq, hkv, d, dtype, device, bias, joint)
    dout = randn((bsz, seq, hq * d), dtype, device)
    kw = dict(hq=hq, hkv=hkv, scale=d ** -0.5, causal=causal)
    args = dict(x=x, wq=ws[0], wk=ws[1], wv=ws[2], cos=cos, sin=sin)
    before = snapshot(args)
    got = run(fused, x, ws, bs, cos, sin, dout, poison=True, **kw)
    assert_unchanged(args, before, f"{what}: ")
    want = run(reference_qkv, x, ws, bs, cos, sin, dout, to=torch.float64, **kw)
    eager = run(reference_qkv, x, ws, bs, cos, sin, dout, **kw)
    assert not got[1].requires_grad and not got[2].requires_grad, f"{what}: the cache's K, V take no gradient"
    for name, g, w, e in zip(NAMES, got, want, eager):
        if w is None:
            assert g is None, f"{what} {name}: a gradient where there is no input"
            continue
        assert_close_2x(g, w, e, f"{what} {name}")


# (batch, seq, hidden, q heads, kv heads, head dim): MHA, GQA, MQA; seq 1
# (no causal mask), odd and above a tile; head dims the CUDA kernels take
# (64, 128) and, on the CPU, others (8, 6).
SHAPES = [(1, 1, 16, 2, 2, 8), (2, 9, 24, 4, 2, 6), (2, 33, 64, 4, 1, 64), (1, 130, 96, 2, 2, 128),
          (3, 70, 128, 8, 2, 64)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("joint", [True, False], ids=["joint", "apart"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", LOWP, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_values(device, shape, dtype, bias, joint, causal):
    check(shape, dtype, device, bias, joint, causal, f"{shape} {dtype} bias={bias} joint={joint}")


def test_takes_the_fused_path(device, monkeypatch):
    """The shapes above run _QKVAttention (not the fallback) where the kernels
    apply: on the CPU every dtype, on CUDA 16-bit at head dims 64 and 128."""
    calls = []
    apply = FF._QKVAttention.apply
    monkeypatch.setattr(FF._QKVAttention, "apply", lambda *a: calls.append(1) or apply(*a))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, ws, bs, cos, sin = inputs(2, 33, 64, 4, 1, 64, dtype, device, False, True)
    FF.qkv_attention(x, *ws, cos, sin, 4, 1)
    assert calls == [1]


def test_falls_back_where_the_kernels_do_not_apply(device):
    """float64 (no kernel), and cos that requires grad: the same math in torch,
    gradients included."""
    x, ws, bs, cos, sin = inputs(2, 9, 24, 4, 2, 6, torch.float64, device, True, False)
    dout = torch.randn(2, 9, 24, dtype=torch.float64, device=device)
    kw = dict(hq=4, hkv=2, scale=6 ** -0.5, causal=True)
    got = run(fused, x, ws, bs, cos, sin, dout, **kw)
    want = run(reference_qkv, x, ws, bs, cos, sin, dout, **kw)
    for name, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g, w, msg=name)
    x, ws, bs, cos, sin = inputs(1, 5, 16, 2, 2, 8, torch.float32, device, False, False)
    cos.requires_grad_()
    out = FF.qkv_attention(x, *ws, cos, sin, 2, 2)
    out.sum().backward()
    assert cos.grad is not None


def test_join_weights_keeps_parameters(device):
    """join_weights moves q, k and v into one storage: values, identities and
    names unchanged, and qkv_attention then needs no copy of them."""
    lin = [torch.nn.Linear(32, n, device=device) for n in (32, 16, 16)]
    m = torch.nn.Module()
    m.q_proj, m.k_proj, m.v_proj = lin
    ids = [id(l.weight) for l in lin]
    vals = [l.weight.detach().clone() for l in lin]
    assert FF._joint_weight(*(l.weight for l in lin)) is None
    fnn.join_weights(m, ("q_proj", "k_proj", "v_proj"))
    assert [id(l.weight) for l in lin] == ids
    for l, v in zip(lin, vals):
        assert torch.equal(l.weight, v)
    assert FF._joint_weight(*(l.weight for l in lin)) is not None


def test_rope_inplace_matches_rope(device):
    for dtype in LOWP:
        q, k = randn((2, 7, 4, 16), dtype, device), randn((2, 7, 2, 16), dtype, device)
        cos, sin = tables(2, 7, 16, dtype, device, "random")
        for inverse in (False, True):
            want = ops.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, inverse)
            q2, k2 = q.clone(), k.clone()
            ops.rope_(q2.transpose(1, 2), k2.transpose(1, 2), cos, sin, inverse)
            assert torch.equal(q2.transpose(1, 2), want[0]) and torch.equal(k2.transpose(1, 2), want[1])


def test_attn_bwd_packed_matches_attn_bwd(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    qkv = randn((2, 40, 8, 64), dtype, device)
    q, k, v = qkv.split([4, 2, 2], dim=2)
    out, lse = ops.attn_fwd(q, k, v, 0.125, True)
    dout = randn(out.shape, dtype, device)
    with maybe_poisoned(device, True):
        packed = ops.attn_bwd_packed(dout, q, k, v, out, lse, 0.125, True, True)
    want = ops.attn_bwd(dout, q, k, v, out, lse, 0.125, True, True)
    assert torch.equal(packed, torch.cat(want, dim=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_opcheck(device, dtype):
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA attention kernels take 16-bit inputs")
    d = 8 if device == "cpu" else 32  # (the CUDA kernels' smallest head dim)
    qkv = randn((2, 6, 8, d), dtype, device)
    q, k, v = qkv.split([4, 2, 2], dim=2)
    cos, sin = tables(2, 6, d, dtype, device, "random")
    torch.library.opcheck(ops.rope_, (q.clone().transpose(1, 2), k.clone().transpose(1, 2), cos, sin))
    out, lse = ops.attn_fwd(q, k, v, 0.3, True)
    torch.library.opcheck(ops.attn_bwd_packed, (torch.randn_like(out), q, k, v, out, lse, 0.3, True, False))


def test_torch_compile(device):
    dtype, hidden, d = (torch.float32, 64, 16) if device == "cpu" else (torch.bfloat16, 256, 64)
    x, ws, bs, cos, sin = inputs(2, 9, hidden, 4, 2, d, dtype, device, True, True)
    dout = torch.randn(x.shape[0], x.shape[1], ws[0].shape[0], dtype=dtype, device=device)
    hq, hkv = 4, 2
    torch._dynamo.reset()
    fn = torch.compile(fused, backend="aot_eager", fullgraph=True)
    kw = dict(hq=hq, hkv=hkv, scale=0.25, causal=True)
    got = run(fn, x, ws, bs, cos, sin, dout, **kw)
    want = run(fused, x, ws, bs, cos, sin, dout, **kw)
    for name, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=name)


def test_bad_input(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q = randn((2, 5, 4, 32), dtype, device)
    k = randn((2, 5, 2, 32), dtype, device)
    cos, sin = tables(2, 5, 32, dtype, device, "random")
    wide = randn((2, 5, 4, 64), dtype, device)[..., ::2]
    raises_unchanged(ops.rope_, dict(q=wide.transpose(1, 2), k=k.transpose(1, 2), cos=cos, sin=sin),
                     r"fusedops.rope_: q has strides \[1280, 64, 256, 2\], expected unit stride along head_dim")
    out, lse = ops.attn_fwd(q, k, k, 0.3, False)
    k6 = randn((2, 6, 2, 32), dtype, device)
    raises_unchanged(ops.attn_bwd_packed, dict(dout=out, q=q, k=k6, v=k6, out=out, lse=lse, scale=0.3,
                                               causal=False, deterministic=False),
                     r"fusedops.attn_bwd_packed: k has 6 keys, expected as many as q has queries \(5\)")


@requires_cuda
def test_bad_device():
    q = randn((2, 5, 4, 8), torch.bfloat16, "cuda")
    cos, sin = tables(2, 5, 8, torch.bfloat16, "cpu", "random")
    raises_unchanged(ops.rope_, dict(q=q.transpose(1, 2), k=q.transpose(1, 2)[:, :2], cos=cos, sin=sin),
                     r"fusedops.rope_: cos is on cpu but q is on cuda:0; all tensors must be on one device")
