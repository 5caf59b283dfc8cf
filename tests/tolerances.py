"""The one correctness rule of the fusedops tests (DESIGN.md, Correctness).

An op's result is compared with the op's plain-PyTorch math (fusedops/reference.py)
run in float64. It passes when its error against that reference is at most twice
the error of eager PyTorch computing the same thing in the same low precision,
plus a small absolute floor (so that an eager result that happens to be exact
does not demand a bit-exact kernel):

    err(out) <= 2 * err(eager) + atol_floor
    atol_floor = FLOOR[out.dtype] * scale,   scale = max(1, max|ref|) by default

err is the largest absolute difference over the elements where the reference is
finite. Where the reference is NaN the output may be NaN; anywhere else a NaN in
the output fails, and an infinite reference must be matched exactly.
"""
import torch

# Absolute floor per dtype, relative to `scale`: about one unit in the last place
# at magnitude 1 for fp16 (2^-10) and bf16 (2^-7), i.e. one rounding of the
# output more than eager's; fp32 leaves room for sums taken in another order.
FLOOR = {
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-2,
}


def max_err(t, ref64):
    """Largest |t - ref64| over the elements where ref64 is finite (0 if none);
    inf when t is NaN or infinite at any of them."""
    finite = torch.isfinite(ref64)
    if not finite.any():
        return 0.0
    d = (t.detach().to(torch.float64) - ref64)[finite].abs()
    return float(d.nan_to_num(nan=float("inf")).max())


def default_scale(ref64):
    finite = ref64[torch.isfinite(ref64)]
    return max(1.0, float(finite.abs().max())) if finite.numel() else 1.0


def assert_close_2x(out, ref64, eager_lowp, name, atol_floor=None, scale=None):
    """Assert `out` is as close to the float64 reference `ref64` as twice the eager
    low-precision result `eager_lowp` is, plus an absolute floor.

    out and eager_lowp must have the same shape and dtype (ref64's shape, float64).
    atol_floor: the floor, as an absolute number; by default FLOOR[out.dtype] * scale,
    with scale the magnitude the result is computed at (default max(1, max|ref64|);
    a sum whose terms cancel is computed at the size of its partial sums)."""
    assert out is not None and ref64 is not None and eager_lowp is not None, f"{name}: missing tensor"
    out, ref64, eager_lowp = out.detach(), ref64.detach(), eager_lowp.detach()
    assert ref64.dtype == torch.float64, f"{name}: reference is {ref64.dtype}, expected float64"
    assert out.shape == ref64.shape == eager_lowp.shape, (
        f"{name}: shape {tuple(out.shape)}, float64 reference {tuple(ref64.shape)}, "
        f"eager {tuple(eager_lowp.shape)}")
    assert out.dtype == eager_lowp.dtype, f"{name}: dtype {out.dtype}, eager gives {eager_lowp.dtype}"
    assert out.device == eager_lowp.device, f"{name}: device {out.device}, eager on {eager_lowp.device}"

    ref64 = ref64.to(out.device)
    bad_nan = torch.isnan(out) & ~torch.isnan(ref64)
    assert not bad_nan.any(), (
        f"{name}: {int(bad_nan.sum())} NaN(s) where the reference has none, first at index "
        f"{tuple(bad_nan.nonzero()[0].tolist())}")
    inf = torch.isinf(ref64)
    assert torch.equal(out.to(torch.float64)[inf], ref64[inf]), f"{name}: infinities differ from the reference"

    err, eager_err = max_err(out, ref64), max_err(eager_lowp, ref64)
    assert eager_err != float("inf"), f"{name}: the eager yardstick is not finite where the reference is"
    if atol_floor is None:
        assert out.dtype in FLOOR, f"{name}: no floor for dtype {out.dtype}; pass atol_floor"
        atol_floor = FLOOR[out.dtype] * (default_scale(ref64) if scale is None else scale)
    bound = 2 * eager_err + atol_floor
    assert err <= bound, (
        f"{name}: max abs error {err:.3g} against the float64 reference; eager {str(out.dtype)[6:]} "
        f"error {eager_err:.3g}; allowed 2 x {eager_err:.3g} + floor {atol_floor:.3g} = {bound:.3g} "
        f"(shape {tuple(out.shape)})")
