"""fusedops.functional.linear_cross_entropy (torch.ops.fusedops.linear_xent_fwd
/ linear_xent_bwd, xent_fwd_bwd_), fusedops.nn.LinearCrossEntropy and the
Hugging Face head patched with loss=True: the loss and the gradients of
input, weight and bias against float64 by the 2x rule (tests/tolerances.py)
over chunk boundaries (rows not a multiple of the chunk), with outputs
poisoned and inputs unchanged; every reduction, label smoothing, softcap,
bias or none, one token, all targets ignored, vocabularies of 1, 7 and
50000; autocast; torch.compile(fullgraph=True); opcheck; the CPU path's peak
memory against the two-step form's; bad input."""
import gc
import re

import pytest
import torch

import fusedops
from fusedops import functional as FF, nn as fnn, reference
from fusedops.ops import linear_xent as LX
from conftest import assert_unchanged, maybe_poisoned, raises_unchanged, requires_cuda, snapshot
from tolerances import assert_close_2x

LOWP = [torch.float32, torch.float16, torch.bfloat16]
IGNORE = -100


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


@pytest.fixture
def chunk(monkeypatch):
    """chunk(rows): the next calls cut their inputs into chunks of `rows`."""
    return lambda rows: monkeypatch.setattr(LX, "_CHUNK_ROWS", rows)


def make(rows, hidden, vocab, dtype, device, bias=False, ignored=0.2):
    """input, weight (and bias) as random normals scaled so that the logits
    have a spread of about 3, and targets, a share of them IGNORE."""
    x = torch.randn(rows, hidden, device=device).to(dtype)
    w = (torch.randn(vocab, hidden, device=device) * (3 / hidden ** 0.5)).to(dtype)
    b = torch.randn(vocab, device=device).to(dtype) if bias else None
    t = torch.randint(0, vocab, (rows,), device=device)
    t[torch.rand(rows, device=device) < ignored] = IGNORE
    return x, w, b, t


def run(fn, x, w, b, t, g, kw, to=None, poison=False):
    """[loss, dinput, dweight(, dbias)] of fn on fresh leaves (cast to `to`)."""
    leaves = [a.detach().to(to or a.dtype).requires_grad_() for a in (x, w, b) if a is not None]
    bias = leaves[2] if b is not None else None
    with maybe_poisoned(x.device, poison):
        loss = fn(leaves[0], leaves[1], t, bias, **kw)
    with maybe_poisoned(x.device, poison):
        loss.backward(g.to(loss.dtype))
    return [loss] + [a.grad for a in leaves]


def upstream(rows, reduction, device):
    return torch.randn(rows, device=device) if reduction == "none" else torch.tensor(1.7, device=device)


def check(x, w, b, t, kw, what):
    """The fused loss and gradients against float64 by the 2x rule, eager in
    x's dtype (the two-step form) the yardstick. Gradients are judged at
    their own size (scale max |ref|), not at the default max(1, ...): the
    weight's gradient of a mean is small, and a floor of 1 % of 1 would
    let anything pass."""
    g = upstream(x.shape[0], kw["reduction"], x.device)
    args = dict(x=x, w=w, b=b, t=t)
    before = snapshot(args)
    got = run(FF.linear_cross_entropy, x, w, b, t, g, kw, poison=True)
    assert_unchanged(args, before, f"{what}: ")
    want = run(reference.linear_cross_entropy, x, w, b, t, g, kw, to=torch.float64)
    eager = run(reference.linear_cross_entropy, x, w, b, t, g, kw)
    for name, a, r, e in zip(["loss", "dinput", "dweight", "dbias"], got, want, eager):
        assert a.dtype == x.dtype, f"{what} {name}: dtype {a.dtype}, expected {x.dtype}"
        finite = r[r.isfinite()].abs()
        size = float(finite.max()) if finite.numel() else 1.0
        scale = max(1.0, size) if name == "loss" else (size or 1.0)
        assert_close_2x(a, r, e, f"{what} {name}", scale=scale)


# rows, hidden, vocab, rows a chunk (None: chunk_rows' own), bias, label
# smoothing, softcap
CASES = [
    (37, 16, 29, 8, False, 0.0, 0.0),       # 5 chunks, the last of 5 rows
    (37, 16, 29, 8, True, 0.1, 0.0),
    (37, 16, 29, 8, False, 0.0, 5.0),
    (37, 16, 29, 10, True, 0.2, 3.0),
    (1, 24, 7, None, True, 0.0, 0.0),       # one token
    (11, 8, 1, 4, True, 0.1, 0.0),          # one class
    (12, 8, 7, 5, False, 0.0, 2.0),
    (9, 32, 50000, 4, True, 0.05, 30.0),
    (300, 64, 1000, None, True, 0.0, 0.0),  # chunk_rows: 2 chunks of 152
]


def case_id(c):
    rows, hidden, vocab, step, bias, ls, cap = c
    return (f"{rows}x{hidden}x{vocab}-c{step}" + ("-bias" if bias else "") + (f"-ls{ls}" if ls else "")
            + (f"-cap{cap}" if cap else ""))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", LOWP, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_values(device, case, dtype, reduction, chunk):
    rows, hidden, vocab, step, bias, ls, cap = case
    chunk(step)
    x, w, b, t = make(rows, hidden, vocab, dtype, device, bias)
    check(x, w, b, t, dict(ignore_index=IGNORE, reduction=reduction, label_smoothing=ls, softcap=cap),
          case_id(case) + f" {dtype_id(dtype)} {reduction}")


def test_chunk_rows_default_takes_300_rows_in_two_chunks():
    assert LX.chunk_rows(300, 1000, 64, 2) == 152


# tokens, vocab, hidden, free bytes -> rows a chunk by policy (bf16). The
# issue's shapes at hidden 4096: "input" differs from "weight" where the
# vocabulary is large against the tokens; "free" is one chunk where half the
# free memory holds it; free memory caps them all.
PLANS = [
    ((8192, 128256, 4096, None), dict(weight=1024, input=256, free=8192)),
    ((8192, 32000, 4096, None), dict(weight=1024, input=1024, free=8192)),
    ((8192, 262144, 4096, None), dict(weight=1024, input=256, free=8192)),  # at most 32 chunks
    ((2048, 128256, 4096, None), dict(weight=1024, input=64, free=2048)),
    ((32768, 128256, 4096, None), dict(weight=1024, input=1024, free=32768)),
    ((65536, 128256, 4096, None), dict(weight=2048, input=2048, free=65536)),  # at most 32 chunks
    ((8192, 128256, 4096, 1 << 30), dict(weight=1024, input=256, free=2048)),  # 2 GiB logits: 4 chunks
    ((8192, 128256, 4096, 1 << 28), dict(weight=512, input=256, free=512)),
    ((300, 1000, 64, None), dict(weight=152, input=16, free=300)),
]


@pytest.mark.parametrize("shape,want", PLANS, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else None)
def test_chunk_rows_plan(shape, want):
    rows, vocab, hidden, free = shape
    got = {p: LX.chunk_rows(rows, vocab, hidden, 2, free, policy=p) for p in LX.POLICIES}
    assert got == want


def test_chunk_rows_unknown_policy_raises():
    with pytest.raises(ValueError, match="chunk policy 'fastest', expected one of"):
        LX.chunk_rows(300, 1000, 64, 2, policy="fastest")


@pytest.mark.parametrize("policy", LX.POLICIES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_values_by_policy(device, policy, reduction, monkeypatch):
    """Each chunk policy (the probe's variants) through the op: 600 tokens,
    3 chunks, 25 or one."""
    monkeypatch.setattr(LX, "_POLICY", policy)
    x, w, b, t = make(600, 64, 1000, torch.bfloat16, device, bias=True)
    check(x, w, b, t, dict(ignore_index=IGNORE, reduction=reduction, label_smoothing=0.1, softcap=0.0),
          f"policy {policy} {reduction}")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(device, reduction, chunk):
    """No target counts: the mean is NaN (0 / 0, as torch's), the sum 0, every
    gradient exactly 0."""
    chunk(4)
    x, w, b, t = make(10, 8, 7, torch.float32, device, bias=True, ignored=1.0)
    kw = dict(ignore_index=IGNORE, reduction=reduction)
    got = run(FF.linear_cross_entropy, x, w, b, t, upstream(10, reduction, device), kw, poison=True)
    want = reference.linear_cross_entropy(x, w, t, b, **kw)
    assert torch.equal(got[0].isnan(), want.isnan()) and (reduction != "mean" or got[0].isnan())
    if reduction != "mean":
        assert torch.equal(got[0], torch.zeros_like(got[0]))
    for name, grad in zip(["dinput", "dweight", "dbias"], got[1:]):
        assert torch.equal(grad, torch.zeros_like(grad)), f"{name} is not 0"


@pytest.mark.parametrize("needs", ["input", "weight", "bias"])
def test_one_gradient(device, needs, chunk):
    """Only the tensors that require grad get a gradient (a frozen head, say:
    no weight gradient is computed), the same values as with all three."""
    chunk(6)
    x, w, b, t = make(20, 8, 13, torch.float32, device, bias=True)
    kw = dict(ignore_index=IGNORE, reduction="mean")
    full = run(FF.linear_cross_entropy, x, w, b, t, torch.tensor(1.0, device=device), kw)
    leaves = {"input": x.clone(), "weight": w.clone(), "bias": b.clone()}
    leaves[needs].requires_grad_()
    FF.linear_cross_entropy(leaves["input"], leaves["weight"], t, leaves["bias"], **kw).backward()
    for i, (name, leaf) in enumerate(leaves.items()):
        if name == needs:
            torch.testing.assert_close(leaf.grad, full[1 + i], rtol=1e-6, atol=1e-7)
        else:
            assert leaf.grad is None


def test_leading_dims_and_module(device, chunk):
    """input [B, S, hidden] and target [B, S], as a language model gives them;
    nn.LinearCrossEntropy is the function with the settings of
    nn.CrossEntropyLoss."""
    chunk(5)
    x, w, b, t = make(2 * 9, 16, 23, torch.float32, device)
    x3, t2 = x.reshape(2, 9, 16), t.reshape(2, 9)
    for reduction in ("mean", "none"):
        module = fnn.LinearCrossEntropy(ignore_index=IGNORE, reduction=reduction, label_smoothing=0.1, softcap=4.0)
        got = module(x3, w, t2)
        want = reference.linear_cross_entropy(x3.double(), w.double(), t2, None, IGNORE, reduction, 0.1, 4.0)
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert "softcap=4.0" in repr(module)


def test_autocast_fp32_weight(device, chunk):
    """fp32 input and weight under bf16 autocast: as torch's linear and
    cross_entropy there, the matmuls in bf16, an fp32 loss, fp32 gradients
    (the cast's); against float64 by the 2x rule, eager under autocast the
    yardstick."""
    chunk(7)
    x, w, b, t = make(30, 16, 41, torch.float32, device, bias=True)
    g = torch.tensor(1.0, device=device)
    kw = dict(ignore_index=IGNORE, reduction="mean", label_smoothing=0.1)
    with torch.autocast(device, dtype=torch.bfloat16):
        got = run(FF.linear_cross_entropy, x, w, b, t, g, kw)
        eager = run(reference.linear_cross_entropy, x, w, b, t, g, kw)
    want = run(reference.linear_cross_entropy, x, w, b, t, g, kw, to=torch.float64)
    for name, a, r, e in zip(["loss", "dinput", "dweight", "dbias"], got, want, eager):
        assert a.dtype == torch.float32 == e.dtype, f"{name}: {a.dtype}, eager {e.dtype}"
        assert_close_2x(a, r, e, f"autocast {name}", scale=max(1.0, float(r.abs().max())) if name == "loss"
                        else float(r.abs().max()))


def test_no_grad_computes_the_loss_only(device, chunk):
    chunk(4)
    x, w, b, t = make(13, 8, 9, torch.float32, device, bias=True)
    with torch.no_grad():
        loss, dx, dw, db = torch.ops.fusedops.linear_xent_fwd(x, w, b, t, IGNORE, "mean", 0.0, 0.0,
                                                              False, False, False)
    assert dx.numel() == dw.numel() == db.numel() == 0
    torch.testing.assert_close(loss.double(), reference.linear_cross_entropy(x.double(), w.double(), t, b.double()),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile(device, reduction, chunk):
    chunk(6)
    x, w, b, t = make(20, 8, 13, torch.float32, device, bias=True)
    g = upstream(20, reduction, device)
    kw = dict(ignore_index=IGNORE, reduction=reduction, label_smoothing=0.1, softcap=3.0)

    def fn(x, w, t, b, **kw):
        return FF.linear_cross_entropy(x, w, t, b, **kw) * 2
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got = run(compiled, x, w, b, t, g, kw)
    want = run(fn, x, w, b, t, g, kw)
    for a, e in zip(got, want):
        assert torch.equal(a, e)


def test_opcheck(device, chunk):
    chunk(4)
    x, w, b, t = make(10, 8, 7, torch.float32, device, bias=True)
    for reduction in ("mean", "none"):
        torch.library.opcheck(torch.ops.fusedops.linear_xent_fwd.default,
                              (x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), t, IGNORE, reduction,
                               0.1, 2.0, True, True, True))
    torch.library.opcheck(torch.ops.fusedops.linear_xent_fwd.default,
                          (x, w, b, t, IGNORE, "mean", 0.1, 2.0, True, True, True, torch.tensor(13.0, device=device)))
    torch.library.opcheck(torch.ops.fusedops.linear_xent_bwd.default,
                          (torch.randn(10, device=device), x.detach(), w.detach(), b.detach(), t, IGNORE, 0.1, 2.0,
                           True, True, True))
    z = torch.randn(10, 7, device=device)
    torch.library.opcheck(torch.ops.fusedops.xent_fwd_bwd_.default,
                          (z, t, torch.rand(10, device=device), IGNORE, 0.1, 2.0))


@pytest.mark.parametrize("n", [1, 7, 1023, 1025, 8 * 4096 + 3])
@pytest.mark.parametrize("dtype", LOWP, ids=dtype_id)
def test_scale_is_one_rounding_of_the_product_and_nothing_at_one(device, dtype, n):
    """linear_xent_scale_ (the backward's scaling): grad * dloss widened to
    fp32 and rounded once, over vector tails; with dloss 1 the tensor is
    bitwise what it was, NaN and inf included (the kernel skips it)."""
    g = torch.randn(n, device=device).to(dtype)
    g[:: max(1, n // 3)] = float("nan")
    g[1:: max(2, n // 2)] = float("inf")
    for d in (1.7, -0.25, 1.0):
        got = g.clone()
        LX.linear_xent_scale_(got, torch.tensor(d, device=device))
        want = (g.float() * d).to(dtype)
        assert torch.equal(got.isnan(), want.isnan()), d
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want)), d
    torch.library.opcheck(torch.ops.fusedops.linear_xent_scale_.default,
                          (g.clone(), torch.tensor(0.5, device=device)))


def test_scale_bad_input(device):
    g = torch.randn(4, 6, device=device)
    cases = [
        (dict(grad=g, dloss=torch.ones(2, device=device)), r"fusedops.linear_xent_scale_: dloss has shape \[2\] "
         r"and dtype float32, expected one float32 value"),
        (dict(grad=g, dloss=torch.ones((), device=device, dtype=torch.float64)), r"dtype float64, expected one "
         r"float32 value"),
        (dict(grad=g.t(), dloss=torch.ones((), device=device)), r"grad has strides \[1, 6\], expected contiguous"),
    ]
    for args, match in cases:
        raises_unchanged(LX.linear_xent_scale_, args, match)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_backward_from_the_loss_itself(device, reduction, chunk):
    """loss.backward() (a gradient of exactly 1: the scaling is skipped) gives
    the gradients of the loss, against float64 by the 2x rule."""
    chunk(8)
    x, w, b, t = make(37, 16, 29, torch.bfloat16, device, bias=True)
    kw = dict(ignore_index=IGNORE, reduction=reduction, label_smoothing=0.1, softcap=0.0)
    one = torch.tensor(1.0, device=device)
    got = run(FF.linear_cross_entropy, x, w, b, t, one, kw)
    want = run(reference.linear_cross_entropy, x, w, b, t, one, kw, to=torch.float64)
    eager = run(reference.linear_cross_entropy, x, w, b, t, one, kw)
    for name, a, r, e in zip(["loss", "dinput", "dweight", "dbias"], got, want, eager):
        assert_close_2x(a, r, e, f"{reduction} {name}", scale=max(float(r.detach().abs().max()), 1e-30))


@pytest.mark.parametrize("num_items", [19, 19.0, "tensor"])
def test_num_items_is_the_means_divisor(device, num_items, chunk):
    """num_items (Hugging Face's num_items_in_batch: an int, a float or a
    tensor) divides the sum, in the op: the loss and the gradients it hands
    out, against float64 by the 2x rule, loss.backward() and a gradient of 1.7
    alike."""
    chunk(8)
    n = torch.tensor(19, device=device) if num_items == "tensor" else num_items
    x, w, b, t = make(37, 16, 29, torch.bfloat16, device, bias=True)

    def fused(x, w, t, b, **kw):
        return FF._linear_xent_f32(x, w, t, b, IGNORE, "mean", 0.1, 0.0, num_items=n).to(x.dtype)

    def ref(x, w, t, b, **kw):
        return reference.linear_cross_entropy(x, w, t, b, IGNORE, "sum", 0.1, 0.0) / 19
    for g in (1.0, 1.7):
        g = torch.tensor(g, device=device)
        got = run(fused, x, w, b, t, g, {})
        want = run(ref, x, w, b, t, g, {}, to=torch.float64)
        eager = run(ref, x, w, b, t, g, {})
        for name, a, r, e in zip(["loss", "dinput", "dweight", "dbias"], got, want, eager):
            assert_close_2x(a, r, e, f"num_items {name}", scale=max(float(r.detach().abs().max()), 1e-30))


def test_num_items_of_more_than_one_value_raises(device):
    x, w, b, t = make(4, 8, 9, torch.float32, device)
    with pytest.raises(RuntimeError, match=r"fusedops.linear_xent_fwd: num_items has shape \[2\], expected one "):
        torch.ops.fusedops.linear_xent_fwd(x, w, None, t, IGNORE, "mean", 0.0, 0.0, False, False, False,
                                           torch.ones(2, device=device))


def test_xent_fwd_bwd_matches_forward_and_backward(device):
    """The fused pass gives xent_fwd's loss and xent_bwd's gradient, written
    over the logits, for every dtype (odd vocab, label smoothing, softcap):
    bitwise where each thread holds at most one vector of a row."""
    for dtype in LOWP:
        z = (torch.randn(9, 37, device=device) * 3).to(dtype)
        t = torch.randint(0, 37, (9,), device=device)
        t[2] = IGNORE
        dloss = torch.rand(9, device=device)
        loss, lse, _ = torch.ops.fusedops.xent_fwd(z, t, IGNORE, 0.1, 2.5)
        grad = torch.ops.fusedops.xent_bwd(dloss, z, t, lse, IGNORE, 0.1, 2.5)
        inplace = z.clone()
        loss2 = torch.ops.fusedops.xent_fwd_bwd_(inplace, t, dloss, IGNORE, 0.1, 2.5)
        assert torch.equal(loss2, loss) and torch.equal(inplace, grad), dtype


@pytest.mark.parametrize("vocab", [32000, 128256])
def test_xent_fwd_bwd_large_vocab(device, vocab):
    """The fused pass on rows of many vectors (on CUDA its own block size and
    a backward second loop): xent_fwd's loss and xent_bwd's gradient within
    rounding, ignored rows zeroed, label smoothing and softcap."""
    z = (torch.randn(40, vocab, device=device) * 3).to(torch.bfloat16)
    t = torch.randint(0, vocab, (40,), device=device)
    t[::7] = IGNORE
    dloss = torch.rand(40, device=device)
    for ls, cap in ((0.0, 0.0), (0.1, 30.0)):
        loss, lse, _ = torch.ops.fusedops.xent_fwd(z, t, IGNORE, ls, cap)
        grad = torch.ops.fusedops.xent_bwd(dloss, z, t, lse, IGNORE, ls, cap)
        inplace = z.clone()
        loss2 = torch.ops.fusedops.xent_fwd_bwd_(inplace, t, dloss, IGNORE, ls, cap)
        torch.testing.assert_close(loss2, loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(inplace.float(), grad.float(), rtol=2 ** -7, atol=1e-9)
        assert (inplace[::7] == 0).all()


def test_double_backward_raises(device, chunk):
    """A gradient of the gradient raises, at the backward with
    create_graph=True (the gradients of "mean" and "sum" come from the
    forward and cannot be differentiated; "none" the same)."""
    chunk(4)
    x, w, _, t = make(10, 8, 7, torch.float32, device)
    x.requires_grad_()
    for reduction in ("mean", "none"):
        with pytest.raises(RuntimeError, match="fusedops.linear_xent_fwd: double backward is not supported"):
            loss = FF.linear_cross_entropy(x, w, t, reduction=reduction).sum()
            (gx,) = torch.autograd.grad(loss, x, create_graph=True)
            gx.sum().backward()


def test_float64_runs_torch(device):
    x, w, b, t = make(6, 8, 7, torch.float64, device, bias=True)
    with pytest.warns(UserWarning, match="float64 input is not supported"):
        got = FF.linear_cross_entropy(x, w, t, b)
    torch.testing.assert_close(got, reference.linear_cross_entropy(x, w, t, b))


# --------------------------------------------------------------- memory
def _resident():
    with open("/proc/self/status") as f:
        status = f.read()
    return {k: int(re.search(rf"{k}:\s+(\d+) kB", status)[1]) << 10 for k in ("VmRSS", "VmHWM")}


def _peak_resident(fn):
    """Bytes the process's resident set grew by at its peak while fn ran
    (the kernel's high-water mark, reset first). Tensors of tens of MB are
    mmap'd by glibc and unmapped when freed, so each shows up for as long as
    it lives; freed smaller ones may be reused unseen, which only lowers
    the figure. Garbage of earlier tests is collected first: a cycle holding
    a large tensor, freed by the collector while fn runs, would take its
    size off the growth."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError as e:
        pytest.skip(f"cannot reset the resident high-water mark: {e}")
    base = _resident()["VmRSS"]
    fn()
    return _resident()["VmHWM"] - base


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_cpu_peak_memory_is_a_chunk_not_the_logits(chunk):
    """Forward and backward of a 65536-class head on 512 tokens: the fused
    path's peak stays under half the fp32 logits (128 MiB): one chunk of 64
    rows (16 MiB), the weight's gradient (8 MiB), small things; the two-step
    form (torch's matmul, fusedops' cross-entropy) holds the logits and their
    gradient. Some kernels' high-water mark sees only one of the two at its
    peak (CI's machine reports about the logits' size), so the bound is three
    quarters of the logits: still above the fused bound, the measurement
    tells them apart."""
    chunk(64)
    rows, hidden, vocab = 512, 32, 65536
    x, w, _, t = make(rows, hidden, vocab, torch.float32, "cpu")
    x.requires_grad_(), w.requires_grad_()
    logits_bytes = rows * vocab * 4

    def fused():
        FF.linear_cross_entropy(x, w, t).backward()

    def two_step():
        FF.cross_entropy(x @ w.t(), t).backward()
    peaks = {}
    for fn in (fused, two_step, fused):  # fused twice: the first call warms the allocator
        x.grad = w.grad = None
        peaks[fn.__name__] = _peak_resident(fn)
    assert peaks["fused"] < logits_bytes // 2, peaks
    assert peaks["two_step"] > logits_bytes * 3 // 4, peaks


# --------------------------------------------------------------- bad input
def _bad_args(device):
    x, w, b, t = make(4, 8, 9, torch.float32, device, bias=True)
    return dict(input=x, weight=w, target=t, bias=b)


BAD = [
    (dict(weight=lambda a: a["weight"][:, :5]), r"fusedops.linear_cross_entropy: weight has shape \[9, 5\], "
     r"expected \[classes, 8\]"),
    (dict(weight=lambda a: a["weight"].half()), r"weight has dtype float16, expected the dtype of input \(float32\)"),
    (dict(bias=lambda a: a["bias"][:3]), r"bias has shape \[3\] and dtype float32, expected \[9\] and float32"),
    (dict(target=lambda a: a["target"].int()), r"target has dtype int32, expected int64"),
    (dict(target=lambda a: a["target"][:3]), r"fusedops.linear_cross_entropy: input has shape \[4, 8\] and target \[3\]"),
]


@pytest.mark.parametrize("over,match", BAD, ids=[m.split(",")[0][-30:] for _, m in BAD])
def test_bad_input(device, over, match):
    args = _bad_args(device)
    args.update({k: f(args) for k, f in over.items()})
    raises_unchanged(FF.linear_cross_entropy, args, match)


def test_bad_settings(device):
    args = _bad_args(device)
    raises_unchanged(lambda **a: FF.linear_cross_entropy(**a, label_smoothing=1.5), args,
                     r"fusedops.linear_cross_entropy: label_smoothing is 1.5, expected a number in \[0, 1\]")
    raises_unchanged(lambda **a: FF.linear_cross_entropy(**a, softcap=-1.0), args,
                     r"softcap is -1.0, expected a finite number > 0, or 0 for none")
    raises_unchanged(lambda **a: FF.linear_cross_entropy(**a, reduction="avg"), args,
                     r"reduction is 'avg', expected 'none', 'mean' or 'sum'", exc=ValueError)


def test_target_out_of_range_raises_on_cpu(chunk):
    chunk(2)
    args = _bad_args("cpu")
    args["target"][3] = 9
    raises_unchanged(FF.linear_cross_entropy, args,
                     r"fusedops.linear_xent_fwd: target\[3\] is 9, expected a class in \[0, 9\) or ignore_index \(-100\)")


@requires_cuda
def test_target_out_of_range_is_nan_on_cuda():
    """No sync to check the targets on a GPU: the loss is NaN."""
    args = _bad_args("cuda")
    args["target"][3] = 9
    assert FF.linear_cross_entropy(**args).isnan()


# --------------------------------------------------------------- Hugging Face
FAMILIES = ["Llama", "Qwen3"]


def _tiny(family, dtype, device, tie=False):
    transformers = pytest.importorskip("transformers")
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie)
    return getattr(transformers, f"{family}ForCausalLM")(cfg).to(device=device, dtype=dtype)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_loss_without_logits(device, family, dtype, tie, chunk):
    """patch(loss=True): a forward with labels gives the loss of the unpatched
    model and its gradients (every parameter's, against the unpatched model
    in float64 by the 2x rule, the unpatched one in dtype the yardstick), the
    logits None; ignored labels and num_items_in_batch as ForCausalLMLoss."""
    import copy
    chunk(7)  # 2 x 13 tokens: chunk boundaries inside the batch
    torch.manual_seed(0)
    model = _tiny(family, dtype, device, tie)
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    fusedops.patch(model, norm=False, swiglu=False, attention=False, fuse_residual=False)
    assert type(model).__name__ == f"Fused{family}ForCausalLM"
    ids = torch.randint(0, 101, (2, 13), device=device)
    ids_labels = ids.clone()
    ids_labels[0, :4] = IGNORE
    for kw in (dict(), dict(num_items_in_batch=torch.tensor(19, device=device))):
        results = []
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            out = m(input_ids=ids, labels=ids_labels, **kw)
            out.loss.backward()
            results.append((out.loss, out.logits, {n: p.grad for n, p in m.named_parameters()}))
        # float64 throughout (ForCausalLMLoss computes in fp32 whatever the
        # model's dtype): the same loss written out.
        ref64.zero_grad(set_to_none=True)
        logits64 = ref64(input_ids=ids).logits
        target = torch.nn.functional.pad(ids_labels, (0, 1), value=IGNORE)[:, 1:].reshape(-1)
        loss64 = torch.nn.functional.cross_entropy(logits64.reshape(-1, 101), target, ignore_index=IGNORE,
                                                   reduction="sum" if kw else "mean")
        loss64 = loss64 / kw["num_items_in_batch"] if kw else loss64
        loss64.backward()
        (loss, logits, g), (loss0, logits0, g0) = results
        g64 = {n: p.grad for n, p in ref64.named_parameters()}
        assert logits is None and logits0 is not None
        assert loss.dtype == loss0.dtype == torch.float32
        assert_close_2x(loss, loss64, loss0, f"{family} loss {kw}")
        assert set(g) == set(g0)
        for n in g0:
            assert_close_2x(g[n], g64[n], g0[n], f"{family} grad {n} {kw}", scale=float(g64[n].abs().max()) or 1.0)
    # Without labels: the logits, as before.
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_hf_original_forward_where_the_fused_one_does_not_apply(chunk):
    """A hook on lm_head (it must see the call), logits_to_keep, return_dict
    False: the original forward, logits and all."""
    chunk(5)
    model = fusedops.patch(_tiny("Llama", torch.float32, "cpu"))
    ids = torch.randint(0, 101, (2, 9))
    assert model(input_ids=ids, labels=ids).logits is None
    assert model(input_ids=ids, labels=ids, return_dict=False)[1].shape == (2, 9, 101)
    assert model(input_ids=ids, labels=ids[:, -3:], logits_to_keep=3).logits.shape == (2, 3, 101)
    seen = []
    h = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert model(input_ids=ids, labels=ids).logits is not None and seen == [(2, 9, 101)]
    h.remove()
    fusedops.unpatch(model)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model(input_ids=ids, labels=ids).logits is not None
