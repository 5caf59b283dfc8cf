# (tools/probes: run on a GPU as python3 tools/probes/mlp_memory.py)
# Peak memory beyond the inputs of one MLP forward+backward (8192 tokens, 4096 -> 14336, bf16), fusedops
# against eager and torch.compile of the LlamaMLP form it replaces, and where fusedops' peak is reached.
import torch, torch.nn as nn, torch.nn.functional as F
import fusedops
dev, dt, N, H, I = "cuda", torch.bfloat16, 8192, 4096, 14336

class LlamaMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False); self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

def peak(mod, label):
    x = torch.randn(N, H, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(N, H, device=dev, dtype=dt)
    for _ in range(2):  # warm-up (compile, autotune), then the measured call
        for p in mod.parameters(): p.grad = None
        x.grad = None
        torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y = mod(x); y.backward(dy); del y
        torch.cuda.synchronize()
    print(f"{label}: peak {(torch.cuda.max_memory_allocated() - base) / 2**30:.3f} GiB beyond the inputs "
          f"(grads held after: {(torch.cuda.memory_allocated() - base) / 2**30:.3f} GiB)", flush=True)

torch.manual_seed(0)
ref = LlamaMLP().to(dev, dt)
peak(ref, "eager")
peak(torch.compile(LlamaMLP().to(dev, dt)), "compile")
fm = fusedops.nn.SwiGLU(H, I).to(dev, dt) if hasattr(fusedops.nn, "SwiGLU") else None
try:
    peak(fm, "fusedops.nn.SwiGLU")
except Exception as e:
    print("fusedops.nn.SwiGLU failed", e)
try:  # Liger-Kernel's LlamaMLP replacement, where it imports
    from types import SimpleNamespace
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    cfg = SimpleNamespace(hidden_size=H, intermediate_size=I, hidden_act="silu")
    peak(LigerSwiGLUMLP(cfg).to(dev, dt), "liger LigerSwiGLUMLP")
except ImportError as e:
    print("liger: not installed", e)
