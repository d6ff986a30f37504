"""The linears of one SmolLM2-135M step (30 layers x qkv, o, gate_up, down; 106 M weights) at M rows:
our bf16 packed kernel vs the ggml block formats executed in place (csrc/linear_ggml.cpp), median of 7.
The crossover between the integer dot and the dequantize-to-bf16 path is linear_ggml.cpp's kDotRowsMax.
Run: .venv/bin/python docs/bench/ggml_microbench.py [FORMAT ...] (correctness: tests/test_linear_ggml.py)."""

import statistics
import sys
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from pagedllm.kernels import load_ops

torch.set_num_threads(2)
ops = load_ops()
print("integer dot ISA path:", ops.linear_ggml_isa, "| bf16:", ops.linear_bf16_isa)
H, FF, Q, KV = 576, 1536, 576, 192
shapes = [(Q + 2 * KV, H), (H, Q), (2 * FF, H), (H, FF)]  # (out, in), one layer; repeated 30 times
formats = [T[name] for name in sys.argv[1:]] or [T.Q4_0, T.Q4_1, T.Q8_0]
rng = np.random.default_rng(0)
weights = [rng.standard_normal((o, k)).astype(np.float32) * 0.02 for o, k in shapes]
p16 = [ops.pack_bf16(torch.from_numpy(w)) for w in weights] * 30
quant = {t: [torch.from_numpy(quantize(w, t)) for w in weights] * 30 for t in formats}
shapes = shapes * 30
flops_per_row = sum(2 * o * k for o, k in shapes)


def median_time(fn, reps: int = 7) -> float:  # noqa: ANN001
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


for m in [1, 2, 4, 8, 12, 15, 16, 24, 32, 64, 256]:
    xs = {k: torch.randn(m, k) for k in (H, FF)}
    t16 = median_time(lambda xs=xs: [ops.linear_bf16(xs[k], w, None, o) for w, (o, k) in zip(p16, shapes)])
    row = f"M={m:4}: bf16 {t16 * 1e3:7.2f} ms ({flops_per_row * m / t16 / 1e9:4.0f} GFLOP/s)"
    for t, ws in quant.items():
        tq = median_time(lambda xs=xs, ws=ws, t=t: [ops.linear_ggml(xs[k], [w], [int(t)], None, o)
                                                    for w, (o, k) in zip(ws, shapes)])
        row += f"  {t.name} {tq * 1e3:7.2f} ms ({flops_per_row * m / tq / 1e9:4.0f})"
    print(row, flush=True)
