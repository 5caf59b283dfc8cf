"""Train a small Llama-style model twice, as plain PyTorch and patched with
fusedops, from the same initial weights on the same data, and compare.

    python examples/train.py                       # CPU or GPU, whichever there is
    python examples/train.py --steps 500 --out my-run
    python examples/train.py --runs fusedops --compile

Nothing is downloaded: the model is Hugging Face's LlamaForCausalLM built from
the small configuration below (pip install fusedops[hf]), and the data are
token sequences generated from a random sparse Markov chain: each token is
followed by one of BRANCH tokens, equally likely, so the loss can fall from
ln(vocab) to ln(BRANCH), the entropy floor printed at the start.

The fusedops run is the plain one plus two lines:

    fusedops.patch(model)                                  # fused norms, MLP, attention
    opt = fusedops.optim.FusedAdamW(model.parameters(), ...)

Writes OUT/summary.json (per run: tokens/s, step time, peak GPU memory, final
loss, the loss curve) and, where matplotlib is installed, OUT/loss.png
(--plot-from OUT/summary.json draws it later, elsewhere).
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

try:
    import fusedops
except ImportError:  # not installed: the checkout this file is in (built in place)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import fusedops

BRANCH = 4
# (model, data) defaults by device: about a minute per run on 2 CPU cores.
CONFIGS = {
    "cpu": dict(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, batch=8, seq=128, steps=300, dtype="fp32"),
    "cuda": dict(vocab_size=2048, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=8, batch=8, seq=1024, steps=300,
                 dtype="amp-bf16"),
}
# Parameter dtype, and the dtype autocast computes in (None: no autocast).
# amp-bf16 is the usual mixed-precision recipe: fp32 parameters and optimizer
# states, bf16 matmuls and kernels. With bf16 parameters (bf16) the two runs
# differ by more than the patching: torch's AdamW updates bf16 states in two
# rounded steps (mul_, then addcmul_), FusedAdamW in one, and on an H100 the
# plain run's loss fell markedly slower (4.0 against 1.6 after 300 steps).
DTYPES = {"fp32": (torch.float32, None), "amp-bf16": (torch.float32, torch.bfloat16),
          "bf16": (torch.bfloat16, None)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default: by device)")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--dtype", choices=DTYPES,
                   help="fp32, amp-bf16 (fp32 parameters, bf16 autocast) or bf16 parameters "
                        "(default: fp32 on CPU, amp-bf16 on GPU)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--runs", default="pytorch,fusedops", help="which runs, of %(default)s")
    p.add_argument("--compile", action="store_true", help="torch.compile the model in every run")
    p.add_argument("--out", default="train-out", help="output folder (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot-from", metavar="SUMMARY_JSON",
                   help="train nothing: draw loss.png beside a summary.json written before (on a machine "
                        "without matplotlib, say)")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    cfg = dict(CONFIGS["cuda" if args.device.type == "cuda" else "cpu"])
    for k in ("steps", "batch", "seq", "dtype"):
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    args.cfg = cfg
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not args.runs or set(args.runs) - {"pytorch", "fusedops"}:
        p.error(f"--runs: {args.runs}; expected pytorch, fusedops or both")
    return args


def markov_data(cfg, seed):
    """cfg['steps'] batches of (batch, seq) token ids from a random chain in
    which each token has BRANCH equally likely successors."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, cfg["vocab_size"], (cfg["vocab_size"], BRANCH), generator=g)
    x = torch.empty(cfg["steps"], cfg["batch"], cfg["seq"], dtype=torch.long)
    x[:, :, 0] = torch.randint(0, cfg["vocab_size"], x.shape[:2], generator=g)
    for t in range(1, cfg["seq"]):
        x[:, :, t] = succ[x[:, :, t - 1], torch.randint(0, BRANCH, x.shape[:2], generator=g)]
    return x


def make_model(cfg, device, seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**{k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                "num_hidden_layers", "num_attention_heads",
                                                "num_key_value_heads")},
                         max_position_embeddings=cfg["seq"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device=device, dtype=DTYPES[cfg["dtype"]][0])


def lr_at(step, steps, lr):
    """Linear warm-up over the first 5 % of the steps, then cosine to 10 %."""
    warm = max(1, steps // 20)
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(run, args, data):
    cfg, device = args.cfg, args.device
    model = make_model(cfg, device, args.seed)
    if run == "fusedops":
        fusedops.patch(model)
        print(model.fusedops_report)
        opt = fusedops.optim.FusedAdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    step_fn = torch.compile(model) if args.compile else model
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    tokens = cfg["batch"] * cfg["seq"]
    amp = DTYPES[cfg["dtype"]][1]
    for step in range(cfg["steps"]):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg["steps"], args.lr)
        x = data[step].to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            loss = step_fn(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # (syncs: the step time is the whole step's)
        times.append(time.perf_counter() - t0)
        if step % max(1, cfg["steps"] // 15) == 0 or step == cfg["steps"] - 1:
            recent = times[max(1, step - 9):] or times
            print(f"[{run}] step {step + 1:4d}/{cfg['steps']}  loss {losses[-1]:.4f}  "
                  f"{tokens / (sum(recent) / len(recent)) / 1e3:7.1f} k tokens/s", flush=True)
    timed = times[min(len(times) - 1, 3):]  # the first steps warm up (and compile)
    step_s = sum(timed) / len(timed)
    return {"run": run, "params": sum(p.numel() for p in model.parameters()),
            "tokens_per_s": tokens / step_s, "step_ms": step_s * 1e3,
            "peak_memory_GiB": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "final_loss": sum(losses[-10:]) / len(losses[-10:]), "losses": losses}


def plot(results, floor, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(2 if len(results) == 2 else 1, 1, figsize=(8, 6 if len(results) == 2 else 4),
                             sharex=True, squeeze=False)
    ax = axes[0][0]
    for r in results:
        ax.plot(r["losses"], label=f"{r['run']} ({r['tokens_per_s'] / 1e3:.1f} k tokens/s)", lw=1)
    ax.axhline(floor, color="gray", ls=":", label=f"entropy floor ln {BRANCH}")
    ax.set_ylabel("training loss")
    ax.legend()
    if len(results) == 2:
        diff = [b - a for a, b in zip(results[0]["losses"], results[1]["losses"])]
        axes[1][0].plot(diff, lw=1, color="C3")
        axes[1][0].set_ylabel("loss difference")
        axes[1][0].set_title(f"{results[1]['run']} - {results[0]['run']}", fontsize=9)
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None):
    args = parse_args(argv)
    if args.plot_from:
        path = Path(args.plot_from)
        summary = json.loads(path.read_text())
        png = plot(summary["runs"], summary["entropy_floor"], path.parent / "loss.png")
        print(f"wrote {png}" if png else "no matplotlib: no loss.png")
        return
    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("examples/train.py needs transformers: pip install fusedops[hf]")
    cfg = args.cfg
    floor = math.log(BRANCH)
    print(f"{args.device}: Llama {cfg}; loss from ln {cfg['vocab_size']} = {math.log(cfg['vocab_size']):.3f} "
          f"down to ln {BRANCH} = {floor:.3f} at best", flush=True)
    data = markov_data(cfg, args.seed)
    results = [train(run, args, data) for run in args.runs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"device": torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu",
               "torch": torch.__version__, "transformers": transformers.__version__,
               "fusedops": fusedops.__version__, "config": cfg, "compile": args.compile,
               "entropy_floor": floor, "runs": results}
    if len(results) == 2:
        d = [abs(a - b) for a, b in zip(results[0]["losses"], results[1]["losses"])]
        summary["max_abs_loss_difference"] = max(d)
        summary["speedup"] = results[1]["tokens_per_s"] / results[0]["tokens_per_s"]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    png = plot(results, floor, out / "loss.png")
    for r in results:
        mem = f", peak {r['peak_memory_GiB']:.2f} GiB" if r["peak_memory_GiB"] is not None else ""
        print(f"{r['run']:9s} final loss {r['final_loss']:.4f}, {r['tokens_per_s'] / 1e3:.1f} k tokens/s, "
              f"{r['step_ms']:.1f} ms/step{mem}")
    if len(results) == 2:
        print(f"loss curves differ by at most {summary['max_abs_loss_difference']:.2e}; "
              f"fusedops / pytorch tokens/s = {summary['speedup']:.2f}")
    print(f"wrote {out / 'summary.json'}" + (f" and {png}" if png else " (no matplotlib: no loss.png)"))


if __name__ == "__main__":
    main()
