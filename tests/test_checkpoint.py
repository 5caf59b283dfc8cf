"""Activation checkpointing on a patched model: the recomputed layers must save
what the forward saved, so that the gradients are those of the run without
checkpointing.

Ways of checkpointing, each per decoder layer:
  torch   torch.utils.checkpoint, non-reentrant (examples/train.py --checkpoint,
          torchtitan, FSDP's checkpoint wrapper)
  hf      transformers' own (gradient_checkpointing_enable)
  sac     selective: torch.utils.checkpoint with a policy that saves the
          matmuls' outputs and recomputes the rest; the matmul outputs come
          back from the policy's cache in the recomputation, so an op that
          writes one in place (RoPE in qkv_attention) would change them

Tolerances: in fp32 the checkpointed patched run computes what the
uncheckpointed one does, op for op, so its gradients must be equal. In bf16
the layers hand the residual stream on in another order when checkpointed
(the next norm is not fused into the layer's last add, patch.can_hand_on), so
both are held to the 2x rule against the unpatched model in float64, with the
unpatched bf16 run as the yardstick (tests/tolerances.py).
"""
import copy
import functools
import warnings

import pytest
import torch

import fusedops
from fusedops import functional as F
from tolerances import assert_close_2x

WAYS = ["torch", "hf", "sac"]


def _sac_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    saved = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def _checkpointed(f, *args, selective=False, **kwargs):
    from torch.utils.checkpoint import checkpoint
    if selective:
        return checkpoint(f, *args, use_reentrant=False, context_fn=_sac_context, **kwargs)
    return checkpoint(f, *args, use_reentrant=False, **kwargs)


def _model(family, layers=3):
    transformers = pytest.importorskip("transformers")
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=96, hidden_size=64, intermediate_size=88, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False)
    return getattr(transformers, f"{family}ForCausalLM")(cfg)


def _checkpoint_layers(model, way):
    model.train()
    if way == "hf":
        with warnings.catch_warnings():  # (transformers 5 deprecates the name: a FutureWarning)
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    for layer in model.model.layers:
        layer.forward = functools.partial(_checkpointed, layer.forward, selective=way == "sac")


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids, use_cache=False).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("family", ["Llama", "Qwen3"])  # Qwen3: q / k norms, the unjoined attention
def test_checkpointed_patched_gradients(family, way, dtype):
    torch.manual_seed(0)
    base = _model(family)
    ids = torch.randint(0, 96, (2, 19))
    ref64 = _grads(copy.deepcopy(base).double().train(), ids)
    eager = _grads(copy.deepcopy(base).to(dtype).train(), ids)
    plain = fusedops.patch(copy.deepcopy(base).to(dtype)).train()
    want = _grads(plain, ids)
    ckpt = fusedops.patch(copy.deepcopy(base).to(dtype))
    _checkpoint_layers(ckpt, way)
    got = _grads(ckpt, ids)
    assert got.keys() == want.keys()
    for n in want:
        if dtype == torch.float32:
            assert torch.equal(got[n], want[n]), (
                f"{n}: checkpointed ({way}) differs from the uncheckpointed run by "
                f"{(got[n] - want[n]).abs().max().item():.3g}")
        else:
            assert_close_2x(want[n], ref64[n], eager[n], f"{n} (not checkpointed)")
            assert_close_2x(got[n], ref64[n], eager[n], f"{n} (checkpointed, {way})")


@pytest.mark.parametrize("selective", [False, True], ids=["full", "sac"])
def test_qkv_attention_recomputed(selective):
    """qkv_attention recomputed under checkpointing, the matmul outputs kept by
    selective checkpointing among them: its rotary embedding, applied in place
    in the packed q / k / v tensor, must not rotate a kept matmul output a
    second time (it did: gradients 2e-3 off in a 2-layer Llama)."""
    torch.manual_seed(0)
    b, s, hidden, hq, hkv, d = 2, 13, 48, 4, 2, 12
    x = torch.randn(b, s, hidden, requires_grad=True)
    ws = [(torch.randn(h * d, hidden) / hidden ** 0.5).requires_grad_() for h in (hq, hkv, hkv)]
    pos = torch.arange(s, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(d // 2) / (d // 2))
    cos, sin = torch.cat([pos.cos()] * 2, -1)[None], torch.cat([pos.sin()] * 2, -1)[None]
    dout = torch.randn(b, s, hq * d)

    def f(x, *ws):
        return F.qkv_attention(x, *ws, cos, sin, hq, hkv)

    def grads(run):
        for t in (x, *ws):
            t.grad = None
        out = run(x, *ws)
        out.backward(dout)
        return out.detach(), [t.grad.clone() for t in (x, *ws)]
    out0, g0 = grads(f)
    out1, g1 = grads(functools.partial(_checkpointed, f, selective=selective))
    assert torch.equal(out1, out0)
    for name, a, e in zip(("x", "q_weight", "k_weight", "v_weight"), g1, g0):
        assert torch.equal(a, e), f"{name}: off by {(a - e).abs().max().item():.3g}"


def test_checkpoint_memory_tool():
    """tools/ci/checkpoint_memory.py (the figures in docs/distributed.md) measures on the
    CPU: checkpointing keeps less after the forward, and peaks lower."""
    pytest.importorskip("transformers")
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "tools" / "ci" / "checkpoint_memory.py"
    spec = importlib.util.spec_from_file_location("checkpoint_memory", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    rows = tool.main(["--device", "cpu", "--preset", "tiny", "--runs", "fusedops"])
    (_, off, kept_off, peak_off), (_, on, kept_on, peak_on) = rows
    assert not off and on
    assert 0 < kept_on < kept_off / 2 and 0 < peak_on < peak_off, rows
