"""Optional C++ kernels, built on first use with torch's own extension tooling (cached in
TORCH_EXTENSIONS_DIR). If the build is not possible the pure-torch path is used."""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path

log = logging.getLogger("pagedllm")

_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


@cache
def paged_attention_op():  # noqa: ANN201
    """The compiled op, or None (PAGEDLLM_NO_CPP=1, or no compiler)."""
    if os.environ.get("PAGEDLLM_NO_CPP"):
        return None
    try:
        from torch.utils.cpp_extension import load

        src = Path(__file__).parent / "csrc" / "paged_attention.cpp"
        mod = load(name="pagedllm_paged_attention", sources=[str(src)], extra_cflags=_FLAGS,
                   extra_ldflags=["-fopenmp"], verbose=False)
        return mod.paged_attention
    except Exception as e:  # noqa: BLE001 - any build failure means: use the torch path
        log.warning("C++ paged attention unavailable (%s); using the pure-torch path", e)
        return None
