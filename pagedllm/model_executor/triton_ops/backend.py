"""The Triton backend: the torch reference's layer compute (GEMMs through torch, i.e. cuBLAS on a GPU), with
the K/V write, attention over the pool and RMSNorm + residual in Triton kernels. Every row of a step goes to the
kernels (the metadata builder gives them all, `all_rows`); pools the kernels do not read (q8_0 / q4_0) take the
torch reference's path."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..attention import AttentionMetadata
from ..kv_cache import KVCache
from ..layers.backends import TorchReference
from .attention import attend
from .kv_write import rope_write_kv
from .norm import rms_norm


class TritonKernels(TorchReference):
    name = "triton"
    all_rows = True  # the metadata builder hands every row to the kernels

    def __init__(self, programs: int) -> None:
        self.programs = programs  # the device's parallel units (x2), for the decode split

    def paged_ops(self, cache: KVCache, head_dim: int, heads_per_kv: int) -> tuple[Callable | None, bool]:
        from ..kv_quant import IntKVCache

        return (None, False) if isinstance(cache, IntKVCache) else (attend, False)

    def rms_norm(self, weight: torch.Tensor, eps: float, x: torch.Tensor,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(weight, eps, x, residual)

    def attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                  head_dim: int, cache: KVCache, meta: AttentionMetadata, scale: float,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        rows = meta.device_rows
        if rows is None:  # a pool the kernels do not read
            return super().attention(qkv, cos, sin, num_heads, num_kv_heads, head_dim, cache, meta, scale, sinks)
        t = qkv.shape[0]
        k_scale = getattr(cache, "k_scale", None)
        v_scale = getattr(cache, "v_scale", None)
        qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
        q = rope_write_kv(qkv, cos.reshape(t, -1), sin.reshape(t, -1), num_heads, num_kv_heads, head_dim, cache.k,
                          cache.v, meta.slot_mapping, k_scale, v_scale)  # [T, H, D]
        out = torch.empty_like(q)
        attend(out, q, cache.k, cache.v, rows, scale, meta.sliding_window, sinks, k_scale, v_scale, self.programs)
        return out
