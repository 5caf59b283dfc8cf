# (tools/probes: run on a GPU as python3 tools/probes/attention_masks.py; about a minute on an H200)
# Masked attention (issue 52): fusedops against FlexAttention (compiled, block mask) and SDPA with
# a dense bool mask, bf16, H16, D128, fwd and fwd+bwd; TFLOP/s on the visible pairs (fwd+bwd
# counted 3.5x the forward), GPU time by CUDA events (median of 20). Cases: a causal window of
# 4096 over 16384 tokens; 7 packed documents of 256-4096 tokens (16384 in all) beside the same
# documents run one dense causal call each, and dense causal batches at the documents' mean
# length and at 16384 tokens; softcap 50 at 4096 tokens beside the same call without it. The
# window row's fusedops_causal is the plain causal call counted on the window's pairs: a time ratio.
import itertools, torch
import torch.nn.functional as TF
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from fusedops import functional as F
dev, dt = "cuda", torch.bfloat16
flex = torch.compile(flex_attention)

def t(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]

def row(name, pairs, H, D, fns, B=1):
    q = torch.randn(B, S, H, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, S, H, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(B, S, H, D, device=dev, dtype=dt, requires_grad=True)
    do = torch.randn(B, S, H, D, device=dev, dtype=dt)
    flops = 4 * B * H * pairs * D
    res = []
    for impl, f in fns.items():
        try:
            fwd = t(lambda: f(q, k, v))
            def fb():
                o = f(q, k, v); torch.autograd.grad(o, (q, k, v), do)
            fwb = t(fb)
            res.append(f"{impl} fwd {flops / fwd / 1e9:.0f} fwd+bwd {3.5 * flops / fwb / 1e9:.0f}")
        except Exception as e:
            res.append(f"{impl} FAILED {type(e).__name__}: {str(e)[:100]}")
    print(name, "|", " | ".join(res), flush=True)

S, H, D = 16384, 16, 128
pos = torch.arange(S, device=dev)
W = 4096
bm = create_block_mask(lambda b, h, i, j: (j <= i) & (j >= i - W), None, None, S, S, device=dev)
dense = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= pos[:, None] - W)
bt = lambda x: x.transpose(1, 2)
row(f"window {W} causal S{S}", sum(min(i, W) + 1 for i in range(S)), H, D, {
    "fusedops": lambda q, k, v: F.flash_attention(q, k, v, causal=True, window_size=(W, 0)),
    "fusedops_causal": lambda q, k, v: F.flash_attention(q, k, v, causal=True),
    "flex": lambda q, k, v: bt(flex(bt(q), bt(k), bt(v), block_mask=bm)),
    "sdpa_mask": lambda q, k, v: bt(TF.scaled_dot_product_attention(bt(q), bt(k), bt(v), attn_mask=dense))})
g = torch.Generator().manual_seed(0)
lens = []
while sum(lens) < S:
    lens.append(min(int(torch.randint(256, 4097, (), generator=g)), S - sum(lens)))
cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
doc = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev))
bm2 = create_block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i), None, None, S, S, device=dev)
dense2 = (doc[None, :] == doc[:, None]) & (pos[None, :] <= pos[:, None])
print("doc lengths", lens)
bounds = list(zip(cu.tolist()[:-1], cu.tolist()[1:]))
row(f"varlen {len(lens)} docs S{S}", sum(n * (n + 1) // 2 for n in lens), H, D, {
    "fusedops": lambda q, k, v: F.flash_attention_varlen(q[0], k[0], v[0], cu, cu, max(lens), max(lens), causal=True)[None],
    "fusedops_dense_per_doc": lambda q, k, v: torch.cat([F.flash_attention(q[:, a:b], k[:, a:b], v[:, a:b], causal=True)
                                                         for a, b in bounds], 1),
    "flex": lambda q, k, v: bt(flex(bt(q), bt(k), bt(v), block_mask=bm2)),
    "sdpa_mask": lambda q, k, v: bt(TF.scaled_dot_product_attention(bt(q), bt(k), bt(v), attn_mask=dense2))})
S16 = S
S = sum(lens) // len(lens)
row(f"dense causal B{len(lens)} S{S} (the documents' mean length)", S * (S + 1) // 2, H, D, {
    "fusedops": lambda q, k, v: F.flash_attention(q, k, v, causal=True)}, B=len(lens))
S = S16
row(f"dense causal S{S}", S * (S + 1) // 2, H, D, {"fusedops": lambda q, k, v: F.flash_attention(q, k, v, causal=True)})
S = 4096
row(f"softcap 50 causal S{S}", S * (S + 1) // 2, H, D, {
    "fusedops": lambda q, k, v: F.flash_attention(q, k, v, causal=True, softcap=50.0),
    "fusedops_nocap": lambda q, k, v: F.flash_attention(q, k, v, causal=True),
    "fusedops_nocap_general": lambda q, k, v: F.flash_attention(q, k, v, causal=True, window_size=(S, 0))})
