"""What a bf16 linear spends rounding its fp32 activations to bf16 pairs (csrc/bf16_tile.h `pairs`): linear_bf16
at 2048 rows through one 48-column panel, where the rounding is nearly all the work, next to the whole layer
shape and torch's own .bfloat16() of the same activations; best of 10.
Run: .venv/bin/python benchmarks/activation_rounding_microbench.py"""

import time

import torch

from pagedllm.platforms.cpu import load_ops

ops = load_ops()


def best(f, reps: int = 10) -> float:
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


for k, o in ((576, 3072), (1536, 576)):  # gate_up's and down's inputs in SmolLM2-135M
    x = torch.randn(2048, k)
    for cols in (48, o):
        packed = ops.pack_bf16(torch.randn(cols, k))
        print(f"K={k:5d} O={cols:5d}: {best(lambda x=x, w=packed, n=cols: ops.linear_bf16(x, w, None, n)) * 1e3:6.2f} ms")
    print(f"  torch .bfloat16() of x: {best(lambda x=x: x.bfloat16()) * 1e3:.2f} ms")
