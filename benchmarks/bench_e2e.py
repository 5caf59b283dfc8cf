"""End to end: training steps of Hugging Face's LlamaForCausalLM, four ways in
one run: eager PyTorch (SDPA attention), torch.compile(model), fusedops
(fusedops.patch: fused norms, residual adds, MLP and attention, FusedAdamW)
and fusedops + torch.compile. Reports tokens/s, step time and peak memory.

    python -m benchmarks.bench_e2e                 # the ANCHORS.md configuration
    python -m benchmarks.bench_e2e --quick         # a tiny model: a smoke test (CPU)
    python -m benchmarks.bench_e2e --modes eager,fusedops --steps 20
    python -m benchmarks.bench_e2e --modes fusedops --without attention   # an ablation
    python -m benchmarks.bench_e2e --vocab 128256 --modes eager,compile,fusedops,liger
    python -m benchmarks.bench_e2e --modes eager,fusedops --layouts padded,packed
    python -m benchmarks.bench_e2e --vocab 128256 --modes fusedops --loss-chunk 2048   # a chunk variant

The ANCHORS.md configuration: 748 M parameters (12 layers, hidden 2048, 16
heads, MLP 5632, vocab 32000, untied embeddings), batch 4 x 2048 tokens, bf16
parameters, AdamW (torch's fused=True for eager and compile, fusedops'
FusedAdamW for the fusedops modes), random initial weights and token ids. A
step is forward + loss, backward, optimizer step, zero_grad; timed per step
(CUDA events on a GPU) after warm-up steps, which include compilation. Peak
memory is torch.cuda.max_memory_allocated over warm-up and timed steps
(parameters, gradients, optimizer state and activations).

The fusedops modes patch the loss too (fusedops.patch's loss=True): the LM
head computes the loss from the last hidden states without the logits
(fusedops.functional.linear_cross_entropy); --without loss keeps the logits
and ForCausalLMLoss. --vocab sets the vocabulary (128256: Llama 3's, where
the logits are the step's largest tensor). The liger mode (not in the
default list) applies Liger-Kernel's Llama patches (RMSNorm, SwiGLU, RoPE,
fused linear cross-entropy) with torch's fused AdamW, where liger_kernel
imports. Liger patches transformers' Llama classes for the whole process,
so the liger mode runs after the others whatever the order asked; the table
gives every mode's tokens/s and memory against liger's too where it ran.

--layouts: "padded" (each row one sequence of --seq tokens, the default)
and/or "packed" (the same tokens as one row of documents of mixed length,
log-uniform between seq / 32 and seq, concatenated without padding,
position_ids restarting at each document and the label of each document's
first token ignored, as transformers' DataCollatorWithFlattening makes
them; use_cache=False, as transformers finds packed documents from
position_ids only then). The fusedops modes run their varlen attention on
packed documents; eager, compile and liger get transformers' mask for them.
Every mode runs each layout, one row each.

--loss-chunk: the fused loss's chunk variant in the fusedops modes, a
policy of fusedops.ops.linear_xent.POLICIES or a count of rows a chunk
(the module's in-process variants, as tools/probes/linear_xent.py sets
them): the step's time and peak memory under another chunking.

Needs transformers (pip install fusedops[hf]). Not part of `python -m
benchmarks.run` (whose bench_<op>.py files time one op each): run it on its
own. Writes OUT/e2e.json and OUT/e2e.md (default bench-results/).
"""
import argparse
import gc
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `fusedops` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import fusedops  # noqa: E402
from benchmarks import common  # noqa: E402

MODES = ("eager", "compile", "fusedops", "fusedops+compile")
OPTIONAL_MODES = ("liger",)  # asked for by name
WITHOUT = ("norm", "swiglu", "attention", "fuse_residual", "loss", "adamw")
LAYOUTS = ("padded", "packed")
GiB = 1 << 30

# ANCHORS.md, End to end.
ANCHOR = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=12,
              num_attention_heads=16, num_key_value_heads=16, batch=4, seq=2048)
# --quick: a few seconds a step on 2 CPU cores (compile takes longer).
QUICK = dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, batch=2, seq=128)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model (smoke test; the default on a CPU)")
    p.add_argument("--full", action="store_true", help="the ANCHORS.md model even on a CPU")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, of %(default)s")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20 on a GPU, 3 on a CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5 / 2)")
    p.add_argument("--batch", type=int, help="sequences per step (default: the configuration's)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the configuration's)")
    p.add_argument("--layers", type=int, help="decoder layers (default: the configuration's)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default: the configuration's)")
    p.add_argument("--dtype", choices=DTYPES, help="parameter dtype (default bf16 on a GPU, fp32 on a CPU)")
    p.add_argument("--without", default="", help="ablation: parts the fusedops modes leave out, of "
                   f"{', '.join(WITHOUT)} (adamw: torch's fused AdamW instead of FusedAdamW)")
    p.add_argument("--no-cache", dest="use_cache", action="store_false",
                   help="use_cache=False (the default keeps transformers' True, which fills a KV "
                   "cache every step: a copy of each layer's K and V). Without a cache, "
                   "transformers 5.x looks for packed sequences in position_ids every forward: a "
                   "host sync in eager, and under torch.compile a materialized causal mask, which "
                   "takes the attention to torch's SDPA in every mode")
    p.add_argument("--loss-chunk", default=None, help="the fused loss's chunk policy (weight, input, free) or "
                   "rows a chunk, in the fusedops modes (default: the library's)")
    p.add_argument("--layouts", default="padded", help="comma-separated, of padded,packed (default %(default)s)")
    p.add_argument("--out", default="bench-results", help="output folder (default %(default)s)")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES + OPTIONAL_MODES]
    if bad:
        p.error(f"--modes: unknown {bad}; have {list(MODES + OPTIONAL_MODES)}")
    # Liger's patches stay on transformers' classes: its mode goes last.
    args.modes = [m for m in args.modes if m != "liger"] + [m for m in args.modes if m == "liger"]
    if args.loss_chunk is not None and not args.loss_chunk.isdigit():
        from fusedops.ops import linear_xent
        if args.loss_chunk not in linear_xent.POLICIES:
            p.error(f"--loss-chunk: {args.loss_chunk!r}; expected rows or one of {list(linear_xent.POLICIES)}")
    args.layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    bad = [x for x in args.layouts if x not in LAYOUTS]
    if bad or not args.layouts:
        p.error(f"--layouts: unknown {bad}; have {list(LAYOUTS)}")
    args.without = [w.strip() for w in args.without.split(",") if w.strip()]
    bad = [w for w in args.without if w not in WITHOUT]
    if bad:
        p.error(f"--without: unknown {bad}; have {list(WITHOUT)}")
    return args


def build(cfg, mode, dtype, device, without=(), seed=0, use_cache=True):
    """The model and optimizer of one mode, from the same initial weights
    (use_cache: see --no-cache)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    fused = mode.startswith("fusedops")
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("batch", "seq")},
                         max_position_embeddings=cfg["seq"], tie_word_embeddings=False,
                         attn_implementation="sdpa", use_cache=use_cache)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.train()
    if fused:
        fusedops.patch(model, **{flag: False for flag in without if flag != "adamw"})
        print(f"  {model.fusedops_report}".replace("\n", "\n  "), file=sys.stderr)
    if mode == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(model=model)
    if fused and "adamw" not in without:
        opt = fusedops.optim.FusedAdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                                fused=device.type == "cuda" or None)
    run = torch.compile(model) if mode.endswith("compile") else model
    return model, run, opt


def make_batch(cfg, layout, device, seed=1):
    """The step's model inputs: input_ids and labels, and for "packed" the
    position_ids of documents concatenated into one row (the module doc)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    b, s = cfg["batch"], cfg["seq"]
    ids = torch.randint(0, cfg["vocab_size"], (b, s), generator=g)
    if layout == "padded":
        return dict(input_ids=ids.to(device), labels=ids.to(device))
    total, lengths = b * s, []
    lo, hi = max(2, s // 32), s
    while sum(lengths) < total:
        n = int(torch.exp(torch.empty(()).uniform_(float(torch.tensor(lo).log()), float(torch.tensor(hi).log()),
                                                     generator=g)))
        lengths.append(min(n, total - sum(lengths)))
    ids = ids.reshape(1, total)
    labels = ids.clone()
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    labels[0, starts] = -100  # no document predicts the next one's first token
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return dict(input_ids=ids.to(device), labels=labels.to(device), position_ids=pos.to(device))


def train_step(run, opt, batch):
    """One training step of a language model on batch (input_ids, labels,
    perhaps position_ids); the loss."""
    loss = run(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loss_chunk(chunk):
    """Set the fused loss's chunk variant (--loss-chunk; None: the library's)."""
    from fusedops.ops import linear_xent
    linear_xent._POLICY = None if chunk is None or chunk.isdigit() else chunk
    linear_xent._CHUNK_ROWS = int(chunk) if chunk is not None and chunk.isdigit() else None


def run_mode(cfg, mode, dtype, device, warmup, steps, without=(), use_cache=True, layout="padded",
             chunk=None):
    """Train warmup + steps steps; returns the result row."""
    torch._dynamo.reset()
    loss_chunk(chunk if mode.startswith("fusedops") else None)
    use_cache = use_cache and layout == "padded"
    model, run, opt = build(cfg, mode, dtype, device, without, use_cache=use_cache)
    if device.type == "cuda":  # after the build, which holds an fp32 copy for a moment
        torch.cuda.reset_peak_memory_stats(device)
    params = sum(p.numel() for p in model.parameters())
    batch = make_batch(cfg, layout, device)

    def step():
        return train_step(run, opt, batch)

    losses, times, warm_s = [], [], 0.0
    t0 = time.perf_counter()
    for i in range(warmup + steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            losses.append(step())
            end.record()
            times.append((start, end))
        else:
            t = time.perf_counter()
            losses.append(step())
            times.append(time.perf_counter() - t)
        if i == warmup - 1:
            _sync(device)
            warm_s = time.perf_counter() - t0
        print(f"\r  {mode}: step {i + 1}/{warmup + steps}", end="", file=sys.stderr, flush=True)
    _sync(device)
    print(file=sys.stderr)
    secs = [s.elapsed_time(e) / 1e3 for s, e in times] if device.type == "cuda" else times
    ms = statistics.median(secs[warmup:]) * 1e3
    tokens = cfg["batch"] * cfg["seq"]
    row = {"mode": mode, "layout": layout, "params": params, "tokens_per_step": tokens, "step_ms": ms,
           "tokens_per_s": tokens / ms * 1e3, "warmup_s": round(warm_s, 1),
           "first_loss": losses[0].item(), "last_loss": losses[-1].item(),
           "peak_GiB": torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None}
    del model, run, opt, losses
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def table(meta, rows):
    """Markdown: one row per mode and layout, with tokens/s and memory against
    compile's and (where it ran) liger's of the same layout."""
    def base(mode, layout):
        return next((r for r in rows if r["mode"] == mode and r.get("layout") == layout and "error" not in r),
                    None)
    with_liger = any(r["mode"] == "liger" and "error" not in r for r in rows)
    head = (["mode", "layout", "tokens/s", "step ms", "peak GiB", "vs compile (tokens/s)", "vs compile (memory)"]
            + (["vs liger (tokens/s)", "vs liger (memory)"] if with_liger else []) + ["loss first -> last"])
    lines = [f"# End to end: {meta['model']} on {meta['device']}", "",
             f"torch {meta['torch']}, transformers {meta['transformers']}, {meta['dtype']}, commit "
             f"{meta['git_commit'][:10]}; median of {meta['steps']} steps after {meta['warmup']}"
             + (f"; fusedops modes without {', '.join(meta['without'])}" if meta["without"] else "")
             + ("; use_cache=False" if meta.get("use_cache") is False else "")
             + (f"; fused loss chunk {meta['loss_chunk']}" if meta.get("loss_chunk") else "")
             + ("; packed: documents of mixed length in one row, use_cache=False"
                if "packed" in meta.get("layouts", ()) else "") + ".", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r.get('layout', '')} | n/a: {r['error']} |" + " |" * (len(head) - 3))
            continue
        peak = "" if r["peak_GiB"] is None else f"{r['peak_GiB']:.2f}"
        ratios = []
        for mode in ("compile", "liger") if with_liger else ("compile",):
            b = base(mode, r["layout"])
            ratios += [f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if b else "",
                       f"{r['peak_GiB'] / b['peak_GiB']:.2f}x" if b and r["peak_GiB"] else ""]
        lines.append(f"| {r['mode']} | {r['layout']} | {r['tokens_per_s'] / 1e3:.2f} k | {r['step_ms']:.1f} | "
                     f"{peak} | " + " | ".join(ratios) + f" | {r['first_loss']:.4f} -> {r['last_loss']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    try:
        import transformers
    except ImportError:
        sys.exit("bench_e2e needs transformers: pip install fusedops[hf]")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    quick = args.quick or (not gpu and not args.full)
    cfg = dict(QUICK if quick else ANCHOR)
    for k, v in (("batch", args.batch), ("seq", args.seq), ("num_hidden_layers", args.layers),
                 ("vocab_size", args.vocab)):
        if v is not None:
            cfg[k] = v
    dtype = DTYPES[args.dtype or ("bf16" if gpu else "fp32")]
    steps = args.steps if args.steps is not None else (20 if gpu else 3)
    warmup = args.warmup if args.warmup is not None else (5 if gpu else 2)
    if device.type == "cpu":
        common.steady_host_allocator()
    meta = common.metadata(device, None)
    meta.update(transformers=transformers.__version__, model="LlamaForCausalLM " + ("quick" if quick else "ANCHORS"),
                config=cfg, dtype=common.DTYPE_NAMES[dtype], steps=steps, warmup=warmup,
                without=args.without, use_cache=args.use_cache, layouts=args.layouts, loss_chunk=args.loss_chunk)
    print(f"{meta['device']}: {meta['model']} {cfg}, {meta['dtype']}", file=sys.stderr, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with warnings.catch_warnings():
        # fusedops' SDPA says once per reason when it hands a call to torch's;
        # shown once here too, not per mode.
        warnings.simplefilter("once")
        for mode, layout in ((m, x) for m in args.modes for x in args.layouts):
            try:
                rows.append(run_mode(cfg, mode, dtype, device, warmup, steps, args.without,
                                     args.use_cache, layout, args.loss_chunk))
            except Exception as e:  # noqa: BLE001  (an n/a row; the other modes still run)
                print(f"\n  {mode} ({layout}): failed: {common._short_error(e)}", file=sys.stderr)
                rows.append({"mode": mode, "layout": layout, "error": common._short_error(e)})
                gc.collect()
                if gpu:
                    torch.cuda.empty_cache()
            (out / "e2e.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    loss_chunk(None)
    md = table(meta, rows)
    (out / "e2e.md").write_text(md)
    print(f"wrote {out}/e2e.json, e2e.md", file=sys.stderr)
    print(md, end="")
    return rows


if __name__ == "__main__":
    main()
