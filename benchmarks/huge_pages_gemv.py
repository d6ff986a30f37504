"""One row of x against Q4_0 weights repacked for this CPU, on 4 KiB pages and on 2 MiB pages, interleaved in one
process: the effect of huge pages on a decode step's weight streaming (kernels.md, huge_pages.h).

Each shape gets enough distinct matrices that every call streams from memory. Both copies sit in 2 MiB-aligned
buffers written after advice: MADV_HUGEPAGE for one, MADV_NOHUGEPAGE for the other (Linux; THP in `madvise` or
`always` mode).

    python benchmarks/huge_pages_gemv.py
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch

from pagedllm.bench.random_gguf import random_tensor
from pagedllm.platforms.cpu import load_ops

HUGE = 2 << 20
MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15


def aligned_copy(t: torch.Tensor, advice: int) -> torch.Tensor:
    """t copied into a 2 MiB-aligned buffer advised `advice` before its first write."""
    buf = torch.empty(t.numel() + HUGE, dtype=torch.uint8)
    p = buf.data_ptr()
    off = ((p + HUGE - 1) & ~(HUGE - 1)) - p
    ctypes.CDLL(None).madvise(ctypes.c_void_p(p + off), ctypes.c_size_t(t.numel()), advice)
    out = buf[off:off + t.numel()].view(t.shape)
    out.copy_(t)
    return out


def main() -> None:
    ops = load_ops()
    rng = np.random.default_rng(0)
    for rows, cols, n in [(1536, 2048, 96), (6144, 2048, 24)]:
        pairs = []
        for _ in range(n):
            w = ops.repack_ggml(torch.from_numpy(random_tensor(rng, rows, cols, "Q4_0", fast=True)), 2)
            pairs.append((aligned_copy(w, MADV_NOHUGEPAGE), aligned_copy(w, MADV_HUGEPAGE)))
        nbytes = pairs[0][0].numel()
        x = torch.randn(1, cols)
        for label, k in (("4 KiB", 0), ("2 MiB", 1)) * 2:
            t = time.perf_counter()
            for pair in pairs:
                ops.linear_ggml(x, [pair[k]], [2 + 1000], [rows], None, rows, 1)
            dt = (time.perf_counter() - t) / n
            print(f"{rows} x {cols} Q4_0, {label} pages: {dt * 1e6:7.1f} us a call, {nbytes / dt / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
