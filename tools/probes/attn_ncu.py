"""One flash_attention forward (and, with --bwd, its backward) at a benchmark
shape, for Nsight Compute to profile:
  ncu --clock-control none -k regex:attn_ --launch-skip 2 --launch-count 1 \\
      --section SpeedOfLight --section WarpStateStats python3 tools/probes/attn_ncu.py
Usage: tools/probes/attn_ncu.py [B H S D] [--causal] [--bwd]"""
import sys

import torch

from fusedops import functional

args = [a for a in sys.argv[1:] if not a.startswith("--")]
B, H, S, D = map(int, args) if args else (2, 16, 8192, 128)
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad="--bwd" in sys.argv)
           for _ in range(3))
for _ in range(3):
    out = functional.flash_attention(q, k, v, causal="--causal" in sys.argv)
    if "--bwd" in sys.argv:
        out.backward(torch.ones_like(out))
torch.cuda.synchronize()
