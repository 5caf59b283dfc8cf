"""The memory activation checkpointing saves: one training step's forward and
backward of examples/train.py's Llama, plain and patched with fusedops, with
and without --checkpoint (each decoder layer recomputed in the backward).

    python tools/ci/checkpoint_memory.py                    # CPU: the cpu preset
    python tools/ci/checkpoint_memory.py --preset cuda      # on a GPU

Two figures a case, over what was allocated before the step (parameters): the
memory held at the end of the forward (the activations kept for the backward,
the loss's among them) and the peak over forward and backward (gradients and
the recomputation's transients included). On a GPU from torch.cuda's allocator
statistics; on the CPU, which keeps none, from the allocations torch.profiler
records (profile_memory: the running "Total Allocated" of its memory events,
from its value before the step's first allocation). Prints a markdown table.
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import fusedops  # noqa: E402

MiB = 2**20


def _train_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("example_train", ROOT / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step(model, x, amp):
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=amp or torch.float32, enabled=amp is not None):
        loss = model(input_ids=x, labels=x, use_cache=False).loss
    return loss


def measure_cuda(model, x, amp):
    """(MiB held after the forward, peak MiB) above what was allocated before."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = _step(model, x, amp)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base
    loss.backward()
    torch.cuda.synchronize()
    return kept / MiB, (torch.cuda.max_memory_allocated() - base) / MiB


def measure_cpu(model, x, amp):
    """The same from torch.profiler's memory events: their running total of
    the bytes allocated, read at the end of the forward (the last event before
    the backward's marker) and at its highest, less its value before the
    first."""
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = _step(model, x, amp)
        with record_function("checkpoint_memory.backward"):
            loss.backward()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    mem = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events
                 if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
    start = min(e["ts"] for e in events if e.get("name") == "checkpoint_memory.backward")
    first = next(e for e in events if e.get("name") == "[memory]" and e["ts"] == mem[0][0])
    base = mem[0][1] - first["args"]["Bytes"]  # the total carries over from earlier profiling
    kept = next((total for ts, total in reversed(mem) if ts < start), base)
    return (kept - base) / MiB, (max(total for _, total in mem) - base) / MiB


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=None, help="examples/train.py's preset (default: by device)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, help="sequences (default: the preset's)")
    p.add_argument("--seq", type=int, help="tokens a sequence (default: the preset's)")
    p.add_argument("--runs", default="pytorch,fusedops", help="which models, of %(default)s")
    args = p.parse_args(argv)
    train = _train_module()
    targs = train.parse_args(["--device", args.device] + (["--preset", args.preset] if args.preset else [])
                             + (["--batch", str(args.batch)] if args.batch else [])
                             + (["--seq", str(args.seq)] if args.seq else []))
    cfg, device = targs.cfg, targs.device
    amp = train.DTYPES[cfg["dtype"]][1]
    x = train.markov_data(dict(cfg, steps=1), targs.seed)[0].to(device)
    measure = measure_cuda if device.type == "cuda" else measure_cpu
    rows, params = [], 0
    for run in [r.strip() for r in args.runs.split(",") if r.strip()]:
        for ckpt in (False, True):
            model = train.make_model(cfg, device, targs.seed)
            params = sum(p.numel() for p in model.parameters())
            if run == "fusedops":
                fusedops.patch(model)
            if ckpt:
                train.checkpoint_layers(model)
            model.train()
            _step(model, x, amp).backward()  # warm-up: lazy allocations, caches
            model.zero_grad(set_to_none=True)
            rows.append((run, ckpt, *measure(model, x, amp)))
            del model
    print(f"{device}, Llama {params / 1e6:.1f} M parameters, {cfg['num_hidden_layers']} layers, "
          f"batch {cfg['batch']} x {cfg['seq']} tokens, {cfg['dtype']}, torch {torch.__version__}; "
          "MiB above the parameters")
    print("\n| model | --checkpoint | held after the forward | peak, forward + backward |\n|---|---|---:|---:|")
    for run, ckpt, kept, peak in rows:
        print(f"| {run} | {'yes' if ckpt else 'no'} | {kept:.1f} | {peak:.1f} |")
    return rows


if __name__ == "__main__":
    main()
