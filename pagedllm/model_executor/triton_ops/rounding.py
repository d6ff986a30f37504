"""Narrowing fp32 to nearest, ties to even, in integer arithmetic: the value comes out as an fp32 that the
narrower type holds exactly, so the cast that follows is exact on any target. Triton's interpreter (CPU tensors)
narrows to bf16 by truncation and to fp8 without carrying into the exponent; a GPU rounds; this way both give
torch's bytes."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_mantissa(x, BITS: tl.constexpr):
    """x (fp32) rounded to BITS mantissa bits, to nearest even, as fp32: a normal value of the narrower type,
    which converts to it exactly (the interpreter's own narrowing truncates and drops carries; a GPU's rounds)."""
    DROP: tl.constexpr = 23 - BITS
    KEEP: tl.constexpr = 0xFFFFFFFF - ((1 << DROP) - 1)  # the sign, exponent and kept mantissa bits
    b = x.to(tl.uint32, bitcast=True)
    b = (b + ((1 << (DROP - 1)) - 1) + ((b >> DROP) & 1)) & KEEP
    return b.to(tl.float32, bitcast=True)
