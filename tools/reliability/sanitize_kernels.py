"""Every CUDA kernel of fusedops, forward and backward, once or a few times at
small odd shapes: the program tools/reliability/sanitize.sh runs under compute-sanitizer
(memcheck, racecheck, initcheck). Each case is one call of the tests' own
helpers (tests/test_<op>.py); the shapes are chosen so that every kernel and
every variant of it runs (register and loop kernels of the norms, each vector
width of the GLU kernel, every head dim of attention with and without the
causal mask, the atomic and the deterministic dQ, each vector width of RoPE
and of the cross-entropy, each Adam dtype pairing on the vector and the
scalar path). Prints one line per op and a summary.
    python tools/reliability/sanitize_kernels.py        (needs a CUDA GPU; ~2 s without the sanitizer)"""
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

import fusedops  # noqa: E402,F401
import test_adam  # noqa: E402
import test_attention  # noqa: E402
import test_norm  # noqa: E402
import test_rope  # noqa: E402
import test_swiglu  # noqa: E402
import test_xent  # noqa: E402
from fusedops.ops import linear_xent  # noqa: E402
from conftest import randn  # noqa: E402

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DEV = os.environ.get("SANITIZE_DEVICE", "cuda")  # "cpu": a dry run of the driver itself
ops = torch.ops.fusedops


def norm_cases():
    """(case, layouts): register kernels (aligned widths; widths of a multiple
    of 4 16-bit values: 8-byte chunks; 2 mod 4: 4-byte; odd or misaligned
    widths: one element; the backward up to 16 one-element chunks, one warp
    a row at 257, two teams a block at 1025; the forward one warp a row at
    264), loop kernels (odd rows wider than the one-element
    teams take: one element a step; rows wider than the registers take:
    16-byte or 8-byte steps), fwd_park (as many rows of 32K as its blocks fill one wave
    with: two an SM), fwd_narrow (rows of 512, 768 and 1024 16-bit values, one row
    stride its own; eight rows of 256 or LayerNorm's 512 a block, the last
    block part full, statistics gathered in shared memory), dweight / dbias
    partials and their column sums), fwd_shift (contiguous rows not 16-byte
    aligned: a head and a tail around 16-byte chunks)."""
    ln, rms = test_norm.ln, test_norm.rms
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 2
    return [(rms((2 * sms, 32768), BF16), []),
            (ln((37, 1000), BF16, residual="fp32", param="fp32"), []),
            (ln((3, 5, 64), F32), []),
            (ln((37, 1001), F16), []),  # odd width: register kernels, one element a chunk
            (ln((37, 1004), BF16, param="fp32"), []),  # a multiple of 4: fwd_shift, 8-byte bwd_regs
            (ln((7, 4098), BF16), []),  # fwd_shift: heads of 0, 6, 4, 2 values, a tail of 2-6
            (rms((9, 4095), F16, param="fp32"), []),  # ... heads of 0-7 values, an fp32 weight
            (ln((5, 10002), BF16, residual="none"), []),  # ... four chunks a thread
            (rms((7, 6002), BF16), []),  # bwd_shift, two chunks a thread
            (ln((37, 1002), BF16, residual="fp32"), []),  # 2 mod 4: 4-byte register kernels
            (rms((37, 202), F32), []),  # fp32, even: 8-byte register kernels
            (ln((5, 62), BF16), []),  # one 4-byte chunk a thread: the backward's sums padded
            (rms((5, 8195), BF16), []),  # odd, past the one-element teams: loop kernels, scalar
            (rms((37, 384), BF16), []),  # the backward one warp a row (bwd_warp)
            (ln((37, 257), BF16), []),  # ... of 16 one-element chunks (kBwdMaxChunks)
            (ln((37, 264), F16), []),  # the forward one warp a row (fwd_warp)
            (rms((7, 4097), BF16), []),  # the backward's 16 one-element chunks, a team of 288
            (ln((37, 1025), BF16), []),  # one-element backward teams two a block (resident_rows)
            (ln((37, 2200), BF16), []),  # the backward 16 values a thread (bwd_mid_bf16)
            (ln((37, 2600), BF16), []),  # bwd_pipe where bwd_regs would hold the row (bwd_pipe_mid)
            (rms((5, 16388), F16, residual="fp32"), [("x", "slice_half")]),  # 8-byte loop kernels
            (ln((5, 20000), BF16), []),  # wider than the register kernels take
            (rms((37, 1000), BF16, residual="none_fp32"), []),
            (rms((3, 7), F16, residual="fp32"), []),
            (rms((37, 512), BF16), [("x", "rowstep")]),
            (ln((5, 3, 1024), F16), []), (rms((7, 768), BF16), []),
            (ln((13, 256), BF16), []), (ln((11, 512), F16, bias=False), []),
            (rms((4, 6, 1000), BF16), [("x", "slice_misaligned"), ("gy", "rowstep")]),
            (ln((24, 1000), BF16, weight=False), [("x", "rowstep"), ("residual", "expand")])]


def run_norm():
    n = 0
    for c, layouts in norm_cases():
        inp = test_norm.make_inputs(c, DEV)
        for arg, kind in layouts:
            inp[arg] = test_norm.relayout(inp[arg], kind)[1]
        test_norm.forward_backward(c, inp)
        n += 1
    return n


def run_glu():
    """Each vector width (16 bytes, 2 elements, 1), both activations, separate
    and packed, the in-place backward ops, rows read through two levels of
    strides."""
    n = 0
    for dtype, f in [(BF16, 1000), (BF16, 998), (F16, 7), (F32, 1000), (F32, 999)]:
        for act in ("silu", "gelu_tanh"):
            g, u, d = (randn((2, 3, 2, f), dtype, DEV) for _ in range(3))
            test_swiglu.run(test_swiglu.FUSED[act, False], [g, u], d)
            gu = randn((2, 3, 2, 2 * f), dtype, DEV)
            test_swiglu.run(test_swiglu.FUSED[act, True], [gu], d)
            strided = test_swiglu._strided("slice_seq", (2, 3, 2, f), dtype, DEV)
            test_swiglu.run(test_swiglu.FUSED[act, False], [strided, u], d)
            ops.glu_bwd_(d.clone(), g.clone(), u.clone(), act)
            ops.glu_packed_bwd_(d.clone(), gu.clone(), act)
            n += 5
    return n


def run_attention():
    """Every head dim, causal and not, Sq and Sk odd both ways, GQA, both dQ
    paths (fp32 atomics at head dims up to 64 unless deterministic)."""
    n = 0
    base = test_attention.Case(B=2, Sq=77, Sk=130, Hq=4, Hkv=2)
    for d in (32, 64, 96, 128):
        for causal in (False, True):
            for dtype, sq, sk in ((BF16, 77, 130), (F16, 130, 77)):
                for det in ((False, True) if d <= 64 else (False,)):
                    c = replace(base, D=d, causal=causal, dtype=dtype, Sq=sq, Sk=sk,
                                layout="bhsd" if det else "bshd")
                    q, k, v, dout = test_attention.make_inputs(c, DEV)
                    test_attention.run("fused", c, q, k, v, dout, deterministic=det)
                    n += 1
    return n


def run_rope():
    """Each vector width (16 bytes, 8, 4, 2 elements, 1: half-dims 64, 4, 2, 3
    at 16 bits; 32, 5 at fp32), both layouts, GQA, tables shared over the batch
    and not; forward and the backward (the inverse rotation)."""
    n = 0
    for dtype, d in [(BF16, 128), (F16, 8), (BF16, 4), (F16, 6), (F32, 64), (F32, 10)]:
        for layout, kind in (("bshd", "rope"), ("bhsd", "random")):
            q, k = test_rope.qk(2, 4, 2, 37, d, dtype, DEV, layout)
            cos, sin = test_rope.tables(1 if kind == "rope" else 2, 37, d, dtype, DEV, kind)
            test_rope.run(fusedops.functional.apply_rotary_pos_emb, q, k, cos, sin, torch.randn_like(q),
                          torch.randn_like(k))
            n += 1
    return n


def run_xent():
    """Each vector width (16 bytes: vocab a multiple of 8 at 16 bits, 4 at
    fp32; 2 elements; 1), column-sliced rows, ignored targets; forward and
    backward; then the fused pass (xent_fwd_bwd_) through linear_cross_entropy,
    with label smoothing and softcap, each reduction, over several chunks, its
    backward's scaling (linear_xent_scale_) both skipped (a gradient of 1) and
    run."""
    n = 0
    for dtype, vocab, layout in [(BF16, 32000, "dense"), (F16, 1002, "dense"), (BF16, 999, "dense"),
                                 (F32, 1000, "slice"), (F32, 77, "dense"), (BF16, 4096, "transposed")]:
        x, t = test_xent.make(37, vocab, dtype, DEV, layout=layout)
        test_xent.run(fusedops.functional.cross_entropy, x, t, "mean", torch.tensor(1.0, device=DEV))
        n += 1
    linear_xent._CHUNK_ROWS = 16
    try:
        for dtype, vocab, reduction in [(BF16, 32000, "mean"), (F16, 1001, "none"), (F32, 77, "sum")]:
            h = torch.randn(37, 64, device=DEV).to(dtype).requires_grad_()
            w = (torch.randn(vocab, 64, device=DEV) * 0.2).to(dtype).requires_grad_()
            t = torch.randint(0, vocab, (37,), device=DEV)
            t[::5] = -100
            loss = fusedops.functional.linear_cross_entropy(h, w, t, reduction=reduction, label_smoothing=0.1,
                                                            softcap=15.0)
            (loss.sum() * (1.5 if reduction == "mean" else 1.0)).backward()
            n += 1
    finally:
        linear_xent._CHUNK_ROWS = None
    return n


def run_adam():
    """Each param / state dtype pairing, amsgrad, tensor lr and grad scale,
    found_inf set and not, ragged ends (the scalar path) and more tensors than
    one launch's table holds."""
    n = 0
    shapes = ((4097,), (3,), (64, 33), (2049,))
    for dtype, state in [(F32, "param"), (BF16, "param"), (BF16, "fp32"), (F16, "master"), (BF16, "master")]:
        for kw in (dict(), dict(amsgrad=True, grad_scale=True, lr_tensor=True, decoupled=False)):
            c = test_adam.Case(dtype, state, shapes=shapes, **kw)
            inp = test_adam.op_inputs(c, DEV)
            test_adam.run_op(c, inp)
            test_adam.run_op(c, inp, found_inf=torch.ones((), device=DEV))
            n += 2
    # Misaligned tensors (views one element in: the scalar path), and 60 tensors (two launches).
    c = test_adam.Case(F32, shapes=tuple((1 + 97 * i,) for i in range(60)))
    inp = test_adam.op_inputs(c, DEV)
    for k in ("params", "grads", "exp_avgs", "exp_avg_sqs"):
        inp[k] = [torch.cat([t.new_zeros(1), t])[1:] for t in inp[k]]
    test_adam.run_op(c, inp)
    return n + 1


def main():
    assert DEV == "cpu" or torch.cuda.is_available(), "sanitize_kernels: needs a CUDA GPU"
    torch.manual_seed(0)
    counts = {}
    for name, fn in (("norm", run_norm), ("glu", run_glu), ("attention", run_attention), ("rope", run_rope),
                     ("xent", run_xent), ("adam", run_adam)):
        counts[name] = fn()
        assert isinstance(counts[name], int) and counts[name] > 0, f"sanitize_kernels: {name} drove no calls"
        if DEV == "cuda":
            torch.cuda.synchronize()
        print(f"sanitize_kernels: {name}: {counts[name]} calls, forward and backward", flush=True)
    print(f"sanitize_kernels: done, {sum(counts.values())} calls "
          f"({', '.join(f'{k} {v}' for k, v in counts.items())})", flush=True)


if __name__ == "__main__":
    main()
