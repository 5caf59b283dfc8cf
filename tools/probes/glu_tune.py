"""Kernel-tuning probe for the SwiGLU CUDA kernels: GPU time (CUDA-graph replay
over rotating inputs) of the raw glu_fwd and glu_bwd ops, as GB/s and as a
fraction of the copy ceiling measured in the same run, at the vectors a thread
that --vectors "F,B" sets (the tuning knobs glu_fwd_vectors / glu_bwd_vectors,
csrc/common/tune.h):

    python tools/probes/glu_tune.py --vectors 2,2 --shapes 16384x11008

Not the benchmark suite (benchmarks/): no eager or compile, no autograd."""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import common  # noqa: E402
import fusedops  # noqa: E402

ops = torch.ops.fusedops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384x11008,16384x14336")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--packed", action="store_true")
    ap.add_argument("--vectors", help='"F,B": vectors a thread, forward and backward (1, 2 or 4); default: the plan\'s')
    a = ap.parse_args()
    if a.vectors:
        f, b = map(int, a.vectors.split(","))
        fusedops._C._tune("glu_fwd_vectors", f)
        fusedops._C._tune("glu_bwd_vectors", b)
    dev = torch.device("cuda")
    dt = getattr(torch, a.dtype)
    ceiling = common.copy_ceiling(dev)["GB/s"]
    tag = a.vectors or "default"
    for shape in a.shapes.split(","):
        T, F = map(int, shape.split("x"))
        n = T * F * dt.itemsize
        sets = []
        for _ in range(max(2, (256 << 20) // (5 * n) + 1)):
            if a.packed:
                gu = torch.randn(T, 2 * F, device=dev, dtype=dt)
                g, u = gu[:, :F], gu[:, F:]
            else:
                g, u = (torch.randn(T, F, device=dev, dtype=dt) for _ in range(2))
            sets.append((g, u, torch.randn(T, F, device=dev, dtype=dt)))
        it = iter(range(1 << 62))

        def fwd():
            g, u, _ = sets[next(it) % len(sets)]
            ops.glu_fwd(g, u, "silu")

        def bwd():
            g, u, d = sets[next(it) % len(sets)]
            ops.glu_bwd(d, g, u, "silu")

        tf, tb = common.graph_time(fwd, dev), common.graph_time(bwd, dev)
        gf, gb, gfb = 3 * n / tf / 1e9, 5 * n / tb / 1e9, 8 * n / (tf + tb) / 1e9
        print(f"vectors={tag:>7} {shape:>11} {a.dtype}{' packed' if a.packed else ''}: "
              f"fwd {gf:5.0f} GB/s ({gf / ceiling:.2f})  bwd {gb:5.0f} ({gb / ceiling:.2f})  "
              f"fwd+bwd {gfb:5.0f} ({gfb / ceiling:.2f})  [ceiling {ceiling:.0f}]", flush=True)


if __name__ == "__main__":
    main()
