"""Train a small Llama-style model twice, as plain PyTorch and patched with
fusedops, from the same initial weights on the same data, and compare.

    python examples/train.py                       # CPU or GPU, whichever there is
    python examples/train.py --steps 500 --out my-run
    python examples/train.py --runs fusedops --compile
    python examples/train.py --checkpoint          # activation checkpointing per decoder layer

Nothing is downloaded: the model is Hugging Face's LlamaForCausalLM built from
the small configuration below (pip install fusedops[hf]), and the data are
token sequences generated from a random sparse Markov chain: each token is
followed by one of BRANCH tokens, equally likely, so the loss can fall from
ln(vocab) to ln(BRANCH), the entropy floor printed at the start.

The fusedops run is the plain one plus two lines:

    fusedops.patch(model)                                  # fused norms, MLP, attention
    opt = fusedops.optim.FusedAdamW(model.parameters(), ...)

Writes OUT/summary.json (per run: tokens/s, step time, peak GPU memory, final
loss -- the mean of the last 10 steps' losses --, the loss curve) and, where
matplotlib is installed, OUT/loss.png (--plot-from OUT/summary.json draws it
later, elsewhere).

--checkpoint recomputes each decoder layer's activations in the backward
instead of keeping them from the forward (torch.utils.checkpoint,
non-reentrant; the same gradients: tests/test_checkpoint.py): less memory
for a third more compute in the layers.

On several GPUs (or CPU processes, gloo), under torchrun:

    torchrun --nproc_per_node 2 examples/train.py --dist fsdp
    torchrun --nproc_per_node 2 examples/train.py --dist ddp --runs fusedops

--dist ddp wraps the (patched) model in DistributedDataParallel; --dist fsdp
shards it with FSDP2 (fully_shard on every decoder layer, then the whole model),
whose parameters are DTensors: FusedAdamW updates their local shards, one launch
per parameter group as on one GPU. --batch is the global batch: each process
takes its slice of every batch, and the loss printed and recorded is the mean
over all processes, so the curve is comparable with one process's over the same
batches. Only rank 0 prints and writes. --micro-batches N accumulates each
process's share of a batch in N parts; on one process, N = 2 does DDP-over-2's
arithmetic (a half-batch mean each, then their average), the reference for
how far rounding alone moves a curve.

Checkpoints: --save-at 150 saves after step 150 of each run, into OUT/<run>-step150
(torch.distributed.checkpoint: every process writes its shards) and/or, with
--ckpt-format full, OUT/<run>-step150.pt (one torch.save file of the full model
and optimizer state, keyed by parameter name: it loads without
torch.distributed, into torch.optim.AdamW say). --resume PATH (either kind)
continues a run from its step, with any --dist, number of processes and
optimizer: FusedAdamW's state is torch's AdamW's.
"""
import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time
import warnings
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
    # A second or so on 2 CPU cores: the distributed tests (an odd vocabulary,
    # so that FSDP2 shards the embeddings unevenly).
    "tiny": dict(vocab_size=67, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, batch=4, seq=32, steps=16, dtype="fp32"),
    # Issue 56's scaling model: Llama 3.2 3B's shape with untied embeddings
    # (3.6 B parameters), 4096-token sequences (tools/ci/scale_gpu.py).
    "3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8, batch=2, seq=4096, steps=30,
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
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda (under torchrun, each process takes the GPU of its LOCAL_RANK)")
    p.add_argument("--preset", choices=CONFIGS, help="model and data (default: by device)")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default: by device)")
    p.add_argument("--batch", type=int,
                   help="sequences a step, over all processes (the global batch; default: by preset)")
    p.add_argument("--seq", type=int, help="tokens a sequence (default: by preset)")
    p.add_argument("--dtype", choices=DTYPES,
                   help="fp32, amp-bf16 (fp32 parameters, bf16 autocast) or bf16 parameters "
                        "(default: fp32 on CPU, amp-bf16 on GPU)")
    p.add_argument("--lr", type=float, default=2e-3,
                   help="peak learning rate of AdamW, reached after a linear warm-up over the first 5%% of "
                        "the steps, then cosine down to a tenth of it (default %(default)s)")
    p.add_argument("--clip", type=float, default=1.0,
                   help="clip the gradients' global norm to this, 0 for off (default %(default)s, the "
                        "usual recipe: without it the bf16 runs on an H100 spiked after the warm-up, "
                        "each at other steps, so that their curves parted by up to 1.9)")
    p.add_argument("--runs", default="pytorch,fusedops", help="which runs, of %(default)s")
    p.add_argument("--compile", action="store_true", help="torch.compile the model in every run")
    p.add_argument("--torch-fused", action="store_true",
                   help="the pytorch run's AdamW with fused=True (torch's one-kernel implementation) "
                        "instead of its default (foreach on a GPU)")
    p.add_argument("--out", default="train-out", help="output folder (default %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initial weights and of the generated data, the same in every run "
                        "(default %(default)s)")
    p.add_argument("--checkpoint", action="store_true",
                   help="activation checkpointing: recompute each decoder layer in the backward "
                        "(torch.utils.checkpoint, non-reentrant) instead of keeping its activations")
    p.add_argument("--micro-batches", type=int, default=1, metavar="N",
                   help="split each process's share of a batch into N micro-batches, their gradients "
                        "accumulated before the step: with N = 2 one process does the arithmetic of DDP "
                        "over 2 (default %(default)s)")
    p.add_argument("--dist", choices=("none", "ddp", "fsdp"), default="none",
                   help="data parallel over the processes torchrun starts (nccl on CUDA, gloo on the CPU): "
                        "DistributedDataParallel or FSDP2 (default %(default)s)")
    p.add_argument("--save-at", default="", metavar="STEPS",
                   help="comma-separated steps after which each run saves a checkpoint in OUT")
    p.add_argument("--ckpt-format", default="dcp", metavar="FORMATS",
                   help="dcp (a torch.distributed.checkpoint folder) and/or full (one .pt file of the "
                        "full state, written by rank 0), comma-separated (default %(default)s)")
    p.add_argument("--resume", metavar="CKPT", help="continue from a checkpoint (a DCP folder or a .pt file)")
    p.add_argument("--plot-from", metavar="SUMMARY_JSON",
                   help="train nothing: draw loss.png beside a summary.json written before (on a machine "
                        "without matplotlib, say)")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    cfg = dict(CONFIGS[args.preset or ("cuda" if args.device.type == "cuda" else "cpu")])
    for k in ("steps", "batch", "seq", "dtype"):
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    args.cfg = cfg
    if args.micro_batches < 1:
        p.error(f"--micro-batches: {args.micro_batches}; expected 1 or more")
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not args.runs or set(args.runs) - {"pytorch", "fusedops"}:
        p.error(f"--runs: {args.runs}; expected pytorch, fusedops or both")
    try:
        args.save_at = sorted({int(k) for k in args.save_at.split(",") if k.strip()})
    except ValueError:
        p.error(f"--save-at: {args.save_at!r}; expected comma-separated step numbers")
    args.ckpt_format = {f.strip() for f in args.ckpt_format.split(",") if f.strip()}
    if not args.ckpt_format or args.ckpt_format - {"dcp", "full"}:
        p.error(f"--ckpt-format: {sorted(args.ckpt_format)}; expected dcp, full or both")
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
    with torch.device(device):  # drawn where it runs: seconds, not minutes, for billions of weights
        model = LlamaForCausalLM(config)
    # The input embedding at unit scale (Hugging Face draws it at std 0.02, as
    # every weight): at 0.02 the random attention and MLP outputs drown the
    # current token in the residual stream, and a model of 8 layers x 1024 sat
    # on a plateau at ln(vocab) for a hundred steps or more before escaping at
    # a step that rounding decided, so two runs' curves parted by 0.1-0.6
    # there. At unit scale the loss falls from the first steps.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 1.0)
    return model.to(device=device, dtype=DTYPES[cfg["dtype"]][0])


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
        fusedops.patch(model)  # before wrapping (DDP, FSDP)
        say(args, model.fusedops_report)
    if args.checkpoint:
        checkpoint_layers(model)
    model = wrap(model, args)
    if run == "fusedops":
        opt = fusedops.optim.FusedAdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=args.torch_fused or None)
    first = load_checkpoint(model, opt, args.resume, args) if args.resume else 0
    if first >= cfg["steps"]:
        sys.exit(f"--resume {args.resume}: saved after step {first}, nothing left of --steps {cfg['steps']}")
    if first:
        say(args, f"[{run}] resumed from {args.resume} after step {first}")
    step_fn = torch.compile(model) if args.compile else model
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    tokens = cfg["batch"] * cfg["seq"]  # a step's, over all processes
    mine = slice(args.rank * cfg["batch"] // args.world, (args.rank + 1) * cfg["batch"] // args.world)
    amp = DTYPES[cfg["dtype"]][1]
    for step in range(first, cfg["steps"]):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg["steps"], args.lr)
        x = data[step, mine].to(device, non_blocking=True)
        loss = 0.0
        for i, xm in enumerate(x.chunk(args.micro_batches)):  # equal micro-batches: the mean of means
            with grad_sync(model, args, last=i == args.micro_batches - 1):
                with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                    # (no KV cache: nothing reads it, and a checkpointed layer would fill it twice)
                    part = step_fn(input_ids=xm, labels=xm, use_cache=False).loss
                (part / args.micro_batches).backward()
            loss = loss + part.detach() / args.micro_batches
        if args.clip > 0:  # over every process's gradients (DTensor shards under FSDP2)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(mean_over_processes(loss.detach(), args))  # (syncs: the step time is the whole step's)
        times.append(time.perf_counter() - t0)
        if step + 1 in args.save_at:
            save_checkpoint(model, opt, step + 1, Path(args.out) / f"{run}-step{step + 1}", args)
        if step % max(1, cfg["steps"] // 15) == 0 or step == cfg["steps"] - 1:
            recent = times[max(1, len(times) - 10):] or times
            say(args, f"[{run}] step {step + 1:4d}/{cfg['steps']}  loss {losses[-1]:.4f}  "
                      f"{tokens / (sum(recent) / len(recent)) / 1e3:7.1f} k tokens/s")
    timed = times[min(len(times) - 1, 3):]  # the first steps warm up (and compile)
    step_s = sum(timed) / len(timed)
    return {"run": run, "params": sum(p.numel() for p in model.parameters()),
            "tokens_per_s": tokens / step_s, "step_ms": step_s * 1e3,
            "peak_memory_GiB": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "final_loss": sum(losses[-10:]) / len(losses[-10:]), "first_step": first, "losses": losses}


# --------------------------------------------------------------- several processes
def say(args, *what):
    if args.rank == 0:
        print(*what, flush=True)


def exit_skipping_teardown(status=0):
    """Ends a torchrun worker without the interpreter's teardown, output
    flushed. With gloo, a worker thread of the process group can still hold
    the last collective's tensors while Python finalizes, even after
    destroy_process_group(); releasing them then takes the GIL of a dying
    interpreter and aborts the process ("terminate called without an active
    exception", exit -6) after a run that succeeded: 4 of ~100 runs of
    tests/test_distributed.py on a 2-core VM, torch 2.13 (a core dump shows
    ProcessGroupGloo::runLoop freeing an AsyncBarrierWork during Py_FinalizeEx;
    pytorch/pytorch#179291 describes the race)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def init_dist(args):
    """Under --dist: join the process group torchrun describes in the
    environment (nccl on CUDA, gloo on the CPU) unless this process is in one
    already, and on CUDA take the GPU of LOCAL_RANK. Sets args.rank and
    args.world; returns whether the group was made here (main ends it)."""
    import torch.distributed as dist
    args.rank, args.world = 0, 1
    if args.dist == "none":
        if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not (dist.is_available() and dist.is_initialized()):
            sys.exit(f"{os.environ['WORLD_SIZE']} processes (torchrun) but --dist none: pass --dist ddp or fsdp")
        return False
    if args.device.type == "cuda":
        args.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(args.device)
    made = not dist.is_initialized()
    if made:
        if "RANK" not in os.environ:
            sys.exit(f"--dist {args.dist}: start it with torchrun --nproc_per_node N examples/train.py ...")
        if args.device.type == "cuda":  # bound to its GPU: NCCL's communicator made now, for this device
            dist.init_process_group("nccl", device_id=args.device)
        else:
            dist.init_process_group("gloo")
    args.rank, args.world = dist.get_rank(), dist.get_world_size()
    if args.cfg["batch"] % args.world:
        sys.exit(f"--batch {args.cfg['batch']} (the global batch) does not split over {args.world} processes")
    return made


def checkpoint_layers(model):
    """--checkpoint: each decoder layer's forward under torch.utils.checkpoint
    (non-reentrant), which keeps the layer's inputs only and runs the forward
    again in the backward. Set on the layer's forward, not around its call, so
    that FSDP2's hooks stay outside: they gather the layer's parameters for its
    forward and again before its backward, which the recomputation is part of."""
    from torch.utils.checkpoint import checkpoint
    for layer in model.model.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


def wrap(model, args):
    """The model as the steps run it: as it is, in DistributedDataParallel, or
    sharded by FSDP2 (each decoder layer a unit, the rest in the root's)."""
    if args.dist == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, device_ids=[args.device] if args.device.type == "cuda" else None)
    if args.dist == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(args.device.type, (args.world,))  # (the default is CUDA's wherever a GPU is)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def grad_sync(model, args, last):
    """Where a step's micro-batches run: the gradients are reduced over the
    processes only with the last one's backward (DDP's no_sync, FSDP2's
    set_requires_gradient_sync); a no-op on one process."""
    if args.dist == "ddp" and not last:
        return model.no_sync()
    if args.dist == "fsdp" and args.micro_batches > 1:
        model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def mean_over_processes(loss, args):
    """The loss over the global batch: the mean of the processes' (each has as
    many tokens)."""
    if args.world > 1:
        import torch.distributed as dist
        loss = loss.clone()
        dist.all_reduce(loss)  # a sum: gloo has no AVG
        loss /= args.world
    return loss.item()


def save_checkpoint(model, opt, step, path, args):
    """The model and optimizer state after `step` steps, as the --ckpt-format
    asks: a DCP folder at `path` (each process writes its shards), and/or the
    full state in path.pt, keyed by parameter name (rank 0 writes it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    if "dcp" in args.ckpt_format:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "step": step}, checkpoint_id=path, no_dist=args.dist == "none")
    if "full" in args.ckpt_format:
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if args.rank == 0:
            torch.save({"model": msd, "optim": osd, "step": step}, path.with_name(path.name + ".pt"))
    say(args, "saved " + " and ".join(f"{path}{'.pt' if f == 'full' else ''}" for f in sorted(args.ckpt_format)))


def load_checkpoint(model, opt, path, args):
    """Load what save_checkpoint wrote (under any --dist and number of
    processes, with either optimizer) into model and opt; returns its step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    if str(path).endswith(".pt"):
        state = torch.load(path, map_location="cpu", weights_only=True)
        options = StateDictOptions(full_state_dict=True)  # each process takes its shards of it
    else:
        import torch.distributed.checkpoint as dcp
        msd, osd = get_state_dict(model, opt)  # what to load, as this run holds it
        state = {"model": msd, "optim": osd, "step": 0}
        with warnings.catch_warnings():  # one process by intent (--dist none): DCP's notice says so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path, no_dist=args.dist == "none")
        options = None
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    return int(state["step"])


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
    steps = range(results[0].get("first_step", 0), results[0].get("first_step", 0) + len(results[0]["losses"]))
    for r in results:
        ax.plot(steps, r["losses"], label=f"{r['run']} ({r['tokens_per_s'] / 1e3:.1f} k tokens/s)", lw=1)
    ax.axhline(floor, color="gray", ls=":", label=f"entropy floor ln {BRANCH}")
    ax.set_ylabel("training loss")
    ax.legend()
    if len(results) == 2:
        diff = [b - a for a, b in zip(results[0]["losses"], results[1]["losses"])]
        axes[1][0].plot(steps, diff, lw=1, color="C3")
        axes[1][0].set_ylabel("loss difference")
        axes[1][0].set_title(f"{results[1]['run']} - {results[0]['run']}", fontsize=9)
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def run_all(args):
    cfg = args.cfg
    say(args, f"{args.device}: Llama {cfg}; loss from ln {cfg['vocab_size']} = {math.log(cfg['vocab_size']):.3f} "
              f"down to ln {BRANCH} = {math.log(BRANCH):.3f} at best"
              + (f"; {args.dist} over {args.world} processes" if args.dist != "none" else ""))
    share = cfg["batch"] // args.world
    if share % args.micro_batches:
        sys.exit(f"--micro-batches {args.micro_batches}: a process's share of --batch {cfg['batch']} is "
                 f"{share} sequences, which do not split into {args.micro_batches} equal micro-batches")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    data = markov_data(cfg, args.seed)
    return [train(run, args, data) for run in args.runs]


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
    made_group = init_dist(args)
    try:
        results = run_all(args)
    finally:
        if made_group:
            torch.distributed.barrier()  # no process tears down while another still talks
            torch.distributed.destroy_process_group()
    if args.rank != 0:
        return
    out = Path(args.out)
    floor = math.log(BRANCH)
    summary = {"device": torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu",
               "torch": torch.__version__, "transformers": transformers.__version__,
               "fusedops": fusedops.__version__, "config": args.cfg, "compile": args.compile,
               "dist": args.dist, "processes": args.world, "resume": args.resume,
               "lr": args.lr, "clip": args.clip, "micro_batches": args.micro_batches, "checkpoint": args.checkpoint,
               "torch_fused": args.torch_fused,
               "entropy_floor": floor, "runs": results}
    if len(results) == 2:
        d = [abs(a - b) for a, b in zip(results[0]["losses"], results[1]["losses"])]
        summary["max_abs_loss_difference"] = max(d)
        summary["speedup"] = results[1]["tokens_per_s"] / results[0]["tokens_per_s"]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    png = plot(results, floor, out / "loss.png")
    for r in results:
        mem = f", peak {r['peak_memory_GiB']:.2f} GiB" if r["peak_memory_GiB"] is not None else ""
        print(f"{r['run']:9s} final loss {r['final_loss']:.4f} (mean of the last 10 steps), "
              f"{r['tokens_per_s'] / 1e3:.1f} k tokens/s, "
              f"{r['step_ms']:.1f} ms/step{mem}")
    if len(results) == 2:
        print(f"loss curves differ by at most {summary['max_abs_loss_difference']:.2e}; "
              f"fusedops / pytorch tokens/s = {summary['speedup']:.2f}")
    print(f"wrote {out / 'summary.json'}" + (f" and {png}" if png else " (no matplotlib: no loss.png)"))


if __name__ == "__main__":
    main()
    if "RANK" in os.environ:  # under torchrun
        exit_skipping_teardown()
