"""Issue 56's scaling table in one command on a host of 4 GPUs: examples/train.py
with the 3b preset (a Llama of 3.6 B parameters, 4096-token sequences,
amp-bf16) on 1, 2 and 4 GPUs, each way of --variants:

  fusedops       patched, FusedAdamW
  pytorch        unpatched, torch's fused AdamW (--torch-fused)
  compile        unpatched, torch's fused AdamW, torch.compile
  fusedops-ckpt  fusedops with --checkpoint (each decoder layer recomputed)

then the DCP checkpoint the 4-GPU fusedops run saved halfway, resumed on 2 GPUs
and on 1 (resharded 4 -> 2 and 4 -> 1), and a markdown table last.

    python tools/ci/scale_gpu.py                                 # all of it (build first)
    python tools/ci/scale_gpu.py --gpus 4 --variants fusedops    # a part (see below)
    python tools/ci/scale_gpu.py --table-from DIR [DIR ...]      # the table of parts run apart
    python tools/ci/scale_gpu.py --dry                           # a check of this script: CPU, gloo, tiny

Weak scaling, with one loss curve: every run takes the same global batch,
PER_GPU x the largest GPU count, in micro-batches of PER_GPU sequences a GPU
(on N GPUs, --micro-batches 4 / N of them a step, gradients accumulated). A
GPU does the same work a micro-batch at every count, and each token costs the
same optimizer work (on 1 GPU the whole model's update once per 4
micro-batches, on 4 a quarter of it once per micro-batch), so tokens/s per
GPU compares like with like; and the runs train on the same batches, so the
1-, 2- and 4-GPU fusedops curves must agree within bf16 tolerance (the end
loss, the mean of the last tenth of the steps, within --end-atol; the first
--early-steps within --early-atol: tools/ci/dist_gpu.sh's check), as must the
resumed runs with the curve they continue. 1 GPU runs without
torch.distributed (--dist none), 2 and 4 with FSDP2 (--dist fsdp).

MFU: model FLOPs a token, 6 x the parameters that multiply (every linear layer,
the output head included; not the embedding or the norms) plus causal
attention's 6 x layers x sequence x (heads x head dim), times tokens/s per GPU,
over --peak-tflops (the dense bf16 rate of the H100 / H200 SXM data sheet).

Parts: each run is one process group of its own (torchrun), its summary.json
and log under OUT/scale/<run>/ (OUT: $OUT, the device tool's folder, else
./gpu-out), checkpoints under --work; a run that fails or passes the deadline
is reported and the others go on. The whole set takes longer than one device
call may (10 minutes): run it in parts (--gpus, --variants, --no-reshard,
--reshard-only), fetch each OUT/scale.tar.gz, unpack them side by side and
print the one table with --table-from. --reshard-only needs the 4-GPU
fusedops run of the same call (it saves the checkpoint).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train.py"
VARIANTS = {"fusedops": ["--runs", "fusedops"],
            "pytorch": ["--runs", "pytorch", "--torch-fused"],
            "compile": ["--runs", "pytorch", "--torch-fused", "--compile"],
            "fusedops-ckpt": ["--runs", "fusedops", "--checkpoint"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", default=None, help="GPU counts, comma-separated (default 1,2,4; --dry: 1,2)")
    p.add_argument("--variants", default="fusedops,pytorch,compile,fusedops-ckpt",
                   help=f"which runs, of {','.join(VARIANTS)} (default %(default)s)")
    p.add_argument("--per-gpu", type=int, default=None,
                   help="sequences a micro-batch on each GPU (default 2; --dry: 1)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps a run (default 30; --dry: 8)")
    p.add_argument("--seq", type=int, default=None, help="tokens a sequence (default: the preset's, 4096)")
    p.add_argument("--no-reshard", action="store_true", help="leave out the DCP save and the resumed runs")
    p.add_argument("--reshard-only", action="store_true",
                   help="only the 4-GPU fusedops run (saving) and the resumed runs")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense bf16 TFLOP/s of one GPU, for MFU (default %(default)s: H100 / H200 SXM)")
    p.add_argument("--end-atol", type=float, default=0.01, help="end-loss tolerance (default %(default)s)")
    p.add_argument("--early-steps", type=int, default=15)
    p.add_argument("--early-atol", type=float, default=0.005,
                   help="tolerance over the first --early-steps steps (default %(default)s)")
    p.add_argument("--deadline", type=float, default=570,
                   help="seconds from the start after which no run starts, and a running one is stopped")
    p.add_argument("--work", default="/tmp/fusedops-scale", help="checkpoints (default %(default)s)")
    p.add_argument("--dry", action="store_true", help="CPU, gloo, the tiny preset; no build")
    p.add_argument("--no-build", action="store_true", help="use the fusedops already built")
    p.add_argument("--table-from", nargs="+", metavar="DIR",
                   help="run nothing: the table of the summaries under these folders (each a scale/ of a part)")
    args = p.parse_args(argv)
    args.gpus = sorted({int(g) for g in (args.gpus or ("1,2" if args.dry else "1,2,4")).split(",")})
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(args.variants) - set(VARIANTS):
        p.error(f"--variants: {args.variants}; expected some of {list(VARIANTS)}")
    args.per_gpu = args.per_gpu or (1 if args.dry else 2)
    args.steps = args.steps or (8 if args.dry else 30)
    top = max(args.gpus)
    if any(top % g for g in args.gpus):
        p.error(f"--gpus {args.gpus}: each must divide the largest, {top}")
    args.global_batch = args.per_gpu * top
    return args


# --------------------------------------------------------------- the runs
def plan(args):
    """[(name, GPUs, train.py arguments)] in the order they run."""
    top = max(args.gpus)
    common = (["--device", "cpu", "--preset", "tiny"] if args.dry else ["--preset", "3b"]) + [
        "--steps", str(args.steps), "--batch", str(args.global_batch)] + (["--seq", str(args.seq)] if args.seq else [])
    half = args.steps // 2
    saver = f"fusedops-{top}gpu"

    def run(variant, n, extra=()):
        dist = ["--dist", "none"] if n == 1 else ["--dist", "fsdp"]
        return common + dist + ["--micro-batches", str(top // n)] + VARIANTS[variant] + list(extra)
    runs = []
    if not args.reshard_only:
        for n in args.gpus:
            for v in args.variants:
                save = ["--save-at", str(half)] if (v == "fusedops" and n == top and not args.no_reshard) else []
                runs.append((f"{v}-{n}gpu", n, run(v, n, save)))
    else:
        runs.append((saver, top, run("fusedops", top, ["--save-at", str(half)])))
    if not args.no_reshard:
        ckpt = Path(args.work) / saver / f"fusedops-step{half}"
        for n in args.gpus:
            if n < top:
                runs.append((f"fusedops-{n}gpu-from-{top}", n, run("fusedops", n, ["--resume", str(ckpt)])))
    return runs


def launch(name, n, argv, args, out, start):
    """One run, its log and summary to out/<name>; False if it failed."""
    work = Path(args.work) / name
    (out / name).mkdir(parents=True, exist_ok=True)
    if n == 1:
        cmd = [sys.executable, str(TRAIN)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), str(TRAIN)]
    cmd += argv + ["--out", str(work)]
    left = args.deadline - (time.time() - start)
    if left < 30:
        print(f"== {name}: not run (the {args.deadline:.0f} s deadline is near)", flush=True)
        return False
    t0 = time.time()
    with open(out / name / "log.txt", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=left).returncode
        except subprocess.TimeoutExpired:
            rc = "timed out"
    if (work / "summary.json").exists():
        shutil.copy(work / "summary.json", out / name / "summary.json")
    tail = (out / name / "log.txt").read_text().strip().splitlines()[-2:]
    print(f"== {name} ({time.time() - t0:.0f} s){'' if rc == 0 else f': FAILED ({rc})'}", *tail, sep="\n  ", flush=True)
    return rc == 0


def build(out):
    """The CUDA extension (tools/ci/gpu.sh build) and transformers (installed, or
    from wheels carried in .whl/hf-py312: the GPU machine has no network)."""
    env = dict(os.environ, OUT=str(out))
    if subprocess.run(["bash", str(ROOT / "tools" / "gpu.sh"), "build"], cwd=ROOT, env=env).returncode:
        sys.exit("BUILD FAILED")
    if subprocess.run([sys.executable, "-c", "import transformers"], capture_output=True).returncode:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links",
                            str(ROOT / ".whl" / "hf-py312"), "transformers"], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"NO TRANSFORMERS\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


# --------------------------------------------------------------- the table
def flops_per_token(cfg):
    """Model FLOPs of one token's forward and backward (see the docstring)."""
    h, layers, heads, kv = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * cfg["intermediate_size"]
    matmul = layers * per_layer + h * cfg["vocab_size"]
    return 6 * matmul + 6 * layers * cfg["seq"] * heads * d


def tail(losses):
    n = max(1, len(losses) // 10)
    return sum(losses[-n:]) / n


def judge(losses, base, args):
    """(end-loss difference, largest difference over the first steps, PASS?)"""
    end = abs(tail(losses) - tail(base))
    first = max(abs(a - b) for a, b in zip(losses[:args.early_steps], base[:args.early_steps]))
    return end, first, end <= args.end_atol and first <= args.early_atol


def load(dirs):
    """{run name: summary} from <dir>/<name>/summary.json of every dir."""
    found = {}
    for d in dirs:
        for p in sorted(Path(d).glob("*/summary.json")):
            found[p.parent.name] = json.loads(p.read_text())
    return found


def table(dirs, args):
    """Print the markdown tables; returns whether every correctness check passed."""
    s = load(dirs)
    ok = True
    rows = {}  # (variant, gpus) -> (tokens/s per GPU, summary)
    for name, summ in s.items():
        if "-from-" in name:
            continue
        variant, gpus = name.rsplit("-", 1)
        n = summ["processes"]
        assert gpus == f"{n}gpu", f"{name}: {n} processes"
        rows[variant, n] = (summ["runs"][0]["tokens_per_s"] / n, summ)
    if not rows:
        print("no summaries found")
        return False
    any_summ = next(iter(rows.values()))[1]
    cfg, on_gpu = any_summ["config"], any_summ["device"] != "cpu"
    fpt = flops_per_token(cfg)
    print(f"\n{any_summ['device']}, torch {any_summ['torch']}, transformers {any_summ['transformers']}, "
          f"fusedops {any_summ['fusedops']}; Llama {any_summ['runs'][0]['params'] / 1e9:.2f} B parameters "
          f"({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, vocabulary {cfg['vocab_size']}), "
          f"{cfg['dtype']}, global batch {cfg['batch']} x {cfg['seq']} tokens, {cfg['steps']} steps; "
          f"{fpt / 1e9:.1f} GFLOP a token; MFU against {args.peak_tflops:g} TFLOP/s a GPU\n")
    print("| run | GPUs | micro-batches | k tokens/s a GPU | x 1 GPU | MFU | peak GiB | end loss | loss vs reference: end, first steps |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    gpus = sorted({n for _, n in rows})
    for variant in VARIANTS:
        one = rows.get((variant, 1))
        for n in gpus:
            if (variant, n) not in rows:
                continue
            tps, summ = rows[variant, n]
            run = summ["runs"][0]
            scale = f"{tps / one[0]:.2f}" if one and n > 1 else ""
            mfu = f"{tps * fpt / (args.peak_tflops * 1e12):.1%}" if on_gpu else "-"
            mem = f"{run['peak_memory_GiB']:.1f}" if run["peak_memory_GiB"] is not None else "-"
            # fusedops against its 1-GPU run; checkpointed against fusedops on as many GPUs
            ref = {"fusedops": ("fusedops", 1), "fusedops-ckpt": ("fusedops", n)}.get(variant)
            vs = ""
            if ref in rows and ref != (variant, n):
                end, first, good = judge(run["losses"], rows[ref][1]["runs"][0]["losses"], args)
                ok &= good
                vs = f"{end:.4f}, {first:.1e} {'PASS' if good else 'FAIL'} ({ref[0]}, {ref[1]} GPU)"
            print(f"| {variant} | {n} | {summ['micro_batches']} | {tps / 1e3:.2f} | {scale} | {mfu} | {mem} | "
                  f"{tail(run['losses']):.4f} | {vs} |")
    # The resumed runs against the run whose checkpoint they took.
    resumed = sorted(name for name in s if "-from-" in name)
    if resumed:
        print("\n| resumed run | from | after step | end vs uninterrupted | first steps | PASS |\n|---|---|---:|---:|---:|---|")
    for name in resumed:
        src = f"fusedops-{name.rsplit('-from-', 1)[1]}gpu"
        r = s[name]["runs"][0]
        full = s.get(src)
        if full is None:
            print(f"| {name} | {src}: no summary | | | | FAIL |")
            ok = False
            continue
        k = r["first_step"]
        end, first, good = judge(r["losses"], full["runs"][0]["losses"][k:], args)
        ok &= good
        print(f"| {name} | {src} (DCP) | {k} | {end:.4f} | {first:.1e} | {'PASS' if good else 'FAIL'} |")
    # The targets, reported (the exit status is about correctness).
    top = gpus[-1]
    if ("fusedops", 1) in rows and ("fusedops", top) in rows and top > 1:
        eff = rows["fusedops", top][0] / rows["fusedops", 1][0]
        print(f"\nfusedops scaling efficiency at {top} GPUs: {eff:.2f} (target 0.9: {'met' if eff >= 0.9 else 'not met'})")
    for n in gpus:
        if ("fusedops", n) in rows:
            others = {v: rows[v, n][0] for v in ("pytorch", "compile") if (v, n) in rows}
            ratios = ", ".join(f"{rows['fusedops', n][0] / t:.2f}x {v}" for v, t in others.items())
            ahead = all(rows["fusedops", n][0] > t for t in others.values())
            print(f"{n} GPU(s): fusedops {ratios or 'alone'}{' (ahead of both)' if ahead and len(others) == 2 else ''}")
    for n in gpus:
        if ("fusedops", n) in rows and ("fusedops-ckpt", n) in rows:
            a, b = rows["fusedops", n], rows["fusedops-ckpt", n]
            ma, mb = a[1]["runs"][0]["peak_memory_GiB"], b[1]["runs"][0]["peak_memory_GiB"]
            mem = f"peak {ma:.1f} -> {mb:.1f} GiB, " if ma is not None and mb is not None else ""
            print(f"{n} GPU(s), --checkpoint: {mem}tokens/s x {b[0] / a[0]:.2f}")
    print(f"\nloss curves: end (mean of the last tenth of the steps) within {args.end_atol}, the first "
          f"{args.early_steps} steps within {args.early_atol}: {'all PASS' if ok else 'FAILURES above'}")
    return ok


def main(argv=None):
    args = parse_args(argv)
    if args.table_from:
        return 0 if table(args.table_from, args) else 1
    start = time.time()
    out = Path(os.environ.get("OUT", ROOT / "gpu-out")) / "scale"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(args.work, ignore_errors=True)
    out.mkdir(parents=True)
    os.environ.update(NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    if args.dry:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    elif not args.no_build:
        build(out.parent)
    if not args.dry:
        import torch
        have = torch.cuda.device_count()
        if have < max(args.gpus):
            sys.exit(f"--gpus {args.gpus}: {have} GPU(s) here")
    ran = [launch(name, n, argv, args, out, start) for name, n, argv in plan(args)]
    ok = table([out], args) and all(ran)
    with tarfile.open(out.parent / "scale.tar.gz", "w:gz") as tar:  # the device tool brings back few files
        tar.add(out, arcname="scale")
    print(f"scale_gpu.py: {time.time() - start:.0f} s; logs and summaries in {out.parent / 'scale.tar.gz'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
