"""Optional C++ kernels (paged attention, packed-weight linear, fused norm/rope/activation,
argmax), built on first use with torch's own extension tooling and cached in
TORCH_EXTENSIONS_DIR. If the build is not possible, or PAGEDLLM_NO_CPP=1, the pure-torch paths
are used."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from torch import Tensor, nn

log = logging.getLogger("pagedllm")

_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
PANEL = 48  # output columns per packed weight panel (NR in ops.cpp)


def pack_weight(w: Tensor) -> Tensor:
    """[O, K] -> [ceil(O / 48), K, 48]: column panels of w^T, zero-padded, each contiguous."""
    o, k = w.shape
    p = -(-o // PANEL)
    padded = w.new_zeros(p * PANEL, k)
    padded[:o] = w
    return padded.view(p, PANEL, k).transpose(1, 2).contiguous()


def unpack_weight(packed: Tensor, out_features: int) -> Tensor:
    p, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(p * PANEL, k)[:out_features].contiguous()


def pad_bias(b: Tensor) -> Tensor:
    p = -(-b.shape[0] // PANEL)
    padded = b.new_zeros(p * PANEL)
    padded[:b.shape[0]] = b
    return padded


@dataclass(frozen=True)
class Ops:
    paged_attention: object
    packed_linear: object
    silu_and_mul: object
    rms_norm: object
    rope_: object
    argmax_rows: object

    def linear(self, x: Tensor, layer: nn.Linear) -> Tensor:
        """layer.packed_weight / packed_bias were set by LlamaForCausalLM.set_ops."""
        return self.packed_linear(x, layer.packed_weight, layer.packed_bias, layer.out_features)


@cache  # one build per process: the compiled library never changes once loaded
def load_ops() -> Ops | None:
    if os.environ.get("PAGEDLLM_NO_CPP"):
        return None
    try:
        from torch.utils.cpp_extension import load

        src = Path(__file__).parent / "csrc" / "ops.cpp"
        mod = load(name="pagedllm_ops", sources=[str(src)], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                   verbose=False)
        return Ops(mod.paged_attention, mod.packed_linear, mod.silu_and_mul, mod.rms_norm, mod.rope_, mod.argmax_rows)
    except Exception as e:  # noqa: BLE001 - any build failure means: use the torch path
        log.warning("C++ kernels unavailable (%s); using the pure-torch paths", e)
        return None
