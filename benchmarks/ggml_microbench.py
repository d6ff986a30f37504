"""The linears of one SmolLM2-135M step (30 layers x qkv, o, gate_up, down; 106 M weights) at M rows:
our bf16 packed kernel vs the ggml block formats executed in place (csrc/linear_ggml.cpp), median of 7.
K-quants: the 576-wide rows fall back to Q8_0 (as llama.cpp's quantizer does). The crossover between
the integer dot and the dequantize-to-bf16 path is linear_ggml.cpp's kDotRowsMax.
Each format is timed as a step of decodes (decode_rows = M) and as prompt rows (decode_rows = 0), which choose
different paths on some CPUs; a format this CPU repacks also as decodes on the file's own layout.
MASK_ISA="-mno-avx512f -mno-avxvnni -mno-amx-tile" runs the kernels as a CPU without
those instruction sets compiles them (e.g. an AVX2-only Zen 3's), on this one.
Run: .venv/bin/python benchmarks/ggml_microbench.py [FORMAT ...] (correctness: tests/test_linear_ggml.py)."""

import os
import sys

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from pagedllm.bench.common import median_time
from pagedllm.bench.random_gguf import random_tensor
from pagedllm.model_executor.layers.formats import FORMATS
from pagedllm.model_executor.layers.weight_formats import GGMLWeight
from pagedllm.platforms.cpu import build_ops, load_ops

torch.set_num_threads(2)
ops = build_ops(tuple(os.environ["MASK_ISA"].split())) if os.environ.get("MASK_ISA") else load_ops()
print("integer dot ISA path:", ops.linear_ggml_isa, "| bf16:", ops.linear_bf16_isa)
H, FF, Q, KV = 576, 1536, 576, 192
shapes = [(Q + 2 * KV, H), (H, Q), (2 * FF, H), (H, FF)]  # (out, in), one layer; repeated 30 times
formats = [T[name] for name in sys.argv[1:]] or [T.Q4_0, T.Q4_1, T.Q8_0]
rng = np.random.default_rng(0)
shapes = shapes * 30  # 120 distinct weights, as in the model: ~10x the L3 cache in bf16, so streamed from memory
p16 = [ops.pack_bf16(torch.randn(o, k) * 0.02) for o, k in shapes]


def fallback(t: T, k: int) -> T:  # K-quants need rows of whole 256-blocks; llama.cpp's quantizer falls back too
    return t if k % GGML_QUANT_SIZES[t][0] == 0 else T.Q8_0


raw = {t: [torch.from_numpy(random_tensor(rng, o, k, fallback(t, k).name, fast=True)) for o, k in shapes]
       for t in formats}
quant = {t: [GGMLWeight(ops, [(r, FORMATS[fallback(t, k).name.lower()])], k) for r, (o, k) in zip(raw[t], shapes)]
         for t in formats}
repacked = [t for t in formats if ops.ggml_repacks(int(t))]
print("repacked into 16-row groups here:", [t.name for t in repacked], "(their decodes also timed on the file layout)")
flops_per_row = sum(2 * o * k for o, k in shapes)


for m in [int(v) for v in os.environ.get("ROWS", "1,2,4,8,12,15,16,24,32,64,256,1024").split(",")]:
    xs = {k: torch.randn(m, k) for k in (H, FF)}
    t16 = median_time(lambda xs=xs: [ops.linear_bf16(xs[k], w, None, o) for w, (o, k) in zip(p16, shapes)])
    row = f"M={m:4}: bf16 {t16 * 1e3:7.2f} ms ({flops_per_row * m / t16 / 1e9:4.0f} GFLOP/s)"
    for t, ws in quant.items():
        for label, rows in (("decodes", m), ("prompt", 0)):
            tq = median_time(lambda xs=xs, ws=ws, rows=rows: [w.matmul(xs[k], rows) for w, (o, k) in zip(ws, shapes)])
            row += f"  {t.name} {label} {tq * 1e3:7.2f} ms ({flops_per_row * m / tq / 1e9:4.0f})"
        if t in repacked:  # the same weights as the file stores them, as a CPU that does not repack them runs them
            tf = median_time(lambda xs=xs, t=t, m=m: [ops.linear_ggml(xs[k], [r], [int(fallback(t, k))], [o], None, o, m)
                                                 for r, (o, k) in zip(raw[t], shapes)])
            row += f"  {t.name} decodes (file layout) {tf * 1e3:7.2f} ms ({flops_per_row * m / tf / 1e9:4.0f})"
    print(row, flush=True)
