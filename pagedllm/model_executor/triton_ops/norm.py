"""RMSNorm with the residual add fused, one program per row: the sum x + residual is written back into the
residual stream and normalized in the same pass, rounded as the torch reference rounds (the sum and the normed
row in the activations' dtype, the statistics in fp32)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import round_mantissa


@triton.jit
def _narrow(x, BF16: tl.constexpr):
    if BF16:
        return round_mantissa(x, 16)
    return x


@triton.jit
def _rms_norm(x, res, w, out, stride_x, stride_r, stride_o, eps, N: tl.constexpr, BLOCK: tl.constexpr,
              HAS_RES: tl.constexpr, BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    cm = c < N
    h = tl.load(x + row * stride_x + c, mask=cm, other=0.0)
    if HAS_RES:
        h = h.to(tl.float32) + tl.load(res + row * stride_r + c, mask=cm, other=0.0).to(tl.float32)
        h = _narrow(h, BF16).to(x.dtype.element_ty)
        tl.store(res + row * stride_r + c, h, mask=cm)
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / N + eps)
    y = _narrow(hf * inv, BF16).to(x.dtype.element_ty).to(tl.float32) * tl.load(w + c, mask=cm, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + c, _narrow(y, BF16).to(out.dtype.element_ty), mask=cm)


def rms_norm(weight: torch.Tensor, eps: float, x: torch.Tensor,
             residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N] -> (norm(residual + x) * weight, residual + x); the sum goes into `residual` in place; without a
    residual, x is the residual stream."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = x2.shape[1]
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x2.shape[0]:
        res = residual.view(-1, n) if residual is not None else x2
        _rms_norm[(x2.shape[0],)](x2, res, weight, out, x2.stride(0), res.stride(0), out.stride(0), eps, n,
                                  triton.next_power_of_2(n), residual is not None, x.dtype == torch.bfloat16)
    return out.view(x.shape), (residual if residual is not None else x)
