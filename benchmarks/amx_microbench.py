"""The bf16 linear (csrc/linear_bf16.cpp) on AMX tiles against the same library built without them
(-mno-amx-tile: its AVX512-BF16 vdpbf16ps micro-kernel) and torch's own bf16 linear (oneDNN), at
SmolLM2-135M's layer shapes from one decode row to a 2048-token chunk; median of 15 after a warm-up.
Needs a CPU with AMX-BF16 (Sapphire Rapids or later) for the first column to be AMX.
Run: .venv/bin/python benchmarks/amx_microbench.py"""

import torch

from pagedllm.bench.common import median_time
from pagedllm.platforms.cpu import build_ops, load_ops

amx, no_amx = load_ops(), build_ops(("-mno-amx-tile",))
print(f"paths: {amx.linear_bf16_isa} vs {no_amx.linear_bf16_isa} vs torch {torch.__version__}")

SHAPES = [(1, 576, 3072), (4, 576, 3072), (8, 576, 3072), (11, 576, 960), (16, 576, 3072), (32, 576, 960),
          (64, 576, 3072), (256, 576, 1536), (2048, 576, 960), (2048, 576, 3072), (2048, 1536, 576)]


def one_shape(m: int, k: int, o: int) -> list[float]:
    x, w = torch.randn(m, k), torch.randn(o, k)
    packed, xb, wb = amx.pack_bf16(w), x.bfloat16(), w.bfloat16()
    runs = [lambda: amx.linear_bf16(x, packed, None, o), lambda: no_amx.linear_bf16(x, packed, None, o),
            lambda: torch.nn.functional.linear(xb, wb)]
    return [median_time(f, 15) for f in runs]


for m, k, o in SHAPES:
    gflop = 2 * m * k * o / 1e9
    row = one_shape(m, k, o)
    print(f"M={m:5d} K={k:5d} O={o:5d}: " + "  ".join(f"{t * 1e3:8.3f} ms {gflop / t:6.0f} GF/s" for t in row))
