"""The ops that write an argument in place (every schema of csrc/library.cpp
with a `(a!)` argument) refuse, before writing anything, a written argument
whose elements overlap (stride 0, as expand() gives) and a written argument
that shares memory with another argument (csrc/common/shim.h,
check_no_aliasing); views of one buffer that never meet (the q and k heads of
a packed q/k/v projection) are accepted.

Each written argument of each op has a case below; test_every_written_argument_has_cases
fails when an op gains a written argument (or a new op writes one) without."""
import pytest
import torch

from conftest import raises_unchanged, randn

ops = torch.ops.fusedops
SHARE = r"share memory, expected separate tensors"
OVERLAP = r"whose elements overlap \(a stride of 0, as expand\(\) gives, or strides that overlap\)"


def written_arguments():
    """{op: [names of its written arguments]} from the registered schemas."""
    out = {}
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("fusedops::"):
            continue
        schema = getattr(ops, name.split("::")[1]).default._schema
        written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        if written:
            out[name.split("::")[1]] = written
    return out


# --------------------------------------------------------------------------- rope_

def rope_args(device, hq=4, hk=2):
    q = randn((2, hq, 5, 8), torch.float32, device)
    k = randn((2, hk, 5, 8), torch.float32, device)
    cos, sin = randn((2, 5, 8), torch.float32, device), randn((2, 5, 8), torch.float32, device)
    return dict(q=q, k=k, cos=cos, sin=sin)


def rope_packed(device, hq, hk, k_from):
    """q and k as [B, H, S, D] views of one packed [B, S, heads, D] tensor: q
    its first hq heads, k hk heads from head k_from."""
    qkv = randn((2, 5, hq + 2 * hk, 8), torch.float32, device)
    return qkv, qkv[:, :, :hq].transpose(1, 2), qkv[:, :, k_from:k_from + hk].transpose(1, 2)


def _rope_q_is_k(a, d):
    return dict(k=a["q"][:, :2])


def _rope_k_expanded(a, d):
    return dict(k=a["k"][:, :1].expand(2, 2, 5, 8))


def _rope_q_expanded(a, d):
    return dict(q=a["q"][:1].expand(2, 4, 5, 8))


def _rope_q_over_cos(a, d):
    return dict(cos=a["q"][:, 0])


def _rope_k_over_sin(a, d):
    return dict(sin=a["k"][:, 1])


def _rope_k_meets_q_heads(a, d):
    _, q, k = rope_packed(d, 4, 2, 3)  # k's first head is q's last
    return dict(q=q, k=k)


# --------------------------------------------------------------------------- glu_bwd_ / glu_packed_bwd_

def glu_args(device):
    return dict(dout=randn((3, 16), torch.float32, device), gate=randn((3, 16), torch.float32, device),
                up=randn((3, 16), torch.float32, device), activation="silu")


def _rows_of_one(device, shift):
    """Two [3, 16] tensors cut from one buffer, the second `shift` elements on."""
    buf = randn((48 + shift,), torch.float32, device)
    return buf[:48].view(3, 16), buf[shift:].view(3, 16)


def glu_packed_args(device):
    return dict(dout=randn((3, 16), torch.float32, device), gate_up=randn((3, 32), torch.float32, device),
                activation="silu")


# --------------------------------------------------------------------------- adam_step

def adam_args(device, dtype=torch.float32, amsgrad=False, master=False):
    shapes = [(4,), (3, 2)]
    state = torch.float32 if master else dtype
    params = [randn(s, dtype, device) for s in shapes]
    return dict(params=params, grads=[randn(s, dtype, device) for s in shapes],
                exp_avgs=[randn(s, state, device).abs() for s in shapes],
                exp_avg_sqs=[randn(s, state, device).abs() for s in shapes],
                max_exp_avg_sqs=[randn(s, state, device).abs() for s in shapes] if amsgrad else [],
                master_params=[p.float() for p in params] if master else [],
                steps=[torch.ones((), device=device) for _ in shapes], lr=0.01, beta1=0.9, beta2=0.999,
                eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True, amsgrad=amsgrad, maximize=False)


def _item(key, i, fn):
    def over(a, d):
        lst = list(a[key])
        lst[i] = fn(a, d)
        return {key: lst}
    return over


def _two(key, fn):  # fn(a, d) -> (first, second) for key[0], key[1]
    def over(a, d):
        return {key: list(fn(a, d))}
    return over


def _buffer_views(d, dtype=torch.float32):
    """Two params cut from one buffer, overlapping by two elements."""
    buf = randn((8,), dtype, d)
    return buf[:4], buf[2:8].view(3, 2)


def xent_args(device):
    return dict(logits=randn((4, 9), torch.float32, device), target=torch.randint(0, 9, (4,), device=device),
                dloss=torch.rand(4, device=device), ignore_index=-100, label_smoothing=0.0, softcap=0.0)


def linear_xent_scale_args(device):
    return dict(grad=randn((4, 9), torch.float32, device), dloss=torch.full((), 2.0, device=device))


OP = {name: rf"fusedops\.{name}: " for name in ("rope_", "glu_bwd_", "glu_packed_bwd_", "adam_step", "xent_fwd_bwd_",
                                                 "linear_xent_scale_")}

# (op, written argument, what, args(device), override(args, device), message)
CASES = [
    ("rope_", "q", "q_passed_as_k", rope_args, _rope_q_is_k,
     OP["rope_"] + r"q and k " + SHARE + r" \(q is written in place; q has shape \[2, 4, 5, 8\] and strides "
     r"\[160, 40, 8, 1\], k shape \[2, 2, 5, 8\] and strides \[160, 40, 8, 1\]\)"),
    ("rope_", "q", "expanded", rope_args, _rope_q_expanded,
     OP["rope_"] + r"q has shape \[2, 4, 5, 8\] and strides \[0, 40, 8, 1\], " + OVERLAP),
    ("rope_", "q", "over_cos", rope_args, _rope_q_over_cos, OP["rope_"] + r"q and cos " + SHARE),
    ("rope_", "k", "expanded", rope_args, _rope_k_expanded,
     OP["rope_"] + r"k has shape \[2, 2, 5, 8\] and strides \[80, 0, 8, 1\], " + OVERLAP),
    ("rope_", "k", "over_sin", rope_args, _rope_k_over_sin, OP["rope_"] + r"k and sin " + SHARE),
    ("rope_", "k", "meets_q_heads", rope_args, _rope_k_meets_q_heads,
     OP["rope_"] + r"q and k " + SHARE),
    ("glu_bwd_", "dout", "is_gate", glu_args, lambda a, d: dict(dout=a["gate"]),
     OP["glu_bwd_"] + r"dout and gate " + SHARE),
    ("glu_bwd_", "gate", "overlaps_up", glu_args, lambda a, d: dict(zip(("gate", "up"), _rows_of_one(d, 16))),
     OP["glu_bwd_"] + r"gate and up " + SHARE),
    ("glu_bwd_", "up", "expanded", glu_args, lambda a, d: dict(up=a["up"][:1].expand(3, 16)),
     OP["glu_bwd_"] + r"up is not contiguous"),
    ("glu_bwd_", "up", "over_dout", glu_args, lambda a, d: dict(zip(("dout", "up"), _rows_of_one(d, 24))),
     OP["glu_bwd_"] + r"dout and up " + SHARE),
    ("glu_packed_bwd_", "dout", "in_gate_up", glu_packed_args,
     lambda a, d: dict(dout=a["gate_up"].view(-1)[:48].view(3, 16)),
     OP["glu_packed_bwd_"] + r"dout and gate_up " + SHARE),
    ("glu_packed_bwd_", "gate_up", "expanded", glu_packed_args,
     lambda a, d: dict(gate_up=a["gate_up"][:1].expand(3, 32)), OP["glu_packed_bwd_"] + r"gate_up is not contiguous"),
    ("xent_fwd_bwd_", "logits", "expanded", xent_args, lambda a, d: dict(logits=a["logits"][:1].expand(4, 9)),
     OP["xent_fwd_bwd_"] + r"logits has shape \[4, 9\] and strides \[0, 1\], " + OVERLAP),
    ("xent_fwd_bwd_", "logits", "over_dloss", xent_args, lambda a, d: dict(dloss=a["logits"].view(-1)[5:9]),
     OP["xent_fwd_bwd_"] + r"logits and dloss " + SHARE),
    ("linear_xent_scale_", "grad", "expanded", linear_xent_scale_args,
     lambda a, d: dict(grad=a["grad"][:1].expand(4, 9)), OP["linear_xent_scale_"] + r"grad has strides \[0, 1\]"),
    ("linear_xent_scale_", "grad", "holds_dloss", linear_xent_scale_args,
     lambda a, d: dict(dloss=a["grad"].view(-1)[3]), OP["linear_xent_scale_"] + r"grad and dloss " + SHARE),
    ("adam_step", "params", "is_its_exp_avg", adam_args, lambda a, d: dict(exp_avgs=[a["exp_avgs"][0], a["params"][1]]),
     OP["adam_step"] + r"params\[1\] and exp_avgs\[1\] " + SHARE + r" \(params\[1\] is written in place"),
    ("adam_step", "params", "overlap_each_other", adam_args, _two("params", lambda a, d: _buffer_views(d)),
     OP["adam_step"] + r"params\[0\] and params\[1\] " + SHARE + r" \(params\[0\] is written in place; params\[0\] "
     r"has shape \[4\] and strides \[1\], params\[1\] shape \[3, 2\] and strides \[2, 1\]\)"),
    ("adam_step", "params", "expanded", adam_args, _item("params", 0, lambda a, d: torch.zeros(1, device=d).expand(4)),
     OP["adam_step"] + r"params\[0\] has shape \[4\] and strides that overlap or leave gaps"),
    ("adam_step", "params", "grad_shifted", adam_args,
     lambda a, d: (lambda buf: dict(params=[buf[:4], a["params"][1]], grads=[buf[1:5], a["grads"][1]]))(
         randn((5,), torch.float32, d)),
     OP["adam_step"] + r"params\[0\] and grads\[0\] " + SHARE),
    ("adam_step", "exp_avgs", "is_exp_avg_sq", adam_args,
     lambda a, d: dict(exp_avg_sqs=[a["exp_avgs"][0], a["exp_avg_sqs"][1]]),
     OP["adam_step"] + r"exp_avgs\[0\] and exp_avg_sqs\[0\] " + SHARE),
    ("adam_step", "exp_avg_sqs", "is_other_grad", adam_args,
     lambda a, d: dict(exp_avg_sqs=[a["exp_avg_sqs"][0], a["grads"][1]]),
     OP["adam_step"] + r"grads\[1\] and exp_avg_sqs\[1\] " + SHARE + r" \(exp_avg_sqs\[1\] is written"),
    ("adam_step", "max_exp_avg_sqs", "is_exp_avg_sq", lambda d: adam_args(d, amsgrad=True),
     lambda a, d: dict(max_exp_avg_sqs=[a["max_exp_avg_sqs"][0], a["exp_avg_sqs"][1]]),
     OP["adam_step"] + r"exp_avg_sqs\[1\] and max_exp_avg_sqs\[1\] " + SHARE),
    ("adam_step", "master_params", "is_exp_avg", lambda d: adam_args(d, torch.bfloat16, master=True),
     lambda a, d: dict(master_params=[a["exp_avgs"][0], a["master_params"][1]]),
     OP["adam_step"] + r"exp_avgs\[0\] and master_params\[0\] " + SHARE),
    ("adam_step", "steps", "shared", adam_args, _two("steps", lambda a, d: (a["steps"][0], a["steps"][0])),
     OP["adam_step"] + r"steps\[0\] and steps\[1\] " + SHARE),
    ("adam_step", "steps", "is_lr_tensor", adam_args, lambda a, d: dict(lr_tensor=a["steps"][1]),
     OP["adam_step"] + r"steps\[1\] and lr_tensor " + SHARE + r" \(steps\[1\] is written"),
    ("adam_step", "steps", "is_found_inf", adam_args, lambda a, d: dict(found_inf=a["steps"][0]),
     OP["adam_step"] + r"steps\[0\] and found_inf " + SHARE),
]


@pytest.mark.parametrize("op,arg,what,make,over,match", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_aliasing_refused(device, op, arg, what, make, over, match):
    args = make(device)
    args.update(over(args, device))
    raises_unchanged(getattr(ops, op), args, match)


def test_every_written_argument_has_cases():
    want = {(op, arg) for op, args in written_arguments().items() for arg in args}
    have = {(c[0], c[1]) for c in CASES}
    assert want == have, f"written arguments without a case: {sorted(want - have)}; cases of none: {sorted(have - want)}"


# --------------------------------------------------------------------------- what still passes

@pytest.mark.parametrize("hq,hk", [(4, 2), (8, 1), (2, 2)])
def test_rope_on_packed_heads(device, hq, hk):
    """q and k heads of one packed projection (GQA: k's heads much fewer than
    q's) interleave in memory without meeting: rotated in place as rope does."""
    qkv, q, k = rope_packed(device, hq, hk, hq)
    cos, sin = randn((2, 5, 8), torch.float32, device), randn((2, 5, 8), torch.float32, device)
    want = ops.rope(q, k, cos, sin)
    v = qkv[:, :, hq + hk:].clone()
    ops.rope_(q, k, cos, sin)
    assert torch.equal(q, want[0]) and torch.equal(k, want[1])
    assert torch.equal(qkv[:, :, hq + hk:], v), "v's heads were written"


def test_rope_on_packed_heads_of_a_long_sequence(device):
    """The search over the strides stays short however long the sequence."""
    qkv = randn((1, 70000, 6, 2), torch.float32, device)
    q, k = qkv[:, :, :4].transpose(1, 2), qkv[:, :, 4:5].transpose(1, 2)
    cos, sin = randn((1, 70000, 2), torch.float32, device), randn((1, 70000, 2), torch.float32, device)
    want = ops.rope(q, k, cos, sin)
    ops.rope_(q, k, cos, sin)
    assert torch.equal(q, want[0]) and torch.equal(k, want[1])


def test_rope_tables_may_share_memory(device):
    """cos and sin are only read: one tensor may be both (and a read-only
    broadcast table may be expanded)."""
    a = rope_args(device)
    t = a["cos"][:1].expand(2, 5, 8)
    want = ops.rope(a["q"], a["k"], t, t)
    ops.rope_(a["q"], a["k"], t, t)
    assert torch.equal(a["q"], want[0]) and torch.equal(a["k"], want[1])


def test_adam_steps_as_views_of_one_tensor(device):
    """Step counts as elements of one tensor, and params cut from one buffer
    without overlapping, are separate memory: the step runs."""
    a = adam_args(device)
    steps = torch.ones(2, device=device)
    buf = randn((10,), torch.float32, device)
    a.update(steps=list(steps.unbind()), params=[buf[:4], buf[4:].view(3, 2)])
    a.update(grads=[a["grads"][0], a["grads"][0].new_ones(3, 2)], lr_tensor=None)
    ops.adam_step(**a)
    assert torch.equal(steps, torch.full((2,), 2.0, device=device))


def test_adam_reads_may_share_memory(device):
    """grads, lr_tensor, grad_scale and found_inf are only read: they may share
    memory with each other."""
    a = adam_args(device)
    g = randn((6,), torch.float32, device)
    one = torch.ones((), device=device)
    a.update(grads=[g[:4], g.view(3, 2)], lr_tensor=one, grad_scale=one)
    ops.adam_step(**a)
