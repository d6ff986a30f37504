"""How fast a decode step's linears stream their bf16 weights: SmolLM2-135M's 30 layers of qkv, o, gate_up and
down (212 MB of bf16 panels) through linear_bf16 at 1 and 11 rows, next to a plain streaming read (torch's
sum over 256 MiB); median of 5 after a warm-up.
Run: .venv/bin/python benchmarks/decode_linears_bandwidth.py"""

import torch

from pagedllm.bench.common import median_time
from pagedllm.platforms.cpu import load_ops

ops = load_ops()
a = torch.ones(256 * 2**20 // 4)
print(f"streaming read (sum of 256 MiB): {a.numel() * 4 / median_time(lambda: a.sum(), 5) / 1e9:.1f} GB/s")
dims = [(o, k) for _ in range(30) for o, k in ((960, 576), (576, 576), (3072, 576), (576, 1536))]
weights = [ops.pack_bf16(torch.randn(o, k)) for o, k in dims]
nbytes = sum(w.numel() * 2 for w in weights)
for m in (1, 11):
    xs = {k: torch.randn(m, k) for k in (576, 1536)}
    t = median_time(lambda xs=xs: [ops.linear_bf16(xs[k], w, None, o) for w, (o, k) in zip(weights, dims)], 5)
    print(f"{m:2d} rows: {nbytes / 1e6:.0f} MB of weights in {t * 1e3:.2f} ms = {nbytes / t / 1e9:.1f} GB/s")
