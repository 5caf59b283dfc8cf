"""Run the fusedops benchmark suite: every benchmarks/bench_<op>.py, each impl
(fusedops, eager, torch.compile, and what a case adds), forward and
forward+backward (or an optimizer step), against the copy ceiling (memory-bound
ops) or the matmul ceiling (compute-bound ones) measured in the same run.

    python -m benchmarks.run [--ops norm,...] [--quick] [--sweep | --no-sweep]
                             [--out DIR] [--no-compile] [--no-plot]

Writes DIR/results.json, DIR/results.md and DIR/results.png (default
bench-results/); progress goes to stderr, the table is the last thing on stdout.
Adding an op is one new bench_<op>.py exposing cases(device, quick, sweep).
The end-to-end training benchmark runs on its own: python -m benchmarks.bench_e2e.
"""
import argparse
import importlib
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402

HERE = Path(__file__).resolve().parent


# bench_<name>.py files that are programs of their own, not op cases for this
# suite: `python -m benchmarks.bench_e2e` (whole training steps of a model).
STANDALONE = {"e2e"}


def available_ops():
    return sorted(op for op in (p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))
                  if op not in STANDALONE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(available_ops()),
                   help="comma-separated ops to run (default: all of %(default)s)")
    p.add_argument("--quick", action="store_true", help="a couple of shapes per op, no sweep")
    sweep = p.add_mutually_exclusive_group()
    sweep.add_argument("--sweep", action="store_true",
                       help="run the hidden-size sweeps (default: on a GPU, unless --quick)")
    sweep.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip them")
    p.set_defaults(sweep=None)  # None: decided by the device
    p.add_argument("--out", default="bench-results", help="output folder (default %(default)s)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    args = p.parse_args(argv)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = set(args.ops) - set(available_ops())
    if unknown & STANDALONE:
        p.error(f"{sorted(unknown & STANDALONE)} run on their own: python -m benchmarks.bench_<name>")
    if unknown:
        p.error(f"unknown op(s) {sorted(unknown)}; have {available_ops()}")
    return args


def collect_cases(ops, device, quick, sweep):
    cases = []
    for op in ops:
        module = importlib.import_module(f"benchmarks.bench_{op}")
        cases += module.cases(device, quick, sweep)
    return cases


def run_cases(cases, device, meta, out, use_compile):
    rows = []
    for i, case in enumerate(cases, 1):
        common.progress_start(i, len(cases), case)
        case_rows = common.run_case(case, device, common.ceilings(meta), use_compile)
        common.progress_end(case_rows)
        rows += case_rows
        common.write_json(out, meta, rows, complete=False)
    return rows


def report(out, meta, rows, plot):
    common.write_json(out, meta, rows, complete=True)
    table = common.format_table(meta, rows)
    (out / "results.md").write_text(table)
    png = common.write_plot(out, meta, rows) if plot else None
    print(f"wrote {out}/results.json, results.md{', results.png' if png else ''} "
          f"in {meta['wall_s']} s", file=sys.stderr, flush=True)
    print(table, end="", flush=True)


def main(argv=None):
    args = parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if device.type == "cpu":
        common.steady_host_allocator()
    sweep = args.sweep if args.sweep is not None else (device.type == "cuda" and not args.quick)
    cases = collect_cases(args.ops, device, args.quick, sweep)
    ceiling = common.copy_ceiling(device)
    meta = common.metadata(device, ceiling)
    if any(c.flops for c in cases):
        meta["matmul_ceiling"] = common.matmul_ceiling(device)
    print(f"{meta['device']}: {common.ceiling_line(meta)}; {len(cases)} cases", file=sys.stderr, flush=True)
    rows = run_cases(cases, device, meta, out, not args.no_compile)
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    report(out, meta, rows, plot=not args.no_plot)


if __name__ == "__main__":
    main()
