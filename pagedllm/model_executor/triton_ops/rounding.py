"""Narrowing fp32 to nearest, ties to even, in integer arithmetic: the value comes out as an fp32 that the
narrower type holds exactly, so the cast that follows is exact on any target. Triton's interpreter (CPU tensors)
narrows to bf16 by truncation and to fp8 without carrying into the exponent; a GPU rounds; this way both give
torch's bytes."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_mantissa(x, DROP: tl.constexpr):
    """x (fp32) rounded to 23 - DROP mantissa bits (bf16 16, fp8 e4m3 20, e5m2 21), to nearest even, as fp32:
    a normal value of the narrower type, which converts to it exactly. Shifts keep it in uint32 (no wide masks)."""
    b = x.to(tl.uint32, bitcast=True)
    b = ((b + ((1 << (DROP - 1)) - 1) + ((b >> DROP) & 1)) >> DROP) << DROP
    return b.to(tl.float32, bitcast=True)


@triton.jit
def round_fp8(y, DROP: tl.constexpr, NORMAL_MIN: tl.constexpr, MAGIC: tl.constexpr):
    """y (fp32, within the format's range) rounded to the nearest fp8 value, ties to even: normals by their
    mantissa, subnormals (below NORMAL_MIN) to multiples of their step by adding MAGIC = 1.5 x 2^23 steps, which
    leaves fp32 no bits below the step, and taking it off again (fp8_constants gives both)."""
    sub = (y + MAGIC) - MAGIC
    return tl.where(tl.abs(y) < NORMAL_MIN, sub, round_mantissa(y, DROP))


def fp8_constants(e5m2: bool) -> tuple[int, float, float]:
    """(DROP, NORMAL_MIN, MAGIC) of round_fp8 for e5m2 (2 mantissa bits, smallest normal 2^-14) or e4m3fn
    (3 bits, 2^-6)."""
    bits, emin = (2, -14) if e5m2 else (3, -6)
    return 23 - bits, 2.0 ** emin, 1.5 * 2.0 ** (23 + emin - bits)
