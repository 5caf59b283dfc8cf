# (tools/probes: run on a GPU as python3 tools/probes/linear_xent.py; about 2 minutes on an H200)
# Fused linear + cross-entropy (issue 53): forward+backward time and peak memory of
# fusedops.functional.linear_cross_entropy under each chunk variant of fusedops/ops/linear_xent.py
# (the policies of chunk_rows, and fixed rows a chunk), beside the unfused form (h @ W.T, then
# fusedops' cross_entropy), torch.compile of transformers' form (fp32 logits) and Liger-Kernel's
# fused linear cross-entropy (where it imports; the implementations are the benchmark's), in one process, bf16, mean over targets of
# which ~5 % are ignored. Peak: memory one call allocates beyond its inputs, gradients included
# (as benchmarks/bench_linear_xent.py). Then, for the first shape, where the GPU time of fusedops'
# default variant and of the unfused form goes, op by op and by operand shapes (torch.profiler);
# and for each vocabulary, the cross-entropy pass on one chunk's logits: the fused pass
# (xent_fwd_bwd_: two reads of a row, the second meant to hit L2, and a write) against xent_fwd +
# xent_bwd (the same reads and write, both reads from DRAM), in GB/s of the fused pass's
# fewest bytes (one read, one write).
#   python3 tools/probes/linear_xent.py                       # the five shapes
#   python3 tools/probes/linear_xent.py --shapes 8192x4096x128256 --rows 512,768,1536 --no-compile
#   python3 tools/probes/linear_xent.py --device cpu --shapes 300x64x1000 --rows 64   # a smoke test
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from benchmarks.bench_linear_xent import IGNORE, _eager as eager, _fused as fused, _liger  # noqa: E402
from benchmarks.bench_linear_xent import _unfused as unfused  # noqa: E402
from fusedops.ops import linear_xent as LX  # noqa: E402
SHAPES = "8192x4096x128256,8192x4096x32000,8192x4096x262144,2048x4096x128256,32768x4096x128256"
MiB = 1 << 20


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=SHAPES, help="tokens x hidden x vocab, comma-separated")
    p.add_argument("--rows", default="512,2048", help="fixed rows a chunk to try besides the policies")
    p.add_argument("--iters", type=int, default=5, help="timed calls a case (median)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test (no peak, no Liger)")
    return p.parse_args()


def variant(policy=None, rows=None):
    """fusedops with chunk_rows' policy or a fixed count of rows (the
    module's in-process variants), restored after the call."""
    def call(h, w, t):
        LX._POLICY, LX._CHUNK_ROWS = policy, rows
        try:
            return fused(h, w, t)
        finally:
            LX._POLICY = LX._CHUNK_ROWS = None
    return call


def make(n, hd, v, device):
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(n, hd, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(v, hd, device=device, generator=g) * hd ** -0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device=device, generator=g)
    t[torch.rand(n, device=device, generator=g) < 0.05] = IGNORE
    return h, w, t


def step(fn, h, w, t):
    loss = fn(h, w, t)
    grads = torch.autograd.grad(loss, (h, w))
    return loss.detach(), grads


def measure(fn, h, w, t, iters):
    """(median ms, peak MiB beyond the inputs or None on a CPU, loss) of
    forward+backward."""
    for _ in range(2):  # warm-up: compile, autotune, the allocator's pools
        step(fn, h, w, t)
    if h.device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            loss, _ = step(fn, h, w, t)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), None, float(loss)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss, grads = step(fn, h, w, t)
    del grads
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / MiB
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step(fn, h, w, t)
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in times), peak, float(loss)


def breakdown(label, fn, h, w, t):
    """GPU time of one forward+backward by op and operand shapes (self time)."""
    from torch.profiler import ProfilerActivity, profile
    gpu = h.device.type == "cuda"
    step(fn, h, w, t)
    if gpu:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else []),
                 record_shapes=True) as prof:
        step(fn, h, w, t)
        if gpu:
            torch.cuda.synchronize()

    def dev(e):
        if not gpu:
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
    rows = sorted((e for e in prof.key_averages(group_by_input_shape=True) if dev(e) > 0), key=dev, reverse=True)
    total = sum(dev(e) for e in rows)
    print(f"\n{label}: {'GPU' if gpu else 'CPU'} time by op (self), total {total / 1e3:.2f} ms")
    for e in rows[:14]:
        shapes = str(e.input_shapes)[:70] if e.input_shapes else ""
        print(f"  {dev(e) / 1e3:8.2f} ms  x{e.count:<3} {e.key[:40]:40} {shapes}")


def xent_pass(rows, v, device, calls=6):
    """ms and GB/s (of 2 x the logits' bytes) of the fused cross-entropy pass
    and of the forward then backward pass on [rows, v] bf16 logits, each
    call on its own buffer (cold in L2)."""
    g = torch.Generator(device=device).manual_seed(1)
    zs = [(torch.randn(rows, v, device=device, generator=g) * 3).to(torch.bfloat16) for _ in range(calls)]
    t = torch.randint(0, v, (rows,), device=device, generator=g)
    dloss = torch.full((rows,), 1.0 / rows, device=device)
    ops = torch.ops.fusedops

    def fused(z):
        ops.xent_fwd_bwd_(z, t, dloss, IGNORE, 0.0, 0.0)

    def split(z):
        _, lse, _ = ops.xent_fwd(z, t, IGNORE, 0.0, 0.0)
        ops.xent_bwd(dloss, z, t, lse, IGNORE, 0.0, 0.0)
    out = {}
    for name, fn in (("fused xent_fwd_bwd_", fused), ("xent_fwd + xent_bwd", split)):
        fn(zs[0])
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in zs]
        for z, (a, b) in zip(zs, ev):
            a.record()
            fn(z)
            b.record()
        torch.cuda.synchronize()
        ms = statistics.median(a.elapsed_time(b) for a, b in ev)
        out[name] = (ms, 2 * rows * v * 2 / ms / 1e6)
    return out


def main():
    args = parse()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("linear_xent probe: no CUDA GPU (--device cpu runs a smoke test)")
    impls = {"unfused": unfused}
    if args.compile:
        impls["compile"] = torch.compile(eager, dynamic=False)
    lig = _liger() if device.type == "cuda" else None
    if device.type == "cuda" and lig is None:
        print("liger: n/a (liger_kernel does not import)")
    if lig is not None:
        impls["liger"] = lig
    for p in LX.POLICIES:
        impls[f"fusedops[{p}]" + ("*" if p == LX.POLICY else "")] = variant(policy=p)
    for r in (int(x) for x in args.rows.split(",") if x.strip()):
        impls[f"fusedops[rows={r}]"] = variant(rows=r)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{machine}, torch {torch.__version__}; bf16, forward+backward, grads of h and W; "
          f"median of {args.iters}; * the library's policy")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    seen = set()  # vocabularies whose cross-entropy pass was timed
    for i, (n, hd, v) in enumerate(shapes):
        h, w, t = make(n, hd, v, device)
        free = LX._free_bytes(h.device)
        print(f"\n{n} tokens x hidden {hd} x vocab {v} (flop-bound time at 6NHV: "
              f"{6 * n * hd * v / 1e12:.1f} TFLOP)")
        print(f"  {'impl':22} {'rows':>6} {'ms':>8} {'peak MiB':>9} {'vs unfused':>10} {'vs liger':>9}  loss")
        res = {}
        for name, fn in impls.items():
            try:
                res[name] = measure(fn, h, w, t, args.iters)
            except Exception as e:  # noqa: BLE001  (an n/a row; the others still run)
                print(f"  {name:22} n/a: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                torch.cuda.empty_cache()
                continue
            ms, peak, loss = res[name]
            rows = ""
            if name.startswith("fusedops"):
                rows = name.split("rows=")[1].rstrip("]") if "rows=" in name else LX.chunk_rows(
                    n, v, hd, h.element_size(), free, policy=name[9:].rstrip("]*"))
            vs_u = f"{ms / res['unfused'][0]:.3f}x" if "unfused" in res else ""
            vs_l = f"{ms / res['liger'][0]:.3f}x" if "liger" in res else ""
            peak = "n/a" if peak is None else f"{peak:.0f}"
            print(f"  {name:22} {rows!s:>6} {ms:8.2f} {peak:>9} {vs_u:>10} {vs_l:>9}  {loss:.5f}", flush=True)
        if args.profile and i == 0:
            breakdown("fusedops (library policy)", fused, h, w, t)
            breakdown("unfused", unfused, h, w, t)
        del h, w, t
        if device.type == "cuda" and v not in seen:
            seen.add(v)
            rows = LX.chunk_rows(n, v, hd, 2, LX._free_bytes(device), policy=LX.POLICY)
            for name, (ms, gbs) in xent_pass(rows, v, device).items():
                print(f"  cross-entropy pass, {rows} x {v} bf16: {name:20} {ms:7.3f} ms {gbs:7.0f} GB/s")
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
