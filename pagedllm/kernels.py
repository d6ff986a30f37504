"""Optional C++ kernels (paged attention, skinny linear, fused norm/rope/activation, argmax), built on first use with torch's own
extension tooling and cached in TORCH_EXTENSIONS_DIR. If the build is not possible, or
PAGEDLLM_NO_CPP=1, the pure-torch paths are used."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import Tensor
from torch.nn import functional as F

log = logging.getLogger("pagedllm")

_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
SKINNY_MAX_ROWS = 160  # measured on SmolLM2 shapes: the kernel beats MKL up to ~192 rows, MKL wins from ~256
SKINNY_MAX_ROWS_LM_HEAD = 256  # the 49k-row lm_head: crossover between 256 and 512 rows


@dataclass(frozen=True)
class Ops:
    paged_attention: object
    skinny_linear: object
    silu_and_mul: object
    rms_norm: object
    rope_: object
    argmax_rows: object

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, max_rows: int = SKINNY_MAX_ROWS) -> Tensor:
        if x.shape[0] <= max_rows and x.dtype == weight.dtype == torch.float32:
            return self.skinny_linear(x, weight, bias)
        return F.linear(x, weight, bias)


@cache  # one build per process: the compiled library never changes once loaded
def load_ops() -> Ops | None:
    if os.environ.get("PAGEDLLM_NO_CPP"):
        return None
    try:
        from torch.utils.cpp_extension import load

        src = Path(__file__).parent / "csrc" / "ops.cpp"
        mod = load(name="pagedllm_ops", sources=[str(src)], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                   verbose=False)
        return Ops(mod.paged_attention, mod.skinny_linear, mod.silu_and_mul, mod.rms_norm, mod.rope_, mod.argmax_rows)
    except Exception as e:  # noqa: BLE001 - any build failure means: use the torch path
        log.warning("C++ kernels unavailable (%s); using the pure-torch paths", e)
        return None
