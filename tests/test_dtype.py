"""The CPU kernels' fp16 / bf16 <-> fp32 conversions (csrc/common/cpu_dtype.h)
against torch's, at every x86-64 level this CPU runs (baseline, v3, v4), and
the kernels themselves at every level: bitwise the same results.

The conversions are reached through fo_cpu_convert, a C entry point of the
extension (csrc/common/dtype_cpu.c), called with ctypes; the level of the
kernels is set with fo_cpu_set_isa."""
import ctypes

import pytest
import torch

from conftest import CPU_LEVEL, CPU_LIB, cpu_level
from fusedops import functional
from fusedops.optim import FusedAdamW

LIB = CPU_LIB
LIB.fo_cpu_convert.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int64]
LIB.fo_cpu_convert.restype = ctypes.c_int

HW_LEVEL = CPU_LEVEL
LEVELS = [lvl for lvl in (0, 3, 4, 5, 6) if lvl <= HW_LEVEL]
FO_DTYPE = {torch.float16: 1, torch.bfloat16: 2}  # csrc/common/fo_types.h
DTYPES = list(FO_DTYPE)


def dtype_id(d):
    return str(d).removeprefix("torch.")


def convert(x, dtype, level):
    """x (16-bit) widened to fp32, or x (fp32) rounded to dtype, by the C code at `level`."""
    x = x.contiguous()
    widen = x.dtype != torch.float32
    out = torch.empty(x.shape, dtype=torch.float32 if widen else dtype)
    rc = LIB.fo_cpu_convert(level, FO_DTYPE[dtype], int(widen), x.data_ptr(), out.data_ptr(), x.numel())
    assert rc == 0, f"fo_cpu_convert(level {level}, {dtype}) refused"
    return out


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).to(torch.int64)


def assert_same(out, want, what, nan_sign=True):
    """Bit for bit, except that a NaN need only be a NaN (of the same sign when
    nan_sign): payloads differ between torch's own scalar and vector paths."""
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan), f"{what}: NaN where torch has none, or the reverse"
    if nan_sign:
        assert torch.equal(out[nan].signbit(), want[nan].signbit()), f"{what}: NaN of the wrong sign"
    ok = ~nan
    bad = (bits(out[ok]) != bits(want[ok])).nonzero().flatten()
    if bad.numel():
        i = bad[0]
        raise AssertionError(f"{what}: {bad.numel()} values differ, first {out[ok][i].item()!r} "
                             f"(bits {bits(out[ok][i:i+1]).item():#x}) where torch gives "
                             f"{want[ok][i].item()!r} (bits {bits(want[ok][i:i+1]).item():#x})")


def all_16bit(dtype):
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


def hard_floats(dtype):
    """fp32 values where rounding to dtype is decided: every value of dtype, the
    midpoints between neighbours (ties, either parity) and one fp32 ulp either
    side of them, subnormals of both formats, the overflow edge, inf, NaNs with
    assorted payloads and signs, and random bit patterns."""
    exact = all_16bit(dtype).float()
    exact = exact[exact.isfinite()].unique()  # sorted, -max .. max, one zero
    mid = (exact[:-1].double() + exact[1:].double()) / 2
    mid = mid.float()  # exact: a midpoint of two 16-bit values has one bit more
    one_ulp = [torch.nextafter(mid, torch.tensor(s)) for s in (float("inf"), float("-inf"))]
    # the overflow edge: halfway between max and the next step up rounds to inf
    # (to even), one fp32 ulp below it to max
    big = torch.finfo(dtype).max
    step = torch.finfo(dtype).eps * 2.0 ** torch.tensor(big).log2().floor().item()
    tie = torch.tensor([big + step / 2, -big - step / 2, big + step], dtype=torch.float64).float()
    below = torch.nextafter(tie[:2], torch.zeros(2))
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"),
                             torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max], dtype=torch.float32)
    nans = torch.tensor([0x7F800001, 0x7FC00000, 0x7FA00000, 0x7FFFFFFF, 0xFF800001, 0xFFC00001, 0x7F80FFFF,
                         0xFFFFFFFF], dtype=torch.int64).to(torch.int32).view(torch.float32)
    f32_sub = torch.randint(0, 1 << 23, (1 << 14,), dtype=torch.int32).view(torch.float32)  # fp32 subnormals
    rand = torch.randint(-2 ** 31, 2 ** 31, (1 << 21,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    # near the 16-bit subnormal range, where the rounding point moves
    small = torch.randn(1 << 18) * torch.finfo(dtype).tiny
    parts = [exact, mid, *one_ulp, tie, below, specials, nans, f32_sub, -f32_sub, rand, small]
    return torch.cat([p.flatten().float() for p in parts])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_widen_every_pattern(dtype, level):
    x = all_16bit(dtype)
    assert_same(convert(x, dtype, level), x.float(), f"{dtype} -> fp32 at level {level}")


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_narrow(dtype, level):
    x = hard_floats(dtype)
    # torch's bf16 NaN comes out positive from its scalar path, negative from
    # its vector one: only NaN-ness is checked there.
    assert_same(convert(x, dtype, level), x.to(dtype), f"fp32 -> {dtype} at level {level}",
                nan_sign=dtype != torch.bfloat16)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 40])
def test_tails(n, dtype, level):
    """Lengths that are not whole blocks: the last, partial block is read and
    written only as far as the row goes."""
    x = torch.randn(n)
    for widen in (0, 1):
        src = x.to(dtype) if widen else x
        out = torch.full((n + 24,), 7.0, dtype=torch.float32 if widen else dtype)
        assert LIB.fo_cpu_convert(level, FO_DTYPE[dtype], widen, src.data_ptr(), out.data_ptr(), n) == 0
        want = src.float() if widen else src.to(dtype)
        assert torch.equal(out[:n], want), f"widen={widen}: wrong values"
        assert (out[n:] == 7).all(), f"widen={widen}: wrote past the end"


def test_level_out_of_range():
    assert LIB.fo_cpu_convert(HW_LEVEL + 1, 1, 1, 0, 0, 0) == -1
    assert LIB.fo_cpu_convert(0, 0, 1, 0, 0, 0) == -1  # fp32 is no 16-bit dtype


# ---- the kernels at every level ----------------------------------------------

def norm_results(dtype, rms, residual, s_fp32=False, H=333):
    T = 37  # H: a partial last block; from 3072 on, 16-bit w and b are read as they are
    st = torch.float32 if s_fp32 else dtype
    x = torch.randn(T, H, dtype=dtype, requires_grad=True)
    r = torch.randn(T, H, dtype=st, requires_grad=True)
    w = (1 + 0.1 * torch.randn(H)).to(dtype).requires_grad_()
    b = None if rms else (0.1 * torch.randn(H)).to(dtype).requires_grad_()
    dy, ds = torch.randn(T, H, dtype=dtype), torch.randn(T, H, dtype=st)

    def run():
        args = (x, r if residual else None, w) + (() if rms else (b,))
        fn = functional.fused_add_rms_norm if rms else functional.fused_add_layer_norm
        y, s = fn(*args, residual_in_fp32=s_fp32)
        outs, grads = ((y, s), (dy, ds)) if residual else ((y,), (dy,))
        wrt = [t for t in (x, r if residual else None, w, b) if t is not None]
        return (y, s, *torch.autograd.grad(outs, wrt, grads))
    return run


def adam_results(dtype, amsgrad, master):
    shapes = [(7, 33), (1000,), (16,)]
    params0 = [torch.randn(s).to(dtype) for s in shapes]
    grads = [torch.randn(s).to(dtype) for s in shapes]

    def run():
        ps = [torch.nn.Parameter(p.clone()) for p in params0]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        kw = dict(master_weights=True) if master else {}
        opt = FusedAdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, **kw)
        for _ in range(3):
            opt.step()
        st = [v for p in ps for v in opt.state[p].values() if torch.is_tensor(v)]
        return (*[p.detach() for p in ps], *st)
    return run


def glu_results(dtype, fn):
    g, u = (torch.randn(29, 777, dtype=dtype, requires_grad=True) for _ in range(2))
    d = torch.randn(29, 777, dtype=dtype)

    def run():
        h = fn(g, u)
        return (h, *torch.autograd.grad(h, (g, u), d))
    return run


CASES = {
    **{f"norm-{'rms' if rms else 'ln'}-{'res' if res else 'nores'}": (lambda dt, rms=rms, res=res:
                                                                     norm_results(dt, rms, res))
       for rms in (False, True) for res in (False, True)},
    "norm-ln-res-s_fp32": lambda dt: norm_results(dt, False, True, s_fp32=True),
    "norm-ln-res-wide": lambda dt: norm_results(dt, False, True, H=4100),
    "norm-rms-nores-wide": lambda dt: norm_results(dt, True, False, H=4100),
    "adamw": lambda dt: adam_results(dt, False, False),
    "adamw-amsgrad": lambda dt: adam_results(dt, True, False),
    "adamw-master": lambda dt: adam_results(dt, False, True),
    "swiglu": lambda dt: glu_results(dt, functional.swiglu),
    "geglu": lambda dt: glu_results(dt, functional.geglu),
}


@pytest.mark.skipif(len(LEVELS) < 2, reason="this CPU runs only the baseline level")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_same_at_every_level(case, dtype):
    """Norm, Adam and SwiGLU give bitwise the same results at every level: the
    same operations in the same order, only the vector width and the fp16
    conversion instructions change (attention is left out: its tile products
    contract to FMA where the level has it)."""
    if case in ("adamw-master", "norm-ln-res-s_fp32") and dtype == torch.float32:
        pytest.skip("a 16-bit case")
    run = CASES[case](dtype)
    results = {}
    for level in LEVELS:
        with cpu_level(level):
            results[level] = run()
    top = LEVELS[-1]
    for level in LEVELS[:-1]:
        for i, (a, b) in enumerate(zip(results[level], results[top])):
            assert_same(a, b, f"{case} {dtype} output {i}: level {level} against level {top}")
