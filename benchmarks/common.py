"""What every benchmark shares: the case description, timing, rotating inputs,
the copy ceiling measured in the same run, torch.compile of the eager baseline,
and the results (JSON, a markdown table, a chart).

A bench_<op>.py module only describes its cases (shapes, inputs, the fusedops
and eager functions, the bytes the op must move, and for compute-bound ops the
FLOPs, judged against a matmul ceiling measured in the same run); everything
else is here.
"""
import datetime
import inspect
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

MB = 1 << 20
# "step": one call that is neither (an optimizer step), timed as it is.
DIRECTIONS = ("fwd", "fwd+bwd", "step")
IMPLS = ("fusedops", "eager", "compile")
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Input sets of one case together exceed this on a GPU: over 2x an H100's 50 MB
# L2, so a timed call never finds its inputs left there by the previous one.
ROTATE_BYTES = 128 * MB


# ---------------------------------------------------------------- cases
@dataclass
class Inputs:
    """One input set: the positional args of every impl and, for fwd+bwd, the
    upstream gradients of its outputs (precomputed so they are not timed)."""
    args: tuple
    grads: Optional[tuple] = None
    wrt: list = field(init=False)  # the args that get gradients

    def __post_init__(self):
        self.wrt = [a for a in self.args if isinstance(a, torch.Tensor) and a.requires_grad]

    @property
    def nbytes(self):
        flat = [t for a in (*self.args, *(self.grads or ()))
                for t in (a if isinstance(a, (list, tuple)) else (a,))]  # lists of tensors too
        return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))


@dataclass
class Case:
    """One (op, shape, dtype, direction) to time under every impl.

    make_inputs(grad) builds one input set; grad=True marks the differentiable
    args requires_grad and adds upstream grads. impls maps "fusedops" and
    "eager" to functions of the args returning the op's outputs; the runner adds
    "compile" (torch.compile of eager) unless impls has one; a case may add
    more (torch's own kernels, say: they show as further columns). nbytes is the
    fewest bytes the op must move in this direction (DESIGN.md, Kernels). A
    compute-bound case gives flops instead: it is then reported in TFLOP/s
    against the matmul ceiling. min_sets: input sets to rotate through at the
    least (1 for cases far larger than the L2 that cannot afford two copies);
    note: a line for the report saying what the columns hold where that is not
    the default; compile_options: further torch.compile impls of eager, name ->
    Inductor options, each a column after compile's."""
    op: str
    shape: tuple
    dtype: torch.dtype
    direction: str
    nbytes: Optional[int]
    make_inputs: Callable[[bool], Inputs]
    impls: dict
    flops: Optional[float] = None
    min_sets: int = 2
    note: str = ""
    compile_options: dict = field(default_factory=dict)

    @property
    def unit(self):
        return "TFLOP/s" if self.flops else "GB/s"

    @property
    def work(self):
        """What one call does, in the unit's numerator (TFLOP or GB)."""
        return self.flops / 1e12 if self.flops else self.nbytes / 1e9

    @property
    def label(self):
        return f"{self.op} {_shape(self)} {_dtype(self)} {self.direction}"


def shape_grid(device, quick, gpu_shapes, cpu_shapes, case):
    """The cases of an op benchmarked over shapes x dtypes: bf16 on a GPU,
    fp32 and bf16 on a CPU; --quick keeps the first shape and dtype.
    case(shape, dtype, device) -> a list of Case."""
    gpu = device.type == "cuda"
    dtypes = [torch.bfloat16] if gpu or quick else [torch.float32, torch.bfloat16]
    return [c for dtype in dtypes for shape in (gpu_shapes if gpu else cpu_shapes)[:1 if quick else None]
            for c in case(shape, dtype, device)]


def _shape(case):
    return "x".join(map(str, case.shape))


def _dtype(case):
    return DTYPE_NAMES.get(case.dtype, str(case.dtype))


# ---------------------------------------------------------------- timing
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# A call this long is timed by its median over 3, after one warm-up call,
# not over 5 after two: on a CPU without native bf16 (AVX2), eager and
# compiled bf16 attention run at 1-4 GFLOP/s, seconds a call. On a 2-core
# AVX2 VM the default suite took 1482 s; its attention part 783 s, now 605 s.
SLOW_CALL_S = 1.0


def _warm_and_count(fn, device, budget_s, lo, hi):
    """Warm up (at least 2 calls, about a quarter of the budget; one call past
    SLOW_CALL_S), then return how many reps fill budget_s, clamped to [lo, hi]
    (at least 3 past SLOW_CALL_S)."""
    n, t0 = 0, time.perf_counter()
    while n < 2 or time.perf_counter() - t0 < budget_s / 4:
        fn()
        _sync(device)
        n += 1
        if time.perf_counter() - t0 > SLOW_CALL_S:
            break
    per_call = (time.perf_counter() - t0) / n
    if per_call > SLOW_CALL_S:
        lo = min(lo, 3)
    return max(lo, min(hi, int(budget_s / per_call)))


def _median_wall(fn, device):
    reps = _warm_and_count(fn, device, budget_s=0.3, lo=5, hi=200)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _median_cuda_events(fn, device, budget_s=0.1):
    reps = _warm_and_count(fn, device, budget_s=budget_s, lo=10, hi=1000)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for start, end in ev:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in ev) / 1e3


def _do_bench():
    """triton.testing.do_bench where it exists and takes return_mode (Triton
    2.2 on); else None and we time with CUDA events ourselves."""
    try:
        from triton.testing import do_bench
    except Exception:  # noqa: BLE001  (no triton, or one that fails to import)
        return None
    return do_bench if "return_mode" in inspect.signature(do_bench).parameters else None


def timer_name(device):
    if device.type != "cuda":
        return "time.perf_counter median"
    return "triton.testing.do_bench median" if _do_bench() else "CUDA events median"


def time_fn(fn, device):
    """Median seconds of one call of fn(): do_bench (which also flushes L2
    between calls) or CUDA events on a GPU, wall clock on the CPU."""
    if device.type == "cuda":
        do_bench = _do_bench()
        if do_bench is not None:
            return do_bench(fn, return_mode="median") / 1e3
        return _median_cuda_events(fn, device)
    return _median_wall(fn, device)


# The impls whose host time a call the suite reports (the "host us/call"
# column): fusedops and the eager code it replaces.
LOOP_IMPLS = ("fusedops", "eager")


def loop_time(fn, device, budget_s=0.05, rounds=3):
    """Seconds a call of fn() as a user's loop runs it: calls one after
    another, no CUDA graph, one synchronize at the end; the best of `rounds`
    loops. Where the kernels are shorter than the host's work for a call
    (small shapes on a GPU, issue 54) this is the host's time; elsewhere the
    GPU's (on the CPU: the call's)."""
    n = _warm_and_count(fn, device, budget_s, lo=3, hi=2000)
    best = math.inf
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / n)
    return best


# A timed call that takes this much longer than the same work replayed as a
# CUDA graph is measuring Python, autograd and launch overhead, not kernels: an
# eager fwd+bwd of a 2^24-element norm is a dozen launches for ~0.1 ms of
# H100 memory traffic, and do_bench's events see the host's issue time.
HOST_BOUND = 1.25


def graph_time(fn, device, calls=10):
    """Median GPU-only seconds per call of fn(): `calls` calls captured in one
    CUDA graph, replayed. None off CUDA or where capture fails."""
    if device.type != "cuda":
        return None
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # capture needs a warm-up off the default stream
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        return _median_cuda_events(graph.replay, device, budget_s=0.05) / calls
    except Exception:  # noqa: BLE001  (no number rather than no benchmark)
        torch.cuda.synchronize(device)
        return None


# ---------------------------------------------------------------- inputs, ceiling
def rotating(make_inputs, grad, device, min_sets=2):
    """Build enough input sets to overflow the L2 (ROTATE_BYTES on a GPU; two on
    the CPU, where memory is the limit; never fewer than min_sets) and return
    (sets, next_set): next_set() hands out the next set in turn, so each timed
    call reads cold inputs."""
    sets = [make_inputs(grad)]
    want = min_sets
    if device.type == "cuda":
        want = max(min_sets, math.ceil(ROTATE_BYTES / max(sets[0].nbytes, 1)))
    sets += [make_inputs(grad) for _ in range(want - 1)]
    i = -1

    def next_set():
        nonlocal i
        i = (i + 1) % len(sets)
        return sets[i]
    return sets, next_set


def _ceiling_bytes(device):
    """2 GiB on a GPU (the ANCHORS.md figure), halved until source, copy and
    do_bench's 256 MB flush buffer fit in free memory with 1 GiB to spare."""
    if device.type != "cuda":
        return 256 * MB
    free, _ = torch.cuda.mem_get_info(device)
    nbytes = 2048 * MB
    while nbytes > 256 * MB and 2 * nbytes + 1280 * MB > free:
        nbytes //= 2
    return nbytes


def matmul_ceiling(device):
    """Dense matmul rate in TFLOP/s (bf16 8192^3 on a GPU, the ANCHORS.md
    figure; fp32 1024^3 on the CPU): the ceiling of compute-bound cases."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = time_fn(lambda: a @ b, device)
    del a, b
    _free(device)
    return {"TFLOP/s": 2 * n**3 / seconds / 1e12, "n": n, "dtype": DTYPE_NAMES[dtype],
            "ms": seconds * 1e3}


def copy_ceiling(device):
    """Device-to-device copy bandwidth in GB/s (bytes read + written): the most
    a memory-bound op can hope for on this machine, measured in this run."""
    nbytes = _ceiling_bytes(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), device)
    del src, dst
    _free(device)
    return {"GB/s": 2 * nbytes / seconds / 1e9, "buffer_bytes": nbytes, "ms": seconds * 1e3}


def _free(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def steady_host_allocator():
    """Keep freed CPU tensors of up to 32 MiB in the heap (glibc only). By
    default glibc may hand them back to the OS and page-fault them in again on
    the next call, which made CPU timings swing 3x between runs: we were timing
    the allocator, not the kernel. Tensors over 32 MiB are always mmap'd."""
    try:
        import ctypes
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
    return bool(mallopt(M_MMAP_THRESHOLD, 32 * MB) and mallopt(M_TRIM_THRESHOLD, -1))


# ---------------------------------------------------------------- torch.compile
def compiled(fn, options=None):
    """torch.compile(fn), default mode, static shapes, with Inductor options if
    given (then through a wrapper of its own, so that its dynamo cache entry is
    not the plain compile's of the same fn). Where compile cannot
    even be set up here (an unsupported Python, say), a stand-in that raises
    the same error when called, so the case records n/a and the suite goes on.
    Most failures (no C++ compiler, an inductor bug) only show at the first
    call, which the caller makes outside timing and catches the same way."""
    # A fresh dynamo cache per case: the sweep would otherwise pass the
    # recompile limit (one compile per shape and grad mode) and dynamo would
    # silently fall back to eager.
    torch._dynamo.reset()
    try:
        if not options:
            return torch.compile(fn, dynamic=False)

        def own(*args):
            return fn(*args)
        return torch.compile(own, dynamic=False, options=options)
    except Exception as e:  # noqa: BLE001
        error = _short_error(e)

    def unavailable(*args):
        raise RuntimeError(f"torch.compile unavailable: {error}")
    return unavailable


# ---------------------------------------------------------------- one case
def _step(fn, direction):
    """What one timed call does: the forward (or an optimizer step) alone under
    no_grad, or the forward plus torch.autograd.grad of every output (no .grad
    accumulation)."""
    if direction in ("fwd", "step"):
        def step(inp):
            with torch.no_grad():
                return fn(*inp.args)
    else:
        def step(inp):
            return torch.autograd.grad(fn(*inp.args), inp.wrt, inp.grads)
    return step


def _candidates(case, use_compile):
    fns = dict(case.impls)
    if use_compile and "eager" in fns:
        if "compile" not in fns:
            fns["compile"] = compiled(fns["eager"])
        for name, options in case.compile_options.items():
            fns[name] = compiled(fns["eager"], options)
    return fns


def _row(case, impl, **extra):
    return {"op": case.op, "shape": _shape(case), "dtype": _dtype(case), "impl": impl,
            "direction": case.direction, "unit": case.unit, "ms": None, case.unit: None,
            "frac_of_ceiling": None, **({"note": case.note} if case.note else {}), **extra}


def rate(row, gpu=True):
    """The row's rate in its unit: of the GPU time alone (CUDA-graph replay)
    where measured and gpu is set, else of the timed call."""
    unit = row.get("unit", "GB/s")
    return (row.get("gpu_" + unit) if gpu else None) or row.get(unit)


def _peak_bytes(call, device):
    """Memory one call allocates at its peak beyond what is already held
    (CUDA only: None elsewhere)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    call()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def _short_error(e):
    # The first line is enough to tell why; inductor errors run to pages.
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg.splitlines()[0][:300] if msg else ''}"


def _time_impl(impl, fn, case, sets, next_set, device, ceiling):
    """Warm fn on every set outside timing (this is where compile happens),
    then time it on the rotating sets. Any failure becomes an n/a row.
    ceiling: the rate of the case's unit that the machine peaks at."""
    row = _row(case, impl)
    step = _step(fn, case.direction)
    call = lambda: step(next_set())  # noqa: E731
    try:
        t0 = time.perf_counter()
        for _ in sets:
            call()
        _sync(device)
        if impl == "compile" and "compile" not in case.impls:  # ours, not a case's own baseline
            row["compile_s"] = round(time.perf_counter() - t0, 2)
        peak = _peak_bytes(call, device)
        if peak is not None:
            row["peak_MiB"] = round(peak / MB, 1)
        u = case.unit
        row["ms"] = time_fn(call, device) * 1e3
        row[u] = case.work / row["ms"] * 1e3
        row["frac_of_ceiling"] = row[u] / ceiling
        if impl in LOOP_IMPLS:
            row["host_us"] = loop_time(call, device) * 1e6
        _record_gpu(row, graph_time(call, device), case, ceiling)
    except Exception as e:  # noqa: BLE001  (record it and go on to the next impl)
        row["error"] = _short_error(e)
    return row


def _record_gpu(row, gpu, case, ceiling):
    """Put a graph time (seconds a call, or None) into the row: gpu_ms and the
    rate and fraction of the ceiling it gives."""
    if gpu is None:
        return
    u = case.unit
    row["gpu_ms"] = gpu * 1e3
    row["gpu_" + u] = case.work / gpu
    row["gpu_frac_of_ceiling"] = row["gpu_" + u] / ceiling
    row["host_bound"] = row["ms"] > HOST_BOUND * row["gpu_ms"]


def _graph_again(row, fn, case, next_set, device, ceiling):
    """Time the impl's CUDA graph a second time and keep the mean of the two.
    run_case does this in the reverse order of the first pass, so every impl
    has one early and one late position: on an H100 the first graphs timed
    in a process read up to 0.9 % high (docs/perf-notes.md, v17-v18), and the
    first pass alone always gave that to the first impl."""
    if row.get("error") or row.get("gpu_ms") is None:
        return
    step = _step(fn, case.direction)
    again = graph_time(lambda: step(next_set()), device)  # None where capture fails: the first stands
    if again is not None:
        row["gpu_ms_passes"] = [row["gpu_ms"], again * 1e3]
        _record_gpu(row, (row["gpu_ms"] / 1e3 + again) / 2, case, ceiling)


def run_case(case, device, ceilings, use_compile=True):
    """Time every impl of one case; returns one result row per impl.
    ceilings: {unit: rate} as measured in this run."""
    torch.manual_seed(0)
    impls = _candidates(case, use_compile)
    try:
        sets, next_set = rotating(case.make_inputs, case.direction == "fwd+bwd", device, case.min_sets)
    except Exception as e:  # noqa: BLE001  (out of memory, say: every impl is n/a)
        _free(device)
        return [_row(case, impl, error=_short_error(e)) for impl in impls]
    rows = [_time_impl(impl, fn, case, sets, next_set, device, ceilings[case.unit])
            for impl, fn in impls.items()]
    for row, fn in reversed(list(zip(rows, impls.values()))):
        _graph_again(row, fn, case, next_set, device, ceilings[case.unit])
    del sets, next_set
    _free(device)
    return rows


def progress_start(i, n, case):
    """'[3/20] add+LayerNorm 16384x4096 bf16 fwd ... ' on stderr before the case
    runs, so a hang or a crash names its case; progress_end finishes the line."""
    print(f"[{i}/{n}] {case.label} ... ", end="", file=sys.stderr, flush=True)


def progress_end(rows):
    parts = [f"{r['impl']} " + (f"{_fmt_rate(rate(r, False))} {r['unit']}" if rate(r, False) else "n/a")
             for r in rows]
    notes = [f" (compiled in {r['compile_s']} s)" for r in rows if "compile_s" in r]
    print(", ".join(parts) + "".join(notes), file=sys.stderr, flush=True)
    for r in rows:
        if r.get("error"):
            print(f"    {r['impl']}: {r['error']}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- metadata
def _cmd(*argv):
    """stdout of a command run from the repository root, or None."""
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_name():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _device_info(device):
    """What the numbers depend on: the GPU (or CPU) and how much of it we had."""
    info = {"cpu": _cpu_name(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        l2 = getattr(p, "L2_cache_size", None)  # not in every torch
        info.update(name=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    memory_GiB=round(p.total_memory / 2**30, 1),
                    l2_MB=None if l2 is None else round(l2 / 1e6, 1),
                    driver=_cmd("nvidia-smi", "--query-gpu=driver_version",
                                "--format=csv,noheader"))
    else:
        info["name"] = info["cpu"]
    return info


def metadata(device, ceiling):
    import fusedops
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    info = _device_info(device)
    dirty = _cmd("git", "status", "--porcelain", "--untracked-files=no")
    return {
        "device": info["name"],
        "device_type": device.type,
        "device_info": info,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "fusedops": fusedops.__version__,
        "build_info": fusedops.build_info(),
        # FUSEDOPS_COMMIT first: a copy of the tree on a remote GPU box may carry
        # no .git, or a stale one, and is told its commit by whoever sent it.
        "git_commit": (os.environ.get("FUSEDOPS_COMMIT") or _cmd("git", "rev-parse", "HEAD")
                       or "unknown"),
        "git_dirty": None if dirty is None else bool(dirty),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "timer": timer_name(device),
        "ceiling": ceiling,
    }


# ---------------------------------------------------------------- reports
def write_json(out_dir, meta, rows, complete):
    """Rewritten after every case, so a run cut off by a time limit still
    leaves what it measured."""
    path = Path(out_dir) / "results.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "complete": complete, "results": rows}, indent=1))
    os.replace(tmp, path)
    return path


def _by_impl(rows):
    """{(op, shape, dtype, direction): {impl: row}}, in first-seen order."""
    groups = {}
    for r in rows:
        key = (r["op"], r["shape"], r["dtype"], r["direction"])
        groups.setdefault(key, {})[r["impl"]] = r
    return groups


def _fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def _ratio(a, b):
    return None if not (a and b) else a / b


def _fmt_rate(v):
    """Three significant digits or more: 2930, 81.4, 0.112."""
    if v is None:
        return "n/a"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.3f}"


def _wall(row):
    # '*' marks a host-bound number (see HOST_BOUND).
    r = rate(row, gpu=False)
    return "n/a" if r is None else _fmt_rate(r) + ("*" if row.get("host_bound") else "")


def _host(g):
    """fusedops' and eager's host time a call (loop_time), in microseconds."""
    us = [g.get(impl, {}).get("host_us") for impl in LOOP_IMPLS]
    return "/".join("n/a" if u is None else f"{u:.0f}" if u >= 100 else f"{u:.1f}" for u in us)


def _peaks(r, impls):
    peaks = [r.get(impl, {}).get("peak_MiB") for impl in impls]
    return "/".join("n/a" if p is None else f"{p:.0f}" for p in peaks)


def _table_row(key, g, ceiling, impls, with_peaks):
    """fusedops' rate, its fraction of the ceiling, every other impl's rate,
    fusedops' speedup over each, its host-timed rate (and peak memory)."""
    v = {impl: rate(g.get(impl, {})) for impl in impls}
    others = impls[1:]
    row = ([*key, _fmt_rate(v["fusedops"]), _fmt(_ratio(v["fusedops"], ceiling), ".2f")]
           + [_fmt_rate(v[o]) for o in others]
           + [_fmt(_ratio(v["fusedops"], v[o]), ".2f") for o in others] + [_wall(g.get("fusedops", {})), _host(g)])
    return row + ([_peaks(g, impls)] if with_peaks else [])


def _table(rows, ceiling, unit):
    """Markdown table of the rows of one unit: one line per (op, shape, dtype,
    direction), the impls in the order first seen (fusedops first)."""
    impls = ["fusedops"] + [i for i in dict.fromkeys(r["impl"] for r in rows) if i != "fusedops"]
    peaks = any("peak_MiB" in r for r in rows)
    head = (["op", "shape", "dtype", "dir", "fusedops", "frac"] + impls[1:]
            + [f"vs {i}" for i in impls[1:]] + ["fusedops wall", "host us/call f/e"]
            + ([f"peak MiB {'/'.join(i[0] if i in IMPLS else i for i in impls)}"] if peaks else []))
    body = [_table_row(key, g, ceiling, impls, peaks) for key, g in _by_impl(rows).items()]
    return f"{unit}:\n" + _markdown(head, body, n_left=4) + "\n"


def _markdown(head, body, n_left):
    """A markdown table with aligned columns: the first n_left left-aligned."""
    width = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    right = [i >= n_left for i in range(len(head))]

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if r else c.ljust(w)
                                 for c, w, r in zip(cells, width, right)) + " |"
    rule = "|" + "|".join(("-" * (w + 1) + ":") if r else ("-" * (w + 2))
                          for w, r in zip(width, right)) + "|"
    return "\n".join([line(head), rule] + [line(b) for b in body])


def format_table(meta, rows):
    """A table per unit (GB/s: the fewest bytes the op must move; TFLOP/s), one
    line per (op, shape, dtype, direction). On a GPU the rates are GPU time
    (the calls replayed as a CUDA graph: kernels only, for every impl alike);
    'wall' is fusedops timed call by call, host overhead included."""
    gpu = meta.get("device_type") == "cuda"
    title = (f"{meta['device']}, torch {meta['torch']}, commit {meta['git_commit'][:12]}"
             f"{' (dirty)' if meta.get('git_dirty') else ''}; {meta['timer']}\n"
             f"{ceiling_line(meta)}. Memory-bound cases in GB/s, compute-bound ones in TFLOP/s; "
             "frac = fusedops / the ceiling of that unit; 'vs' = fusedops speedup.\n")
    if not gpu:
        title += ("On a CPU the copy ceiling is the memory's bandwidth and the matmul ceiling one fp32 "
                  "matmul: a case whose operands stay in the caches, or that runs in bf16, can read a "
                  "frac above 1 (a yardstick here, not a bound).\n")
    if gpu:
        title += ("Rates from GPU time (each impl's calls replayed as a CUDA graph, timed twice, the "
                  "impls in turn and then in reverse order, the mean kept); 'fusedops wall' "
                  "times each call from the host, launch and autograd overhead included.\n")
    title += ("host us/call f/e: fusedops' and eager's microseconds a call in a user's loop (calls back to "
              "back, no CUDA graph, one synchronize at the end; the best of 3 loops): the host's time "
              "where it exceeds the kernels'.\n")
    if any("peak_MiB" in r for r in rows):
        title += ("peak MiB: memory one call allocates beyond its inputs, per impl in column order "
                  "(f/e/c: fusedops/eager/compile; fwd+bwd: the whole step, saved activations "
                  "included).\n")
    if any(r.get("host_bound") for r in rows):
        title += (f"* host-bound: over {HOST_BOUND}x the time of the same calls replayed as a "
                  "CUDA graph (gpu_ms in results.json).\n")
    tables = [_table([r for r in rows if r.get("unit", "GB/s") == u], ceilings(meta).get(u), u)
              for u in ("GB/s", "TFLOP/s") if any(r.get("unit", "GB/s") == u for r in rows)]
    notes = "".join(f"{n}\n" for n in dict.fromkeys(r["note"] for r in rows if r.get("note")))
    return title + "\n".join(tables) + ("\n" + notes if notes else "") + "\n" + verdict(rows) + "\n"


def ceiling_line(meta):
    """The ceilings a run measured, in words: 'copy ceiling 3017 GB/s (2048 MiB,
    read + write); matmul ceiling 745 TFLOP/s (bfloat16 8192^3)'."""
    c = meta["ceiling"]
    line = f"copy ceiling {_fmt_rate(c['GB/s'])} GB/s ({c['buffer_bytes'] // MB} MiB, read + write)"
    if meta.get("matmul_ceiling"):
        m = meta["matmul_ceiling"]
        line += f"; matmul ceiling {_fmt_rate(m['TFLOP/s'])} TFLOP/s ({m['dtype']} {m['n']}^3)"
    return line


BASELINES = {"eager": "eager", "compile": "torch.compile"}


def verdict(rows):
    """One line: in how many cases fusedops is faster than eager and than
    torch.compile, and its worst ratio to either (with the case)."""
    wins, worst = {}, None
    for key, g in _by_impl(rows).items():
        ours = rate(g.get("fusedops", {}))
        for impl, name in BASELINES.items():
            ratio = _ratio(ours, rate(g.get(impl, {})))
            if ratio is None:
                continue
            won, of = wins.get(name, (0, 0))
            wins[name] = (won + (ratio > 1), of + 1)
            if worst is None or ratio < worst[0]:
                worst = (ratio, name, key)
    if worst is None:
        return "verdict: no case ran fusedops beside eager or torch.compile"
    ratio, name, (op, shape, dtype, direction) = worst
    return ("verdict: fusedops is faster than " + ", than ".join(f"{n} in {w} of {of} cases"
                                                                for n, (w, of) in wins.items())
            + f"; worst {ratio:.2f}x {name} ({op} {shape} {dtype} {direction})")


def ceilings(meta):
    """{unit: ceiling rate} of a run's metadata."""
    out = {"GB/s": meta["ceiling"]["GB/s"]}
    if meta.get("matmul_ceiling"):
        out["TFLOP/s"] = meta["matmul_ceiling"]["TFLOP/s"]
    return out


def write_plot(out_dir, meta, rows):
    """Each impl's rate as a fraction of its unit's ceiling, per case: one panel
    per unit and direction. Returns the path, or None (with a message) without
    matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart (pip install matplotlib)", file=sys.stderr)
        return None
    timing = "GPU time" if meta.get("device_type") == "cuda" else "wall time"
    panels = []
    for unit, ceiling in (("GB/s", "copy"), ("TFLOP/s", "matmul")):
        groups = _by_impl([r for r in rows if r.get("unit", "GB/s") == unit])
        panels += [(groups, [k for k in groups if k[3] == d], f"{d} ({unit})", f"{unit} / {ceiling} ceiling ({timing})")
                   for d in DIRECTIONS if any(k[3] == d for k in groups)]
    if not panels:
        return None
    n = max(len(keys) for _, keys, _, _ in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 0.55 * n + 2), 4.5 * len(panels)), squeeze=False)
    for ax, (groups, keys, title, ylabel) in zip(axes[:, 0], panels):
        _plot_panel(ax, groups, keys, title, ylabel)
    # Legend and title above the panels, where they cannot hide a bar.
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="upper right", ncol=3, fontsize=8)
    fig.suptitle(f"{meta['device']}, torch {meta['torch']}\n{ceiling_line(meta)}", fontsize=9, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path = Path(out_dir) / "results.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _frac(row):
    return row.get("gpu_frac_of_ceiling") or row.get("frac_of_ceiling")


def _plot_panel(ax, groups, keys, title, ylabel):
    several_dtypes = len({k[2] for k in groups}) > 1
    # Stacked labels while they fit side by side, one rotated line past that.
    sep, rot = ("\n", 0) if len(keys) <= 10 else (" ", 90)
    labels = [sep.join([k[0].replace("add+", ""), k[1]] + ([k[2]] if several_dtypes else []))
              for k in keys]
    fracs = {impl: [_frac(groups[k].get(impl, {})) for k in keys]
             for impl in IMPLS}
    for j, impl in enumerate(IMPLS):
        if not any(impl in groups[k] for k in keys):
            continue  # not run at all (--no-compile): no bars, no n/a marks
        xs = [i + (j - 1) * 0.27 for i in range(len(keys))]
        ax.bar(xs, [f or 0 for f in fracs[impl]], 0.27, label=impl)
        for x, f in zip(xs, fracs[impl]):
            if f is None:  # a failed or skipped impl: say so rather than draw a zero
                ax.text(x, 0.01, "n/a", rotation=90, fontsize=6, ha="center", va="bottom")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    top = max([1.0] + [f for fr in fracs.values() for f in fr if f])
    ax.set_ylim(0, top * 1.08)  # headroom so the ceiling line is not the frame
    ax.set_xticks(range(len(keys)), labels, rotation=rot, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
