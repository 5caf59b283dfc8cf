"""How fast can a stream with Adam's mix of reads and writes run at all?

Adam reads 4 arrays and writes 3 (p, g, m, v in; p, m, v out: 28 bytes per
fp32 parameter), where the copy ceiling of the benchmarks reads 1 and writes 1.
This probe times the simplest kernels of each mix (Triton, one flat array
each, far beyond L2) beside torch's copy, in one run:

  copy 1:1   torch's device-to-device copy (the benchmarks' ceiling)
  triton 1:1 the same copy as a Triton kernel (Triton's own overhead)
  triton 4:3 Adam's mix: 4 loads, an update, 3 stores

If triton 4:3 sits below the copy by what fusedops' Adam misses (0.94 of the
copy where issue 4 asks 0.95), the mix is the limit, not the kernel.

    python3 tools/probes/mix_ceiling.py [--elements 536870912]

Needs a CUDA GPU and Triton; not part of the benchmark suite."""
import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import common  # noqa: E402


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _adam_mix(p, g, m, v, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    pv = tl.load(p + offs, mask=mask)
    gv = tl.load(g + offs, mask=mask)
    mv = tl.load(m + offs, mask=mask)
    vv = tl.load(v + offs, mask=mask)
    mv = 0.9 * mv + 0.1 * gv
    vv = 0.999 * vv + 0.001 * gv * gv
    pv = pv - 1e-3 * mv / (tl.sqrt(vv) + 1e-8)
    tl.store(p + offs, pv, mask=mask)
    tl.store(m + offs, mv, mask=mask)
    tl.store(v + offs, vv, mask=mask)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=1 << 29, help="fp32 elements per array")
    ap.add_argument("--block", type=int, default=4096)
    a = ap.parse_args()
    dev = torch.device("cuda")
    n, block = a.elements, a.block
    grid = (triton.cdiv(n, block),)
    ceiling = common.copy_ceiling(dev)["GB/s"]
    rows = [("copy 1:1 (torch)", ceiling)]
    src, dst = (torch.rand(n, device=dev) for _ in range(2))
    t = common.time_fn(lambda: _copy[grid](src, dst, n, BLOCK=block), dev)
    rows.append(("triton copy 1:1", 8 * n / t / 1e9))
    del src, dst
    p, g, m, v = (torch.rand(n, device=dev) for _ in range(4))
    t = common.time_fn(lambda: _adam_mix[grid](p, g, m, v, n, BLOCK=block), dev)
    rows.append(("triton adam mix 4:3", 28 * n / t / 1e9))
    print(f"{torch.cuda.get_device_name()}, {n} fp32 elements an array, block {block}")
    for name, gbs in rows:
        print(f"{name:22s} {gbs:7.0f} GB/s  {gbs / ceiling:.3f} of the copy")


if __name__ == "__main__":
    main()
