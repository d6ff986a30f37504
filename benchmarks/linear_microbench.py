"""The linears of one SmolLM2-135M step (30 layers x qkv, o, gate_up, down; 106 M weights) at M rows:
our fp32 packed kernel vs oneDNN's bf16 GEMM (torch) vs our bf16 kernel, median of 7.
MASK_ISA="-mno-avx512f -mno-avxvnni -mno-amx-tile" runs our kernels as a CPU without those instruction sets compiles
them (an AVX2-only Zen 3's), on this one; ROWS="1,4,6" picks the row counts.
Run: .venv/bin/python benchmarks/linear_microbench.py (correctness is tests/test_bf16.py)."""

import os

import torch
import torch.nn.functional as F

from pagedllm.bench.common import median_time
from pagedllm.platforms.cpu import build_ops, load_ops, pack_weight

torch.set_num_threads(2)
ops = build_ops(tuple(os.environ["MASK_ISA"].split())) if os.environ.get("MASK_ISA") else load_ops()
print("bf16 kernel ISA path:", ops.linear_bf16_isa)
H, FF, Q, KV = 576, 1536, 576, 192
shapes = [(Q + 2 * KV, H), (H, Q), (2 * FF, H), (H, FF)] * 30  # (out, in)
weights = [torch.randn(o, k) * 0.02 for o, k in shapes]
p32 = [pack_weight(w, ops.f32_strip) for w in weights]
plain_bf16 = [w.bfloat16() for w in weights]
p16 = [ops.pack_bf16(w) for w in weights]
del weights
flops_per_row = sum(2 * o * k for o, k in shapes)


def gflops(m: int, t: float) -> float:
    return flops_per_row * m / t / 1e9


for m in [int(r) for r in os.environ.get("ROWS", "1,2,4,8,16,32,64,256,1024").split(",")]:
    xs = {k: torch.randn(m, k) for k in (H, FF)}
    t32 = median_time(lambda xs=xs: [ops.packed_linear(xs[k], w, None, o) for w, (o, k) in zip(p32, shapes)])
    tdn = median_time(lambda xs=xs: [F.linear(xs[w.shape[1]].bfloat16(), w).float() for w in plain_bf16])
    t16 = median_time(lambda xs=xs: [ops.linear_bf16(xs[k], w, None, o) for w, (o, k) in zip(p16, shapes)])
    print(f"M={m:4}: fp32 packed {t32 * 1e3:7.2f} ms ({gflops(m, t32):4.0f} GFLOP/s)  oneDNN bf16 {tdn * 1e3:7.2f} ms "
          f"({gflops(m, tdn):4.0f})  bf16 packed {t16 * 1e3:7.2f} ms ({gflops(m, t16):4.0f})", flush=True)
