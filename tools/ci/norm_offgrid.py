"""The benchmark suite's norm cases (fusedops, eager, torch.compile,
compile_exact; GPU time, copy ceiling in the same run) at widths off its grid,
e.g. rows that allow only 4-byte or one-element access (docs/perf-notes.md,
v27; docs/results/h100-norm-offgrid.md came from the default shapes):

    python tools/ci/norm_offgrid.py [--shapes 16384x1030,...] [--out DIR] [--no-compile]

On the CPU the same shapes replace the CPU's (in fp32, bf16 and fp16)."""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import bench_norm, run  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384x1030,16384x1025,4096x4098,4096x4095,65536x258,65536x257")
    ap.add_argument("--out", default="bench-results/norm-offgrid")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    a = ap.parse_args(argv)
    bench_norm.GPU_SHAPES = bench_norm.CPU_SHAPES = [tuple(map(int, s.split("x"))) for s in a.shapes.split(",")]
    run.main(["--ops", "norm", "--no-sweep", "--no-plot", "--out", a.out] + (["--no-compile"] if a.no_compile else []))


if __name__ == "__main__":
    main()
