"""torch.ops.fusedops.xent_fwd / xent_bwd, fusedops.functional.cross_entropy
and fusedops.hf.causal_lm_loss: the loss and the gradient of the logits
against float64 by the 2x rule (tests/tolerances.py), with outputs poisoned,
inputs unchanged; odd vocabularies, ignored targets, strided logits, every
reduction; NaN and inf as torch; bad input; opcheck and torch.compile."""
import pytest
import torch
import torch.nn.functional as TF

from fusedops import functional as FF
from conftest import assert_unchanged, maybe_poisoned, raises_unchanged, requires_cuda, snapshot
from tolerances import assert_close_2x

LOWP = [torch.float32, torch.float16, torch.bfloat16]
IGNORE = -100


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


def make(rows, vocab, dtype, device, ignored=0.2, spread=3.0, layout="dense"):
    """Logits (normals times `spread`, so that the softmax is not flat) and
    targets, a share of them IGNORE. layout: "dense", "slice" (a column slice
    of wider rows: row stride > vocab) or "transposed" (unit stride along
    rows: the op copies)."""
    base = torch.randn(rows, vocab + 5, device=device) * spread
    if layout == "slice":
        x = base.to(dtype)[:, 2:2 + vocab]
    elif layout == "transposed":
        x = base[:, :vocab].t().contiguous().to(dtype).t()
    else:
        x = base[:, :vocab].contiguous().to(dtype)
    t = torch.randint(0, vocab, (rows,), device=device)
    t[torch.rand(rows, device=device) < ignored] = IGNORE
    return x, t


def run(fn, x, t, reduction, g, to=None, poison=False, **kw):
    """[loss, dlogits] of fn(logits, target, **kw) on a fresh leaf (cast to `to`)."""
    leaf = x.detach().to(to or x.dtype).requires_grad_()
    with maybe_poisoned(x.device, poison):
        loss = fn(leaf, t, ignore_index=IGNORE, reduction=reduction, **kw)
    with maybe_poisoned(x.device, poison):
        loss.backward(g.to(loss.dtype))
    return [loss, leaf.grad]


def check(x, t, reduction, what, **kw):
    g = torch.randn(x.shape[0], device=x.device) if reduction == "none" else torch.tensor(1.7, device=x.device)
    args = dict(x=x, t=t)
    before = snapshot(args)
    got = run(FF.cross_entropy, x, t, reduction, g, poison=True, **kw)
    assert_unchanged(args, before, f"{what}: ")
    want = run(TF.cross_entropy, x, t, reduction, g, to=torch.float64, **kw)
    eager = run(TF.cross_entropy, x, t, reduction, g, **kw)
    for name, a, w, e in zip(["loss", "dlogits"], got, want, eager):
        assert a.dtype == x.dtype, f"{what} {name}: dtype {a.dtype}, expected {x.dtype}"
        assert_close_2x(a, w, e, f"{what} {name}",
                        scale=max(1.0, w.abs().max().item()) if name == "loss" else None)


SHAPES = [(1, 1), (3, 2), (7, 33), (64, 1000), (5, 32000), (9, 50257), (300, 128)]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", LOWP, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_values(device, shape, dtype, reduction):
    x, t = make(*shape, dtype, device)
    check(x, t, reduction, f"{shape} {dtype} {reduction}")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", LOWP, ids=dtype_id)
def test_label_smoothing(device, dtype, reduction):
    """Through the kernel (it mixes e / classes into every target)."""
    x, t = make(37, 1003, dtype, device)
    check(x, t, reduction, f"label smoothing {dtype} {reduction}", label_smoothing=0.15)


@pytest.mark.parametrize("layout", ["slice", "transposed"])
@pytest.mark.parametrize("dtype", LOWP, ids=dtype_id)
def test_strided_logits(device, dtype, layout):
    x, t = make(37, 1003, dtype, device, layout=layout)
    check(x, t, "mean", f"{layout} {dtype}")


def test_all_ignored_is_nan_as_torch(device):
    x, t = make(4, 10, torch.float32, device, ignored=1.0)
    got = FF.cross_entropy(x, t, ignore_index=IGNORE)
    want = TF.cross_entropy(x, t, ignore_index=IGNORE)
    assert got.isnan() and want.isnan()
    assert FF.cross_entropy(x, t, ignore_index=IGNORE, reduction="sum").item() == 0.0


def test_nan_and_inf_as_torch(device):
    """A NaN logit makes its row's loss NaN; -inf logits (masked classes) are
    classes of probability 0 and change nothing else; a +inf logit makes the
    row's loss NaN, as torch's (its log_softmax subtracts an infinite max)."""
    x, t = make(6, 50, torch.float32, device, ignored=0.0)
    x[1, 7] = float("nan")
    x[2, :10] = float("-inf")
    t[2] = 20
    x[3, 5] = float("inf")   # +inf elsewhere than the target: NaN, as torch's
    x[4, 9] = float("inf")   # and at the target
    t[4] = 9
    got = FF.cross_entropy(x, t, reduction="none")
    want = TF.cross_entropy(x.double(), t, reduction="none")
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    assert torch.equal(got.isinf(), want.isinf()), (got, want)
    ok = want.isfinite()
    torch.testing.assert_close(got[ok].double(), want[ok], rtol=1e-5, atol=1e-5)


def test_target_out_of_range_raises_on_cpu():
    x, t = make(5, 10, torch.float32, "cpu", ignored=0.0)
    t[3] = 10
    raises_unchanged(lambda x, t: torch.ops.fusedops.xent_fwd(x, t, IGNORE), dict(x=x, t=t),
                     r"fusedops.xent_fwd: target\[3\] is 10, expected a class in \[0, 10\) or ignore_index \(-100\)")
    t[3] = -1
    raises_unchanged(lambda x, t: FF.cross_entropy(x, t), dict(x=x, t=t), r"target\[3\] is -1")


@requires_cuda
def test_target_out_of_range_is_nan_on_cuda():
    """No sync to check the targets on a GPU: that row's loss is NaN (and so
    is the mean), the other rows are right."""
    x, t = make(5, 10, torch.bfloat16, "cuda", ignored=0.0)
    t[3] = 10
    loss, _, _ = torch.ops.fusedops.xent_fwd(x, t, IGNORE)
    assert loss[3].isnan() and not loss[[0, 1, 2, 4]].isnan().any()
    assert FF.cross_entropy(x, t).isnan()


def _bad(device):
    x, t = make(4, 9, torch.float32, device)
    return dict(logits=x, target=t, ignore_index=IGNORE)


BAD = [
    (dict(logits=lambda a: a["logits"][None]), r"fusedops.xent_fwd: logits has shape \[1, 4, 9\], expected \[rows, classes\]"),
    (dict(logits=lambda a: a["logits"][:, :0]), r"logits has shape \[4, 0\], expected at least one class"),
    (dict(logits=lambda a: a["logits"].double()), r"logits has dtype float64, expected float32, float16 or bfloat16"),
    (dict(target=lambda a: a["target"].int()), r"target has dtype int32, expected int64"),
    (dict(target=lambda a: a["target"][:3]), r"target has shape \[3\], expected \[4\]"),
]


@pytest.mark.parametrize("over,match", BAD, ids=[m.split(",")[0][:40] for _, m in BAD])
def test_bad_input(device, over, match):
    args = _bad(device)
    args.update({k: f(args) for k, f in over.items()})
    raises_unchanged(torch.ops.fusedops.xent_fwd, args, match)


def test_bad_reduction(device):
    args = _bad(device)
    args["reduction"] = "avg"
    raises_unchanged(torch.ops.fusedops.xent_fwd, args,
                     r"fusedops.xent_fwd: reduction is 'avg', expected 'none', 'mean' or 'sum'")


def test_bad_input_bwd(device):
    x, t = make(4, 9, torch.float32, device)
    loss, lse, _ = torch.ops.fusedops.xent_fwd(x, t, IGNORE)
    raises_unchanged(torch.ops.fusedops.xent_bwd, dict(dloss=loss[:3], logits=x, target=t, lse=lse,
                                                       ignore_index=IGNORE),
                     r"fusedops.xent_bwd: dloss has shape \[3\], expected \[4\] \(a value a row of logits\) "
                     r"or \[\] \(the gradient of a mean or sum\)")
    raises_unchanged(torch.ops.fusedops.xent_bwd, dict(dloss=loss, logits=x, target=t, lse=lse,
                                                       ignore_index=IGNORE, count=lse[:1]),
                     r"fusedops.xent_bwd: count has dtype float32 and shape \[1\], expected a float32 \[\]")
    raises_unchanged(torch.ops.fusedops.xent_bwd, dict(dloss=loss.half(), logits=x, target=t, lse=lse,
                                                       ignore_index=IGNORE),
                     r"fusedops.xent_bwd: dloss has dtype float16, expected float32")
    raises_unchanged(torch.ops.fusedops.xent_bwd, dict(dloss=loss, logits=x, target=t, lse=lse[:2],
                                                       ignore_index=IGNORE),
                     r"fusedops.xent_bwd: lse has shape \[2\], expected \[4\]")


def test_double_backward_raises(device):
    x, t = make(4, 9, torch.float32, device)
    x.requires_grad_()
    (gx,) = torch.autograd.grad(FF.cross_entropy(x, t), x, create_graph=True)
    with pytest.raises(RuntimeError, match="fusedops.xent_bwd: double backward is not supported"):
        gx.sum().backward()


def test_falls_back_to_torch(device):
    x, t = make(4, 9, torch.float32, device)
    w = torch.rand(9, device=device)
    with pytest.warns(UserWarning, match="class weights"):
        got = FF.cross_entropy(x, t, weight=w)
    torch.testing.assert_close(got, TF.cross_entropy(x, t, weight=w))
    x3 = x.reshape(2, 2, 9).transpose(1, 2)  # (N, C, d) as torch takes it
    torch.testing.assert_close(FF.cross_entropy(x3, t.reshape(2, 2)), TF.cross_entropy(x3, t.reshape(2, 2)))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_opcheck(device, dtype, reduction):
    x, t = make(6, 40, dtype, device)
    torch.library.opcheck(torch.ops.fusedops.xent_fwd.default, (x.requires_grad_(), t, IGNORE, 0.0, 0.0, reduction))
    loss, lse, count = torch.ops.fusedops.xent_fwd(x.detach(), t, IGNORE, 0.0, 0.0, reduction)
    torch.library.opcheck(torch.ops.fusedops.xent_bwd.default,
                          (torch.randn_like(loss), x.detach(), t, lse, IGNORE, 0.0, 0.0,
                           count if reduction == "mean" else None))


@pytest.mark.parametrize("ignored", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("rows", [0, 1, 37, 2500])
def test_kernel_reduction(device, rows, reduction, ignored):
    """The op's own reduction (cross_entropy's only op): the loss a 0-d
    tensor, count the rows not ignored, and the gradient through the op's
    autograd against float64 by the 2x rule, ignored rows and all rows
    ignored (a mean of nothing is NaN, as torch's) included."""
    x, t = make(rows, 301, torch.bfloat16, device, ignored=ignored)
    g = torch.tensor(1.3, device=device)
    got = []
    for xs in (x, x.float(), x.double()):  # the op (bf16), eager torch (bf16: its error), float64
        leaf = xs.detach().requires_grad_()
        if xs is x:
            loss, lse, count = torch.ops.fusedops.xent_fwd(leaf, t, IGNORE, 0.0, 0.0, reduction)
            assert loss.shape == () and count.shape == () and lse.shape == (rows,)
            assert count.item() == (t != IGNORE).sum().item()
        else:
            loss = TF.cross_entropy(leaf if xs.dtype == torch.float64 else leaf.bfloat16(), t,
                                    ignore_index=IGNORE, reduction=reduction)
        loss.backward(g.to(loss.dtype))
        got.append((loss, leaf.grad))
    (loss, grad), (e_loss, e_grad), (w_loss, w_grad) = got
    if rows == 0 or ignored == 1.0:
        assert loss.isnan().item() == (reduction == "mean") and w_loss.isnan().item() == (reduction == "mean")
        if reduction == "sum":
            assert loss.item() == 0.0
        if rows:
            assert not grad.any()
        return
    assert_close_2x(loss, w_loss, e_loss.float(), f"{rows} {reduction} loss", scale=max(1.0, w_loss.abs().item()))
    assert_close_2x(grad, w_grad, e_grad.to(grad.dtype), f"{rows} {reduction} dlogits")


def test_torch_compile(device):
    x, t = make(16, 300, torch.float32, device)
    fn = torch.compile(FF.cross_entropy, backend="aot_eager", fullgraph=True)
    g = torch.tensor(1.0, device=device)
    got = run(fn, x, t, "mean", g)
    want = run(FF.cross_entropy, x, t, "mean", g)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# --------------------------------------------------------------- Hugging Face
def test_hf_causal_lm_loss_matches_transformers(device):
    pytest.importorskip("transformers")
    from transformers.loss.loss_utils import ForCausalLMLoss
    from fusedops.hf import causal_lm_loss
    V = 77
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(3, 11, V, device=device) * 3).to(dtype)
        labels = torch.randint(0, V, (3, 11), device=device)
        labels[0, :4] = IGNORE
        for kw in (dict(), dict(num_items_in_batch=torch.tensor(17, device=device))):
            outs = []
            for fn in (causal_lm_loss, ForCausalLMLoss):
                leaf = logits.detach().requires_grad_()
                loss = fn(leaf, labels, V, **kw)
                loss.backward()
                outs.append((loss, leaf.grad))
            (l1, g1), (l2, g2) = outs
            assert l1.dtype == l2.dtype == torch.float32
            torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(g1.float(), g2.float(), rtol=0.02 if dtype != torch.float32 else 1e-5,
                                       atol=1e-3 if dtype != torch.float32 else 1e-6)


def test_hf_patch_sets_and_unpatch_restores_the_loss():
    pytest.importorskip("transformers")
    import fusedops
    from fusedops.hf import causal_lm_loss
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    original = model.loss_function
    ids = torch.randint(0, 61, (2, 9))
    want = model(input_ids=ids, labels=ids).loss
    fusedops.patch(model, norm=False, swiglu=False, attention=False, fuse_residual=False)
    assert model.loss_function is causal_lm_loss
    assert "loss of the model: ForCausalLMLoss -> fusedops.hf.causal_lm_loss" in str(model.fusedops_report)
    # the head alone: the base model inside it (model.model) computes no loss
    assert model.fusedops_report.loss == [("", "ForCausalLMLoss", "fusedops.hf.causal_lm_loss")]
    got = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    fusedops.unpatch(model)
    assert model.loss_function is original and "_loss_function" not in model.__dict__
    fusedops.patch(model, loss=False)
    assert model.loss_function is original
