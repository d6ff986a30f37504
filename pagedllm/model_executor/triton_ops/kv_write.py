"""New tokens' K and V into their pool slots, one program per (token, KV head).

Pool layout: [num_blocks, block_size, KVH, D]; slot = block * block_size + offset, so a slot's head vector starts
at (slot * KVH + head) * D. An fp8 pool gets the scale kv_quant.quantize computes: amax / fp8 max, clamped at
1e-30 and rounded to bf16 before the division, stored beside the pool [num_blocks, block_size, KVH].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import fp8_constants, round_fp8, round_mantissa


@triton.jit
def _quantize_store(x, pool, scales, slot, h, d, dm, KVH: tl.constexpr, D: tl.constexpr, FMAX: tl.constexpr,
                    E5M2: tl.constexpr, DROP: tl.constexpr, NORMAL_MIN: tl.constexpr, MAGIC: tl.constexpr):
    xf = x.to(tl.float32)
    amax = tl.max(tl.where(dm, tl.abs(xf), 0.0), axis=0)
    s = round_mantissa(tl.maximum(amax / FMAX, 1e-30), 16)  # to bf16
    tl.store(scales + slot * KVH + h, s.to(tl.bfloat16))
    y = tl.minimum(tl.maximum(xf / s, -FMAX), FMAX)
    y = round_fp8(y, DROP, NORMAL_MIN, MAGIC)
    if E5M2:
        q = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(pool + (slot * KVH + h) * D + d, q, mask=dm)


@triton.jit
def _write_kv(k, v, k_pool, v_pool, k_scale, v_scale, slots, stride_kt, stride_kh, stride_vt, stride_vh,
              KVH: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, FMAX: tl.constexpr,
              E5M2: tl.constexpr, DROP: tl.constexpr, NORMAL_MIN: tl.constexpr, MAGIC: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots + t).to(tl.int64)
    if slot < 0:  # a padded row of a captured batch writes nowhere
        return
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    kx = tl.load(k + t * stride_kt + h * stride_kh + d, mask=dm, other=0.0)
    vx = tl.load(v + t * stride_vt + h * stride_vh + d, mask=dm, other=0.0)
    if FP8:
        _quantize_store(kx, k_pool, k_scale, slot, h, d, dm, KVH, D, FMAX, E5M2, DROP, NORMAL_MIN, MAGIC)
        _quantize_store(vx, v_pool, v_scale, slot, h, d, dm, KVH, D, FMAX, E5M2, DROP, NORMAL_MIN, MAGIC)
    else:
        dst = (slot * KVH + h) * D + d
        tl.store(k_pool + dst, kx.to(k_pool.dtype.element_ty), mask=dm)
        tl.store(v_pool + dst, vx.to(v_pool.dtype.element_ty), mask=dm)


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """k, v: [T, KVH, D] (head rows contiguous) into the pools [NB, BS, KVH, D] at slots [T]. With scales the
    pools are fp8 (e4m3fn or e5m2) and the scales [NB, BS, KVH] bf16."""
    t, kvh, d = k.shape
    if t == 0:
        return
    fp8 = k_scale is not None
    e5m2 = k_pool.dtype == torch.float8_e5m2
    fmax = torch.finfo(k_pool.dtype).max if fp8 else 0.0
    kp, vp = (k_pool.view(torch.uint8), v_pool.view(torch.uint8)) if fp8 else (k_pool, v_pool)
    _write_kv[(t, kvh)](k, v, kp, vp, k_scale, v_scale, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                        kvh, d, triton.next_power_of_2(d), fp8, fmax, e5m2, *fp8_constants(e5m2))


@triton.jit
def _rope_write_kv(qkv, cos, sin, q_out, k_pool, v_pool, k_scale, v_scale, slots, stride_t, stride_c,
                   H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                   FMAX: tl.constexpr, E5M2: tl.constexpr, DROP: tl.constexpr, NORMAL_MIN: tl.constexpr,
                   MAGIC: tl.constexpr, BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)  # heads: H query heads, then KVH key heads (each with its value head)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    HALF: tl.constexpr = D // 2
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    sign = tl.where(d < HALF, -1.0, 1.0)
    c = tl.load(cos + t * stride_c + d, mask=dm, other=0.0).to(tl.float32)
    s = tl.load(sin + t * stride_c + d, mask=dm, other=0.0).to(tl.float32)
    row = qkv + t * stride_t + j * D
    x = tl.load(row + d, mask=dm, other=0.0).to(tl.float32)
    xp = tl.load(row + partner, mask=dm, other=0.0).to(tl.float32) * sign
    if BF16:  # rounded where the reference rounds: each product, then the sum
        y = round_mantissa(round_mantissa(x * c, 16) + round_mantissa(xp * s, 16), 16)
    else:
        y = x * c + xp * s
    if j < H:
        tl.store(q_out + (t * H + j) * D + d, y.to(q_out.dtype.element_ty), mask=dm)
    else:
        h = j - H
        slot = tl.load(slots + t).to(tl.int64)
        if slot >= 0:  # a padded row of a captured batch writes nowhere
            v = tl.load(qkv + t * stride_t + (H + KVH + h) * D + d, mask=dm, other=0.0)
            if FP8:
                _quantize_store(y, k_pool, k_scale, slot, h, d, dm, KVH, D, FMAX, E5M2, DROP, NORMAL_MIN, MAGIC)
                _quantize_store(v, v_pool, v_scale, slot, h, d, dm, KVH, D, FMAX, E5M2, DROP, NORMAL_MIN, MAGIC)
            else:
                dst = (slot * KVH + h) * D + d
                tl.store(k_pool + dst, y.to(qkv.dtype.element_ty).to(k_pool.dtype.element_ty), mask=dm)
                tl.store(v_pool + dst, v.to(v_pool.dtype.element_ty), mask=dm)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                  head_dim: int, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One launch for a layer's rope and K/V write: qkv [T, (H + 2 KVH) D] (rows contiguous), cos and sin [T, D]
    (the reference's tables, rows contiguous) -> q after rope [T, H, D]; k after rope and v into the pools at
    slots [T] (a slot < 0 is skipped), quantized where the pools are fp8 (scales given)."""
    t = qkv.shape[0]
    q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    fp8 = k_scale is not None
    e5m2 = k_pool.dtype == torch.float8_e5m2
    kp, vp = (k_pool.view(torch.uint8), v_pool.view(torch.uint8)) if fp8 else (k_pool, v_pool)
    _rope_write_kv[(t, num_heads + num_kv_heads)](
        qkv, cos, sin, q, kp, vp, k_scale, v_scale, slots, qkv.stride(0), cos.stride(0), num_heads, num_kv_heads,
        head_dim, triton.next_power_of_2(head_dim), fp8, torch.finfo(k_pool.dtype).max if fp8 else 0.0, e5m2,
        *fp8_constants(e5m2), qkv.dtype == torch.bfloat16)
    return q
