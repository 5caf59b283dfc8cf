"""Kernel-tuning probe for the fused add+norm CUDA kernels: GPU time (CUDA-graph
replay over rotating inputs) of the raw forward and backward ops at a few
shapes, as GB/s and as a fraction of the copy ceiling measured in the same run.
--tune sets the launch plans' tuning knobs (csrc/common/tune.h: norm_values,
norm_stages, norm_narrow, norm_park, norm_narrow_block, norm_ln16,
norm_bwd_pipe_from, norm_group, norm_group_kb, norm_group_bwd, norm_shift,
norm_shift_bwd) in this process, to compare plans:

    python tools/probes/norm_tune.py --tune norm_values=16 --shapes 16384x4096,8192x8192

--compile adds torch.compile's forward of the reference (the suite's yardstick)
timed the same way; with --rounds N the forwards are timed in turn N times
(--order: "oc" ours then compile, the default; "occo" mirrored; an "e" adds
torch.compile with emulate_precision_casts, Inductor's mode that rounds s to
bf16 / fp16 before normalising it, as eager and fusedops do) and every figure
printed: the first graphs timed in a process can read 1 % above later ones
(docs/perf-notes.md, v17-v18), so compare like positions. With --compile each
forward's largest error in y against float64 LayerNorm / RMSNorm of eager's
s is printed too. --fwd-only skips the backward. The forward writes no mean /
rstd unless --stats (as in the suite's forward rows).

Not the benchmark suite (benchmarks/): no eager, no autograd."""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import bench_norm, common  # noqa: E402
import fusedops  # noqa: E402
from fusedops import reference  # noqa: E402

ops = torch.ops.fusedops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384x1024,16384x4096,8192x8192")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--wdtype", help="dtype of weight and bias (default: --dtype)")
    ap.add_argument("--rms", action="store_true")
    ap.add_argument("--no-dwdb", action="store_true",
                    help="backward without dweight / dbias (dx only: no partial rows, no colsum)")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile's forward")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --compile: time ours and compile's forward in turn this many times")
    ap.add_argument("--order", default="oc",
                    help="with --compile: one round's timings, o ours and c compile (e.g. occo: mirrored)")
    ap.add_argument("--fwd-only", action="store_true", help="time the forward alone")
    ap.add_argument("--stats", action="store_true",
                    help="the forward writes mean / rstd (training); by default it does not, as in the suite's "
                         "forward rows and torch.compile's inference kernel")
    ap.add_argument("--once", action="store_true",
                    help="run fwd (as timed: statistics only with --stats), bwd (unless --fwd-only; dx only with "
                         "--no-dwdb) and, with --compile, torch.compile's fwd once per shape, untimed (for ncu)")
    ap.add_argument("--tune", default="",
                    help="tuning knobs name=value,... (csrc/common/tune.h), e.g. norm_values=16,norm_park=0")
    a = ap.parse_args()
    knobs = dict(kv.split("=") for kv in a.tune.split(",") if kv)
    for name, value in knobs.items():
        fusedops._C._tune(name, int(value))
    if not (a.order.startswith("o") and "c" in a.order and set(a.order) <= {"o", "c", "e"}):
        ap.error(f"--order: letters o, c and e, o first, at least one c; got {a.order!r}")
    dev = torch.device("cuda")
    dt = getattr(torch, a.dtype)
    wdt = getattr(torch, a.wdtype or a.dtype)
    if a.once:
        return once(a, dev, dt)
    ceiling = common.copy_ceiling(dev)["GB/s"]
    tag = " ".join(f"{k}={v}" for k, v in knobs.items()) or "default"
    if a.no_dwdb:
        tag += " dx-only"
    if a.stats:
        tag += " stats"
    for shape in a.shapes.split(","):
        T, H = map(int, shape.split("x"))
        n = T * H * dt.itemsize
        sets = []
        for _ in range(max(2, (256 << 20) // (8 * n) + 1)):
            x, r, dy, ds = (torch.randn(T, H, device=dev, dtype=dt) for _ in range(4))
            w = 1 + 0.1 * torch.randn(H, device=dev, dtype=wdt)
            b = None if a.rms else 0.1 * torch.randn(H, device=dev, dtype=wdt)
            y, s, mean, rstd = ops.add_norm_fwd(x, r, w, b, 1e-5, a.rms, False)
            sets.append((x, r, w, b, dy, ds, s, mean, rstd))
        it = iter(range(1 << 62))

        fwd = rotating_fwd(sets, it, lambda x, r, w, b: ops.add_norm_fwd(x, r, w, b, 1e-5, a.rms, False, a.stats))

        def bwd():
            x, r, w, b, dy, ds, s, mean, rstd = sets[next(it) % len(sets)]
            ops.add_norm_bwd(dy, ds, s, w, b, mean, rstd, a.rms, not a.no_dwdb, b is not None and not a.no_dwdb)

        tf = common.graph_time(fwd, dev)
        gf = 4 * n / tf / 1e9
        line = f"values={tag} {'rms' if a.rms else 'ln'} {shape:>11} {a.dtype}{'/' + a.wdtype if a.wdtype else ''}: fwd {gf:5.0f} GB/s ({gf / ceiling:.2f})"
        if a.compile:
            def ref_fn(x, r, w, b):
                return reference.add_norm(x, r, w, b, 1e-5, a.rms)
            # Both wrapped before either compiles: common.compiled resets dynamo.
            forwards = {"o": fwd, "c": rotating_fwd(sets, it, common.compiled(ref_fn))}
            if "e" in a.order:  # the suite's compile_exact
                forwards["e"] = rotating_fwd(sets, it, common.compiled(ref_fn, bench_norm.EXACT["compile_exact"]))
            # Each letter of --order, each round: one graph captured and timed.
            timed = {k: [] for k in forwards}
            for k, impl in enumerate(a.order * a.rounds):
                if k == 0:
                    timed["o"].append(gf)  # ours, timed above
                    continue
                timed[impl].append(4 * n / common.graph_time(forwards[impl], dev) / 1e9)
            gc = timed["c"][0]
            line += f"  compile {gc:5.0f} ({gc / ceiling:.2f}, ours {gf / gc:.2f}x)"
            if a.rounds > 1 or len(a.order) > 2:
                line += f"  [{a.order} x{a.rounds}] " + " / ".join(
                    f"{_NAMES[k]} " + " ".join(f"{v:.0f}" for v in timed[k]) for k in timed)
            line += "  max |y err| " + " / ".join(
                f"{_NAMES[k]} {y_error(sets[0], forwards[k].fn, a.rms):.4g}" for k in timed)
        if not a.fwd_only:
            tb = common.graph_time(bwd, dev)
            gb, gfb = 4 * n / tb / 1e9, 8 * n / (tf + tb) / 1e9
            line += f"  bwd {gb:5.0f} ({gb / ceiling:.2f})  fwd+bwd {gfb:5.0f} ({gfb / ceiling:.2f})"
        print(line + f"  [ceiling {ceiling:.0f}]", flush=True)


_NAMES = {"o": "ours", "c": "compile", "e": "compile_exact"}


def rotating_fwd(sets, it, fn):
    """A forward over the rotating sets calling fn(x, r, w, b) (ours, or a
    compiled reference); fn is kept on it as .fn, for y_error."""
    def run():
        x, r, w, b, *_ = sets[next(it) % len(sets)]
        fn(x, r, w, b)
    run.fn = fn
    return run


def y_error(one_set, fn, rms):
    """The largest |y - y64| of fn over one input set; y64: LayerNorm / RMSNorm
    in float64 of s = x + residual rounded as eager rounds it."""
    x, r, w, b, *_ = one_set
    y = fn(x, r, w, b)[0]
    s = (x + r).double()
    y64 = reference.add_norm(s, None, w.double(), None if b is None else b.double(), 1e-5, rms)[0]
    return (y.double() - y64).abs().max().item()


def once(a, dev, dt):
    for shape in a.shapes.split(","):
        T, H = map(int, shape.split("x"))
        x, r, dy, ds = (torch.randn(T, H, device=dev, dtype=dt) for _ in range(4))
        w = torch.randn(H, device=dev, dtype=dt)
        b = None if a.rms else torch.randn(H, device=dev, dtype=dt)
        ops.add_norm_fwd(x, r, w, b, 1e-5, a.rms, False, a.stats)  # the forward as timed
        if not a.fwd_only:  # the backward needs the statistics: a second forward saves them
            y, s, mean, rstd = ops.add_norm_fwd(x, r, w, b, 1e-5, a.rms, False, True)
            ops.add_norm_bwd(dy, ds, s, w, b, mean, rstd, a.rms, not a.no_dwdb, b is not None and not a.no_dwdb)
        if a.compile:
            torch.compile(lambda *t: reference.add_norm(*t, 1e-5, a.rms))(x, r, w, b)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
