"""Tests of flash attention (csrc/attention): torch.ops.fusedops.attn_fwd /
attn_bwd, fusedops.functional.flash_attention and the drop-in
fusedops.functional.scaled_dot_product_attention.

Outputs, logsumexp and the three gradients are checked against
fusedops.reference.attention run in float64 by the 2x rule (tests/tolerances.py),
with the same reference run in the inputs' low precision as the yardstick.
CUDA cases run where a GPU is present and the CUDA kernels cover them."""
import itertools
import warnings
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F

from fusedops import functional as FF, reference
from conftest import CPU_LEVEL, cpu_level, poisoned, randn, requires_cuda
from tolerances import assert_close_2x

ops = torch.ops.fusedops
LOWP = [torch.float32, torch.float16, torch.bfloat16]
NAN = float("nan")


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- cases

@dataclass(frozen=True)
class Case:
    """One configuration: q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D).

    layout: how the inputs (and the upstream gradient) are laid out in memory:
    "bshd" contiguous; "bhsd" transposed views of (B, H, S, D) tensors (read in
    place); "packed" q, k, v slices of one (B, S, 3, H, D) tensor (read in place;
    needs Sq == Sk, Hq == Hkv); "lastdim" head_dim not unit-stride (copied); "oddstride"
    rows an odd number of elements apart."""
    B: int = 2
    Sq: int = 129
    Sk: int = 129
    Hq: int = 4
    Hkv: int = 2
    D: int = 64
    causal: bool = False
    dtype: torch.dtype = torch.bfloat16
    layout: str = "bshd"
    scale: float = None

    def __str__(self):
        return (f"B{self.B}-S{self.Sq}x{self.Sk}-H{self.Hq}x{self.Hkv}-D{self.D}-"
                f"{'causal' if self.causal else 'full'}-{dtype_id(self.dtype)}-{self.layout}"
                + ("" if self.scale is None else f"-scale{self.scale}"))


def ids(cases):
    return [str(c) for c in cases]


def make_tensor(shape, dtype, device, layout):
    """A random (B, S, H, D) tensor laid out as `layout`; padding that a
    misreading kernel could pick up is NaN."""
    B, S, H, D = shape
    if layout == "bshd":
        return randn(shape, dtype, device)
    if layout == "bhsd":
        return randn((B, H, S, D), dtype, device).transpose(1, 2)
    if layout == "lastdim":
        return randn((B, S, H, D), dtype, device).transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "padded":  # a slice of a wider head_dim, rows not one tensor apart
        wide = torch.full((B, S, H, D + 8), NAN, dtype=dtype, device=device)
        wide[..., 3:3 + D] = randn(shape, dtype, device)
        return wide[..., 3:3 + D]
    if layout == "oddstride":  # rows an odd number of elements apart: bf16 pairs straddle 4-byte words
        flat = torch.full((B, S, H * D + 1), NAN, dtype=dtype, device=device)
        flat[..., :H * D] = randn((B, S, H * D), dtype, device)
        return flat[..., :H * D].unflatten(-1, (H, D))
    raise ValueError(layout)


def make_inputs(c, device):
    """q, k, v and the upstream gradient dout, laid out as c.layout."""
    if c.layout == "packed":
        assert c.Sq == c.Sk and c.Hq == c.Hkv
        qkv = randn((c.B, c.Sq, 3, c.Hq, c.D), c.dtype, device)
        q, k, v = qkv.unbind(2)
        return q, k, v, make_tensor((c.B, c.Sq, c.Hq, c.D), c.dtype, device, "padded")
    q = make_tensor((c.B, c.Sq, c.Hq, c.D), c.dtype, device, c.layout)
    k = make_tensor((c.B, c.Sk, c.Hkv, c.D), c.dtype, device, c.layout)
    v = make_tensor((c.B, c.Sk, c.Hkv, c.D), c.dtype, device, c.layout)
    dout = make_tensor((c.B, c.Sq, c.Hq, c.D), c.dtype, device, c.layout)
    return q, k, v, dout


def skip_unless_supported(c, device, backward=True):
    """Skip a case the device's kernels do not take. backward=False: the forward
    is enough; returns whether the backward is there too (on CUDA the forward
    kernels come first)."""
    if device == "cpu":
        return True
    gap = FF._cuda_gap(c.dtype, c.D, needs_grad=False)
    if gap is not None:
        pytest.skip(gap)
    has_bwd = FF._cuda_gap(c.dtype, c.D, needs_grad=True) is None
    if backward and not has_bwd:
        pytest.skip("no CUDA attention backward kernel in this build")
    return has_bwd


def run(impl, c, q, k, v, dout, to=None, backward=True, **kw):
    """impl's out, lse and gradients dq, dk, dv on fresh leaves made from q, k, v
    (cast to `to` if given). impl: "fused" (the op, through autograd) or
    "reference" (fusedops.reference.attention). backward=False: out and lse only."""
    leaves = [t.detach().to(to or t.dtype).requires_grad_(backward) for t in (q, k, v)]
    if impl == "fused":
        scale = c.D ** -0.5 if c.scale is None else c.scale
        out, lse = ops.attn_fwd(*leaves, scale, c.causal, kw.get("deterministic", False))
    else:
        out, lse = reference.attention(*leaves, c.causal, c.scale, return_lse=True)
    if not backward:
        return {"out": out, "lse": lse}
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return dict(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)))


def check(c, q, k, v, dout, got):
    backward = "dq" in got
    ref = run("reference", c, q, k, v, dout, to=torch.float64, backward=backward)
    eager = run("reference", c, q, k, v, dout, backward=backward)
    eager["lse"] = eager["lse"].float()  # the op returns fp32 lse whatever the dtype
    for name, t in got.items():
        assert t.shape == ref[name].shape, f"{c} {name}: shape {tuple(t.shape)}"
        assert_close_2x(t, ref[name], eager[name], f"{c} {name}")


def fused_and_check(c, device, **kw):
    backward = skip_unless_supported(c, device, backward=False)
    q, k, v, dout = make_inputs(c, device)
    got = run("fused", c, q, k, v, dout, backward=backward, **kw)
    assert got["out"].dtype == c.dtype and got["lse"].dtype == torch.float32
    assert got["lse"].shape == (c.B, c.Hq, c.Sq)
    check(c, q, k, v, dout, got)
    return got


# --------------------------------------------------------------------------- correctness

BASE = Case()
DTYPE_CASES = [replace(BASE, dtype=dt, causal=cz) for dt, cz in itertools.product(LOWP, [False, True])]
# Sequence lengths around the 64-row tiles, Sq != Sk both ways (the causal mask
# top-left: query i sees keys j <= i), one and two key tiles against many.
SEQ_CASES = [replace(BASE, Sq=sq, Sk=sk, causal=cz, dtype=dt)
             for (sq, sk), cz, dt in itertools.product(
                 [(1, 1), (17, 17), (1, 129), (129, 1), (17, 129), (129, 17), (64, 65), (200, 63)],
                 [False, True], [torch.float32, torch.bfloat16])]
SEQ_CASES += [Case(B=1, Sq=1023, Sk=1023, Hq=2, Hkv=1, D=64, causal=True),
              Case(B=1, Sq=1023, Sk=1023, Hq=1, Hkv=1, D=32, causal=False, dtype=torch.float16)]
# Every head dim the CUDA kernels are to take, and odd ones (CPU).
DIM_CASES = [replace(BASE, Sq=77, Sk=77, D=d, dtype=dt, causal=cz)
             for d, dt, cz in itertools.product([32, 64, 96, 128, 256], [torch.float16, torch.bfloat16],
                                                [False, True])]
DIM_CASES += [replace(BASE, Sq=77, Sk=50, D=d, dtype=torch.float32, causal=True) for d in (1, 7, 33, 80, 200)]
GQA_CASES = [replace(BASE, Hq=hq, Hkv=hkv, causal=cz, dtype=dt)
             for (hq, hkv), cz, dt in itertools.product([(4, 4), (8, 2), (6, 1)], [False, True],
                                                        [torch.float16, torch.float32])]
LAYOUT_CASES = [replace(BASE, layout=lay, causal=cz, dtype=dt)
                for lay, cz, dt in itertools.product(["bhsd", "padded", "lastdim"], [False, True],
                                                     [torch.bfloat16, torch.float32])]
LAYOUT_CASES += [replace(BASE, Hkv=4, layout="packed", dtype=dt) for dt in LOWP]
LAYOUT_CASES += [replace(BASE, layout="oddstride", causal=cz, Sk=77) for cz in (False, True)]
# A negative scale: the H100's wgmma forward takes scale > 0 only and hands it on.
SCALE_CASES = [replace(BASE, scale=0.5, causal=True), replace(BASE, scale=0.01, dtype=torch.float16),
               replace(BASE, scale=-0.3, causal=True, D=128)]
ALL_CASES = DTYPE_CASES + SEQ_CASES + DIM_CASES + GQA_CASES + LAYOUT_CASES + SCALE_CASES


@pytest.mark.parametrize("c", ALL_CASES, ids=ids(ALL_CASES))
def test_against_reference(device, c):
    fused_and_check(c, device)


# Sizes for the GPU (too slow for the float64 reference on the CPU, which runs
# the same tiling at 1023): several key and query tiles with tails, causal
# with Sq != Sk both ways, GQA and MQA, every head dim, transposed views.
CUDA_CASES = [Case(B=1, Sq=4097, Sk=4097, Hq=2, Hkv=1, D=128, causal=True),
              Case(B=1, Sq=4097, Sk=4097, Hq=2, Hkv=2, D=64, causal=False, dtype=torch.float16),
              Case(B=1, Sq=1000, Sk=3000, Hq=4, Hkv=1, D=64, causal=True, dtype=torch.float16),
              Case(B=2, Sq=3000, Sk=1000, Hq=8, Hkv=2, D=128, causal=True, layout="bhsd"),
              Case(B=2, Sq=700, Sk=1500, Hq=6, Hkv=3, D=128, causal=False, dtype=torch.float16,
                   scale=0.2),
              Case(B=2, Sq=1500, Sk=1100, Hq=4, Hkv=1, D=32, causal=True),
              Case(B=1, Sq=1100, Sk=1500, Hq=4, Hkv=2, D=96, causal=True, dtype=torch.float16,
                   layout="bhsd"),
              Case(B=2, Sq=700, Sk=1100, Hq=4, Hkv=2, D=256, causal=True),
              Case(B=1, Sq=1500, Sk=600, Hq=3, Hkv=1, D=256, causal=False, dtype=torch.float16,
                   layout="bhsd")]


@pytest.mark.parametrize("c", CUDA_CASES, ids=ids(CUDA_CASES))
def test_against_reference_long(device, c):
    if device == "cpu":
        pytest.skip("GPU-sized case (the CPU runs the same tiling in SEQ_CASES)")
    fused_and_check(c, device)


# deterministic=True takes another CUDA path (dQ by its own kernel, no atomics):
# the same checks on a cross-section, the GPU-sized cases included.
DET_REF_CASES = [c for c in DTYPE_CASES + GQA_CASES + SEQ_CASES + DIM_CASES if c.dtype != torch.float32
                 and c.D in FF.CUDA_HEAD_DIMS] + [replace(BASE, layout="bhsd", causal=True)] + CUDA_CASES


@pytest.mark.parametrize("c", DET_REF_CASES, ids=ids(DET_REF_CASES))
def test_against_reference_deterministic(device, c):
    if device == "cpu" and c in CUDA_CASES:
        pytest.skip("GPU-sized case")
    fused_and_check(c, device, deterministic=True)


# On an H100 / H200 head dims 64 and 128 take the warp-specialised wgmma
# kernels (attention_{fwd,bwd}_wgmma_cuda.cu, TMA loads). FUSEDOPS_ATTN_WGMMA=0
# sends them to the mma.sync kernels that other GPUs run, =1 to the wgmma
# kernels before warp specialisation (which also serve the layouts a tensor
# map cannot describe): the same cases on each.
SM80_CASES = [c for c in DTYPE_CASES + SEQ_CASES + GQA_CASES + LAYOUT_CASES + CUDA_CASES
              if c.dtype != torch.float32 and c.D in (64, 128)]


@pytest.mark.parametrize("kernels", ["0", "1"], ids=["mma_sync", "wgmma_v0"])
@pytest.mark.parametrize("c", SM80_CASES, ids=ids(SM80_CASES))
def test_against_reference_kernel_choice(device, c, kernels, monkeypatch):
    if device == "cpu":
        pytest.skip("a CUDA kernel choice")
    monkeypatch.setenv("FUSEDOPS_ATTN_WGMMA", kernels)
    fused_and_check(c, device)


# On a CPU with AVX512-BF16 (level 5) the bf16 forward at head dims that are
# multiples of 32 takes its own tiles (vdpbf16ps, attention_cpu.c), which the
# cases above then check; here the same cases on the level-4 tiles.
BF16_TILE_CASES = [c for c in DTYPE_CASES + SEQ_CASES + DIM_CASES + GQA_CASES + LAYOUT_CASES
                   if c.dtype == torch.bfloat16 and c.D % 32 == 0]


@pytest.mark.skipif(CPU_LEVEL < 5, reason="no AVX512-BF16: the CPU runs the level-4 tiles everywhere")
@pytest.mark.parametrize("c", BF16_TILE_CASES, ids=ids(BF16_TILE_CASES))
def test_cpu_bf16_without_dot_tiles(c):
    with cpu_level(4):
        fused_and_check(c, "cpu")


# The fp32 tiles' products take 8 x 32 register blocks with AVX-512 (level 4
# and up), 4 x 16 ones below: the fp32 cases at each level the CPU has.
FP32_TILE_CASES = [c for c in DTYPE_CASES + SEQ_CASES + DIM_CASES + GQA_CASES + LAYOUT_CASES
                   if c.dtype == torch.float32]


@pytest.mark.parametrize("level", [lv for lv in (0, 3, 4) if lv <= CPU_LEVEL])
@pytest.mark.parametrize("c", FP32_TILE_CASES, ids=ids(FP32_TILE_CASES))
def test_cpu_fp32_tiles_each_level(c, level):
    with cpu_level(level):
        fused_and_check(c, "cpu")


# On an Intel CPU with AMX (level 6) the bf16 tiles' products run on AMX tiles
# (csrc/common/cpu_amx.h), and level 5 (vdpbf16ps) runs nowhere else there:
# the same cases at each level from 5 up, forward and backward.
NO_AMX = "no AMX tiles (level 6: AMX-TILE, AMX-BF16 and Linux's permission): the bf16 tiles run at level 5 or below"
BF16_LEVELS = [5, 6]


@pytest.mark.skipif(CPU_LEVEL < 6, reason=NO_AMX)
@pytest.mark.parametrize("level", BF16_LEVELS)
@pytest.mark.parametrize("c", BF16_TILE_CASES, ids=ids(BF16_TILE_CASES))
def test_cpu_bf16_tiles_each_level(c, level):
    with cpu_level(level):
        fused_and_check(c, "cpu")


POISON_CASES = [BASE, replace(BASE, Sq=17, Sk=129, causal=True, dtype=torch.float16),
                replace(BASE, Sq=1, Sk=1, D=33, dtype=torch.float32), replace(BASE, layout="bhsd", Hkv=1)]


@pytest.mark.parametrize("c", POISON_CASES, ids=ids(POISON_CASES))
def test_poisoned_outputs(device, c):
    """Outputs (and the backward's workspace) allocated from NaN-filled memory:
    every element written, correct."""
    backward = skip_unless_supported(c, device, backward=False)
    q, k, v, dout = make_inputs(c, device)
    with poisoned(device):
        got = run("fused", c, q, k, v, dout, backward=backward)
    for name, t in got.items():
        assert torch.isfinite(t).all(), f"{c} {name} has non-finite values"
    check(c, q, k, v, dout, got)


@pytest.mark.parametrize("dtype", LOWP, ids=dtype_id)
def test_no_keys(device, dtype):
    """Sk = 0: every query row sees nothing; torch gives out = 0, and so do we
    (lse = -inf, dq = 0, dk and dv empty)."""
    c = Case(Sq=5, Sk=0, causal=True, dtype=dtype)
    backward = skip_unless_supported(c, device, backward=False)
    q, k, v, dout = make_inputs(c, device)
    got = run("fused", c, q, k, v, dout, backward=backward)
    assert torch.equal(got["out"], torch.zeros_like(got["out"]))
    assert torch.equal(got["lse"], torch.full_like(got["lse"], float("-inf")))
    if backward:
        assert torch.equal(got["dq"], torch.zeros_like(got["dq"]))
        assert got["dk"].shape == k.shape and got["dv"].shape == v.shape
    torch_out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                               enable_gqa=True)
    assert torch.equal(got["out"], torch_out.transpose(1, 2))


@pytest.mark.parametrize("shape", [(0, 5, 2, 8), (2, 0, 2, 8)], ids=["B0", "Sq0"])
def test_empty(device, shape):
    c = Case(B=shape[0], Sq=shape[1], Sk=6, Hq=2, Hkv=2, D=8, dtype=torch.float32)
    skip_unless_supported(c, device)
    q, k, v, dout = make_inputs(c, device)
    got = run("fused", c, q, k, v, dout)
    assert got["out"].shape == q.shape and got["lse"].shape == (c.B, 2, c.Sq)
    assert torch.equal(got["dk"], torch.zeros_like(k)) and torch.equal(got["dv"], torch.zeros_like(v))


def test_dout_broadcast(device):
    """out.sum().backward(): the upstream gradient is an expanded scalar (every
    stride 0), which the op copies rather than misreads."""
    c = replace(BASE, causal=True)
    skip_unless_supported(c, device)
    q, k, v, _ = make_inputs(c, device)
    dout = torch.ones((), dtype=c.dtype, device=device).expand(c.B, c.Sq, c.Hq, c.D)
    check(c, q, k, v, dout, run("fused", c, q, k, v, dout))


# --------------------------------------------------------------------------- determinism

def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


DET_CASES = [replace(BASE, Sq=300, Sk=300, causal=True), replace(BASE, B=1, Hq=4, Hkv=1, Sq=257, Sk=130,
                                                                   dtype=torch.float32),
             replace(BASE, B=1, Hq=8, Hkv=2, Sq=257, Sk=700, D=128, dtype=torch.float16)]


@pytest.mark.parametrize("c", DET_CASES, ids=ids(DET_CASES))
def test_deterministic(device, c):
    """deterministic=True: bitwise the same results on a second run and, on the
    CPU, with another thread count."""
    skip_unless_supported(c, device)
    q, k, v, dout = make_inputs(c, device)
    first = run("fused", c, q, k, v, dout, deterministic=True)
    runs = [run("fused", c, q, k, v, dout, deterministic=True)]
    if device == "cpu":
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            runs.append(run("fused", c, q, k, v, dout, deterministic=True))
        finally:
            torch.set_num_threads(threads)
    for again in runs:
        for name in first:
            assert torch.equal(bits(first[name]), bits(again[name])), f"{c} {name} differs"


# --------------------------------------------------------------------------- flash_attention

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attention(device, causal):
    """The public function: default scale 1/sqrt(D), (B, S, H, D) in and out."""
    c = replace(BASE, Sq=100, Sk=70, causal=causal, layout="bhsd")
    skip_unless_supported(c, device)
    q, k, v, dout = make_inputs(c, device)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = FF.flash_attention(*leaves, causal=causal)
    got = dict(zip(("out", "dq", "dk", "dv"), (out, *torch.autograd.grad(out, leaves, dout))))
    ref, eager = (run("reference", c, q, k, v, dout, to=t) for t in (torch.float64, None))
    for name, t in got.items():
        assert_close_2x(t, ref[name], eager[name], f"{c} {name}")


@requires_cuda
def test_flash_attention_cuda_gaps():
    """On CUDA, flash_attention raises (never falls back) where the kernels do
    not apply: float32 at least, and everything while none are built."""
    q = torch.randn(1, 8, 2, 64, device="cuda")
    with pytest.raises(RuntimeError, match=r"fusedops\.flash_attention: not supported: "):
        FF.flash_attention(q, q, q)


# --------------------------------------------------------------------------- drop-in SDPA

SDPA_CALLS = [  # (q shape, k shape, kwargs)
    ((2, 4, 129, 64), (2, 4, 129, 64), {}),
    ((2, 4, 129, 64), (2, 4, 129, 64), dict(is_causal=True)),
    ((2, 4, 40, 64), (2, 4, 130, 64), dict(is_causal=True)),
    ((2, 4, 130, 64), (2, 4, 40, 64), dict(is_causal=True)),
    ((2, 8, 65, 128), (2, 2, 65, 128), dict(enable_gqa=True, is_causal=True)),
    ((2, 4, 33, 32), (2, 4, 33, 32), dict(scale=0.3)),
    ((4, 17, 64), (4, 17, 64), dict(is_causal=True)),  # 3-D: (H, S, D)
    ((2, 3, 2, 17, 16), (2, 3, 2, 9, 16), {}),  # 5-D: two leading batch dims
]


@pytest.mark.parametrize("dtype", LOWP, ids=dtype_id)
@pytest.mark.parametrize("qs,ks,kw", SDPA_CALLS, ids=[f"{'x'.join(map(str, q))}-{'x'.join(map(str, k))}-"
                                                     f"{'-'.join(f'{a}={b}' for a, b in kw.items())}"
                                                     for q, k, kw in SDPA_CALLS])
def test_sdpa_matches_torch(device, dtype, qs, ks, kw):
    """fusedops' scaled_dot_product_attention against torch's for the same call:
    torch's in float64 is the reference, torch's in dtype the yardstick (2x
    rule), outputs and gradients; no warning (the kernels take the call)."""
    backward = skip_unless_supported(Case(D=qs[-1], dtype=dtype), device, backward=False)
    q, k, v = randn(qs, dtype, device), randn(ks, dtype, device), randn(ks, dtype, device)
    dout = randn(qs, dtype, device)

    def results(fn, to=None):
        leaves = [t.detach().to(to or t.dtype).requires_grad_(backward) for t in (q, k, v)]
        out = fn(*leaves, **kw)
        return [out, *torch.autograd.grad(out, leaves, dout.to(out.dtype))] if backward else [out]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = results(FF.scaled_dot_product_attention)
    ref = results(F.scaled_dot_product_attention, torch.float64)
    eager = results(F.scaled_dot_product_attention)
    for name, g, r, e in zip(("out", "dq", "dk", "dv"), got, ref, eager):
        assert_close_2x(g, r, e, f"{qs} {ks} {kw} {name}")


FALLBACKS = [  # (id, call modifications, warning text)
    ("mask", lambda q, k, v: dict(attn_mask=torch.randn(q.shape[-2], k.shape[-2], device=q.device)), "attn_mask"),
    ("dropout", lambda q, k, v: dict(dropout_p=0.3), "dropout_p > 0"),
    ("float64", lambda q, k, v: dict(q=q.double(), k=k.double(), v=v.double()), "dtypes"),
    ("value_dim", lambda q, k, v: dict(v=torch.randn(*v.shape[:-1], 24, device=v.device)), "head dims"),
    ("broadcast_batch", lambda q, k, v: dict(k=k[:1], v=v[:1]), "batch dims"),
]


@pytest.mark.parametrize("over,text", [f[1:] for f in FALLBACKS], ids=[f[0] for f in FALLBACKS])
def test_sdpa_fallback_warns_once(device, over, text):
    """What the kernels do not cover goes to torch's function: the same results
    (bitwise: it is torch's), one warning naming the reason, then no more."""
    q, k, v = (randn((2, 2, 9, 16), torch.float32, device) for _ in range(3))
    args = dict(query=q, key=k, value=v)
    args.update({"query" if n == "q" else "key" if n == "k" else "value" if n == "v" else n: t
                 for n, t in over(q, k, v).items()})
    FF._warned.clear()
    outs, caught = [], []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.manual_seed(0)  # dropout: the same mask as torch's call below
            outs.append(FF.scaled_dot_product_attention(**args))
        caught.append([str(x.message) for x in w])
    assert len(caught[0]) == 1 and text in caught[0][0], caught[0]
    assert caught[1] == [], caught[1]
    torch.manual_seed(0)
    want = F.scaled_dot_product_attention(**args)
    assert torch.equal(outs[0], want) and torch.equal(outs[1], want)


def test_sdpa_errors_like_torch(device):
    """Calls torch rejects (head counts that differ without enable_gqa) get
    torch's own error."""
    q, k = randn((2, 4, 9, 16), torch.float32, device), randn((2, 2, 9, 16), torch.float32, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError):
            FF.scaled_dot_product_attention(q, k, k)


# --------------------------------------------------------------------------- bad input

def fwd_args(device, **over):
    a = dict(q=randn((2, 9, 4, 16), torch.float32, device), k=randn((2, 7, 2, 16), torch.float32, device),
             v=randn((2, 7, 2, 16), torch.float32, device), scale=0.25, causal=False)
    a.update(over)
    return a


def raises_unchanged(fn, args, match):
    before = {n: t.clone() for n, t in args.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(RuntimeError, match=match):
        fn(**args)
    for n, t in before.items():
        assert torch.equal(args[n], t), f"{n} was modified"


FWD = r"fusedops\.attn_fwd: "
BAD_FWD = [
    ("q_3d", lambda d: dict(q=randn((2, 9, 16), torch.float32, d)),
     FWD + r"q has shape \[2, 9, 16\], expected 4 dimensions \[batch, seq, heads, head_dim\]"),
    ("k_5d", lambda d: dict(k=randn((2, 7, 2, 16, 1), torch.float32, d)), FWD + r"k has shape \[2, 7, 2, 16, 1\]"),
    ("q_float64", lambda d: dict(q=randn((2, 9, 4, 16), torch.float64, d)),
     FWD + r"q has dtype float64, expected float32, float16 or bfloat16"),
    ("q_int", lambda d: dict(q=torch.ones((2, 9, 4, 16), dtype=torch.int32, device=d)),
     FWD + r"q has dtype int32, expected float32, float16 or bfloat16"),
    ("k_dtype", lambda d: dict(k=randn((2, 7, 2, 16), torch.bfloat16, d)),
     FWD + r"k has dtype bfloat16, expected float32"),
    ("v_dtype", lambda d: dict(v=randn((2, 7, 2, 16), torch.float16, d)),
     FWD + r"v has dtype float16, expected float32"),
    ("batch", lambda d: dict(k=randn((3, 7, 2, 16), torch.float32, d)),
     FWD + r"k has batch size 3, expected the batch size of q \(2\)"),
    ("head_dim", lambda d: dict(k=randn((2, 7, 2, 8), torch.float32, d)),
     FWD + r"k has head_dim 8, expected the head_dim of q \(16\)"),
    ("v_shape", lambda d: dict(v=randn((2, 6, 2, 16), torch.float32, d)),
     FWD + r"v has shape \[2, 6, 2, 16\], expected the shape of k \[2, 7, 2, 16\]"),
    ("heads", lambda d: dict(k=randn((2, 7, 3, 16), torch.float32, d), v=randn((2, 7, 3, 16), torch.float32, d)),
     FWD + r"q has 4 heads, expected a multiple of the 3 heads of k"),
    ("no_kv_heads", lambda d: dict(k=randn((2, 7, 0, 16), torch.float32, d), v=randn((2, 7, 0, 16), torch.float32, d)),
     FWD + r"k has 0 heads, expected at least 1"),
    ("head_dim_0", lambda d: dict(q=randn((2, 9, 4, 0), torch.float32, d), k=randn((2, 7, 2, 0), torch.float32, d),
                                  v=randn((2, 7, 2, 0), torch.float32, d)),
     FWD + r"q has head_dim 0, expected at least 1"),
]


@pytest.mark.parametrize("over,match", [b[1:] for b in BAD_FWD], ids=[b[0] for b in BAD_FWD])
def test_bad_input_fwd(device, over, match):
    raises_unchanged(ops.attn_fwd, fwd_args(device, **over(device)), match)


@pytest.mark.parametrize("over,match", [b[1:] for b in BAD_FWD], ids=[b[0] for b in BAD_FWD])
def test_bad_input_flash_attention(over, match):
    """flash_attention passes bad input on to the op's checks (CPU)."""
    args = fwd_args("cpu", **over("cpu"))
    args.pop("scale")
    raises_unchanged(FF.flash_attention, args, match)


BWD = r"fusedops\.attn_bwd: "


def bwd_args(device, **over):
    a = fwd_args(device)
    out, lse = ops.attn_fwd(**a)
    b = dict(dout=torch.randn_like(out), q=a["q"], k=a["k"], v=a["v"], out=out, lse=lse, scale=0.25,
             causal=False, deterministic=False)
    b.update(over)
    return b


BAD_BWD = [
    ("dout_shape", lambda d: dict(dout=randn((2, 9, 4, 8), torch.float32, d)),
     BWD + r"dout has shape \[2, 9, 4, 8\], expected the shape of q \[2, 9, 4, 16\]"),
    ("out_dtype", lambda d: dict(out=randn((2, 9, 4, 16), torch.bfloat16, d)),
     BWD + r"out has dtype bfloat16, expected float32"),
    ("lse_shape", lambda d: dict(lse=torch.zeros((2, 9, 4), device=d)),
     BWD + r"lse has shape \[2, 9, 4\], expected \[2, 4, 9\] \(batch, q heads, q seq\)"),
    ("lse_dtype", lambda d: dict(lse=torch.zeros((2, 4, 9), dtype=torch.float64, device=d)),
     BWD + r"lse has dtype float64, expected float32"),
    ("heads", lambda d: dict(k=randn((2, 7, 3, 16), torch.float32, d), v=randn((2, 7, 3, 16), torch.float32, d)),
     BWD + r"q has 4 heads, expected a multiple of the 3 heads of k"),
]


@pytest.mark.parametrize("over,match", [b[1:] for b in BAD_BWD], ids=[b[0] for b in BAD_BWD])
def test_bad_input_bwd(device, over, match):
    skip_unless_supported(Case(D=16, dtype=torch.float32), device)
    raises_unchanged(ops.attn_bwd, bwd_args(device, **over(device)), match)


@requires_cuda
@pytest.mark.parametrize("dtype,D,match", [(torch.float32, 64, r"q has dtype float32, expected float16 or bfloat16 on CUDA"),
                                           (torch.bfloat16, 48, r"q has head_dim 48, expected 32, 64, 96, 128 or 256 on CUDA")],
                         ids=["float32", "head_dim"])
def test_bad_input_bwd_cuda(dtype, D, match):
    """What the CUDA backward is not built for is refused by name (a forward
    computed on the CPU supplies out and lse)."""
    args = fwd_args("cpu", q=randn((2, 9, 4, D), dtype, "cpu"), k=randn((2, 7, 2, D), dtype, "cpu"),
                    v=randn((2, 7, 2, D), dtype, "cpu"))
    out, lse = ops.attn_fwd(**args)
    b = dict(dout=torch.randn_like(out), q=args["q"], k=args["k"], v=args["v"], out=out, lse=lse,
             scale=0.25, causal=False, deterministic=False)
    raises_unchanged(ops.attn_bwd, {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in b.items()},
                     BWD + match)


@requires_cuda
@pytest.mark.parametrize("which", ["fwd", "bwd"])
def test_bad_input_too_many_heads_cuda(which):
    """Batch x heads past the CUDA grid's 65535 rows is refused by name, not as a
    launch error."""
    q = randn((1, 3, 65536, 32), torch.bfloat16, "cuda")
    kv = randn((1, 3, 1, 32), torch.bfloat16, "cuda")
    match = r"q has batch x heads = 1 x 65536 = 65536, expected at most 65535 on CUDA"
    if which == "fwd":
        raises_unchanged(ops.attn_fwd, fwd_args("cuda", q=q, k=kv, v=kv.clone()), match)
    else:
        out = torch.zeros_like(q)
        lse = torch.zeros(1, 65536, 3, device="cuda")
        b = dict(dout=torch.randn_like(out), q=q, k=kv, v=kv.clone(), out=out, lse=lse,
                 scale=0.25, causal=False, deterministic=False)
        raises_unchanged(ops.attn_bwd, b, BWD + match)


@requires_cuda
def test_bad_input_mixed_devices():
    args = fwd_args("cpu")
    args["k"] = args["k"].cuda()
    with pytest.raises((RuntimeError, NotImplementedError)):
        ops.attn_fwd(**args)


# --------------------------------------------------------------------------- opcheck, compile

OPCHECK_CASES = [Case(B=1, Sq=17, Sk=9, Hq=2, Hkv=1, D=d, causal=cz, dtype=dt, layout=lay)
                 for d, cz, dt, lay in [(8, False, torch.float32, "bshd"), (8, True, torch.bfloat16, "bhsd"),
                                        (8, True, torch.float16, "bshd"), (64, True, torch.bfloat16, "bhsd")]]


@pytest.mark.parametrize("c", OPCHECK_CASES, ids=ids(OPCHECK_CASES))
def test_opcheck(device, c):
    skip_unless_supported(c, device)
    q, k, v, dout = make_inputs(c, device)
    torch.library.opcheck(ops.attn_fwd, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(),
                                         0.3, c.causal, False))
    out, lse = ops.attn_fwd(q.detach(), k.detach(), v.detach(), 0.3, c.causal)
    torch.library.opcheck(ops.attn_bwd, (dout, q.detach(), k.detach(), v.detach(), out, lse, 0.3,
                                         c.causal, True))


class AttentionBlock(torch.nn.Module):
    """qkv projection -> attention (fusedops SDPA drop-in or flash_attention)
    -> output projection, as in a transformer layer; 4 q heads, 2 kv heads."""

    def __init__(self, dim, sdpa):
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 2 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.sdpa = sdpa

    def forward(self, x):
        B, S, _ = x.shape
        q, kv = self.qkv(x).split([x.shape[-1], x.shape[-1]], -1)
        q = q.view(B, S, 4, -1)
        k, v = kv.view(B, S, 2, 2, -1)[:, :, :, 0], kv.view(B, S, 2, 2, -1)[:, :, :, 1]
        if self.sdpa:
            y = FF.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                is_causal=True, enable_gqa=True).transpose(1, 2)
        else:
            y = FF.flash_attention(q, k, v, causal=True)
        return self.out(y.reshape(B, S, -1))


@pytest.mark.parametrize("sdpa", [False, True], ids=["flash_attention", "sdpa"])
def test_torch_compile(device, sdpa):
    """torch.compile(fullgraph=True) of a block using the op (no graph breaks)
    matches eager, forward and backward, at two sequence lengths. aot_eager:
    traces through dynamo and AOT autograd with the fake kernels, without
    inductor's minutes of C++ compiling on the CPU (test_norm covers inductor)."""
    c = Case(dtype=torch.float32)
    skip_unless_supported(c, device)
    block = AttentionBlock(64, sdpa).to(device)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    for S in (33, 70):
        x = randn((2, S, 64), torch.float32, device)
        results = []
        for fn in (block, compiled):
            block.zero_grad()
            xi = x.clone().requires_grad_()
            y = fn(xi)
            y.backward(torch.ones_like(y))
            results.append([y, xi.grad] + [p.grad for p in block.parameters()])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
