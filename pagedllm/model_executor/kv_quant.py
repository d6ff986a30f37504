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
    POOLS = ("k", "v", "k_scale", "v_scale")
    OWN_POOLS = ("k_scale", "v_scale")

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, compute_dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__(num_blocks, block_size, num_kv_heads, head_dim, dtype, compute_dtype, device)
        self.k_scale = torch.zeros((num_blocks, block_size, num_kv_heads), dtype=SCALE_DTYPE, device=device)
        self.v_scale = torch.zeros((num_blocks, block_size, num_kv_heads), dtype=SCALE_DTYPE, device=device)
        self.lut = torch.arange(256, dtype=torch.uint8).view(dtype).float()  # fp8 bits -> value: names the format to the C++ op
        self.e5m2 = dtype == torch.float8_e5m2

    @staticmethod
    def storage_dtype(name: str) -> torch.dtype:
        return FP8_DTYPES[name]

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        scale_bytes = torch.tensor([], dtype=SCALE_DTYPE).element_size()
        return 2 * num_kv_heads * (head_dim * 1 + scale_bytes)

    @staticmethod
    def own_bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_kv_heads * torch.tensor([], dtype=SCALE_DTYPE).element_size()

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

    def copy_block(self, src: int, dst: int) -> None:
        for data in (self.k, self.v):
            data.view(torch.uint8)[dst].copy_(data.view(torch.uint8)[src])
        self.k_scale[dst].copy_(self.k_scale[src])
        self.v_scale[dst].copy_(self.v_scale[src])


# Integer KV blocks as llama.cpp's cache types: 32 values of one K or V head share an fp16 scale d, then the
# values: q8_0 32 int8 (x = d q), q4_0 16 bytes of nibble pairs (value j in the low nibble of byte j, value 16 + j
# in the high one; x = d (q - 8)). A head of D values is D / 32 such blocks, [NB, BS, KVH, D / 32 x bytes] uint8.
# Quantized as gguf-py (hence ggml) does, bit for bit: q8_0 d = amax / 127, q rounded half away from zero;
# q4_0 d = (the value of largest magnitude) / -8, q = trunc(x / d + 8.5) clipped to 15.
#
# What is quantized is each head vector rotated by R, a normalized Hadamard matrix over the head (over its
# largest power-of-two part, block-diagonally, when D is not a power of two), as QuaRot does: a few outlier
# channels, which would set every block's scale and leave the other values a few steps, are spread over all of
# them. R is orthogonal and symmetric (R R = I), so attention needs no unrotated copy: q.k = (q R).(k R) and
# sum p v = (sum p (v R)) R, so the op takes q R and its output is rotated back. Measured on SmolLM2-135M
# (pagedllm eval-kv): q8_0 K + q4_0 V perplexity +4.5% over fp32 KV unrotated, +0.1% rotated; a 32-value R
# (each block on its own) +1.1%.
INT_FORMATS = {"q8_0": 34, "q4_0": 18}  # bytes per 32 values


def quantize_int(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x: [..., D] (D a multiple of 32) -> [..., D / 32 * bytes] uint8 blocks of `fmt`."""
    b = x.float().reshape(*x.shape[:-1], -1, 32)  # [..., D / 32, 32]
    if fmt == "q8_0":
        d = b.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d == 0, 0.0, 1.0 / d)
        v = b * inv
        q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).to(torch.int8).view(torch.uint8)
    else:
        i = b.abs().argmax(-1, keepdim=True)
        d = b.gather(-1, i) / -8
        inv = torch.where(d == 0, 0.0, 1.0 / d)
        n = torch.trunc(b.double() * inv.double() + 8.5).float().clamp(max=15).to(torch.uint8)
        q = n[..., :16] | (n[..., 16:] << 4)
    scale = d.to(torch.float16).view(torch.uint8)  # [..., D / 32, 2]
    return torch.cat([scale, q], -1).flatten(-2)


def dequantize_int(q: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """[..., D / 32 * bytes] uint8 blocks of `fmt` -> [..., D] in dtype."""
    b = q.reshape(*q.shape[:-1], -1, INT_FORMATS[fmt])
    d = b[..., :2].contiguous().view(torch.float16).float()  # [..., D / 32, 1]
    if fmt == "q8_0":
        v = b[..., 2:].contiguous().view(torch.int8).float()
    else:
        n = b[..., 2:]
        v = torch.cat([n & 15, n >> 4], -1).float() - 8
    return (v * d).flatten(-2).to(dtype)


def hadamard(d: int) -> torch.Tensor:
    """[d, d] normalized Sylvester Hadamard matrices of the largest power of two dividing d, block-diagonal."""
    n = d & -d
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return torch.block_diag(*[h / n ** 0.5] * (d // n))


class IntKVCache(KVCache):
    """K and V in q8_0 / q4_0 blocks (each its own format: `formats`) of rotated heads, quantized when written;
    the C++ op reads them in place (attention.cpp), the torch paths through gather."""

    lossy = True
    rotated = True  # attention takes rotate(q) and rotates its output back (the block comment above)
    formats: tuple[str, str] = ("q8_0", "q8_0")  # (K, V): set by int_kv_cache

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, compute_dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        if head_dim % 32:
            raise ValueError(f"{'/'.join(self.formats)} KV needs a head_dim that is a multiple of 32, got {head_dim}")
        kb, vb = (head_dim // 32 * INT_FORMATS[f] for f in self.formats)
        self.k = torch.zeros((num_blocks, block_size, num_kv_heads, kb), dtype=torch.uint8, device=device)
        self.v = torch.zeros((num_blocks, block_size, num_kv_heads, vb), dtype=torch.uint8, device=device)
        self.head_dim, self.compute_dtype, self.block_size = head_dim, compute_dtype, block_size
        self.rotation = hadamard(head_dim).to(device)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> x R in fp32 (R R = I: also the inverse)."""
        return x.float() @ self.rotation

    @classmethod
    def bytes_per_token(cls, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_kv_heads * -(-head_dim // 32) * sum(INT_FORMATS[f] for f in cls.formats)

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for pool, fmt, x in ((self.k, self.formats[0], k), (self.v, self.formats[1], v)):
            pool.view(-1, *pool.shape[2:]).index_copy_(0, slot_mapping, quantize_int(self.rotate(x), fmt))

    def gather(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, nb = block_tables.shape
        out = [self.rotate(dequantize_int(pool[block_tables].view(b, nb * self.block_size, *pool.shape[2:]), fmt,
                                          torch.float32)).to(self.compute_dtype)  # [B, L, KVH, D]
               for pool, fmt in ((self.k, self.formats[0]), (self.v, self.formats[1]))]
        return out[0], out[1]


def int_kv_cache(k_format: str, v_format: str) -> type[IntKVCache]:
    """The cache class of one (K, V) pair of integer formats."""
    for f in (k_format, v_format):
        if f not in INT_FORMATS:
            raise ValueError(f"integer KV formats are {sorted(INT_FORMATS)}, got {f!r}")
    return type(f"IntKVCache_{k_format}_{v_format}", (IntKVCache,), {"formats": (k_format, v_format)})
