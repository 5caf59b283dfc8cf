"""Tests of the fused residual-add + LayerNorm / RMSNorm op (csrc/norm):
torch.ops.fusedops.add_norm_fwd / add_norm_bwd, fusedops.functional and
fusedops.nn.LayerNorm / RMSNorm.

Every output and gradient is checked against fusedops.reference.add_norm run in
float64 by the 2x rule (tests/tolerances.py), with reference.add_norm run on the
low-precision inputs on the same device as the yardstick."""
import copy
import itertools
import math
from dataclasses import dataclass

import pytest
import torch

import fusedops
from fusedops import functional as FF, reference
from conftest import bits, maybe_poisoned, poisoned, raises_unchanged, randn, requires_cuda, tuned
from tolerances import assert_close_2x, default_scale

ops = torch.ops.fusedops
LOWP = [torch.float32, torch.float16, torch.bfloat16]
OTHER_HALF = {torch.float16: torch.bfloat16, torch.bfloat16: torch.float16, torch.float32: torch.float16}
NAN = float("nan")


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- cases

@dataclass(frozen=True)
class Case:
    """One configuration of the op.

    residual: "none"; "x" (in x's dtype); "fp32"; or "none_fp32" (no residual and
    residual_in_fp32=True: s is x widened to fp32).
    param: the dtype of weight and bias: "x" (x's), "fp32", or "other" (the other
    16-bit dtype, which the public functions widen to fp32; the raw op rejects it)."""
    shape: tuple
    dtype: torch.dtype = torch.float32
    rms: bool = False
    residual: str = "x"
    weight: bool = True
    bias: bool = True
    param: str = "x"

    def __post_init__(self):
        assert not (self.rms and self.bias), "RMSNorm has no bias"

    def __str__(self):
        params = "".join(n for n, on in (("w", self.weight), ("b", self.bias)) if on) or "noparams"
        if self.weight or self.bias:
            params += "_" + self.param
        return (f"{'x'.join(map(str, self.shape))}-{dtype_id(self.dtype)}-"
                f"{'rms' if self.rms else 'ln'}-res_{self.residual}-{params}")

    @property
    def eps(self):
        return 1e-6 if self.rms else 1e-5

    @property
    def residual_in_fp32(self):
        return self.residual == "none_fp32"

    @property
    def s_dtype(self):
        return torch.float32 if self.residual in ("fp32", "none_fp32") else self.dtype

    @property
    def stores_s(self):
        """Whether the raw op returns s, or an empty placeholder because s is x."""
        return self.residual in ("x", "fp32") or self.s_dtype != self.dtype

    @property
    def param_dtype(self):
        return {"x": self.dtype, "fp32": torch.float32, "other": OTHER_HALF[self.dtype]}[self.param]

    @property
    def rows(self):
        return math.prod(self.shape[:-1])


def ln(shape, dtype=torch.float32, **kw):
    return Case(tuple(shape), dtype, rms=False, **kw)


def rms(shape, dtype=torch.float32, **kw):
    return Case(tuple(shape), dtype, rms=True, bias=False, **kw)


def ids(cases):
    return [str(c) for c in cases]


RESIDUALS = ["none", "x", "fp32", "none_fp32"]
NORMS = [(False, True, True), (False, True, False), (False, False, True), (False, False, False),
         (True, True, False), (True, False, False)]  # (rms, weight, bias)


def dtype_cases(shape):
    """Every combination of x dtype, residual mode, weight/bias presence and
    parameter dtype, for LayerNorm and RMSNorm."""
    for dtype, res, (rms_, w, b) in itertools.product(LOWP, RESIDUALS, NORMS):
        params = ["x"] if dtype == torch.float32 or not (w or b) else ["x", "fp32", "other"]
        for p in params:
            yield Case(shape, dtype, rms_, res, w, b, p)


# Hidden sizes 1, 7, 1000, 4097, 65536; rows 0, 1, 3 and thousands; x of rank 1
# to 4 (leading dims of rank 0 to 3). 65536 only with few rows and thousands of
# rows only with narrow rows, to keep the CPU run short.
SHAPES = [(7,), (0, 7), (2, 0, 1000), (1, 1), (3, 1), (1, 7), (3, 7), (3, 1000), (2, 3, 1000),
          (1, 3, 1, 4097), (3, 4097), (1, 65536), (3, 65536), (4000, 7), (2, 1500, 1), (2, 2, 1000, 7)]


def shape_cases():
    for shape, dtype in itertools.product(SHAPES, LOWP):
        yield ln(shape, dtype)  # residual and parameters in x's dtype
        yield rms(shape, dtype, residual="fp32", param="fp32")


# --------------------------------------------------------------------------- running

ARGS = ("x", "residual", "weight", "bias")
RESULTS = ("y", "s", "dx", "dresidual", "dweight", "dbias")


def make_inputs(c, device):
    """Random inputs of case c, and upstream gradients gy (for y) and gs (for s)."""
    h = c.shape[-1]
    return dict(
        x=randn(c.shape, c.dtype, device),
        residual=randn(c.shape, c.s_dtype, device) if c.residual in ("x", "fp32") else None,
        weight=randn(h, c.param_dtype, device) if c.weight else None,
        bias=randn(h, c.param_dtype, device) if c.bias else None,
        gy=randn(c.shape, c.dtype, device),
        gs=randn(c.shape, c.s_dtype, device),
    )


def fused(x, residual, weight, bias, eps, rms, residual_in_fp32):
    """fusedops.functional with reference.add_norm's signature."""
    if rms:
        assert bias is None
        return FF.fused_add_rms_norm(x, residual, weight, eps, residual_in_fp32)
    return FF.fused_add_layer_norm(x, residual, weight, bias, eps, residual_in_fp32)


def forward_backward(c, inp, impl=fused, to=None, poison=False):
    """Run impl (fused, or reference.add_norm) forward and backward on fresh leaves
    made from inp (cast to `to` if given), backpropagating gy into y and gs into
    s (s feeds the next layer; where s is x itself, gs goes straight to x).
    Returns {name: tensor or None} for RESULTS. poison: run the forward and the
    backward each under conftest.poisoned."""
    leaves = {k: None if inp[k] is None else inp[k].detach().to(to or inp[k].dtype).requires_grad_()
              for k in ARGS}
    # residual_in_fp32 widens x to fp32; in float64 there is nothing to widen (s = x).
    rif = c.residual_in_fp32 and to is None
    device = inp["x"].device
    with maybe_poisoned(device, poison):
        y, s = impl(*(leaves[k] for k in ARGS), c.eps, c.rms, rif)
    with maybe_poisoned(device, poison):
        torch.autograd.backward([y, s], [inp["gy"].to(y.dtype), inp["gs"].to(s.dtype)])
    got = {"y": y, "s": s}
    got.update({"d" + k: None if t is None else t.grad for k, t in leaves.items()})
    return got


def check_against_reference(c, inp, got, floor=None, eager=None):
    """Every result in `got` by the 2x rule against the float64 reference.
    floor: the rule's floor relative to the scale (default tolerances.FLOOR);
    eager: the yardstick's results (default reference.add_norm in c.dtype)."""
    eager = eager or forward_backward(c, inp, reference.add_norm)
    ref = forward_backward(c, inp, reference.add_norm, to=torch.float64)
    for name in RESULTS:
        if ref[name] is None:
            assert got[name] is None, f"{c} {name}: expected no gradient"
            continue
        assert got[name] is not None, f"{c} {name}: missing"
        scale = None
        if name in ("dweight", "dbias"):
            # Sums over rows of O(1) terms: their partial sums reach ~sqrt(rows)
            # whatever the final value, and a sum taken in another order than
            # eager's rounds at that size.
            scale = max(default_scale(ref[name]), math.sqrt(c.rows))
        atol_floor = None if floor is None else floor * (scale or default_scale(ref[name]))
        assert_close_2x(got[name], ref[name], eager[name], f"{c} {name}", atol_floor=atol_floor, scale=scale)


def assert_same_results(a, b, what):
    for name in RESULTS:
        if a[name] is None or b[name] is None:
            assert a[name] is None and b[name] is None, f"{what}: {name} present in one run only"
            continue
        assert (a[name].dtype, a[name].shape) == (b[name].dtype, b[name].shape), f"{what}: {name} dtype/shape"
        assert torch.equal(bits(a[name]), bits(b[name])), (
            f"{what}: {name} differs, max abs diff "
            f"{(a[name].double() - b[name].double()).abs().max().item():.3g}")


# --------------------------------------------------------------------------- correctness

DTYPE_CASES = list(dtype_cases((2, 9, 4097)))
SHAPE_CASES = list(shape_cases())


@pytest.mark.parametrize("c", DTYPE_CASES, ids=ids(DTYPE_CASES))
def test_dtypes(device, c):
    inp = make_inputs(c, device)
    check_against_reference(c, inp, forward_backward(c, inp))


@pytest.mark.parametrize("c", SHAPE_CASES, ids=ids(SHAPE_CASES))
def test_shapes(device, c):
    inp = make_inputs(c, device)
    check_against_reference(c, inp, forward_backward(c, inp))


# Rows of 16K values and more are split over a thread-block cluster on sm_90
# (norm_wide.cuh): slices that end mid-row (20000 = 5 slices of 4000 with the
# last one ragged), a width past the 8-block cluster (65536), fp32 (4-value
# chunks), and more rows than clusters fit on the device at once, so that a
# cluster walks several rows and reuses its exchange slots.
WIDE_CASES = [ln((600, 20000), torch.bfloat16, residual="fp32"), rms((600, 20000), torch.float16),
              ln((400, 65536), torch.bfloat16), rms((40, 32768 + 8), param="fp32"),
              ln((300, 16384), torch.float32, residual="none"),
              ln((3, 24576), torch.bfloat16, weight=False, bias=False),
              # fwd_park (16-bit x and s, 16K-32K wide, half of each thread's
              # chunks parked in shared memory; every one of these rows in
              # test_forward_plans_cuda, by default those whose rows fill its
              # last wave, as 257 x 32768 does on an H100): the widest row it
              # holds, the narrowest (16392: the last chunks past the row), fp32
              # weight and bias, no residual
              ln((257, 32768), torch.bfloat16), rms((33, 32768), torch.float16),
              ln((129, 16392), torch.bfloat16, param="fp32"), rms((70, 30000), torch.bfloat16, residual="none"),
              ln((5, 32768), torch.float16, bias=False, param="fp32"),
              # two waves of fwd_park's blocks: fwd_park by default on an H100,
              # RMSNorm's fwd_regs on an H200 (norm_plan.c, park_plan)
              rms((520, 32768), torch.bfloat16)]


# Rows of 4097-8192 16-bit values run bwd_pipe on CUDA (norm_bwd.cuh: each
# row's s, dy and ds staged through shared memory, rows ahead; fp32 rows of
# 4097-8192 values and every row of 16K and more split over a cluster, on
# sm_90, as WIDE_CASES are): every stored
# dtype combination, rows fewer than the grid's teams (1, 3) and not a multiple
# of them (333, 2001), widths whose last chunks fall past the team's slice
# (4104, 6000), no residual gradient (ds), no weight, fp32 weight.
PIPE_CASES = [ln((2001, 8192), torch.bfloat16), ln((333, 6000), torch.float16, residual="fp32"),
              rms((3, 4104), torch.bfloat16, residual="none"), ln((1, 8192), torch.bfloat16, weight=False, bias=False),
              rms((700, 7168), torch.bfloat16, param="fp32"), ln((257, 5120), torch.float16, residual="none_fp32"),
              ln((64, 8192), torch.float16, bias=False, param="fp32"), ln((100, 6000), torch.float32),
              # bwd_regs blocks of two 384-thread teams: 48 KB of dynamic shared
              # memory, over the 48 KB a kernel may take unasked with its static array
              ln((5000, 3072), torch.bfloat16), rms((999, 3072), torch.float32, residual="none")]


def check_twice(c, device):
    """Case c's outputs and gradients (poisoned first) against the reference,
    and bitwise the same from a second run."""
    inp = make_inputs(c, device)
    got = forward_backward(c, inp, poison=True)
    check_against_reference(c, inp, got)
    assert_same_results(got, forward_backward(c, inp), f"{c}: second run")


# Rows of 256, 512, 768 and 1024 16-bit values with a residual and a weight in x's
# dtype run fwd_narrow on CUDA (norm_regs.cuh: the width a compile-time
# constant, one warp a row): LayerNorm with and without bias, RMSNorm, one
# row, a few, and thousands. Beside them, calls at those widths that
# fwd_narrow leaves to fwd_regs: no weight, fp32 weight, fp32 residual, no
# residual. With statistics (the backward's forward), rows of 256 and
# LayerNorm's of 512 run eight to a block: row counts of whole blocks and of
# a last block part full.
NARROW_CASES = ([ln((2, 700, 512), torch.bfloat16), ln((3, 256), torch.float16, bias=False),
                 rms((1, 1024), torch.bfloat16), rms((4000, 256), torch.float16),
                 ln((1500, 1024), torch.float16), rms((5, 512), torch.bfloat16),
                 ln((13, 512), torch.bfloat16), ln((1001, 256), torch.bfloat16),
                 rms((9, 256), torch.bfloat16), ln((3000, 768), torch.bfloat16),
                 rms((7, 768), torch.float16), ln((2, 3, 768), torch.float16, bias=False)]
                + [ln((33, 1024), torch.bfloat16, weight=False), ln((33, 256), torch.bfloat16, param="fp32"),
                   rms((33, 512), torch.float16, residual="fp32"), rms((33, 1024), torch.bfloat16, residual="none"),
                   ln((33, 768), torch.bfloat16, param="fp32")])


@pytest.mark.parametrize("c", NARROW_CASES, ids=ids(NARROW_CASES))
def test_narrow_rows(device, c):
    check_twice(c, device)


# Rows of a multiple of 4 16-bit values but not of 8 run 8-byte kernels on
# CUDA (norm_plan.c, access_vec: fwd_regs and bwd_regs at 4 values a chunk,
# else the loop kernels and dwdb_cols): a warp a row (100), teams of 64
# threads (260) and 288 (4100, 8196), the forward's 8 chunks a thread (8196),
# the loop kernels past the register teams (16388 forward and backward, 8196
# backward); s, weight or no residual in other dtypes.
HALF_CASES = [ln((3, 100), torch.bfloat16), rms((1000, 260), torch.float16, residual="fp32"),
              ln((33, 260), torch.bfloat16), ln((5, 1004), torch.bfloat16, param="fp32"),
              rms((33, 4100), torch.bfloat16), ln((7, 4100), torch.float16, residual="none"),
              ln((9, 8196), torch.bfloat16), rms((3, 8196), torch.float16, weight=False),
              ln((5, 16388), torch.bfloat16, residual="fp32", param="fp32"), rms((70, 16388), torch.bfloat16)]


@pytest.mark.parametrize("c", HALF_CASES, ids=ids(HALF_CASES))
def test_half_aligned_rows(device, c):
    check_twice(c, device)


# Rows that no 8-byte access fits run the register kernels at 4 bytes a chunk
# (16-bit rows of 2 mod 4 values, whose rows are 4-byte aligned; fp32 rows of
# an even number of values: 8 bytes) or one element a chunk (odd widths) on
# CUDA (norm_plan.c, access_vec), and past their teams the loop kernels one
# element a load: one chunk a thread (62: the backward's dweight / dbias sums
# padded to a float4), teams of 64-512 threads with 4 or 8 chunks a thread,
# the forward's 8 chunks of 2 (8190) and of 1 (4095), the backward's 16 of 1
# (4097, 6001: teams of 288 and 384), the backward one warp a row (262), the
# loop kernels past them (8195 both ways; 10002, 16382 and 16386 both ways;
# 4097 and 6001 forward); teams of one-element chunks two rows a block (1025:
# resident_rows); s, weight or no residual in other dtypes. The
# forward's contiguous rows up to 1536 values (1024 with fp32 s) run
# fwd_group instead (norm_misaligned.cuh: groups of 8 rows, 4 of fp32; 5, 33 and 3
# rows leave the last group part full, and a tail that is not a whole 16-byte
# word), and their backward up to 438-512 values bwd_group (62, 262, 263 and
# the one-warp cases' 257-259); their other sides are under
# test_chunk_plans_cuda. The forward of such rows past 1536 values, and of
# HALF_CASES' 8-byte rows, runs fwd_shift where the rows are contiguous
# (norm_misaligned.cuh: each row's first values up to a 16-byte boundary, then
# 16-byte chunks, then a tail): one, two and four chunks a thread (2050-4097,
# 8190-8195, 10002-16386), heads of 1, 2, 5, 6 and 7 values (the rows of
# 4095, 4097, 8195) and of 2, 4, 6 (2050, 8190), no weight or bias (4097), an
# fp32 weight (2050, 4095, 16382); with norm_shift=0 (test_chunk_plans_cuda) the
# register and loop kernels run them, and with 2 fwd_shift runs every width.
SMALL_CHUNK_CASES = [ln((5, 62), torch.bfloat16), ln((33, 1030), torch.bfloat16),
                     rms((1000, 262), torch.float16, residual="fp32"), ln((5, 2050), torch.bfloat16, param="fp32"),
                     rms((7, 8190), torch.bfloat16), ln((9, 10002), torch.bfloat16, residual="none"),
                     ln((50, 202), torch.float32), rms((33, 1001), torch.float32, residual="none"),
                     ln((5, 1025), torch.bfloat16), rms((1000, 263), torch.float16, residual="fp32"),
                     ln((3, 4095), torch.bfloat16, param="fp32"), ln((4, 8195), torch.float16),
                     ln((3, 4097), torch.bfloat16, weight=False, bias=False),
                     rms((17, 6001), torch.float16, residual="fp32"), ln((5, 16382), torch.bfloat16, param="fp32"),
                     ln((3, 16386), torch.bfloat16, residual="none")]


@pytest.mark.parametrize("c", SMALL_CHUNK_CASES, ids=ids(SMALL_CHUNK_CASES))
def test_small_chunk_rows(device, c):
    check_twice(c, device)


SHIFT_PARAM_CASES = [ln((6, 4098), torch.bfloat16), ln((5, 4095), torch.float16), rms((4, 4100), torch.bfloat16),
                     ln((9, 2050), torch.bfloat16, residual="none")]


@requires_cuda
@pytest.mark.parametrize("offset", [1, 2])
@pytest.mark.parametrize("c", SHIFT_PARAM_CASES, ids=ids(SHIFT_PARAM_CASES))
def test_shifted_rows_cuda(c, offset):
    """fwd_shift reads a chunk's weight and bias (misaligned with the row's
    head) 4 bytes at a time where their addresses allow it, else an element
    at a time: parameters that start `offset` values into their storage give
    bitwise the forward of aligned ones (y only where fwd_shift runs: with
    the norm_shift knob at 0 such parameters take the rows to one element a
    chunk, another order of sums), and every result passes the 2x rule."""
    shift = fusedops._C._tune()["norm_shift"][0] != 0
    inp = make_inputs(c, "cuda")

    def moved(t):
        if t is None:
            return None
        wide = torch.full((t.shape[0] + offset,), NAN, dtype=t.dtype, device=t.device)
        wide[offset:] = t
        return wide[offset:]

    got = forward_backward(c, {**inp, "weight": moved(inp["weight"]), "bias": moved(inp["bias"])}, poison=True)
    want = forward_backward(c, inp)
    for name in ("y", "s") if shift else ("s",):
        assert torch.equal(bits(got[name]), bits(want[name])), f"{c}: {name} with parameters {offset} values in"
    check_against_reference(c, inp, got)


# Rows where a team would be two warps with lanes to spare run one warp a row
# at twice the values on CUDA: the backward's wherever the team is not full
# (norm_plan.c, the backward's one-warp rule: 384 and 264 16-bit values, 260 in HALF_CASES, 200
# fp32 values, 257 in 16 chunks of one element, 258 in 8 of two; 259 fp32
# keeps its team of 64), the forward's where about half its chunk slots are
# empty and its chunks are of 16 bytes, or of 8 for LayerNorm (fwd_warp: 264;
# LayerNorm's 260 in HALF_CASES; not 384, nor 257-259).
WARP_BWD_CASES = [ln((100, 384), torch.bfloat16), rms((33, 264), torch.float16, residual="fp32"),
                  ln((50, 200), torch.float32, residual="none"), ln((65, 257), torch.bfloat16),
                  rms((40, 258), torch.float16, residual="fp32"), ln((9, 259), torch.float32),
                  rms((3, 257), torch.bfloat16, param="fp32", residual="none")]


@pytest.mark.parametrize("c", WARP_BWD_CASES, ids=ids(WARP_BWD_CASES))
def test_warp_backward_rows(device, c):
    check_twice(c, device)


# The backward between 2048 and 4096 values on CUDA: 16-bit x and s from 2304
# values run bwd_pipe (norm_plan.c, bwd_pipe_mid; teams of 160-256 threads,
# at 2600 192 whose last chunks lie past the row), bf16 rows below it (2056,
# 2200) bwd_regs at 16 values a thread (bwd_mid_bf16; the last threads'
# second chunks past the row), and an fp32 residual bwd_regs at 8. With
# norm_bwd_pipe_from=65536 (test_backward_plans_cuda) the rows of
# 2304 and up take bwd_mid_bf16 (bf16) or 8 values (fp16, an fp32 weight).
MID_BWD_CASES = [ln((1000, 2560), torch.bfloat16), rms((37, 2056), torch.bfloat16), ln((7, 3072), torch.bfloat16),
                 rms((5, 3840), torch.bfloat16), ln((3, 5, 3584), torch.bfloat16, bias=False),
                 rms((300, 2600), torch.bfloat16, weight=False), ln((513, 2304), torch.bfloat16),
                 ln((65, 2200), torch.bfloat16),
                 ln((33, 3072), torch.float16), rms((33, 2560), torch.bfloat16, param="fp32"),
                 rms((600, 4096), torch.float16), ln((33, 3584), torch.bfloat16, residual="fp32")]


@pytest.mark.parametrize("c", MID_BWD_CASES, ids=ids(MID_BWD_CASES))
def test_mid_backward_rows(device, c):
    check_twice(c, device)


@requires_cuda
@pytest.mark.parametrize("c", WIDE_CASES + PIPE_CASES, ids=ids(WIDE_CASES + PIPE_CASES))
def test_wide_rows_cuda(c):
    check_twice(c, "cuda")


# LayerNorm of rows whose mean is far from zero against their spread, where a
# variance taken as the mean square less the squared mean would lose its
# digits (fp32 at 1000 + N(0, 2): 0.3 % of each square's bits are the
# deviation). On CUDA rows past 32K bf16 values (16K fp32 or fp16) split over
# a cluster (fwd_pipe): each block takes its slice's mean, and the row's
# deviations are the slices' combined (ClusterSum::moments). 40000 bf16: four
# whole slices of 8192 and one part full; 65536: whole slices, fp32 sixteen
# of 4096; 1000: a row no cluster splits.
OFFSET_CASES = [ln((7, 40000), torch.bfloat16), ln((5, 65536), torch.bfloat16), ln((3, 65536), torch.float32),
                ln((33, 20000), torch.float16, residual="fp32"), ln((9, 1000), torch.float32)]
OFFSETS = {torch.bfloat16: 128.0, torch.float16: 1000.0, torch.float32: 1000.0}  # whole ulps of 1 or less


@pytest.mark.parametrize("c", OFFSET_CASES, ids=ids(OFFSET_CASES))
def test_rows_with_a_large_mean(device, c):
    inp = make_inputs(c, device)
    inp["x"] = (inp["x"].float() + OFFSETS[c.dtype]).to(c.dtype)
    check_against_reference(c, inp, forward_backward(c, inp, poison=True))


# Long rows: every sum of the op (the forward's mean and variance or mean
# square, the backward's row sums, dweight / dbias over rows) is taken in
# blocks whose totals are added with compensation (cpu_dtype.h, long sums;
# csrc/norm/norm_*.cuh), so its error does not grow with the row (it grew with it:
# 4x eager's error at 262144 fp32 values, 250x at 4M; dweight of RMSNorm over
# 262144 rows 36x). The 2x rule's floor, room for a sum taken in another order
# than eager's, is where such growth hides: these cases hold the kernels to
# LONG_FLOOR of the scale instead of tolerances.FLOOR's 1e-5. Few rows, to
# keep the CPU run short; COLUMN_CASES: many rows of few columns.
LONG_FLOOR = 1e-7
LONG_CASES = [c for rows, n in ((2, 262144), (2, 1 << 20), (1, 1 << 22))
              for c in (ln((rows, n), residual="none"), ln((rows, n), residual="x"),
                        rms((rows, n), residual="none"), rms((rows, n), residual="x", param="fp32"))]
COLUMN_CASES = [ln((262144, 16)), rms((262144, 16), residual="none"), ln((65536, 40), residual="fp32")]


@pytest.mark.parametrize("c", LONG_CASES + COLUMN_CASES, ids=ids(LONG_CASES + COLUMN_CASES))
def test_long_rows(device, c):
    inp = make_inputs(c, device)
    check_against_reference(c, inp, forward_backward(c, inp, poison=True), floor=LONG_FLOOR)


def test_layer_norm_module_of_a_million_values(device):
    """fusedops.nn.LayerNorm((64, 128, 128)) (rows of 1M values: 30x eager's
    error before the long sums) against torch.nn.LayerNorm, by the 2x rule with
    LONG_FLOOR, forward and backward."""
    shape = (64, 128, 128)
    x = torch.randn(2, *shape, device=device)
    gy = torch.randn_like(x)
    ref = torch.nn.LayerNorm(shape, device=device, dtype=torch.float64)
    eager = torch.nn.LayerNorm(shape, device=device)
    mod = fusedops.nn.LayerNorm(shape, device=device)
    with torch.no_grad():
        for m in (ref, eager, mod):  # one random affine for all three
            torch.manual_seed(0)
            m.weight.copy_(torch.randn(shape))
            m.bias.copy_(torch.randn(shape))
    results = []
    for m in (mod, ref, eager):
        xi = x.detach().to(m.weight.dtype).requires_grad_()
        y = m(xi)
        y.backward(gy.to(y.dtype))
        results.append([y, xi.grad, m.weight.grad, m.bias.grad])
    for name, got, want, ea in zip(["y", "dx", "dweight", "dbias"], *results):
        assert_close_2x(got, want, ea, f"LayerNorm{shape} {name}", atol_floor=LONG_FLOOR * default_scale(want.detach()))


# Rows holding a value of 1e30 or 1e38: a sum of squares overflows fp32 (from
# about 1e19), which gave outputs of 3e32 (inf at 1e38) where LayerNorm's are
# bounded by sqrt(n - 1) and RMSNorm's by sqrt(n). The statistics of such a row
# are taken on it scaled by a power of two. torch's own fp32 result is no
# yardstick here (zeros where the outputs reach sqrt(n - 1), NaN gradients at
# 1e38): every result is held to the float64 result rounded to fp32 (twice
# its error plus the floor), and y to its bound.
HUGE_CASES = [ln((3, 1000), residual="none"), ln((3, 1000), residual="fp32"), rms((3, 1000), residual="none"),
              rms((3, 1000), residual="x"), ln((2, 4097), bias=False), rms((1, 70000), residual="none")]


@pytest.mark.parametrize("big", [1e30, 1e38])
@pytest.mark.parametrize("c", HUGE_CASES, ids=ids(HUGE_CASES))
def test_rows_with_a_huge_value(request, device, c, big):
    if device == "cuda":  # strict: passes, and so fails, once the CUDA kernels rescale such rows
        request.applymarker(pytest.mark.xfail(strict=True, reason="the CUDA kernels do not rescale rows whose "
                                              "sums overflow yet: all-zero outputs (issue 50, item 7)"))
    inp = make_inputs(c, device)
    n = c.shape[-1]
    inp["x"][:, 123] = big
    inp["x"][0, 7] = -big  # and one row with two
    got = forward_backward(c, inp, poison=True)
    ref = forward_backward(c, inp, reference.add_norm, to=torch.float64)
    rounded = {k: None if v is None else v.to(c.dtype) for k, v in ref.items()}
    check_against_reference(c, inp, got, eager=rounded)
    w = 1.0 if inp["weight"] is None else float(inp["weight"].abs().max())
    b = 0.0 if inp["bias"] is None else float(inp["bias"].abs().max())
    bound = math.sqrt(n) * w + b
    y = got["y"].detach()
    assert torch.isfinite(y).all() and float(y.abs().max()) <= bound * (1 + 1e-5), (
        f"{c}: |y| reaches {float(y.abs().max()):.3g}, bounded by {bound:.3g}")


@requires_cuda
@pytest.mark.parametrize("rms_", [False, True])
def test_pipe_rows_without_ds_cuda(rms_):
    """Without a gradient for s (no ds) bwd_pipe stages two arrays a row, not
    three: dx must equal that of ds = 0, and dweight / dbias be unchanged."""
    c = (rms if rms_ else ln)((300, 8192), torch.bfloat16)
    inp = make_inputs(c, "cuda")
    y, s, mean, rstd = ops.add_norm_fwd(inp["x"], inp["residual"], inp["weight"], inp["bias"], c.eps, c.rms, False)
    args = (s, inp["weight"], inp["bias"], mean, rstd, c.rms, True, not c.rms)
    with poisoned("cuda"):
        got = ops.add_norm_bwd(inp["gy"], None, *args)
    want = ops.add_norm_bwd(inp["gy"], torch.zeros_like(s), *args)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def _tests_with_env(env, select):
    """This file's tests selected by `select` (pytest -k), run in a subprocess
    with the settings `env` ("NAME=value ..."): the kernels' tuning switches
    are read once per process."""
    import os
    import subprocess
    import sys
    extra = dict(kv.split("=") for kv in env.split())
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", select],
                          env=dict(os.environ, **extra), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{env}:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-500:]


@pytest.mark.parametrize("env", ["FUSEDOPS_CPU_STREAM=2", "FUSEDOPS_CPU_STREAM=2 FUSEDOPS_CPU_ISA=3"])
def test_streaming_stores_cpu(env):
    """The CPU forward and backward of fp32 rows in a call that moves 32 MiB
    or more (fo_cpu_stream) store y and dx past the caches (aligned whole
    blocks; the rest plainly) and prefetch each next row; no test shape is
    that large, so FUSEDOPS_CPU_STREAM=2 takes that path on every fp32 call:
    at the CPU's level (64-byte blocks on AVX-512) and at v3 (32). Odd widths
    and slices give misaligned rows."""
    _tests_with_env(env, "cpu and (test_dtypes or test_shapes or test_noncontiguous or test_s_is_eager_sum or "
                         "test_poisoned_outputs or test_deterministic or test_raw_forward_outputs or "
                         "test_large_mean or test_narrow_rows or test_half_aligned or test_small_chunk)")


def _cuda_calls(*groups):
    """This file's CUDA tests of the named groups, as (test function, arguments)."""
    dev = "cuda"
    table = {
        "wide": [(test_wide_rows_cuda, dict(c=c)) for c in WIDE_CASES + PIPE_CASES],
        "pipe_no_ds": [(test_pipe_rows_without_ds_cuda, dict(rms_=r)) for r in (False, True)],
        "shapes": [(test_shapes, dict(device=dev, c=c)) for c in SHAPE_CASES],
        "half": [(test_half_aligned_rows, dict(device=dev, c=c)) for c in HALF_CASES],
        "small": [(test_small_chunk_rows, dict(device=dev, c=c)) for c in SMALL_CHUNK_CASES],
        "warp": [(test_warp_backward_rows, dict(device=dev, c=c)) for c in WARP_BWD_CASES],
        "mid": [(test_mid_backward_rows, dict(device=dev, c=c)) for c in MID_BWD_CASES],
        "shifted": [(test_shifted_rows_cuda, dict(c=c, offset=o)) for c in SHIFT_PARAM_CASES for o in (1, 2)],
        "no_stats": [(test_forward_without_stats, dict(device=dev, c=c)) for c in NO_STATS_CASES]
                    + [(test_forward_without_stats_wide_cuda, dict(c=c)) for c in NO_STATS_CUDA_CASES],
        "park_layouts": [(test_noncontiguous, dict(device=dev, c=c, arg=a, kind=k)) for c, a, k in LAYOUT_PARAMS
                         if 17000 in c.shape],
        "back_to_back": [(test_back_to_back_cuda, dict(shape=sh, rms_=r)) for sh in BACK_TO_BACK
                         for r in (False, True)],
        "eager_sum": [(test_s_is_eager_sum, dict(device=dev, cols=n, dtype=t, rms_=r)) for n in EAGER_SUM_WIDTHS
                      for t in (torch.bfloat16, torch.float16) for r in (False, True)],
        "narrow": [(test_narrow_rows, dict(device=dev, c=c)) for c in NARROW_CASES],
    }
    return [call for g in groups for call in table[g]]


def _run_tuned(knobs, calls):
    """Runs each call with the knobs set; a failure names the knobs and the call."""
    with tuned(**knobs):
        for fn, kwargs in calls:
            try:
                fn(**kwargs)
            except pytest.skip.Exception:
                pass
            except Exception as e:
                raise AssertionError(f"with {knobs}: {fn.__name__}({kwargs}): {e}") from e


@requires_cuda
@pytest.mark.parametrize("knobs", [dict(norm_stages=4), dict(norm_stages=0), dict(norm_values=16),
                                   dict(norm_bwd_pipe_from=65536)], ids=str)
def test_backward_plans_cuda(knobs):
    """The backward's tuning knobs: four pipeline stages (three rows ahead), no
    pipe kernels (stages 0: bwd_regs and the loop kernels take their rows), 16
    values a thread (registers that cap a block at 512 threads), and bwd_regs
    for the 16-bit rows of 2304-4096 values (bwd_pipe from 65536 only), on the
    pipe, wide-row, shape, 8-byte, small-chunk, one-warp and middle-width cases."""
    _run_tuned(knobs, _cuda_calls("wide", "pipe_no_ds", "shapes", "half", "small", "warp", "mid"))


@requires_cuda
@pytest.mark.parametrize("knobs", [dict(norm_group=0), dict(norm_group=2, norm_group_kb=200), dict(norm_group_bwd=0),
                                   dict(norm_shift=0), dict(norm_shift=2), dict(norm_shift_bwd=0),
                                   dict(norm_shift_bwd=2)], ids=str)
def test_chunk_plans_cuda(knobs):
    """fwd_group off (the register kernels at 4 bytes and one element) and
    taken also at 8 bytes a chunk, up to 200 KB a block (100, 260, 1004 and
    4100 wide among them), bwd_group off (62, 257-263 on bwd_regs), fwd_shift
    off (the forward's rows of 4 mod 8 values and its rows past 1536 values of
    2 mod 4 or odd widths on the register and loop kernels) and taken at every
    width (1 and 7 values all head or tail, 62-263 one warp a row, fwd_group's
    1025 and 1030), and bwd_shift likewise (off: bwd_regs and the loop
    kernels; 2: bwd_group's rows too), on the shape, 8-byte, small-chunk,
    one-warp and shifted-row cases."""
    _run_tuned(knobs, _cuda_calls("shifted", "shapes", "half", "small", "warp"))


@requires_cuda
@pytest.mark.parametrize("knobs", [dict(norm_park=2), dict(norm_park=0), dict(norm_narrow_block=1),
                                   dict(norm_narrow_block=2), dict(norm_ln16=0), dict(norm_ln16=2)], ids=str)
def test_forward_plans_cuda(knobs):
    """fwd_park runs by default only where its rows fill its last wave of
    blocks (norm_plan.c, park_plan), which most test shapes do not: with
    norm_park=2 it runs every 16K-32K row of 16-bit x and s, and with 0 none
    (fwd_regs' 1024-thread teams and fwd_pipe run them). norm_narrow_block
    sets the rows (one a warp) of a block of the forward without statistics at
    256 and 512 wide, whose default depends on the GPU's memory bandwidth (1 on
    an H100, 2 on an H200): with 2, odd row counts (1, 3, 5, 9, 13, 1001)
    leave the last block half full. norm_ln16 likewise sets LayerNorm's values
    a thread at 2048-4096 wide (8 on an H100, 16 on an H200; 0: 8, 2: 16 on
    any GPU), on the middle widths' cases (2200-3584, bf16 and fp16)."""
    _run_tuned(knobs, _cuda_calls("wide", "no_stats", "park_layouts", "back_to_back", "eager_sum", "narrow",
                                  "mid"))


# One shape (rows, cols) for each kernel: fwd_narrow (1024 wide), fwd_regs and
# bwd_regs (4096; 4100: 8-byte loads; 1030: 4-byte; 1025: one element),
# fwd_group and bwd_group (257),
# fwd_loop, bwd_loop and dwdb_cols (8195: one element a load; the backward of
# 4099 too),
# fwd_park under norm_park=2 (32768; test_forward_plans_cuda), the
# cluster pipes (65536); colsum after every backward.
BACK_TO_BACK = [(2048, 1024), (1024, 4096), (1024, 4100), (512, 4099), (1024, 1030), (1024, 1025),
                (1024, 257), (256, 8195), (96, 32768), (48, 65536)]


@requires_cuda
def test_backward_on_two_threads_cuda():
    """One backward kernel launched from two threads with different shared
    memory (autograd runs CUDA backwards on a thread of its own): rows of 512
    bf16 values take bwd_regs' 8-value kernel with 60 KB of dynamic shared
    memory, rows of 256 the same kernel with 30 KB. A grant of each call's
    own bytes, remembered per thread, let the second thread's call lower the
    kernel's limit under the first thread's next launch ("invalid argument")."""
    import threading

    def backward(cols):
        x, r, dy, ds = (torch.randn(64, cols, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        w, b = (torch.randn(cols, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        _, s, mean, rstd = ops.add_norm_fwd(x, r, w, b, 1e-5, False, False)
        got = ops.add_norm_bwd(dy, ds, s, w, b, mean, rstd, False, True, True)
        torch.cuda.synchronize()
        return got

    backward(512)
    errors = []

    def other():
        try:
            backward(256)
        except RuntimeError as e:
            errors.append(e)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert not errors, errors
    backward(512)  # raised "CUDA error: invalid argument" before


@requires_cuda
@pytest.mark.parametrize("rms_", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("shape", BACK_TO_BACK, ids=[f"{r}x{c}" for r, c in BACK_TO_BACK])
def test_back_to_back_cuda(shape, rms_):
    """Forward and backward calls that each read what the call before wrote,
    queued with no synchronization, give bitwise what the same calls give one
    at a time, and so does the chain captured in a CUDA graph and replayed:
    every kernel and workspace is ordered on the caller's stream, and the
    allocator hands freed memory straight back to the next call."""
    rows, cols = shape
    gen = torch.Generator(device="cuda").manual_seed(rows * cols + rms_)
    x, r = (torch.randn(rows, cols, device="cuda", generator=gen).bfloat16() for _ in range(2))
    w = (1 + 0.1 * torch.randn(cols, device="cuda", generator=gen)).bfloat16()
    b = None if rms_ else (0.1 * torch.randn(cols, device="cuda", generator=gen)).bfloat16()

    def chain(sync):
        xs, rs, out = x, r, []
        for _ in range(6):
            y, s, mean, rstd = ops.add_norm_fwd(xs, rs, w, b, 1e-5, rms_, False)
            if sync:
                torch.cuda.synchronize()
            dx, dw, db = ops.add_norm_bwd(y, s, s, w, b, mean, rstd, rms_, True, b is not None)
            if sync:
                torch.cuda.synchronize()
            out += [dw, db]
            xs, rs = dx, y
        return out + [y, s, xs]

    want, got = chain(True), chain(False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(want[-1].float()).all()
    for how, outs in (("queued", got), ("graph", captured)):
        for i, (a, g) in enumerate(zip(want, outs)):
            assert torch.equal(bits(a), bits(g)), f"{shape} {'rms' if rms_ else 'ln'} {how}: output {i}"


# One width for each forward kernel that adds x and residual of one 16-bit
# dtype (csrc/norm/norm_*.cuh): fwd_narrow (256, 512, 768, 1024), fwd_regs with
# one, two and four chunks a thread (4096, 8192, 16384), fwd_park (32768; every
# row under norm_park=2, test_forward_plans_cuda), fwd_regs at 4 bytes
# and one element a chunk (1030, 4099), fwd_loop (8195: one element a load)
# and the pipe (65536).
EAGER_SUM_WIDTHS = [256, 512, 768, 1024, 4096, 8192, 16384, 32768, 1030, 4099, 8195, 65536]


@pytest.mark.parametrize("rms_", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("cols", EAGER_SUM_WIDTHS)
def test_s_is_eager_sum(device, cols, dtype, rms_):
    """s is bitwise eager's x + residual (the fp32 sum rounded once to the
    dtype), with and without a weight, for values whose exponents lie far apart
    (one far below the other's last bit, and every distance between), with
    subnormals, and with sums that fall exactly halfway between two values of
    the dtype (rounded to even)."""
    if torch.device(device).type == "cpu" and cols > 8192:
        pytest.skip("the CPU kernel has one code path for every width")
    rows = 3 if cols > 8192 else 40
    gen = torch.Generator(device=device).manual_seed(cols * 4 + 2 * rms_ + (dtype == torch.float16))
    lo, hi = (-134, 40) if dtype == torch.bfloat16 else (-26, 10)  # down to subnormals

    def spread():
        e = torch.randint(lo, hi, (rows, cols), device=device, generator=gen).double()
        return (torch.randn(rows, cols, device=device, generator=gen, dtype=torch.float64) * e.exp2()).to(dtype)
    x, r = spread(), spread()
    # A quarter of the residuals: half an ulp of x (a tie to round to even), or
    # that and a quarter ulp more (just past it), with either sign.
    ulp = torch.where(x == 0, 1.0, x.double().abs()).log2().floor().exp2() * torch.finfo(dtype).eps
    half = ulp / 2 * torch.where(torch.rand(rows, cols, device=device, generator=gen) < 0.5, 1.0, 1.5)
    sign = torch.where(torch.rand(rows, cols, device=device, generator=gen) < 0.5, -1.0, 1.0)
    tie = (torch.rand(rows, cols, device=device, generator=gen) < 0.25) & (x != 0)
    r = torch.where(tie, (sign * half).to(dtype), r)
    want = x + r  # eager: fp32 sum, rounded
    assert torch.isfinite(want).all()
    w = (1 + 0.1 * torch.randn(cols, device=device, generator=gen)).to(dtype)
    b = None if rms_ else (0.1 * torch.randn(cols, device=device, generator=gen)).to(dtype)
    for weight, bias in ((w, b), (None, None)):
        _, s, _, _ = ops.add_norm_fwd(x, r, weight, bias, 1e-5, rms_, False)
        assert torch.equal(bits(s), bits(want)), (
            f"{cols} {dtype_id(dtype)} {'rms' if rms_ else 'ln'} weight={weight is not None}: "
            f"{(bits(s) != bits(want)).sum().item()} of {want.numel()} values of s differ from x + residual")


def _stats64(s, eps, rms):
    """Per-row (mean, rstd) of s, computed in s's dtype ([0] mean for RMSNorm)."""
    s = s.reshape(-1, s.shape[-1])
    mean = s.mean(-1)
    var = (s * s).mean(-1) if rms else (s - mean[:, None]).pow(2).mean(-1)
    return (s.new_zeros(0) if rms else mean), (var + eps).rsqrt()


STAT_CASES = [ln((3, 1000), torch.bfloat16), ln((3, 1000), torch.bfloat16, residual="fp32"),
              rms((3, 1000), torch.float16, residual="none"), rms((5, 4097), residual="none_fp32"),
              ln((2, 3, 7), torch.float16, residual="none_fp32", weight=False, bias=False),
              ln((0, 7)), rms((1, 1))]


def _fwd(inp, c, **kw):
    return ops.add_norm_fwd(inp["x"], inp["residual"], inp["weight"], inp["bias"], c.eps, c.rms,
                            c.residual_in_fp32, **kw)


@pytest.mark.parametrize("c", STAT_CASES, ids=ids(STAT_CASES))
def test_raw_forward_outputs(device, c):
    """add_norm_fwd's four outputs: y, s (empty when s is x), and the fp32 per-row
    mean (empty for RMSNorm) and rstd saved for the backward, computed from s as
    stored."""
    inp = make_inputs(c, device)
    with poisoned(device):
        y, s, mean, rstd = _fwd(inp, c)
    assert y.shape == inp["x"].shape and y.dtype == c.dtype and y.is_contiguous()
    if c.stores_s:
        assert s.shape == inp["x"].shape and s.dtype == c.s_dtype
    else:
        assert s.shape == (0,) and s.dtype == c.dtype
        s = inp["x"]
    assert mean.dtype == rstd.dtype == torch.float32
    assert mean.shape == ((0,) if c.rms else (c.rows,)) and rstd.shape == (c.rows,)
    ref, eager = _stats64(s.double(), c.eps, c.rms), _stats64(s.float(), c.eps, c.rms)
    for name, got, r, e in zip(("mean", "rstd"), (mean, rstd), ref, eager):
        assert_close_2x(got, r, e, f"{c} {name}")


# Every forward kernel on CUDA: one-warp and block teams, fwd_park (32768 bf16
# and fp16), the pipe (65536), one element a chunk (4099) and the loop (8195).
NO_STATS_CASES = STAT_CASES + [ln((300, 4099), torch.bfloat16), ln((30, 8195), torch.bfloat16),
                               rms((40, 4096), torch.float16, residual="fp32"),
                               ln((70, 512), torch.bfloat16), rms((70, 1024), torch.float16),  # fwd_narrow
                               # and its two-warp blocks (H200; norm_narrow_block=2), the last one half full
                               ln((33, 256), torch.bfloat16), rms((7, 512), torch.float16),
                               ln((1, 512), torch.bfloat16, bias=False), rms((1001, 256), torch.bfloat16)]
NO_STATS_CUDA_CASES = [ln((33, 32768), torch.bfloat16), rms((9, 32768), torch.float16),
                       ln((5, 65536), torch.bfloat16, residual="fp32")]


@pytest.mark.parametrize("c", NO_STATS_CASES, ids=ids(NO_STATS_CASES))
def test_forward_without_stats(device, c):
    """stats=False (no backward to come): y and s bitwise those of stats=True,
    mean and rstd empty (and not written)."""
    inp = make_inputs(c, device)
    want = _fwd(inp, c)
    with poisoned(device):
        got = _fwd(inp, c, stats=False)
    for name, a, b in zip(("y", "s"), want[:2], got[:2]):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b)), f"{c} {name}"
    assert got[2].shape == (0,) and got[3].shape == (0,) and got[3].dtype == torch.float32


@requires_cuda
@pytest.mark.parametrize("c", NO_STATS_CUDA_CASES, ids=ids(NO_STATS_CUDA_CASES))
def test_forward_without_stats_wide_cuda(c):
    test_forward_without_stats(torch.device("cuda"), c)


def test_forward_without_stats_refuses_a_gradient(device):
    c = ln((3, 8))
    inp = make_inputs(c, device)
    inp["x"].requires_grad_()
    with pytest.raises(RuntimeError, match=r"fusedops\.add_norm_fwd: stats is False, expected True when a "
                                           r"gradient is wanted"):
        _fwd(inp, c, stats=False)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_functional_stats_only_for_a_backward(device, grad, monkeypatch):
    """fusedops.functional asks for the statistics only when autograd will
    want them, and its results do not depend on it."""
    c = ln((5, 33), torch.bfloat16)
    inp = make_inputs(c, device)
    seen = []
    real = FF._norm.add_norm_fwd

    class Spy:
        def __call__(self, *args):
            seen.append(args[-1])
            return real(*args)
    monkeypatch.setattr(FF, "_norm", type("O", (), {"add_norm_fwd": Spy()})())
    x, r, w, b = (inp[k].detach().requires_grad_(grad) for k in ARGS)
    y, s = FF.fused_add_layer_norm(x, r, w, b)
    with torch.no_grad():
        y2, s2 = FF.fused_add_layer_norm(x, r, w, b)
    assert seen == [grad, False]
    assert torch.equal(bits(y), bits(y2)) and torch.equal(bits(s), bits(s2))


@pytest.mark.parametrize("rms_", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_norm_functions(device, rms_, affine):
    """fusedops.functional.layer_norm / rms_norm: the norm alone, no residual."""
    x = randn((2, 5, 300), torch.bfloat16, device)
    w = randn(300, torch.bfloat16, device) if affine else None
    b = randn(300, torch.bfloat16, device) if affine and not rms_ else None
    eps = 1e-6 if rms_ else 1e-5
    got = FF.rms_norm(x, w, eps) if rms_ else FF.layer_norm(x, w, b, eps)
    want = reference.add_norm(*(None if t is None else t.double() for t in (x, None, w, b)), eps, rms_)[0]
    eager = reference.add_norm(x, None, w, b, eps, rms_)[0]
    assert_close_2x(got, want, eager, "y")


# --------------------------------------------------------------------------- layouts

def relayout(t, kind):
    """(contiguous, non-contiguous) tensors holding the same values, the second
    laid out as `kind`. Padding that a misreading kernel could pick up is NaN."""
    def padded(shape, index):
        wide = torch.full(shape, NAN, dtype=t.dtype, device=t.device)
        wide[index] = t
        return wide[index]

    if kind == "expand":  # one row broadcast to every row (row stride 0)
        v = t.reshape(-1, t.shape[-1])[0].expand(t.shape)
        return v.contiguous(), v
    if kind == "transpose":  # last dim not unit-stride: must be copied
        return t, t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "permute":  # leading dims swapped: rows not one stride apart
        return t, t.transpose(0, 1).contiguous().transpose(0, 1)
    if kind.startswith("slice"):  # a slice along the last dim of a wider tensor
        # 16-byte aligned rows, 8-byte (16-bit values), 4-byte, or one element's
        start, extra = {"slice": (8, 16), "slice_half": (4, 8), "slice_quarter": (2, 6),
                        "slice_misaligned": (1, 3)}[kind]
        return t, padded((*t.shape[:-1], t.shape[-1] + extra), (..., slice(start, start + t.shape[-1])))
    if kind == "rowstep":  # every other row of a taller tensor
        return t, padded((2 * t.shape[0], *t.shape[1:]), slice(None, None, 2))
    if kind == "stride2":  # a 1-D parameter with stride 2
        return t, padded((2 * t.shape[0],), slice(None, None, 2))
    raise ValueError(kind)


LAYOUTS = [("x", "transpose"), ("x", "permute"), ("x", "slice"), ("x", "slice_misaligned"),
           ("x", "slice_half"), ("x", "slice_quarter"), ("x", "rowstep"), ("residual", "slice"),
           ("residual", "slice_misaligned"), ("residual", "slice_half"), ("residual", "slice_quarter"),
           ("residual", "transpose"), ("residual", "expand"), ("residual", "rowstep"),
           ("weight", "stride2"), ("bias", "stride2"), ("gy", "slice"), ("gy", "slice_misaligned"),
           ("gy", "transpose"), ("gy", "slice_half"), ("gy", "slice_quarter"), ("gs", "slice_misaligned"),
           ("gs", "expand")]
LAYOUT_CASES = [ln((4, 6, 1000), torch.bfloat16), ln((24, 1000), residual="fp32"),
                rms((24, 1000), torch.float16), rms((4, 6, 1000), torch.bfloat16, residual="fp32"),
                ln((4, 6, 512), torch.bfloat16), rms((24, 1024), torch.float16),  # fwd_narrow
                ln((2, 3, 17000), torch.bfloat16)]  # fwd_park
LAYOUT_PARAMS = [(c, arg, kind) for c in LAYOUT_CASES for arg, kind in LAYOUTS
                 if not (arg == "bias" and c.rms) and not (kind == "permute" and len(c.shape) < 3)]
# Layouts whose results may differ in rounding from the contiguous ones on CUDA:
# with rows not 16-byte aligned the CUDA kernels read 8 or 4 bytes or one
# element at a time (norm_plan.c, access_vec), and sum in another order. Every other
# layout is read in place on the same path, or copied, and must give bitwise the
# contiguous results.
NOT_BITWISE_ON_CUDA = {"slice_misaligned", "slice_half", "slice_quarter"}


@pytest.mark.parametrize("c,arg,kind", LAYOUT_PARAMS, ids=[f"{c}-{a}-{k}" for c, a, k in LAYOUT_PARAMS])
def test_noncontiguous(device, c, arg, kind):
    """Non-contiguous inputs (and upstream gradients) are read correctly: the
    results equal bitwise those of contiguous inputs holding the same values
    (see NOT_BITWISE_ON_CUDA), and pass the 2x rule."""
    inp = make_inputs(c, device)
    contiguous, strided = relayout(inp[arg], kind)
    assert not strided.is_contiguous()
    want = forward_backward(c, {**inp, arg: contiguous})
    got = forward_backward(c, {**inp, arg: strided})
    if kind not in NOT_BITWISE_ON_CUDA or device == "cpu":
        assert_same_results(got, want, f"{arg} as {kind}")
    check_against_reference(c, {**inp, arg: contiguous}, got)


# --------------------------------------------------------------------------- poisoned outputs

def test_poison_fills_allocations(device):
    """conftest.poisoned works: memory allocated inside it, the way the extension
    allocates its outputs (new_empty), reads as NaN."""
    like = torch.ones(3, device=device)
    with poisoned(device):
        made = [like.new_empty((5, 7), dtype=dt) for dt in LOWP] + [torch.empty(1 << 20, device=device)]
    for t in made:
        assert t.isnan().all(), t.dtype


POISON_CASES = [ln((3, 1000), torch.bfloat16), ln((3, 4097), torch.float16, residual="none_fp32"),
                ln((5, 7), residual="none"), ln((3, 1), torch.bfloat16, param="fp32"),
                ln((2, 3, 7), bias=False), ln((3, 7), weight=False), ln((0, 7)),
                ln((0, 4097), torch.bfloat16, residual="fp32", param="fp32"),
                rms((3, 1000), torch.bfloat16, residual="fp32"), rms((1, 65536), torch.float16),
                rms((4000, 7), residual="none"), rms((3, 7), torch.bfloat16, residual="none_fp32")]


@pytest.mark.parametrize("c", POISON_CASES, ids=ids(POISON_CASES))
def test_poisoned_outputs(device, c):
    """Outputs allocated from NaN-filled memory are fully written: finite (the
    inputs are) and correct."""
    inp = make_inputs(c, device)
    got = forward_backward(c, inp, poison=True)
    for name, t in got.items():
        assert t is None or torch.isfinite(t).all(), f"{c} {name} has non-finite values"
    check_against_reference(c, inp, got)


# --------------------------------------------------------------------------- inputs unchanged

def call_unchanged(op, *args):
    """op(*args), asserting that every tensor argument's whole storage (padding
    of a view included) is bitwise the same afterwards."""
    tensors = {i: a if a._base is None else a._base for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    before = {i: bits(t).clone() for i, t in tensors.items()}
    try:
        return op(*args)
    finally:
        for i, t in tensors.items():
            assert torch.equal(bits(t), before[i]), f"{op}: argument {i} was modified"


UNCHANGED_CASES = [ln((3, 1000), torch.bfloat16), ln((3, 1000), torch.float16, residual="fp32", param="fp32"),
                   ln((3, 7), residual="none"), ln((3, 7), torch.bfloat16, residual="none_fp32"),
                   rms((3, 4097), torch.bfloat16), rms((2, 3, 7), residual="fp32")]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "sliced"])
@pytest.mark.parametrize("c", UNCHANGED_CASES, ids=ids(UNCHANGED_CASES))
def test_inputs_unchanged(device, c, strided):
    """add_norm_fwd and add_norm_bwd leave every input bitwise unchanged."""
    inp = make_inputs(c, device)
    if strided:
        inp = {k: None if t is None else relayout(t, "stride2" if t.dim() == 1 else "slice")[1]
               for k, t in inp.items()}
    x, r, w, b = (inp[k] for k in ARGS)
    y, s, mean, rstd = call_unchanged(ops.add_norm_fwd, x, r, w, b, c.eps, c.rms, c.residual_in_fp32)
    ds = inp["gs"] if c.stores_s else None
    call_unchanged(ops.add_norm_bwd, inp["gy"], ds, s if c.stores_s else x, w, b, mean, rstd, c.rms,
                   w is not None, b is not None)


# --------------------------------------------------------------------------- determinism

DETERMINISM_CASES = [ln((4000, 7), torch.bfloat16), ln((64, 4097), residual="fp32", param="fp32"),
                     rms((3, 65536), torch.float16), rms((2, 1000, 7), torch.bfloat16, residual="none_fp32")]


@pytest.mark.parametrize("c", DETERMINISM_CASES, ids=ids(DETERMINISM_CASES))
def test_deterministic(device, c):
    """Two runs of forward and backward on the same inputs agree bitwise."""
    inp = make_inputs(c, device)
    assert_same_results(forward_backward(c, inp), forward_backward(c, inp), "second run")


# --------------------------------------------------------------------------- bad input

def fwd_args(device, dtype=torch.float32, shape=(3, 8)):
    """Valid add_norm_fwd arguments; each bad-input case replaces some."""
    return dict(x=randn(shape, dtype, device), residual=randn(shape, dtype, device),
                weight=randn(shape[-1], dtype, device), bias=randn(shape[-1], dtype, device),
                eps=1e-5, rms=False, residual_in_fp32=False)


FWD = r"fusedops\.add_norm_fwd: "
NO_EXTRAS = dict(residual=None, weight=None, bias=None)
# (id, arguments that replace valid ones, expected message: op, argument, given, expected)
BAD_FWD = [
    ("weight_size", lambda d: dict(weight=randn(7, torch.float32, d)),
     FWD + r"weight has shape \[7\], expected \[8\]"),
    ("weight_2d", lambda d: dict(weight=randn((1, 8), torch.float32, d)),
     FWD + r"weight has shape \[1, 8\], expected \[8\]"),
    ("bias_size", lambda d: dict(bias=randn(9, torch.float32, d)),
     FWD + r"bias has shape \[9\], expected \[8\]"),
    ("residual_shape", lambda d: dict(residual=randn((3, 9), torch.float32, d)),
     FWD + r"residual has shape \[3, 9\], expected the shape of x \[3, 8\]"),
    ("residual_broadcastable", lambda d: dict(residual=randn(8, torch.float32, d)),
     FWD + r"residual has shape \[8\], expected the shape of x \[3, 8\]"),
    ("x_float64", lambda d: dict(x=randn((3, 8), torch.float64, d), **NO_EXTRAS),
     FWD + r"x has dtype float64, expected float32, float16 or bfloat16"),
    ("x_int64", lambda d: dict(x=torch.randint(-5, 5, (3, 8), device=d), **NO_EXTRAS),
     FWD + r"x has dtype int64, expected float32, float16 or bfloat16"),
    ("x_int32", lambda d: dict(x=torch.randint(-5, 5, (3, 8), dtype=torch.int32, device=d), **NO_EXTRAS),
     FWD + r"x has dtype int32, expected float32, float16 or bfloat16"),
    ("residual_float64", lambda d: dict(residual=randn((3, 8), torch.float64, d)),
     FWD + r"residual has dtype float64, expected the dtype of x or float32"),
    ("residual_float16_for_bfloat16_x", lambda d: dict(x=randn((3, 8), torch.bfloat16, d),
                                                       residual=randn((3, 8), torch.float16, d)),
     FWD + r"residual has dtype float16, expected the dtype of x or float32"),
    ("weight_float64", lambda d: dict(weight=randn(8, torch.float64, d)),
     FWD + r"weight has dtype float64, expected the dtype of x or float32"),
    ("bias_int32", lambda d: dict(bias=torch.ones(8, dtype=torch.int32, device=d)),
     FWD + r"bias has dtype int32, expected the dtype of x or float32"),
    ("bias_dtype_unlike_weight", lambda d: dict(x=randn((3, 8), torch.bfloat16, d), residual=None,
                                                weight=randn(8, torch.bfloat16, d)),
     FWD + r"bias has dtype float32, expected the dtype of weight \(bfloat16\)"),
    ("bias_with_rms", lambda d: dict(rms=True),
     FWD + r"bias was given, expected none for RMSNorm \(rms=True\)"),
    ("x_0dim", lambda d: dict(x=randn((), torch.float32, d), **NO_EXTRAS),
     FWD + r"x has shape \[\], expected at least one dimension"),
]


@pytest.mark.parametrize("over,match", [b[1:] for b in BAD_FWD], ids=[b[0] for b in BAD_FWD])
def test_bad_input_fwd(device, over, match):
    raises_unchanged(ops.add_norm_fwd, {**fwd_args(device), **over(device)}, match)


# Cases the public functions do not pass on: they widen a parameter of another
# dtype to fp32 (fusedops.functional._param), and fused_add_rms_norm takes no bias.
NOT_FUNCTIONAL = {"weight_float64", "bias_int32", "bias_with_rms"}
BAD_FUNCTIONAL = [b for b in BAD_FWD if b[0] not in NOT_FUNCTIONAL]


def _fused_add_layer_norm(x, residual, weight, bias, eps, rms, residual_in_fp32):
    return FF.fused_add_layer_norm(x, residual, weight, bias, eps, residual_in_fp32)


@pytest.mark.parametrize("over,match", [b[1:] for b in BAD_FUNCTIONAL], ids=[b[0] for b in BAD_FUNCTIONAL])
def test_bad_input_functional(device, over, match):
    """fused_add_layer_norm passes bad input on to the op's checks."""
    raises_unchanged(_fused_add_layer_norm, {**fwd_args(device), **over(device)}, match)


@requires_cuda
@pytest.mark.parametrize("arg", ["residual", "weight", "bias"])
@pytest.mark.parametrize("x_device", ["cuda", "cpu"])
def test_bad_input_mixed_devices(x_device, arg):
    args = fwd_args(x_device)
    other = "cpu" if x_device == "cuda" else "cuda"
    args[arg] = args[arg].to(other)
    name = {"cuda": "cuda:0", "cpu": "cpu"}
    raises_unchanged(ops.add_norm_fwd, args, FWD + f"{arg} is on {name[other]} but x is on {name[x_device]}; "
                                                   "all tensors must be on one device")


def bwd_args(device):
    """Valid add_norm_bwd arguments (from a forward with residual, weight, bias)."""
    a = fwd_args(device)
    y, s, mean, rstd = ops.add_norm_fwd(**a)
    return dict(dy=randn((3, 8), torch.float32, device), ds=randn((3, 8), torch.float32, device), s=s,
                weight=a["weight"], bias=a["bias"], mean=mean, rstd=rstd, rms=False,
                need_dweight=True, need_dbias=True)


BWD = r"fusedops\.add_norm_bwd: "
BAD_BWD = [
    ("dy_shape", lambda d: dict(dy=randn((3, 9), torch.float32, d)),
     BWD + r"dy has shape \[3, 9\], expected the shape of s \[3, 8\]"),
    ("dy_float64", lambda d: dict(dy=randn((3, 8), torch.float64, d)),
     BWD + r"dy has dtype float64, expected float32, float16 or bfloat16"),
    ("ds_dtype", lambda d: dict(ds=randn((3, 8), torch.bfloat16, d)),
     BWD + r"ds has dtype bfloat16, expected float32"),
    ("mean_shape", lambda d: dict(mean=torch.zeros(2, device=d)),
     BWD + r"mean has shape \[2\], expected a contiguous \[3\]"),
    ("rstd_dtype", lambda d: dict(rstd=torch.ones(3, dtype=torch.float64, device=d)),
     BWD + r"rstd has dtype float64, expected float32"),
    ("dweight_without_weight", lambda d: dict(weight=None),
     BWD + r"need_dweight=True but weight is None"),
    ("weight_size", lambda d: dict(weight=randn(7, torch.float32, d)),
     BWD + r"weight has shape \[7\], expected \[8\]"),
]


@pytest.mark.parametrize("over,match", [b[1:] for b in BAD_BWD], ids=[b[0] for b in BAD_BWD])
def test_bad_input_bwd(device, over, match):
    raises_unchanged(ops.add_norm_bwd, {**bwd_args(device), **over(device)}, match)


@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm"])
def test_bad_input_module_shape(device, name):
    norm = getattr(fusedops.nn, name)((3, 8)).to(device)
    with pytest.raises(RuntimeError, match=rf"fusedops\.nn\.{name}: input of shape \(4, 8, 3\) does not "
                                           r"end with normalized_shape \(3, 8\)"):
        norm(randn((4, 8, 3), torch.float32, device))


# --------------------------------------------------------------------------- opcheck

OPCHECK_CASES = [ln((3, 7)), ln((3, 7), torch.bfloat16, residual="fp32", param="fp32"),
                 ln((2, 3, 7), torch.float16, residual="none"), ln((3, 7), torch.bfloat16, residual="none_fp32"),
                 ln((3, 7), weight=False), ln((3, 7), bias=False), ln((3, 7), weight=False, bias=False),
                 ln((0, 7)), rms((3, 7)), rms((3, 7), torch.bfloat16, residual="fp32", param="fp32"),
                 rms((3, 7), torch.float16, residual="none"), rms((3, 7), residual="none", weight=False),
                 rms((3, 7), torch.bfloat16, residual="fp32", weight=False)]


@pytest.mark.parametrize("c", OPCHECK_CASES, ids=ids(OPCHECK_CASES))
def test_opcheck_fwd(device, c):
    inp = make_inputs(c, device)
    args = tuple(None if inp[k] is None else inp[k].requires_grad_() for k in ARGS)
    torch.library.opcheck(ops.add_norm_fwd, (*args, c.eps, c.rms, c.residual_in_fp32))
    plain = tuple(None if inp[k] is None else inp[k].detach() for k in ARGS)
    torch.library.opcheck(ops.add_norm_fwd, (*plain, c.eps, c.rms, c.residual_in_fp32, False))


@pytest.mark.parametrize("c", OPCHECK_CASES, ids=ids(OPCHECK_CASES))
def test_opcheck_bwd(device, c):
    inp = make_inputs(c, device)
    x, r, w, b = (inp[k] for k in ARGS)
    _, s, mean, rstd = ops.add_norm_fwd(x, r, w, b, c.eps, c.rms, c.residual_in_fp32)
    ds = inp["gs"] if c.stores_s else None
    torch.library.opcheck(ops.add_norm_bwd, (inp["gy"], ds, s if c.stores_s else x, w, b, mean, rstd,
                                             c.rms, w is not None, b is not None))


# --------------------------------------------------------------------------- modules

MODULES = [("LayerNorm", dict(normalized_shape=1000)),
           ("LayerNorm", dict(normalized_shape=(3, 7), eps=1e-3)),
           ("LayerNorm", dict(normalized_shape=1000, elementwise_affine=False)),
           ("LayerNorm", dict(normalized_shape=(4097,), bias=False)),
           ("RMSNorm", dict(normalized_shape=1000)),  # eps=None: finfo(dtype).eps
           ("RMSNorm", dict(normalized_shape=[3, 7], eps=1e-5)),
           ("RMSNorm", dict(normalized_shape=4097, elementwise_affine=False, eps=1e-6))]
MODULE_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items())}".replace(" ", "") for n, kw in MODULES]


def torch_module(name, kwargs, device, dtype=torch.float32):
    """torch.nn.<name> with random (not default) parameters."""
    m = getattr(torch.nn, name)(**kwargs).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32))
    return m


@pytest.mark.parametrize("name,kwargs", MODULES, ids=MODULE_IDS)
def test_module_state_dict(name, kwargs):
    """fusedops.nn modules and torch's load each other's state_dict (strict)."""
    theirs = torch_module(name, kwargs, "cpu")
    ours = getattr(fusedops.nn, name)(**kwargs)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    back = torch_module(name, kwargs, "cpu")
    back.load_state_dict(ours.state_dict(), strict=True)
    assert list(ours.state_dict()) == list(theirs.state_dict()) == list(back.state_dict())
    for k, v in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v) and torch.equal(back.state_dict()[k], v), k
    assert repr(ours) == repr(theirs)


def _module_results(module, x, residual, gy):
    """Output and gradients (input, residual, parameters) of the module on x + residual.
    fusedops' modules take the residual (and must return x + residual as s);
    torch's are given the sum."""
    x = x.detach().requires_grad_()
    residual = None if residual is None else residual.detach().requires_grad_()
    if residual is None:
        y = module(x)
    elif isinstance(module, (fusedops.nn.LayerNorm, fusedops.nn.RMSNorm)):
        y, s = module(x, residual)
        assert torch.equal(s, x + residual), "forward(x, residual) did not return x + residual"
    else:
        y = module(x + residual)
    module.zero_grad()
    y.backward(gy.to(y.dtype))
    out = {"y": y, "dx": x.grad, "dresidual": None if residual is None else residual.grad}
    out.update({"d" + n: p.grad for n, p in module.named_parameters()})
    return out


@pytest.mark.parametrize("with_residual", [False, True], ids=["x", "x+residual"])
@pytest.mark.parametrize("dtype", LOWP, ids=dtype_id)
@pytest.mark.parametrize("name,kwargs", MODULES, ids=MODULE_IDS)
def test_module_matches_torch(device, name, kwargs, dtype, with_residual):
    """fusedops.nn.<name> matches torch.nn.<name> (same state) by the 2x rule, with
    torch's module in float64 as the reference and in dtype as the yardstick;
    forward(x, residual) returns (norm(x + residual), x + residual)."""
    theirs = torch_module(name, kwargs, device, dtype)
    ours = getattr(fusedops.nn, name)(**kwargs).to(device=device, dtype=dtype)
    ours.load_state_dict(theirs.state_dict())
    ref = copy.deepcopy(theirs).double()
    if name == "RMSNorm" and ref.eps is None:
        ref.eps = torch.finfo(dtype).eps  # eps=None means the eps of the input's dtype
    shape = (2, 5, *torch.Size(theirs.normalized_shape))
    x, gy = randn(shape, dtype, device), randn(shape, dtype, device)
    r = randn(shape, dtype, device) if with_residual else None
    got = _module_results(ours, x, r, gy)
    eager = _module_results(theirs, x, r, gy)
    want = _module_results(ref, x.double(), None if r is None else r.double(), gy)
    assert got.keys() == eager.keys() == want.keys()
    for k in got:
        if want[k] is not None:
            scale = max(default_scale(want[k]), math.sqrt(10)) if k in ("dweight", "dbias") else None
            assert_close_2x(got[k], want[k], eager[k], f"{name} {k}", scale=scale)


@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm"])
def test_module_float64_falls_back_to_torch(device, name):
    """Inputs the kernels do not take (float64) get torch's own math."""
    theirs = torch_module(name, dict(normalized_shape=7), device, torch.float64)
    ours = getattr(fusedops.nn, name)(7).to(device=device, dtype=torch.float64)
    ours.load_state_dict(theirs.state_dict())
    x, r = randn((3, 7), torch.float64, device), randn((3, 7), torch.float64, device)
    assert torch.equal(ours(x), theirs(x))
    y, s = ours(x, r)
    assert torch.equal(s, x + r) and torch.equal(y, theirs(x + r))


# --------------------------------------------------------------------------- torch.compile

class PreNormBlock(torch.nn.Module):
    """Linear -> norm(x, residual) -> Linear, as in a pre-norm transformer layer."""

    def __init__(self, norm, hidden):
        super().__init__()
        self.inp = torch.nn.Linear(hidden, hidden)
        self.norm = norm
        self.out = torch.nn.Linear(hidden, hidden)

    def forward(self, x, residual):
        y, s = self.norm(self.inp(x), residual)
        return self.out(y), s


@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm"])
def test_torch_compile(device, name):
    """torch.compile(fullgraph=True) of a block using the fused norm (so: no graph
    breaks) matches eager, forward and backward; a second input shape recompiles
    (with dynamic shapes: the fake kernels' symbolic sizes). Inductor on every
    device (on the CPU its first compile takes ~20 s)."""
    hidden = 96
    norm = getattr(fusedops.nn, name)(hidden)
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_()
    block = PreNormBlock(norm, hidden).to(device)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)

    def run(fn, x, r, g_out, g_s):
        block.zero_grad()
        x, r = x.clone().requires_grad_(), r.clone().requires_grad_()
        out, s = fn(x, r)
        torch.autograd.backward([out, s], [g_out, g_s])
        return [out, s, x.grad, r.grad] + [p.grad for p in block.parameters()]

    for lead in [(2, 5), (3, 7)]:
        tensors = [randn((*lead, hidden), torch.float32, device) for _ in range(4)]
        # The norm is one opaque op to the compiler; the Linears around it may be
        # fused or reduced in another order: fp32 rounding differences only.
        for got, want in zip(run(compiled, *tensors), run(block, *tensors)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- autocast

@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm"])
def test_autocast(device, name):
    """Under bf16 autocast, Linear -> fusedops norm runs on the Linear's bf16
    output with the module's fp32 parameters. The plain norm's output has the
    dtype torch's module gives under the same autocast (fp32 where autocast
    lists the op as fp32: CUDA's layer_norm, and rms_norm in newer releases;
    bf16 otherwise); the fused residual form keeps its inputs' dtypes (y bf16,
    an fp32 residual stream stays fp32); gradients reach every parameter in
    fp32."""
    hidden = 64
    lin = torch.nn.Linear(hidden, hidden).to(device)
    norm = torch_module(name, dict(normalized_shape=hidden, eps=1e-5), device)
    fused_norm = getattr(fusedops.nn, name)(hidden, eps=1e-5).to(device)
    fused_norm.load_state_dict(norm.state_dict())
    x, r = randn((4, 8, hidden), torch.float32, device), randn((4, 8, hidden), torch.float32, device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        h = lin(x)
        y = fused_norm(h)
        y2, s = fused_norm(h, r)
        y_torch = norm(h)
    assert h.dtype == y2.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert y.dtype == y_torch.dtype, (y.dtype, y_torch.dtype)
    (y.float().square().sum() + y2.float().square().sum() + s.sum()).backward()
    for n, p in itertools.chain(lin.named_parameters(), fused_norm.named_parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, n
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n
    h, w, b = h.detach(), fused_norm.weight.detach(), getattr(fused_norm, "bias", None)
    b = None if b is None else b.detach()
    for out, res in ((y, None), (y2, r)):
        args = (h, res, w, b)
        want = reference.add_norm(*(None if t is None else t.double() for t in args), 1e-5, name == "RMSNorm")[0]
        # eager: torch's module under the same autocast for the plain norm (its dtype), the
        # reference in the inputs' dtypes for the fused residual form.
        eager = y_torch.detach() if res is None else reference.add_norm(*args, 1e-5, name == "RMSNorm")[0]
        assert_close_2x(out, want, eager, f"autocast {name} y")
