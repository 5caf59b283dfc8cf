"""Seeded random cases of every fusedops op against the float64 reference by
the 2x rule (tests/tolerances.py), forward and backward, on any device:
random shapes (aligned widths and odd ones, empty ones), memory layouts
(slices, transposes, broadcast rows, packed tensors), dtypes and options.

    python tools/reliability/fuzz.py [--device cuda] [--cases 300] [--ops norm,attention] [--seed 0]
                         [--size small|large] [--case N]

Ops: norm (add + LayerNorm / RMSNorm), glu (SwiGLU / GeGLU), glu_packed, mlp
(fusedops.functional.glu_mlp: the in-place backward ops), attention, rope, xent
(cross-entropy), adam.
--cases is per op. Each case draws from its own generator, seeded by (seed,
op, case number), so a failure printed as "FAIL norm #17 ..." reruns alone
with --ops norm --case 17 (and the same --seed, --size and --device). Prints
one line per failure and a summary line last; exits 1 if any case failed.
--size small (the CPU default; tests/test_reliability.py runs it in CI) keeps
every tensor tiny; --size large (the CUDA default) adds GPU-sized widths,
sequence lengths and tensor lists.

Only the case generators are written here: running a case and judging it is
done by the tests' own helpers (tests/test_<op>.py), so that the fuzzer and the
tests apply one rule."""
import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

import fusedops  # noqa: E402,F401
from fusedops import functional as FF, reference  # noqa: E402
import test_adam  # noqa: E402
import test_attention  # noqa: E402
import test_norm  # noqa: E402
import test_rope  # noqa: E402
import test_swiglu  # noqa: E402
import test_xent  # noqa: E402
from conftest import randn  # noqa: E402

LOWP = [torch.float32, torch.float16, torch.bfloat16]
HALF = [torch.float16, torch.bfloat16]
ACTS = ["silu", "gelu_tanh"]


def dname(dtype):
    return str(dtype).removeprefix("torch.")


def lead_shape(rng, rows_max, rank_max=3):
    """Leading dims (rank 0..rank_max) of at most about rows_max rows, now and
    then one of size 0."""
    dims, left = [], rows_max
    for _ in range(rng.randint(0, rank_max)):
        d = 0 if rng.random() < 0.03 else rng.randint(1, max(1, min(left, 9)))
        dims.append(d)
        left = max(1, left // max(d, 1))
    return tuple(dims)


def pick_layouts(rng, options, most=2):
    """Up to `most` (argument, layout) pairs out of `options`, one per argument."""
    chosen, args = [], set()
    for arg, kind in rng.sample(options, k=min(len(options), rng.choice([0, 0, 1, most]))):
        if arg not in args:
            chosen.append((arg, kind))
            args.add(arg)
    return chosen


# Each generator returns (description, run): run() raises AssertionError when
# the case fails the 2x rule (or anything else when it breaks).

# --------------------------------------------------------------------------- norm

NORM_WIDTHS = {"small": [1, 2, 3, 7, 8, 16, 33, 64, 100, 128, 257, 1000],
               "large": [1, 3, 8, 64, 256, 1000, 1024, 2048, 4096, 4097, 8192, 12288, 16384, 32768,
                         65536]}


def fuzz_norm(rng, device, size):
    cols = rng.choice(NORM_WIDTHS[size])
    rms = rng.random() < 0.5
    if cols == 2 and not rms:
        # LayerNorm of two elements is +-1 whatever they are: dx is 0 but for
        # eps, a cancellation of terms of size rstd, which any two orders of
        # summation round differently (rows of nearly equal values).
        cols = 3
    rows_max = 48 if size == "small" else (300 if cols <= 16384 else 5)
    shape = (*lead_shape(rng, rows_max), cols)
    dtype = rng.choice(LOWP)
    weight = rng.random() < 0.8
    bias = not rms and rng.random() < 0.6
    # "other": a weight in the other 16-bit dtype, which the functions widen to fp32.
    param = rng.choice(["x", "fp32", "other"]) if dtype != torch.float32 and (weight or bias) else "x"
    c = test_norm.Case(shape, dtype, rms, rng.choice(test_norm.RESIDUALS), weight, bias, param)
    inp = test_norm.make_inputs(c, device)
    options = [(a, k) for a, k in test_norm.LAYOUTS if inp[a] is not None and inp[a].numel() > 0
               and not (k == "permute" and len(shape) < 3) and not (k == "transpose" and len(shape) < 2)]
    layouts = pick_layouts(rng, options)

    def run():
        contiguous = dict(inp)
        for arg, kind in layouts:  # the reference reads the same values, contiguous
            contiguous[arg], inp[arg] = test_norm.relayout(inp[arg], kind)
        got = test_norm.forward_backward(c, inp, poison=True)
        test_norm.check_against_reference(c, contiguous, got)
    return f"{c} {layouts or ''}", run


# --------------------------------------------------------------------------- glu

GLU_WIDTHS = {"small": [1, 2, 3, 5, 7, 8, 16, 31, 64, 100, 257],
              "large": [1, 3, 7, 8, 64, 1000, 4097, 11008, 14336]}


def glu_shape(rng, size):
    f = rng.choice(GLU_WIDTHS[size])
    rows_max = 40 if size == "small" else max(1, (1 << 21) // f)
    return f, rows_max


def fuzz_glu(rng, device, size):
    """fusedops.functional.swiglu / geglu on separate gate and up."""
    act, dtype = rng.choice(ACTS), rng.choice(LOWP)
    f, rows_max = glu_shape(rng, size)
    kind = rng.choice(["contiguous"] * 3 + ["chunks"] + test_swiglu.KINDS)
    arg = rng.choice(["gate", "up", "dout"])
    if kind in test_swiglu.KINDS:  # the strided views are of rank 4
        shape = (rng.randint(1, 2), rng.randint(1, 4), rng.randint(1, 3), f)
    else:
        shape = (*lead_shape(rng, rows_max), f)

    def run():
        t = {a: randn(shape, dtype, device) for a in ("gate", "up", "dout")}
        if kind == "chunks":  # gate and up, the two halves of one projection
            t["gate"], t["up"] = randn((*shape[:-1], 2 * f), dtype, device).chunk(2, dim=-1)
        elif kind != "contiguous":
            t[arg] = test_swiglu._strided(kind, shape, dtype, device)
        fused = test_swiglu.FUSED[act, False]
        test_swiglu.check(fused, lambda g, u: reference.glu(g, u, act), [t["gate"], t["up"]], t["dout"],
                          f"{act} {kind}")
    return f"{act} {tuple(shape)} {dname(dtype)} {kind}{'' if kind in ('contiguous', 'chunks') else ' ' + arg}", run


def fuzz_glu_packed(rng, device, size):
    """swiglu_packed / geglu_packed on [gate | up]."""
    act, dtype = rng.choice(ACTS), rng.choice(LOWP)
    f, rows_max = glu_shape(rng, size)
    kind = rng.choice(["contiguous"] * 3 + ["slice_last", "slice_seq", "three_levels", "strided_last"])
    if kind == "contiguous":
        shape = (*lead_shape(rng, rows_max), f)
    else:
        shape = (rng.randint(1, 2), rng.randint(1, 4), rng.randint(1, 3), f)

    def run():
        wide = (*shape[:-1], 2 * f)
        gu = randn(wide, dtype, device) if kind == "contiguous" else test_swiglu._strided(kind, wide, dtype, device)
        test_swiglu.check(test_swiglu.FUSED[act, True], lambda t: reference.glu_packed(t, act), [gu],
                          randn(shape, dtype, device), f"packed {act} {kind}")
    return f"packed {act} {tuple(shape)} {dname(dtype)} {kind}", run


def mlp_scales(x, wg, wu, wd, bs, dy, act):
    """The size each result of the MLP is summed at: every output and gradient
    is a sum of products (over H, F or the rows), whose rounding scales with
    the sum of the terms' magnitudes, not with the (possibly cancelled)
    result. Keys as test_swiglu.check names them."""
    x, dy = (t.detach().double().reshape(-1, t.shape[-1]) for t in (x, dy))
    wg, wu, wd = (t.detach().double() for t in (wg, wu, wd))
    gate, up = (x @ w.t() + (0 if b is None else b.double()) for w, b in ((wg, bs[0]), (wu, bs[1])))
    g, u = gate.requires_grad_(), up.requires_grad_()
    hh = reference.glu(g, u, act)
    dgate, dup = torch.autograd.grad(hh, (g, u), dy @ wd)
    a = {"x": x.abs(), "h": hh.detach().abs(), "dg": dgate.abs(), "du": dup.abs(), "dy": dy.abs()}
    sizes = [a["h"] @ wd.abs().t(), a["dg"] @ wg.abs() + a["du"] @ wu.abs(),
             a["dg"].t() @ a["x"], a["du"].t() @ a["x"], a["dy"].t() @ a["h"],
             a["dg"].sum(0), a["du"].sum(0), a["dy"].sum(0)]
    present = [True] * 5 + [b is not None for b in bs]
    names = ["out"] + [f"d{i}" for i in range(sum(present) - 1)]
    return {n: float(t.max()) if t.numel() else 1.0
            for n, t in zip(names, [t for t, on in zip(sizes, present) if on])}


def fuzz_mlp(rng, device, size):
    """fusedops.functional.glu_mlp: two projections (one matmul when gate's and
    up's weights are adjacent), the fused product, the down projection; the
    backward overwrites the saved projections in place."""
    act, dtype = rng.choice(ACTS), rng.choice(LOWP)
    small = size == "small"
    h = rng.choice([1, 3, 8, 16, 24, 33] if small else [64, 256, 1000, 1024])
    f = rng.choice([1, 5, 8, 16, 40] if small else [64, 300, 2048, 2752])
    shape = (*lead_shape(rng, 24 if small else 512, rank_max=2), h)
    joined = rng.random() < 0.5
    biases = [rng.random() < 0.3 for _ in range(3)]

    def run():
        x, dy = randn(shape, dtype, device), randn(shape, dtype, device)
        wgu = randn((2 * f, h), dtype, device) * h ** -0.5
        wg, wu = wgu.chunk(2) if joined else (wgu[:f].clone(), wgu[f:].clone())
        wd = randn((h, f), dtype, device) * f ** -0.5
        bs = [randn(n, dtype, device) if on else None for n, on in zip((f, f, h), biases)]
        inputs = [x, wg, wu, wd] + [b for b in bs if b is not None]

        def unpack(fn):
            def call(x, wg, wu, wd, *b):
                it = iter(b)
                bg, bu, bd = (next(it) if on else None for on in biases)
                return fn(x, wg, wu, wd, bg, bu, bd, act)
            return call
        test_swiglu.check(unpack(FF.glu_mlp), unpack(reference.glu_mlp), inputs, dy, f"mlp {act}",
                          scales=mlp_scales(x, wg, wu, wd, bs, dy, act))
    return f"mlp {act} {tuple(shape)} F{f} {dname(dtype)} joined={joined} biases={biases}", run


# --------------------------------------------------------------------------- attention

def fuzz_attention(rng, device, size):
    cuda = torch.device(device).type == "cuda"
    small = size == "small"
    dtype = rng.choice(HALF if cuda else LOWP)
    d = rng.choice(list(FF.CUDA_HEAD_DIMS) if cuda else [1, 3, 8, 16, 24, 32, 33, 64, 80])
    hkv = rng.randint(1, 2 if small else 3)
    hq = hkv * rng.randint(1, 3)
    seq = (lambda: rng.randint(1, 70)) if small else (lambda: rng.choice([rng.randint(1, 200), rng.randint(1, 1500)]))
    sq, sk = seq(), seq()
    layout = rng.choice(["bshd", "bshd", "bhsd", "padded", "lastdim", "packed"])
    if sk == 1 and dtype == torch.float32:
        # One key: softmax is 1 and dq, dk are 0 but for rounding; eager's
        # P (dP - sum P dP) cancels exactly, the kernels' dP - rowsum(dO O)
        # sums in two orders: noise at the size of dP, above fp32's floor.
        sk = 2
    if layout == "packed":
        sq = sk = max(sq, 2) if dtype == torch.float32 else sq
        hkv = hq
    c = test_attention.Case(B=rng.randint(1, 2), Sq=sq, Sk=sk, Hq=hq, Hkv=hkv, D=d,
                            causal=rng.random() < 0.5, dtype=dtype, layout=layout,
                            scale=rng.choice([None, None, 0.05, 0.3, 1.0]))
    deterministic = rng.random() < 0.3

    def run():
        q, k, v, dout = test_attention.make_inputs(c, device)
        got = test_attention.run("fused", c, q, k, v, dout, deterministic=deterministic)
        test_attention.check(c, q, k, v, dout, got)
    return f"{c}{' deterministic' if deterministic else ''}", run


# --------------------------------------------------------------------------- rope

def fuzz_rope(rng, device, size):
    """fusedops.functional.apply_rotary_pos_emb on q and k together: GQA / MQA,
    even head dims (halves of any width), (B, H, S, D) tensors or the
    transposed views of (B, S, H, D) ones, model tables or random ones, shared
    over the batch or not."""
    dtype = rng.choice(LOWP)
    hk = rng.randint(1, 3)
    hq = hk * rng.randint(1, 4)
    d = 2 * rng.choice([1, 3, 4, 5, 8, 16, 32, 64] + ([] if size == "small" else [128]))
    s = rng.randint(1, 70) if size == "small" else rng.choice([rng.randint(1, 200), rng.randint(1, 2000)])
    b, kind, layout = rng.randint(1, 3), rng.choice(["rope", "random"]), rng.choice(["bhsd", "bshd"])
    shared = kind == "rope" or rng.random() < 0.5
    q, k = test_rope.qk(b, hq, hk, s, d, dtype, device, layout)
    cos, sin = test_rope.tables(1 if shared else b, s, d, dtype, device, kind)
    desc = f"(b={b}, hq={hq}, hk={hk}, s={s}, d={d}) {dname(dtype)} {layout} {kind}{' shared' if shared else ''}"
    return desc, lambda: test_rope.check(q, k, cos, sin, desc)


# --------------------------------------------------------------------------- cross-entropy

def fuzz_xent(rng, device, size):
    """fusedops.functional.cross_entropy: any vocab (1 up to a Llama-3's on a
    GPU), a share of ignored targets (none to all), dense, column-sliced or
    transposed logits, each reduction."""
    dtype = rng.choice(LOWP)
    vocab = rng.choice([1, 2, 7, 33, 100, 1000, 4097] + ([] if size == "small" else [32000, 50257, 128256]))
    rows = rng.randint(1, 40 if size == "small" else (300 if vocab > 10000 else 3000))
    ignored = rng.choice([0.0, 0.0, 0.1, 0.5, 1.0])
    layout = rng.choice(["dense", "dense", "slice", "transposed"])
    reduction = rng.choice(["mean", "sum", "none"])
    x, t = test_xent.make(rows, vocab, dtype, device, ignored=ignored, spread=rng.choice([0.5, 3.0, 10.0]),
                          layout=layout)
    if ignored == 1.0 and reduction == "mean":  # 0 / 0: NaN, as torch's (test_all_ignored_is_nan_as_torch)
        reduction = "sum"
    desc = f"{rows}x{vocab} {dname(dtype)} {layout} ignored={ignored} {reduction}"
    return desc, lambda: test_xent.check(x, t, reduction, desc)


# --------------------------------------------------------------------------- adam

def fuzz_adam(rng, device, size):
    dtype = rng.choice(LOWP)
    state = "param" if dtype == torch.float32 else rng.choice(["param", "fp32", "master"])
    most = 3000 if size == "small" else (1 << 20) + 5
    n = rng.choice([1, 2, 3, 5]) if size == "small" or rng.random() < 0.8 else rng.randint(57, 130)
    shapes = []
    for _ in range(n):
        numel = rng.choice([0, 1, 7, 8, 2048, 2049, rng.randint(1, most)])
        shapes.append((numel,) if rng.random() < 0.5 or numel < 4 else (numel // 4, 4))
    c = test_adam.Case(dtype, state, decoupled=rng.random() < 0.5,
                       weight_decay=rng.choice([0.0, 0.0, 0.01, 0.1]), amsgrad=rng.random() < 0.3,
                       maximize=rng.random() < 0.2, grad_scale=rng.random() < 0.3,
                       lr_tensor=rng.random() < 0.3, shapes=tuple(shapes))
    return f"{c} {list(c.shapes) if n <= 5 else f'{n} tensors'}", lambda: test_adam.check_op(c, device)


OPS = {"norm": fuzz_norm, "glu": fuzz_glu, "glu_packed": fuzz_glu_packed, "mlp": fuzz_mlp,
       "attention": fuzz_attention, "rope": fuzz_rope, "xent": fuzz_xent, "adam": fuzz_adam}


def case_seed(seed, op, i):
    return f"{seed}/{op}/{i}"


def fuzz(ops=tuple(OPS), cases=100, device="cpu", seed=0, size=None, only=None, log=print):
    """Run `cases` cases of each op in `ops`; returns {op: (passed, [failure lines])}."""
    size = size or ("large" if torch.device(device).type == "cuda" else "small")
    results = {}
    for op in ops:
        passed, failures = 0, []
        for i in ([only] if only is not None else range(cases)):
            rng = random.Random(case_seed(seed, op, i))
            torch.manual_seed(rng.randrange(1 << 62))
            desc, run = OPS[op](rng, device, size)
            try:
                run()
                passed += 1
            except Exception as e:  # noqa: BLE001  (a crash is a failure, reported like one)
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                failures.append(f"FAIL {op} #{i} {desc}: {type(e).__name__}: {first[:400]}")
                log(failures[-1])
        results[op] = (passed, failures)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", type=int, default=300, help="cases per op")
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated: " + ", ".join(OPS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", choices=["small", "large"], default=None)
    ap.add_argument("--case", type=int, default=None, help="run this case number only")
    a = ap.parse_args()
    ops = [o for o in a.ops.split(",") if o]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        ap.error(f"unknown ops {unknown}; choose from {list(OPS)}")
    t0 = time.time()
    res = fuzz(ops, a.cases, a.device, a.seed, a.size, a.case)
    total = sum(p + len(f) for p, f in res.values())
    failed = sum(len(f) for _, f in res.values())
    per_op = " ".join(f"{op} {p}/{p + len(f)}" for op, (p, f) in res.items())
    size = a.size or ("large" if torch.device(a.device).type == "cuda" else "small")
    print(f"fuzz: {total - failed}/{total} cases passed, {failed} failed ({per_op}; {a.device}, "
          f"{size}, seed {a.seed}, {time.time() - t0:.0f} s)")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
