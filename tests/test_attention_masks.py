"""Tests of the masks of flash attention beyond causal (csrc/attention,
attention.h's rule): sliding windows, logit soft-capping and packed (varlen)
sequences, through torch.ops.fusedops.attn_fwd / attn_bwd (window_left,
window_right, softcap), attn_varlen_fwd / attn_varlen_bwd and the public
fusedops.functional.flash_attention / flash_attention_varlen.

Outputs, logsumexp and the three gradients are checked against
fusedops.reference.attention / attention_varlen (the equivalent dense mask)
run in float64, by the 2x rule (tests/tolerances.py), with the same reference
in the inputs' low precision as the yardstick. Padded batches align the mask
top-left (query i against key i), packed sequences bottom-right (the last
query against the last key), as torch SDPA and FlashAttention do. CUDA cases
run the same tests where a GPU is present."""
import itertools
from dataclasses import dataclass, replace

import pytest
import torch

from fusedops import functional as FF, reference
from conftest import CPU_LEVEL, bits, cpu_level, poisoned, randn, raises_unchanged, requires_cuda
import test_attention
from test_attention import dtype_id, ids, make_inputs as padded_inputs, skip_unless_supported
from tolerances import assert_close_2x

ops = torch.ops.fusedops
LOWP = [torch.float32, torch.float16, torch.bfloat16]
NAMES = ("out", "lse", "dq", "dk", "dv")


def check(name, got, ref, eager):
    """Each result of got against the float64 ref, eager the yardstick."""
    for n, t in got.items():
        e = eager[n].float() if n == "lse" else eager[n]  # the op's lse is fp32 whatever the dtype
        assert t.shape == ref[n].shape, f"{name} {n}: shape {tuple(t.shape)}, expected {tuple(ref[n].shape)}"
        assert_close_2x(t, ref[n], e, f"{name} {n}")


def grads(out, lse, leaves, dout, backward):
    if not backward:
        return dict(zip(NAMES, (out, lse)))
    return dict(zip(NAMES, (out, lse, *torch.autograd.grad(out, leaves, dout.to(out.dtype)))))


# --------------------------------------------------------------------------- padded batches

@dataclass(frozen=True)
class Case(test_attention.Case):
    """test_attention's case (q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D), a
    memory layout) with a window (left, right), -1 unbounded, and softcap."""
    window: tuple = (-1, -1)
    softcap: float = 0.0

    def __str__(self):
        return f"{super().__str__()}-w{self.window[0]}_{self.window[1]}-cap{self.softcap:g}"


def run_padded(impl, c, q, k, v, dout, to=None, backward=True, deterministic=False):
    """impl ("fused": the op through autograd; "reference") on fresh leaves."""
    leaves = [t.detach().to(to or t.dtype).requires_grad_(backward) for t in (q, k, v)]
    if impl == "fused":
        out, lse = ops.attn_fwd(*leaves, c.D ** -0.5, c.causal, deterministic, *c.window, c.softcap)
    else:
        out, lse = reference.attention(*leaves, c.causal, None, True, c.window, c.softcap)
    return grads(out, lse, leaves, dout, backward)


def check_padded(c, device, deterministic=False):
    backward = skip_unless_supported(c, device, backward=False)
    q, k, v, dout = padded_inputs(c, device)
    got = run_padded("fused", c, q, k, v, dout, backward=backward, deterministic=deterministic)
    assert got["out"].dtype == c.dtype and got["lse"].dtype == torch.float32
    check(c, got, run_padded("reference", c, q, k, v, dout, torch.float64, backward),
          run_padded("reference", c, q, k, v, dout, None, backward))
    return got


BASE = Case()
# W >= S: 300 and more keys either side, the window covering the whole sequence.
WINDOWS = [(0, 0), (1, 0), (3, 5), (300, 300), (-1, 4), (5, -1), (0, -1), (70, 2)]
# Sq = Sk, Sq < Sk, Sq > Sk (top-left: queries past Sk + left see nothing).
SHAPES = [(129, 129), (77, 150), (150, 77)]
WINDOW_CASES = [replace(BASE, Sq=sq, Sk=sk, window=w, causal=cz)
                for (sq, sk), w, cz in itertools.product(SHAPES, WINDOWS, [False, True])]
WINDOW_CASES += [replace(BASE, window=w, causal=cz, dtype=dt, D=d)
                 for w, cz, dt, d in itertools.product([(1, 0), (3, 5), (64, 0)], [False, True],
                                                       [torch.float32, torch.float16], [64, 33])]
SOFTCAP_CASES = [replace(BASE, softcap=cap, causal=cz, dtype=dt)
                 for cap, cz, dt in itertools.product([5.0, 50.0], [False, True], LOWP)]
SOFTCAP_CASES += [replace(BASE, Sq=150, Sk=77, softcap=5.0, window=(3, 5), causal=True),
                  replace(BASE, softcap=50.0, window=(20, 0), dtype=torch.float16, D=128, Hq=6, Hkv=1),
                  replace(BASE, softcap=5.0, D=96, dtype=torch.float16)]
# GQA / MQA, a layout read through strides, long rows against a narrow band.
MISC_CASES = [replace(BASE, Hq=hq, Hkv=hkv, window=(7, 0), causal=True, softcap=cap)
              for (hq, hkv), cap in itertools.product([(4, 4), (8, 2), (6, 1)], [0.0, 30.0])]
MISC_CASES += [replace(BASE, layout="bhsd", window=(16, 16), dtype=dt) for dt in LOWP]
MISC_CASES += [Case(B=1, Sq=1000, Sk=1000, Hq=2, Hkv=1, D=64, causal=True, window=(100, -1)),
               Case(B=1, Sq=1000, Sk=1000, Hq=2, Hkv=1, D=128, window=(0, 200), softcap=20.0,
                    dtype=torch.float16)]
# Shapes of the Hopper warp-specialised kernels' masked instances (head dims
# 64 and 128, bf16 / fp16; elsewhere the mma.sync kernels or the CPU run
# them): several 128-row query and key tiles, so that whole tiles are
# skipped, cut by the band or by the sequence's end, and Sq != Sk.
WS_CASES = [Case(B=1, Sq=600, Sk=600, Hq=4, Hkv=2, D=128, causal=True, window=(200, 0), softcap=30.0),
            Case(B=2, Sq=520, Sk=390, Hq=2, Hkv=1, D=64, window=(130, 70), dtype=torch.float16),
            Case(B=1, Sq=300, Sk=450, Hq=8, Hkv=2, D=128, softcap=50.0, dtype=torch.float16),
            Case(B=1, Sq=450, Sk=300, Hq=2, Hkv=2, D=64, causal=True, window=(0, 0)),
            Case(B=1, Sq=385, Sk=385, Hq=2, Hkv=1, D=128, window=(-1, 129), softcap=5.0)]
PADDED_CASES = WINDOW_CASES + SOFTCAP_CASES + MISC_CASES + WS_CASES


def assert_same(got, want, same_kernel, msg):
    """got is want bitwise where one kernel computed both; else (two kernels,
    each checked against float64 by the other tests) within the bf16
    rounding of one result."""
    if same_kernel:
        assert torch.equal(bits(got), bits(want)), msg
    else:
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1.6e-2 * want.abs().max().item(), msg=msg)


def test_window_covering_everything_is_no_window(device):
    """A window at least as wide as the sequence (W >= S) and window (-1, 0)
    without causal give what no window and causal give: bitwise where the same
    kernel runs both (the CPU; window (-1, 0) is the causal call everywhere),
    else (CUDA: windows take their own instances, mma.sync or, on Hopper,
    warp-specialised) within the bf16 rounding of one result (each is checked
    against float64 by the other tests)."""
    c = replace(BASE, Sq=100, Sk=100)
    skip_unless_supported(c, device)
    q, k, v, dout = padded_inputs(c, device)
    for masked, plain in [(replace(c, window=(100, 100)), c),
                          (replace(c, window=(-1, 0)), replace(c, causal=True))]:
        a = run_padded("fused", masked, q, k, v, dout)
        b = run_padded("fused", plain, q, k, v, dout)
        same_kernel = device == "cpu" or masked.window == (-1, 0)
        for n in NAMES:
            assert_same(a[n], b[n], same_kernel, f"{masked} {n} differs from {plain}")


# --------------------------------------------------------------------------- packed sequences

@dataclass(frozen=True)
class VCase:
    """Packed sequences: query lengths lq, key lengths lk (None: lq); q
    (sum lq, Hq, D), k and v (sum lk, Hkv, D)."""
    lq: tuple = (7, 64)
    lk: tuple = None
    Hq: int = 4
    Hkv: int = 2
    D: int = 64
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    dtype: torch.dtype = torch.bfloat16

    @property
    def keys(self):
        return self.lq if self.lk is None else self.lk

    def __str__(self):
        lens = "_".join(map(str, self.lq)) if len(self.lq) < 5 else f"{len(self.lq)}seqs{sum(self.lq)}"
        if self.lk is not None:
            lens += "-k" + ("_".join(map(str, self.lk)) if len(self.lk) < 5 else str(sum(self.lk)))
        return (f"L{lens}-H{self.Hq}x{self.Hkv}-D{self.D}-{'causal-' if self.causal else ''}"
                f"w{self.window[0]}_{self.window[1]}-cap{self.softcap:g}-{dtype_id(self.dtype)}")


def cu_seqlens(lengths, device):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def varlen_inputs(c, device):
    tq, tk = sum(c.lq), sum(c.keys)
    return (randn((tq, c.Hq, c.D), c.dtype, device), randn((tk, c.Hkv, c.D), c.dtype, device),
            randn((tk, c.Hkv, c.D), c.dtype, device), randn((tq, c.Hq, c.D), c.dtype, device),
            cu_seqlens(c.lq, device), cu_seqlens(c.keys, device))


def run_varlen(impl, c, q, k, v, dout, cu_q, cu_k, to=None, backward=True, deterministic=False):
    leaves = [t.detach().to(to or t.dtype).requires_grad_(backward) for t in (q, k, v)]
    if impl == "fused":
        out, lse = ops.attn_varlen_fwd(*leaves, cu_q, cu_k, max(c.lq, default=0), max(c.keys, default=0),
                                       c.D ** -0.5, c.causal, deterministic, *c.window, c.softcap)
    else:
        out, lse = reference.attention_varlen(*leaves, cu_q, cu_k, c.causal, None, True, c.window, c.softcap)
    return grads(out, lse, leaves, dout, backward)


def check_varlen(c, device, deterministic=False):
    backward = skip_unless_supported(c, device, backward=False)
    q, k, v, dout, cu_q, cu_k = varlen_inputs(c, device)
    got = run_varlen("fused", c, q, k, v, dout, cu_q, cu_k, backward=backward, deterministic=deterministic)
    assert got["lse"].shape == (c.Hq, sum(c.lq)) and got["lse"].dtype == torch.float32
    check(c, got, run_varlen("reference", c, q, k, v, dout, cu_q, cu_k, torch.float64, backward),
          run_varlen("reference", c, q, k, v, dout, cu_q, cu_k, None, backward))
    return got


VBASE = VCase()
# 1, 2 and 17 sequences of lengths 1, 7, 64 and 1000, an empty one among them;
# Sq != Sk within sequences both ways (bottom-right: with causal the first
# sq - sk queries of a longer query sequence see nothing).
SEVENTEEN = (1, 7, 64, 0, 7, 1, 64, 64, 7, 1, 1, 100, 7, 64, 1, 7, 200)
SEVENTEEN_K = (1, 9, 60, 3, 0, 1, 64, 70, 7, 2, 1, 90, 7, 64, 1, 5, 210)
LENGTHS = [((1000,), None), ((7, 64), None), ((7, 64), (64, 7)), (SEVENTEEN, None), (SEVENTEEN, SEVENTEEN_K),
           ((1, 1000), (1000, 1))]
VARLEN_CASES = [replace(VBASE, lq=lq, lk=lk, causal=cz)
                for (lq, lk), cz in itertools.product(LENGTHS, [False, True])]
VARLEN_CASES += [replace(VBASE, lq=SEVENTEEN, lk=SEVENTEEN_K, window=w, causal=cz, softcap=cap)
                 for w, cz, cap in [((0, 0), False, 0.0), ((1, 0), True, 0.0), ((3, 5), False, 5.0),
                                    ((3, 5), True, 50.0), ((1000, 1000), False, 0.0), ((-1, 2), False, 0.0)]]
VARLEN_CASES += [replace(VBASE, lq=(64, 7, 0, 130), lk=(70, 0, 5, 130), causal=cz, dtype=dt, window=w, D=d)
                 for cz, dt, w, d in [(True, torch.float32, (-1, -1), 64), (False, torch.float16, (10, 0), 64),
                                      (True, torch.float32, (5, 5), 33), (True, torch.float16, (-1, -1), 128),
                                      (False, torch.float32, (-1, -1), 7)]]
VARLEN_CASES += [replace(VBASE, lq=(7, 64, 100), Hq=hq, Hkv=hkv, causal=True, softcap=cap, dtype=dt)
                 for (hq, hkv), cap, dt in [((4, 4), 0.0, torch.bfloat16), ((8, 2), 5.0, torch.float16),
                                            ((6, 1), 0.0, torch.float32)]]
VARLEN_CASES += [replace(VBASE, lq=(1000,), causal=True, window=(255, 0), softcap=50.0)]
# The Hopper warp-specialised kernels' shapes (WS_CASES): sequences of several
# tiles and not multiples of one, whose tiles run past their sequence's end
# into the next one's rows; empty sequences; Sq != Sk within sequences.
WS_VARLEN = [replace(VBASE, lq=(300, 0, 129, 517), lk=(260, 5, 129, 600), D=128, causal=True, window=(100, -1)),
             replace(VBASE, lq=(1, 257, 130, 0, 390), D=64, softcap=50.0, dtype=torch.float16),
             replace(VBASE, lq=(200, 333, 64), lk=(450, 129, 64), Hq=8, Hkv=2, D=128, causal=True),
             replace(VBASE, lq=(129, 0, 700), lk=(129, 3, 700), D=64, window=(64, 64), softcap=5.0)]
VARLEN_CASES += WS_VARLEN



def check_case(c, device, deterministic=False):
    return (check_padded if isinstance(c, Case) else check_varlen)(c, device, deterministic)


ALL_CASES = PADDED_CASES + VARLEN_CASES


@pytest.mark.parametrize("c", ALL_CASES, ids=ids(ALL_CASES))
def test_against_reference(device, c):
    check_case(c, device)


# Soft-capping's tanh (attention_mma.cuh, softcap_scores) takes an odd
# polynomial where every scaled score of a warp's tile is within the cap and
# the ex2 form elsewhere: query rows scaled by 0.5 .. 4 in blocks of 16 (a warp's
# rows) put |score scale| / softcap from below 1 to about 3, so that both
# branches run, side by side and on scores where they meet.
CAP_SPAN_CASES = [replace(BASE, B=1, Sq=200, Sk=200, Hq=2, Hkv=1, softcap=5.0, causal=cz, dtype=dt, D=d)
                  for cz, dt, d in itertools.product([False, True], LOWP, [64, 128])]


@pytest.mark.parametrize("c", CAP_SPAN_CASES, ids=ids(CAP_SPAN_CASES))
def test_softcap_both_branches(device, c):
    backward = skip_unless_supported(c, device, backward=False)
    q, k, v, dout = padded_inputs(c, device)
    rows = torch.arange(c.Sq, device=device)
    factor = torch.tensor([0.5, 1.0, 2.0, 4.0], device=device)[(rows // 16) % 4]
    q = (q.float() * factor[None, :, None, None]).to(c.dtype)
    got = run_padded("fused", c, q, k, v, dout, backward=backward)
    check(c, got, run_padded("reference", c, q, k, v, dout, torch.float64, backward),
          run_padded("reference", c, q, k, v, dout, None, backward))


# At CPU level 5 bf16 with head dims divisible by 32 takes the AVX512-BF16
# tiles (attention_cpu.c); here the same masks on the level-4 fp32 tiles.
BF16_CASES = [c for c in ALL_CASES if c.dtype == torch.bfloat16 and c.D % 32 == 0][::3]


@pytest.mark.skipif(CPU_LEVEL < 5, reason="no AVX512-BF16: the CPU runs the level-4 tiles everywhere")
@pytest.mark.parametrize("c", BF16_CASES, ids=ids(BF16_CASES))
def test_cpu_bf16_without_dot_tiles(c):
    with cpu_level(4):
        check_case(c, "cpu")


# With AMX (level 6), every masked case of the bf16 tiles at each level from 5
# up (test_attention.test_cpu_bf16_tiles_each_level).
BF16_ALL = [c for c in ALL_CASES if c.dtype == torch.bfloat16 and c.D % 32 == 0]


@pytest.mark.skipif(CPU_LEVEL < 6, reason=test_attention.NO_AMX)
@pytest.mark.parametrize("level", test_attention.BF16_LEVELS)
@pytest.mark.parametrize("c", BF16_ALL, ids=ids(BF16_ALL))
def test_cpu_bf16_tiles_each_level(c, level):
    with cpu_level(level):
        check_case(c, "cpu")


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (4, 4)), (True, (9, 0))],
                         ids=["causal", "window", "causal-window"])
def test_varlen_matches_padded(device, causal, window):
    """Equal-length sequences packed give what the padded batch gives (for sq
    = sk the two alignments agree): bitwise where one kernel runs both (the
    CPU; windows on CUDA: one instance, whose dq here sums at most two parts
    a query tile, which add in either order to the same bits), else (CUDA's plain causal call, which has kernels of its
    own) within the bf16 rounding of one result."""
    c = replace(VBASE, lq=(100, 100, 100), causal=causal, window=window)
    skip_unless_supported(c, device)
    q, k, v, dout, cu_q, cu_k = varlen_inputs(c, device)
    packed = run_varlen("fused", c, q, k, v, dout, cu_q, cu_k)
    pc = Case(B=3, Sq=100, Sk=100, Hq=c.Hq, Hkv=c.Hkv, D=c.D, causal=causal, window=window, dtype=c.dtype)
    padded = run_padded("fused", pc, *(t.view(3, 100, *t.shape[1:]) for t in (q, k, v, dout)))
    for n in NAMES:
        want = padded[n].transpose(0, 1).reshape(c.Hq, 300) if n == "lse" else padded[n].flatten(0, 1)
        assert_same(packed[n], want, device == "cpu" or window != (-1, -1), f"{c} {n}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_varlen_empty(device, dtype):
    """No tokens at all (zero sequences, or sequences all empty), and queries
    without keys: empty results, out 0, lse -inf, dq 0, dk and dv 0 where no
    query exists."""
    for lq, lk in [((), ()), ((0, 0), (0, 0)), ((5, 3), (0, 0)), ((0, 0), (4, 2))]:
        c = replace(VBASE, lq=lq, lk=lk, dtype=dtype)
        skip_unless_supported(c, device)
        q, k, v, dout, cu_q, cu_k = varlen_inputs(c, device)
        got = run_varlen("fused", c, q, k, v, dout, cu_q, cu_k)
        assert got["out"].shape == q.shape and got["lse"].shape == (c.Hq, q.shape[0])
        assert torch.equal(got["out"], torch.zeros_like(q))
        assert torch.equal(got["lse"], torch.full_like(got["lse"], float("-inf")))
        assert torch.equal(got["dq"], torch.zeros_like(q))
        assert torch.equal(got["dk"], torch.zeros_like(k)) and torch.equal(got["dv"], torch.zeros_like(v))


# --------------------------------------------------------------------------- poisoned outputs, determinism

POISON_PADDED = [replace(BASE, Sq=150, Sk=77, window=(3, 5), causal=True, dtype=torch.float16),
                 replace(BASE, window=(0, 0), softcap=5.0, dtype=torch.float32, D=33)]
POISON_VARLEN = [replace(VBASE, lq=SEVENTEEN, lk=SEVENTEEN_K, causal=True, window=(3, -1)),
                 replace(VBASE, lq=(64, 7, 0, 130), lk=(70, 0, 5, 130), softcap=5.0, dtype=torch.float32)]


@pytest.mark.parametrize("c", POISON_PADDED + POISON_VARLEN, ids=ids(POISON_PADDED + POISON_VARLEN))
def test_poisoned_outputs(device, c):
    """Outputs and the backward's workspace allocated from NaN-filled memory:
    every element written (rows that see no key included), correct."""
    backward = skip_unless_supported(c, device, backward=False)
    if isinstance(c, Case):
        q, k, v, dout = padded_inputs(c, device)
        with poisoned(device):
            got = run_padded("fused", c, q, k, v, dout, backward=backward)
        check(c, got, run_padded("reference", c, q, k, v, dout, torch.float64, backward),
              run_padded("reference", c, q, k, v, dout, None, backward))
    else:
        q, k, v, dout, cu_q, cu_k = varlen_inputs(c, device)
        with poisoned(device):
            got = run_varlen("fused", c, q, k, v, dout, cu_q, cu_k, backward=backward)
        check(c, got, run_varlen("reference", c, q, k, v, dout, cu_q, cu_k, torch.float64, backward),
              run_varlen("reference", c, q, k, v, dout, cu_q, cu_k, None, backward))
    for n, t in got.items():
        assert not torch.isnan(t).any(), f"{c} {n} has NaNs"


DET_CASES = [replace(BASE, Sq=300, Sk=300, window=(40, 0), causal=True, softcap=30.0),
             WS_CASES[0], WS_VARLEN[0], WS_VARLEN[3],
             replace(BASE, B=1, Hq=4, Hkv=1, Sq=257, Sk=130, window=(20, 20), dtype=torch.float32),
             replace(VBASE, lq=SEVENTEEN, lk=SEVENTEEN_K, causal=True, window=(10, -1), softcap=5.0),
             replace(VBASE, lq=(300,), Hq=8, Hkv=2, causal=True, dtype=torch.float16)]


@pytest.mark.parametrize("c", DET_CASES, ids=ids(DET_CASES))
def test_deterministic(device, c):
    """deterministic=True: bitwise the same results on a second run and, on the
    CPU, with another thread count."""
    skip_unless_supported(c, device)
    if isinstance(c, Case):
        q, k, v, dout = padded_inputs(c, device)

        def once():
            return run_padded("fused", c, q, k, v, dout, deterministic=True)
    else:
        q, k, v, dout, cu_q, cu_k = varlen_inputs(c, device)

        def once():
            return run_varlen("fused", c, q, k, v, dout, cu_q, cu_k, deterministic=True)
    first, runs = once(), [once()]
    if device == "cpu":
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            runs.append(once())
        finally:
            torch.set_num_threads(threads)
    for again in runs:
        for n in first:
            assert torch.equal(bits(first[n]), bits(again[n])), f"{c} {n} differs"


# --------------------------------------------------------------------------- public functions

def test_flash_attention(device):
    """flash_attention(window_size=, softcap=): default scale 1/sqrt(D)."""
    c = replace(BASE, Sq=100, Sk=70, window=(10, 3), causal=True, softcap=20.0, layout="bhsd")
    skip_unless_supported(c, device)
    q, k, v, dout = padded_inputs(c, device)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = FF.flash_attention(*leaves, causal=True, window_size=(10, 3), softcap=20.0)
    got = dict(zip(("out", "dq", "dk", "dv"), (out, *torch.autograd.grad(out, leaves, dout))))
    ref, eager = (run_padded("reference", c, q, k, v, dout, to) for to in (torch.float64, None))
    check(c, got, ref, eager)


def test_flash_attention_varlen(device):
    """flash_attention_varlen: bottom-right within each sequence, default scale."""
    c = replace(VBASE, lq=(5, 40, 0, 70), lk=(9, 30, 4, 70), causal=True, window=(6, -1), softcap=10.0)
    skip_unless_supported(c, device)
    q, k, v, dout, cu_q, cu_k = varlen_inputs(c, device)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = FF.flash_attention_varlen(*leaves, cu_q, cu_k, 70, 70, causal=True, window_size=(6, -1), softcap=10.0)
    got = dict(zip(("out", "dq", "dk", "dv"), (out, *torch.autograd.grad(out, leaves, dout))))
    ref, eager = (run_varlen("reference", c, q, k, v, dout, cu_q, cu_k, to) for to in (torch.float64, None))
    check(c, got, ref, eager)


# --------------------------------------------------------------------------- bad input

VFWD = r"fusedops\.attn_varlen_fwd: "


def varlen_args(device, **over):
    q, k = randn((12, 4, 16), torch.float32, device), randn((10, 2, 16), torch.float32, device)
    a = dict(q=q, k=k, v=randn((10, 2, 16), torch.float32, device),
             cu_seqlens_q=torch.tensor([0, 5, 12], dtype=torch.int32, device=device),
             cu_seqlens_k=torch.tensor([0, 4, 10], dtype=torch.int32, device=device),
             max_seqlen_q=7, max_seqlen_k=6, scale=0.25, causal=True, deterministic=False,
             window_left=-1, window_right=-1, softcap=0.0)
    a.update(over)
    return a


def i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


BAD_VARLEN = [
    ("cu_int64", lambda d: dict(cu_seqlens_q=torch.tensor([0, 5, 12], device=d)),
     VFWD + r"cu_seqlens_q has dtype int64, expected int32"),
    ("cu_k_float", lambda d: dict(cu_seqlens_k=torch.tensor([0., 4., 10.], device=d)),
     VFWD + r"cu_seqlens_k has dtype float32, expected int32"),
    ("cu_2d", lambda d: dict(cu_seqlens_q=i32([[0, 5, 12]], d)),
     VFWD + r"cu_seqlens_q has shape \[1, 3\], expected 1 dimension of batch \+ 1 >= 1 values"),
    ("cu_empty", lambda d: dict(cu_seqlens_q=i32([], d)), VFWD + r"cu_seqlens_q has shape \[0\], expected 1 dim"),
    ("cu_lengths", lambda d: dict(cu_seqlens_k=i32([0, 10], d)),
     VFWD + r"cu_seqlens_k has 2 values, expected as many as cu_seqlens_q \(3\)"),
    ("cu_first", lambda d: dict(cu_seqlens_q=i32([1, 5, 12], d)), VFWD + r"cu_seqlens_q\[0\] is 1, expected 0"),
    ("cu_decreasing", lambda d: dict(cu_seqlens_k=i32([0, 7, 6, 10], d), cu_seqlens_q=i32([0, 5, 6, 12], d),
                                         max_seqlen_k=10),
     VFWD + r"cu_seqlens_k decreases from 7 to 6 at index 2, expected non-decreasing"),
    ("cu_last", lambda d: dict(cu_seqlens_q=i32([0, 5, 11], d)),
     VFWD + r"cu_seqlens_q\[-1\] is 11, expected the number of tokens of q \(12\)"),
    ("cu_last_k", lambda d: dict(cu_seqlens_k=i32([0, 4, 12], d)),
     VFWD + r"cu_seqlens_k\[-1\] is 12, expected the number of tokens of k \(10\)"),
    ("max_seqlen_q", lambda d: dict(max_seqlen_q=6),
     VFWD + r"cu_seqlens_q gives sequence 1 7 tokens, expected at most max_seqlen_q \(6\)"),
    ("max_seqlen_k", lambda d: dict(max_seqlen_k=-1), VFWD + r"max_seqlen_k is -1, expected at least 0"),
    ("window_left", lambda d: dict(window_left=-2),
     VFWD + r"window_left is -2, expected -1 \(unbounded\) or a number of keys >= 0"),
    ("window_right", lambda d: dict(window_right=-5), VFWD + r"window_right is -5, expected -1"),
    ("softcap_negative", lambda d: dict(softcap=-1.0), VFWD + r"softcap is -1, expected a finite value >= 0"),
    ("softcap_nan", lambda d: dict(softcap=float("nan")), VFWD + r"softcap is nan, expected a finite value"),
    ("softcap_inf", lambda d: dict(softcap=float("inf")), VFWD + r"softcap is inf, expected a finite value"),
    ("q_4d", lambda d: dict(q=randn((1, 12, 4, 16), torch.float32, d)),
     VFWD + r"q has shape \[1, 12, 4, 16\], expected 3 dimensions \[total_tokens, heads, head_dim\]"),
    ("heads", lambda d: dict(k=randn((10, 3, 16), torch.float32, d), v=randn((10, 3, 16), torch.float32, d)),
     VFWD + r"q has 4 heads, expected a multiple of the 3 heads of k"),
    ("v_shape", lambda d: dict(v=randn((9, 2, 16), torch.float32, d)),
     VFWD + r"v has shape \[9, 2, 16\], expected the shape of k \[10, 2, 16\]"),
]


# The offsets' values are read on the CPU only: on a GPU that read would wait
# for the stream inside the op (flash_attention_varlen's docstring).
CU_VALUES = {"cu_first", "cu_decreasing", "cu_last", "cu_last_k", "max_seqlen_q"}


def skip_cu_values_on_gpu(name, device):
    if name in CU_VALUES and device != "cpu":
        pytest.skip("cu_seqlens values are checked on the CPU only")


@pytest.mark.parametrize("name,over,match", BAD_VARLEN, ids=[b[0] for b in BAD_VARLEN])
def test_bad_input_varlen_fwd(device, name, over, match):
    skip_cu_values_on_gpu(name, device)
    raises_unchanged(ops.attn_varlen_fwd, varlen_args(device, **over(device)), match)


VBWD = r"fusedops\.attn_varlen_bwd: "


def varlen_bwd_args(device, **over):
    a = varlen_args(device)
    out, lse = ops.attn_varlen_fwd(**a)
    b = dict(dout=torch.randn_like(out), q=a["q"], k=a["k"], v=a["v"], out=out, lse=lse,
             cu_seqlens_q=a["cu_seqlens_q"], cu_seqlens_k=a["cu_seqlens_k"], max_seqlen_q=7, max_seqlen_k=6,
             scale=0.25, causal=True, deterministic=False, window_left=-1, window_right=-1, softcap=0.0)
    b.update(over)
    return b


BAD_VARLEN_BWD = [
    ("lse_shape", lambda d: dict(lse=torch.zeros((12, 4), device=d)),
     VBWD + r"lse has shape \[12, 4\], expected \[4, 12\] \(q heads, total q tokens\)"),
    ("cu_decreasing", lambda d: dict(cu_seqlens_q=i32([0, 13, 12], d)),
     VBWD + r"cu_seqlens_q decreases from 13 to 12 at index 2"),
    ("cu_int64", lambda d: dict(cu_seqlens_k=torch.tensor([0, 4, 10], device=d)),
     VBWD + r"cu_seqlens_k has dtype int64, expected int32"),
    ("dout_shape", lambda d: dict(dout=randn((12, 4, 8), torch.float32, d)),
     VBWD + r"dout has shape \[12, 4, 8\], expected the shape of q \[12, 4, 16\]"),
    ("window", lambda d: dict(window_right=-3), VBWD + r"window_right is -3, expected -1"),
    ("softcap", lambda d: dict(softcap=-0.5), VBWD + r"softcap is -0.5, expected a finite value >= 0"),
]


@pytest.mark.parametrize("name,over,match", BAD_VARLEN_BWD, ids=[b[0] for b in BAD_VARLEN_BWD])
def test_bad_input_varlen_bwd(device, name, over, match):
    skip_cu_values_on_gpu(name, device)
    skip_unless_supported(Case(D=16, dtype=torch.float32), device)
    raises_unchanged(ops.attn_varlen_bwd, varlen_bwd_args(device, **over(device)), match)


@pytest.mark.parametrize("op", ["attn_fwd", "attn_bwd"])
@pytest.mark.parametrize("over,match", [(dict(window_left=-2), r"window_left is -2, expected -1"),
                                        (dict(window_right=-7), r"window_right is -7, expected -1"),
                                        (dict(softcap=-3.0), r"softcap is -3, expected a finite value >= 0"),
                                        (dict(softcap=float("inf")), r"softcap is inf, expected a finite")],
                         ids=["left", "right", "softcap_negative", "softcap_inf"])
def test_bad_input_padded_masks(device, op, over, match):
    """The padded ops' mask arguments: the same checks."""
    skip_unless_supported(Case(D=16, dtype=torch.float32), device)
    q, k = randn((2, 9, 4, 16), torch.float32, device), randn((2, 7, 2, 16), torch.float32, device)
    v = randn((2, 7, 2, 16), torch.float32, device)
    a = dict(q=q, k=k, v=v, scale=0.25, causal=False, deterministic=False)
    if op == "attn_bwd":
        out, lse = ops.attn_fwd(**a)
        a = dict(dout=torch.randn_like(out), out=out, lse=lse, **a)
        a = {n: a[n] for n in ("dout", "q", "k", "v", "out", "lse", "scale", "causal", "deterministic")}
    a.update(over)
    raises_unchanged(getattr(ops, op), a, rf"fusedops\.{op}: " + match)


def test_bad_input_cu_seqlens_device():
    """cu_seqlens on another device than q: refused by name (a meta tensor
    reaches the fake kernel's device check)."""
    a = varlen_args("cpu", cu_seqlens_k=torch.empty(3, dtype=torch.int32, device="meta"))
    raises_unchanged(ops.attn_varlen_fwd, a, VFWD + r"cu_seqlens_k is on meta but q is on cpu")


@requires_cuda
def test_bad_input_cu_seqlens_cuda():
    """cu_seqlens on the GPU for CPU tensors, and on the CPU for GPU ones."""
    a = varlen_args("cpu")
    a["cu_seqlens_q"] = a["cu_seqlens_q"].cuda()
    with pytest.raises((RuntimeError, NotImplementedError)):
        ops.attn_varlen_fwd(**a)
    a = varlen_args("cuda", q=randn((12, 4, 64), torch.bfloat16, "cuda"), k=randn((10, 2, 64), torch.bfloat16, "cuda"),
                    v=randn((10, 2, 64), torch.bfloat16, "cuda"))
    a["cu_seqlens_k"] = a["cu_seqlens_k"].cpu()
    with pytest.raises((RuntimeError, NotImplementedError), match="cu_seqlens_k is on cpu but q is on cuda"):
        ops.attn_varlen_fwd(**a)


# --------------------------------------------------------------------------- opcheck, compile

def test_opcheck(device):
    c = replace(BASE, B=1, Sq=17, Sk=9, Hq=2, Hkv=1, D=64, window=(3, 1), softcap=5.0, causal=True)
    skip_unless_supported(c, device)
    q, k, v, dout = padded_inputs(c, device)
    torch.library.opcheck(ops.attn_fwd, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), 0.3, True,
                                         False, 3, 1, 5.0))
    out, lse = ops.attn_fwd(q.detach(), k.detach(), v.detach(), 0.3, True, False, 3, 1, 5.0)
    torch.library.opcheck(ops.attn_bwd, (dout, q.detach(), k.detach(), v.detach(), out, lse, 0.3, True, True,
                                         3, 1, 5.0))
    vc = replace(VBASE, lq=(5, 0, 9), lk=(3, 4, 9), D=64, causal=True, window=(2, -1), softcap=5.0)
    q, k, v, dout, cu_q, cu_k = varlen_inputs(vc, device)
    args = (cu_q, cu_k, 9, 9, 0.3, True, False, 2, -1, 5.0)
    torch.library.opcheck(ops.attn_varlen_fwd, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *args))
    out, lse = ops.attn_varlen_fwd(q.detach(), k.detach(), v.detach(), *args)
    torch.library.opcheck(ops.attn_varlen_bwd, (dout, q.detach(), k.detach(), v.detach(), out, lse, cu_q, cu_k, 9,
                                                9, 0.3, True, True, 2, -1, 5.0))


def test_torch_compile(device):
    """torch.compile(fullgraph=True) of flash_attention with a window and
    softcap and of flash_attention_varlen (no graph breaks) matches eager,
    forward and backward. aot_eager: dynamo and AOT autograd with the fake
    kernels, without inductor's C++ compiling on the CPU."""
    c = replace(BASE, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    skip_unless_supported(c, device)

    def fn(q, k, v, qp, kp, vp, cu_q, cu_k):
        a = FF.flash_attention(q, k, v, causal=True, window_size=(5, 0), softcap=30.0)
        b = FF.flash_attention_varlen(qp, kp, vp, cu_q, cu_k, 40, 40, causal=True, window_size=(8, -1),
                                      softcap=10.0)
        return a.sum(2), b.sum(1)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for S, lens in ((33, (7, 40, 1)), (70, (40, 0, 12, 30))):
        q, k, v = (randn((2, S, 4, 64), c.dtype, device) for _ in range(3))
        tq = sum(lens)
        qp, kp, vp = (randn((tq, 4, 64), c.dtype, device) for _ in range(3))
        cu = cu_seqlens(lens, device)
        results = []
        for f in (fn, compiled):
            leaves = [t.clone().requires_grad_() for t in (q, k, v, qp, kp, vp)]
            a, b = f(*leaves, cu, cu)
            (a.float().square().sum() + b.float().square().sum()).backward()
            results.append([a, b] + [t.grad for t in leaves])
        for x, y in zip(*results):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
