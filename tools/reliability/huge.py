"""Every op on tensors past 2^31 elements, where a 32-bit offset would wrap:
add + LayerNorm and RMSNorm (register and loop kernels), SwiGLU / GeGLU
(16-byte and 1-element vectors, packed, the in-place backward ops), Adam
(fp32; bf16 with fp32 master weights) and attention with B*H*S*D past 2^31
(head dims 128 and 64, causal and not, the deterministic and the atomic dQ).
Forward and backward, each checked against the float64 reference by the 2x
rule (tests/tolerances.py) chunk by chunk: every row of the norms, the GLUs and
Adam; the batches of attention on both sides of the 2^31-th element.

    python tools/reliability/huge.py [--ops norm,glu,adam,attention] [--log2 31]

Sized for an 80 GB GPU: one case at a time, at most ~41 GB of tensors (each
case says its peak). --log2 20 runs the same code at 2^20 elements (a check of
the script itself, on any device). Prints one line per case and a summary
line last; exits 1 if any case failed."""
import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

import fusedops  # noqa: E402,F401
from fusedops import reference  # noqa: E402
import test_adam  # noqa: E402
import test_attention  # noqa: E402
import test_swiglu  # noqa: E402
from tolerances import assert_close_2x, default_scale  # noqa: E402

ops = torch.ops.fusedops
BF16 = torch.bfloat16
CHUNK = 1 << 26  # elements a chunk of the reference (float64: 512 MB a tensor)


def rows_past(target, cols):
    """Rows of `cols` that make a matrix of more than `target` elements."""
    return target // cols + 3


def row_chunks(rows, cols):
    step = max(1, CHUNK // cols)
    return [(i, min(rows, i + step)) for i in range(0, rows, step)]


def randn(shape, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=dtype)


# --------------------------------------------------------------------------- norms

def norm_case(device, target, rms):
    """add + LayerNorm (bf16 x and residual, fp32 parameters, width 4096: the
    register kernels) or RMSNorm (bf16, no residual, bf16 weight, width 4097:
    the loop kernels and the column-tile dweight sums)."""
    cols = 4097 if rms else 4096
    rows = rows_past(target, cols)
    pdt = BF16 if rms else torch.float32
    x = randn((rows, cols), BF16, device, 1)
    res = None if rms else randn((rows, cols), BF16, device, 2)
    w = randn((cols,), pdt, device, 3)
    b = None if rms else randn((cols,), pdt, device, 4)
    eps = 1e-6 if rms else 1e-5
    y, s, mean, rstd = ops.add_norm_fwd(x, res, w, b, eps, rms, False)
    if s.numel() == 0:
        s = x
    dy = randn((rows, cols), BF16, device, 5)
    ds = None if rms else randn((rows, cols), BF16, device, 6)
    dx, dw, db = ops.add_norm_bwd(dy, ds, s, w, b, mean, rstd, rms, True, not rms)
    sums = {"dweight": [0.0, 0.0], "dbias": [0.0, 0.0]}  # [float64 reference, eager fp32]
    for i, j in row_chunks(rows, cols):
        got = {"y": y[i:j], "s": s[i:j], "dx": dx[i:j]}
        res_chunk = None if res is None else res[i:j]
        ref, eager = ({}, {})
        for out, to in ((ref, torch.float64), (eager, None)):
            leaves = [None if t is None else t.detach().to(to or t.dtype).requires_grad_()
                      for t in (x[i:j], res_chunk, w, b)]
            yy, ss = reference.add_norm(*leaves, eps, rms)
            outs, grads = [yy], [dy[i:j].to(yy.dtype)]
            if res is not None:
                outs, grads = [yy, ss], [dy[i:j].to(yy.dtype), ds[i:j].to(ss.dtype)]
            torch.autograd.backward(outs, grads)
            out.update(y=yy, s=ss, dx=leaves[0].grad)
            for k, t in (("dweight", leaves[2]), ("dbias", leaves[3])):
                if t is not None:
                    sums[k][to is None] = sums[k][to is None] + t.grad.to(torch.float64 if to else torch.float32)
        for k, t in got.items():
            assert_close_2x(t, ref[k], eager[k].to(t.dtype), f"{k} rows {i}:{j}")
    for k, t in (("dweight", dw), ("dbias", db)):
        if t.numel():
            ref64, eager32 = sums[k]
            assert_close_2x(t, ref64, eager32.to(t.dtype), k, scale=max(default_scale(ref64), math.sqrt(rows)))
    return f"{'RMSNorm' if rms else 'add+LayerNorm'} {rows}x{cols} bf16", rows * cols


# --------------------------------------------------------------------------- GLU

def glu_case(device, target, f, act, packed):
    """glu_fwd / glu_bwd / glu_bwd_ on [rows, f], or the packed ops on
    [rows, 2f], past `target` elements."""
    width = 2 * f if packed else f
    rows = rows_past(target, width)
    ref_fn = (lambda t: reference.glu_packed(t, act)) if packed else (lambda g, u: reference.glu(g, u, act))
    if packed:
        inputs = [randn((rows, 2 * f), BF16, device, 1)]
        out = ops.glu_packed_fwd(inputs[0], act)
        dout = randn((rows, f), BF16, device, 3)
        grads = [ops.glu_packed_bwd(dout, inputs[0], act)]
    else:
        inputs = [randn((rows, f), BF16, device, 1), randn((rows, f), BF16, device, 2)]
        out = ops.glu_fwd(*inputs, act)
        dout = randn((rows, f), BF16, device, 3)
        grads = list(ops.glu_bwd(dout, *inputs, act))
    for i, j in row_chunks(rows, width):
        chunk = [t[i:j] for t in inputs]
        got = [out[i:j]] + [g[i:j] for g in grads]
        want = test_swiglu.run(ref_fn, chunk, dout[i:j], to=torch.float64)
        eager = test_swiglu.run(ref_fn, chunk, dout[i:j])
        for n, g, w, e in zip(["out", "d0", "d1"], got, want, eager):
            assert_close_2x(g, w, e, f"{n} rows {i}:{j}")
    # The in-place backward (glu_mlp's): the same results over its inputs.
    if packed:
        ops.glu_packed_bwd_(dout, inputs[0], act)
    else:
        ops.glu_bwd_(dout, *inputs, act)
    assert torch.equal(dout, out), "in-place backward: dout does not hold the forward's output"
    for n, (t, g) in enumerate(zip(inputs, grads)):
        assert torch.equal(t, g), f"in-place backward: input {n} does not hold its gradient"
    return f"{'packed ' if packed else ''}{act} {rows}x{width} bf16", rows * width


# --------------------------------------------------------------------------- Adam

def adam_case(device, target, dtype, state):
    """One step of one tensor of more than `target` elements; its inputs are
    regenerated chunk by chunk (same seeds) for the reference."""
    n = target + 4099  # a ragged end
    c = test_adam.Case(dtype, state, decoupled=True, weight_decay=0.1, amsgrad=False, shapes=((n,),))
    st = c.state_dtype

    def make(i, j, seed0):
        k = j - i
        p = randn((k,), dtype, device, seed0)
        return dict(params=[p], grads=[randn((k,), dtype, device, seed0 + 1)],
                    exp_avgs=[(0.1 * randn((k,), torch.float32, device, seed0 + 2)).to(st)],
                    exp_avg_sqs=[(0.01 * randn((k,), torch.float32, device, seed0 + 3)).abs().to(st)],
                    max_exp_avg_sqs=[],
                    master_params=[p.float() + 1e-3 * randn((k,), torch.float32, device, seed0 + 4)]
                    if state == "master" else [],
                    steps=[torch.tensor(4.0, device=device)], grad_scale=None)

    chunks = [(i, min(n, i + CHUNK)) for i in range(0, n, CHUNK)]
    spec = {"params": dtype, "grads": dtype, "exp_avgs": st, "exp_avg_sqs": st}
    if state == "master":
        spec["master_params"] = torch.float32
    big = {k: torch.empty(n, dtype=dt, device=device) for k, dt in spec.items()}
    for ci, (i, j) in enumerate(chunks):
        part = make(i, j, 10 * ci)
        for k in spec:
            big[k][i:j] = part[k][0]
    step = torch.tensor(4.0, device=device)
    hp = test_adam.HP
    ops.adam_step([big["params"]], [big["grads"]], [big["exp_avgs"]], [big["exp_avg_sqs"]], [],
                  [big["master_params"]] if state == "master" else [], [step], hp["lr"], hp["beta1"],
                  hp["beta2"], hp["eps"], c.weight_decay, c.decoupled, False, False)
    assert float(step) == 5.0, "step count not incremented"
    for ci, (i, j) in enumerate(chunks):
        part = make(i, j, 10 * ci)
        ref = test_adam.run_reference(c, part, torch.float64)
        eager = test_adam.run_reference(c, part, torch.float32)
        for k, outs in ref.items():
            if outs:
                g = big[k][i:j]
                assert_close_2x(g, outs[0], eager[k][0].to(g.dtype), f"{k} [{i}:{j}]")
    return f"adam {str(dtype)[6:]} states {state} {n}", n


# --------------------------------------------------------------------------- attention

def attention_case(device, target, d, hkv, causal, deterministic):
    """(B, 1024, 16, d) q with B*S*H*D past `target`; every output and gradient
    of the first batch, the middle one, the first past the 2^31-th element of
    q and the last, by the 2x rule."""
    S, H = 1024, 16
    B = target // (S * H * d) + 1
    c = test_attention.Case(B=1, Sq=S, Sk=S, Hq=H, Hkv=hkv, D=d, causal=causal, dtype=BF16)
    q = randn((B, S, H, d), BF16, device, 1)
    k = randn((B, S, hkv, d), BF16, device, 2)
    v = randn((B, S, hkv, d), BF16, device, 3)
    dout = randn((B, S, H, d), BF16, device, 4)
    scale = d ** -0.5
    out, lse = ops.attn_fwd(q, k, v, scale, causal)
    dq, dk, dv = ops.attn_bwd(dout, q, k, v, out, lse, scale, causal, deterministic)
    past = min(B - 1, -(-target // (S * H * d)))  # the first batch at or past element 2^31 of q
    for b in sorted({0, B // 2, max(0, past - 1), past, B - 1}):
        s = slice(b, b + 1)
        got = dict(out=out[s], lse=lse[s], dq=dq[s], dk=dk[s], dv=dv[s])
        test_attention.check(c, q[s], k[s], v[s], dout[s], got)
    return (f"attention B{B} S{S} H{H}/{hkv} D{d} {'causal' if causal else 'full'}"
            f"{' deterministic' if deterministic else ''} bf16", B * S * H * d)


CASES = {
    "norm": [("layer_norm", lambda dev, t: norm_case(dev, t, False)),
             ("rms_norm", lambda dev, t: norm_case(dev, t, True))],
    "glu": [("swiglu_odd", lambda dev, t: glu_case(dev, t, 4097, "silu", False)),
            ("geglu", lambda dev, t: glu_case(dev, t, 11008, "gelu_tanh", False)),
            ("swiglu_packed", lambda dev, t: glu_case(dev, t, 5504, "silu", True))],
    "adam": [("adam_fp32", lambda dev, t: adam_case(dev, t, torch.float32, "param")),
             ("adam_bf16_master", lambda dev, t: adam_case(dev, t, BF16, "master"))],
    "attention": [("attention_d128", lambda dev, t: attention_case(dev, t, 128, 16, True, False)),
                  ("attention_d64", lambda dev, t: attention_case(dev, t, 64, 4, False, False)),
                  ("attention_d64_det", lambda dev, t: attention_case(dev, t, 64, 16, True, True))],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default=",".join(CASES))
    ap.add_argument("--log2", type=int, default=31, help="elements past 2^N (default 31)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    target = 1 << a.log2
    cuda = a.device.startswith("cuda")
    results = []
    for op in a.ops.split(","):
        for name, fn in CASES[op]:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.time()
            try:
                desc, numel = fn(a.device, target)
                ok, why = True, ""
            except Exception as e:  # noqa: BLE001  (a crash is a failure, reported like one)
                desc, numel, ok = name, 0, False
                why = f": {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else ""
            log2 = f"2^{math.log2(numel):.4f}" if numel else "?"
            print(f"huge: {'ok  ' if ok else 'FAIL'} {desc} ({numel} elements = {log2}; "
                  f"{time.time() - t0:.1f} s{peak}){why}", flush=True)
            results.append(ok)
    print(f"huge: {sum(results)}/{len(results)} cases passed past 2^{a.log2} elements ({a.device})")
    raise SystemExit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
