"""FP8 KV storage (e4m3 or e5m2) with one scale per token and KV head.

Granularity: a bf16 scale per (slot, kv head), computed when the token is written
(scale = amax over head_dim / fp8 max). Why: it needs no calibration data, it follows outlier
tokens (attention-sink tokens have K norms far above the rest, which a per-layer scale would let
crush every other token into a few fp8 steps), and it costs 2 bytes per 64-byte head vector
(3%), so FP8 still holds ~1.94x the tokens of bf16 and ~3.9x of fp32 in the same budget.
The scale is rounded to bf16 before quantizing, so quantize and dequantize use the same value.
"""

from __future__ import annotations

import torch

from .kv_cache import KVCache

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SCALE_DTYPE = torch.bfloat16


def quantize(x: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] -> (q [..., D] fp8, scale [...] bf16) with x ~= q * scale."""
    fmax = torch.finfo(fp8).max
    amax = x.abs().amax(-1).float()
    scale = (amax / fmax).clamp(min=1e-30).to(SCALE_DTYPE)
    q = (x.float() / scale.float().unsqueeze(-1)).clamp(-fmax, fmax).to(fp8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


class FP8KVCache(KVCache):
    lossy = True  # attention always reads what the cache holds, so fp8 affects every token

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
        super().__init__(num_blocks, block_size, num_kv_heads, head_dim, dtype, compute_dtype)
        self.k_scale = torch.zeros((num_blocks, block_size, num_kv_heads), dtype=SCALE_DTYPE)
        self.v_scale = torch.zeros((num_blocks, block_size, num_kv_heads), dtype=SCALE_DTYPE)
        self.lut = torch.arange(256, dtype=torch.uint8).view(dtype).float()  # fp8 bits -> value, for the C++ op

    @staticmethod
    def storage_dtype(name: str) -> torch.dtype:
        return FP8_DTYPES[name]

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        scale_bytes = torch.tensor([], dtype=SCALE_DTYPE).element_size()
        return 2 * num_kv_heads * (head_dim * 1 + scale_bytes)

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for data, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = quantize(x, data.dtype)  # q: [T, KVH, D], s: [T, KVH]
            # fp8 has few CPU kernels: move the bytes as uint8
            data.view(torch.uint8).view(-1, *data.shape[2:]).index_copy_(0, slot_mapping, q.view(torch.uint8))
            scales.view(-1, scales.shape[-1]).index_copy_(0, slot_mapping, s)

    def op_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                               torch.Tensor | None]:
        return self.k.view(torch.uint8), self.v.view(torch.uint8), self.k_scale, self.v_scale, self.lut

    def gather(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, nb = block_tables.shape
        n = nb * self.block_size
        out = []
        for data, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            q = data.view(torch.uint8)[block_tables].view(data.dtype).view(b, n, *data.shape[2:])  # [B, L, KVH, D]
            s = scales[block_tables].view(b, n, scales.shape[-1])  # [B, L, KVH]
            out.append(dequantize(q, s, self.compute_dtype))
        return out[0], out[1]

    def pools(self) -> list[torch.Tensor]:
        return [*super().pools(), self.k_scale.view(torch.uint8), self.v_scale.view(torch.uint8)]

    def copy_block(self, src: int, dst: int) -> None:
        for data in (self.k, self.v):
            data.view(torch.uint8)[dst].copy_(data.view(torch.uint8)[src])
        self.k_scale[dst].copy_(self.k_scale[src])
        self.v_scale[dst].copy_(self.v_scale[src])
