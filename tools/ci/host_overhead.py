"""Host time of one call of each fusedops op beside eager PyTorch's, at shapes
so small that the kernels take no time: what a call costs the Python thread
(argument handling, the dispatcher, the stable-ABI boxed call, autograd).

    python tools/ci/host_overhead.py [--device cuda] [--rounds 5] [--calls 3000]
        [--op NAME ...] [--clock thread] [--breakdown]

Each figure is the best of --rounds loops of --calls calls, in microseconds a
call, fusedops' and eager's loops taking turns; fwd+bwd is the forward, then
torch.autograd.backward with given output gradients. One table: every op
(the norms plain and with the residual add, swiglu / geglu, glu_mlp, rope,
cross_entropy, flash_attention) and an AdamW step (no_grad column: torch's
AdamW with its defaults for the device). With FUSEDOPS_TORCH_AUTOGRAD=1 in the environment fusedops
registers each op's autograd formula through torch.library.register_autograd
instead of its own kernel (fusedops.ops._common.register_autograd), for
comparison. On CUDA a loop ends with a synchronize, and the kernels of these
shapes are shorter than the host's work, so the loop measures the host.

--breakdown says where a call's time goes: for each case, without grad and
forward+backward, the function beside the ops it runs (recorded once under a
TorchDispatchMode, the backward's too) replayed back to back below autograd,
and its fusedops ops alone; eager's function and ops beside. The function
minus its ops is Python and autograd; its fusedops ops beside eager's ops
compare the C++ shims (the stable-ABI call, checks, allocation, launch) with
ATen's. --clock thread times the thread's CPU time (CPU only): another
process on the same cores then disturbs the figures less.

Not a test: the suite's "fusedops wall" column (benchmarks/) shows the same
cost at real shapes, where it is hidden behind the GPU or not."""
import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import fusedops  # noqa: E402
from fusedops import functional as FF, reference  # noqa: E402


def cases(d):
    """(name, fusedops fn, eager fn, inputs that require grad): fn(*inputs) -> outputs."""
    t = lambda *shape: torch.randn(*shape, device=d)  # noqa: E731
    H, F_ = 64, 128
    ln = lambda x, r, w, b: (F.layer_norm(x + r, (H,), w, b), x + r)  # noqa: E731
    rms = lambda x, r, w: (F.rms_norm(x + r, (H,), w, 1e-6), x + r)  # noqa: E731
    adt = torch.float32 if d == "cpu" else torch.bfloat16
    qkv = [t(1, 16, 2, 32).to(adt) for _ in range(3)]
    cos, sin = t(1, 16, 32), t(1, 16, 32)
    tgt = torch.randint(0, 100, (8,), device=d)
    mlp = lambda x, wg, wu, wd: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)  # noqa: E731
    return [
        ("layer_norm", FF.layer_norm, lambda x, w, b: F.layer_norm(x, (H,), w, b), [t(4, H), t(H), t(H)]),
        ("rms_norm", FF.rms_norm, lambda x, w: F.rms_norm(x, (H,), w, 1e-6), [t(4, H), t(H)]),
        ("add+layer_norm", FF.fused_add_layer_norm, ln, [t(4, H), t(4, H), t(H), t(H)]),
        ("add+rms_norm", FF.fused_add_rms_norm, rms, [t(4, H), t(4, H), t(H)]),
        ("swiglu", FF.swiglu, lambda g, u: F.silu(g) * u, [t(4, F_), t(4, F_)]),
        ("geglu", FF.geglu, lambda g, u: F.gelu(g, approximate="tanh") * u, [t(4, F_), t(4, F_)]),
        ("glu_mlp", FF.glu_mlp, mlp, [t(4, H), t(F_, H), t(F_, H), t(H, F_)]),
        ("rope", lambda q, k: FF.apply_rotary_pos_emb(q, k, cos, sin),
         lambda q, k: reference.rope(q, k, cos, sin), [t(1, 2, 16, 32), t(1, 2, 16, 32)]),
        ("cross_entropy", lambda x: FF.cross_entropy(x, tgt), lambda x: F.cross_entropy(x, tgt), [t(8, 100)]),
        ("flash_attention", lambda q, k, v: FF.flash_attention(q, k, v, causal=True),
         lambda q, k, v: F.scaled_dot_product_attention(*(a.transpose(1, 2) for a in (q, k, v)),
                                                        is_causal=True).transpose(1, 2), qkv),
    ]


def adamw_steps(d):
    """(fusedops step, torch's step): AdamW over four small tensors with
    gradients, torch's optimizer with its defaults for the device."""
    def make(cls):
        ps = [torch.nn.Parameter(torch.randn(*s, device=d)) for s in ((64, 64), (64,), (128, 64), (64,))]
        for p in ps:
            p.grad = torch.randn_like(p)
        return cls(ps, lr=1e-3).step
    return make(fusedops.optim.FusedAdamW), make(torch.optim.AdamW)


def per_call(fns, calls, rounds, sync, clock=time.perf_counter):
    """Microseconds a call of each fn, the best of `rounds` loops of `calls`;
    the fns take turns each round, so that a busy spell of the machine falls
    on all of them."""
    for fn in fns:
        for _ in range(min(calls, 300)):
            fn()
    sync()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = clock()
            for _ in range(calls):
                fn()
            sync()
            best[i] = min(best[i], (clock() - t0) / calls * 1e6)
    return best


class _Record(TorchDispatchMode):
    """The ops a call runs below autograd, in order: (op, args, kwargs)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # (autograd saving an output for the backward: under a dispatch mode a
        # detach op, without one a copy of the tensor's header; not replayed)
        if func is not torch.ops.aten.detach.default:
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def ops_of(call):
    """The ops call() runs below autograd (forward and backward ones), recorded once."""
    with _Record() as r:
        call()
    return r.calls


def replay(ops):
    """A call of the recorded ops back to back, with their recorded arguments,
    below autograd: the dispatcher and the kernels, no Python glue or autograd."""
    def run():
        with torch._C._AutoDispatchBelowAutograd():
            for func, args, kwargs in ops:
                func(*args, **kwargs)
    return run


def calls_of(fn, leaves, douts):
    """The three ways a case is called: no_grad, fwd, fwd+bwd."""
    def no_grad():
        with torch.no_grad():
            fn(*leaves)

    def fwd():
        fn(*leaves)

    def fwd_bwd():
        o = fn(*leaves)
        torch.autograd.backward(o if isinstance(o, tuple) else (o,), douts)
    return {"no_grad": no_grad, "fwd": fwd, "fwd+bwd": fwd_bwd}


def names(ops):
    counts = {}
    for func, _, _ in ops:
        n = str(func).removesuffix(".default")
        counts[n] = counts.get(n, 0) + 1
    return ", ".join(f"{n}" + (f" x{c}" if c > 1 else "") for n, c in counts.items())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--op", action="append", help="only this case (repeatable), e.g. --op add+layer_norm")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: this thread's CPU time (CPU only), for a machine busy with other work")
    ap.add_argument("--breakdown", action="store_true",
                    help="where a call's time goes: each function beside the ops it runs, replayed "
                         "below autograd (the C++ kernels and the dispatcher alone), no_grad and fwd+bwd")
    a = ap.parse_args()
    kernel = ("torch.library.register_autograd" if os.environ.get("FUSEDOPS_TORCH_AUTOGRAD") == "1"
              else "fusedops' register_autograd")
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    if a.clock == "thread" and a.device != "cpu":
        ap.error("--clock thread measures the CPU alone; with --device cuda the wait for the GPU is not counted")
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    if a.device == "cpu":
        # One thread: at these sizes eager's ops would otherwise fork parallel
        # regions, whose waits on a busy machine swamp the host time measured.
        torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"host us a call ({a.clock} clock), {a.device}, torch {torch.__version__}, fusedops {fusedops.__version__}, "
          f"autograd kernels: {kernel}; each cell fusedops / eager, ratio = fusedops / eager")
    if a.breakdown:
        print("| op | kind | fusedops fn | its ops | its fusedops ops | eager fn | its ops | the ops of the fusedops fn |\n"
              "|---|---|---:|---:|---:|---:|---:|---|")
    else:
        print("| op | no_grad fwd | fwd | fwd+bwd | ratio fwd | ratio fwd+bwd |\n|---|---:|---:|---:|---:|---:|")
    for name, ours, eager, xs in cases(a.device):
        if a.op and name not in a.op:
            continue
        leaves = [x.requires_grad_() for x in xs]
        outs = ours(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        douts = [torch.randn_like(o) for o in outs]
        ours_calls, eager_calls = calls_of(ours, leaves, douts), calls_of(eager, leaves, douts)
        if a.breakdown:
            for kind in ("no_grad", "fwd+bwd"):
                ours_ops, eager_ops = ops_of(ours_calls[kind]), ops_of(eager_calls[kind])
                own = [op for op in ours_ops if op[0].namespace == "fusedops"]
                fns = [ours_calls[kind], replay(ours_ops), replay(own), eager_calls[kind], replay(eager_ops)]
                t = per_call(fns, a.calls, a.rounds, sync, clock)
                print(f"| {name} | {kind} | " + " | ".join(f"{x:.1f}" for x in t) + f" | {names(ours_ops)} |",
                      flush=True)
            continue
        figures = [per_call([ours_calls[kind], eager_calls[kind]], a.calls, a.rounds, sync, clock)
                   for kind in ("no_grad", "fwd", "fwd+bwd")]
        cells = " | ".join(f"{f:.1f} / {e:.1f}" for f, e in figures)
        print(f"| {name} | {cells} | {figures[1][0] / figures[1][1]:.2f} | {figures[2][0] / figures[2][1]:.2f} |",
              flush=True)
    if not a.breakdown and (not a.op or "adamw" in a.op):
        f, e = per_call(adamw_steps(a.device), max(a.calls // 10, 1), a.rounds, sync, clock)
        print(f"| AdamW step (4 tensors) | {f:.1f} / {e:.1f} | | | {f / e:.2f} (step) | |", flush=True)


if __name__ == "__main__":
    main()
