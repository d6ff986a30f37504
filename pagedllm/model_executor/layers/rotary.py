"""Rotary position embeddings: the inverse frequencies and attention scale of each rope scaling a config
names (default, linear, llama3, LongRoPE, YaRN), and the head-dim order that makes a partial rotary a full-width
one. The tables themselves are built by the model (cos / sin per position) and applied by the layer backend."""

from __future__ import annotations

import math

import numpy as np
import torch

from ...errors import ModelLoadError
from ..models.config import ModelConfig


def rotary_dim(cfg: ModelConfig) -> int:
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim / 2]: each rotate_half pair's frequency. Under partial rotary the pairs past rotary_dim / 2
    get 0 (cos 1, sin 0: untouched); the model's loader has ordered each head's q/k dims so that its rotary
    pairs come first (see `partial_rotary_order`)."""
    inv_freq = _rotary_inv_freq(cfg)
    return torch.cat((inv_freq, inv_freq.new_zeros(cfg.head_dim // 2 - inv_freq.shape[0])))


def rope_attention_scale(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] multiplier of the cos / sin tables: LongRoPE's attention factor on the rotary pairs only."""
    s, n_rot = cfg.rope_scaling or {}, rotary_dim(cfg) // 2
    scale = torch.ones(cfg.head_dim // 2)
    kind = s.get("rope_type", s.get("type"))
    if kind in ("longrope", "yarn"):
        factor = s.get("factor") or cfg.max_position_embeddings / s["original_max_position_embeddings"]
        attention = s.get("attention_factor")
        if attention is None and kind == "longrope":
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(s["original_max_position_embeddings"]))
        elif attention is None and s.get("mscale") and s.get("mscale_all_dim"):
            attention = _yarn_mscale(factor, s["mscale"]) / _yarn_mscale(factor, s["mscale_all_dim"])
        elif attention is None:
            attention = _yarn_mscale(factor)
        scale[:n_rot] = attention
    return scale


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(s: dict, d: int, theta: float, base: torch.Tensor) -> torch.Tensor:
    """YaRN: the high-frequency pairs (more than beta_fast turns over the original context) keep their frequency,
    the low ones (under beta_slow turns) are divided by the factor, a linear ramp in between."""
    factor, orig = s["factor"], s["original_max_position_embeddings"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def pair_of(turns: float) -> float:  # the (fractional) pair index that turns `turns` times over orig positions
        return d * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = pair_of(fast), pair_of(slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)  # [d / 2]: 0 keep, 1 scale
    return (1.0 / (factor * base)) * ramp + (1.0 / base) * (1 - ramp)


def partial_rotary_order(head_dim: int, rot: int) -> torch.Tensor:
    """The order of a head's dims that puts HF's partial-rotary pairs (i, i + rot / 2), i < rot / 2, at rotate_half's
    full-width pairs (i, i + head_dim / 2) and the unrotated dims in the remaining slots: q and k are reordered
    alike (their dot product is unchanged), so the full-width rope kernels rotate exactly HF's dims."""
    half, rest = rot // 2, (head_dim - rot) // 2
    first = [*range(half), *range(rot, rot + rest)]
    second = [*range(half, rot), *range(rot + rest, head_dim)]
    return torch.tensor(first + second)


def partial_rotary_rows(head_dim: int, rot: int, heads: int, stride: int, n: int) -> np.ndarray:
    """Row order of a q/k weight of n rows whose first `heads` heads start `stride` rows apart: each head's first
    head_dim rows in partial_rotary_order (a head's rows past them, and rows past the heads, kept in place)."""
    head = np.concatenate([partial_rotary_order(head_dim, rot).numpy(), np.arange(head_dim, stride)])
    return np.concatenate([h * stride + head for h in range(heads)] + [np.arange(heads * stride, n)])


def llama3_scaling_from_factors(factors: list[float], rot_dim: int, theta: float,
                                original_context: int = 8192) -> dict | None:
    """The llama3 rope scaling that llama.cpp's converter stores as per-pair divisors of the frequencies (a GGUF's
    `rope_freqs`: 1 for the fast pairs, the factor for the slow ones, a ramp between), as HF's config states it;
    None where every divisor is 1. The ramp is linear in 1 / wavelength, so two of its pairs fix it, and any original
    context gives the same frequencies with the matching low / high frequency factors: `original_context` is kept.
    Raises ModelLoadError where the divisors are not of that form (checked pair by pair against what it gives)."""
    n = rot_dim // 2
    if len(factors) != n:
        raise ModelLoadError(f"rope_freqs holds {len(factors)} values for {n} rotary pairs")
    factor = max(factors)
    if factor == 1.0:
        return None
    x = [theta ** (-2 * i / rot_dim) / (2 * math.pi) for i in range(n)]  # 1 / wavelength of each pair
    # on the ramp: 1 / f = (1 - s) / factor + s, with s = (orig / wavelength - low) / (high - low), linear in x
    ramp = [(xi, (1 / f - 1 / factor) / (1 - 1 / factor)) for xi, f in zip(x, factors) if 1.0 < f < factor]
    if len(ramp) >= 2:
        (x0, s0), (x1, s1) = ramp[0], ramp[-1]
        slope = (s1 - s0) / (x1 - x0)
        x_low, x_high = x0 - s0 / slope, x0 + (1 - s0) / slope  # where s is 0 and 1
    else:  # no ramp pairs to fit: its ends between the last slow pair and the first fast one
        slow = max(xi for xi, f in zip(x, factors) if f == factor)
        fast = min(xi for xi, f in zip(x, factors) if f == 1.0)
        x_low, x_high = slow + (fast - slow) / 3, slow + 2 * (fast - slow) / 3
    out = {"rope_type": "llama3", "factor": factor, "low_freq_factor": x_low * original_context,
           "high_freq_factor": x_high * original_context, "original_max_position_embeddings": original_context}
    inv = theta ** -(torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    given = torch.tensor(factors, dtype=torch.float64)
    off = ((inv / _llama3_inv_freq(inv, out) - given).abs() > 1e-4 * given).nonzero()
    if len(off):
        i = int(off[0])
        raise ModelLoadError(f"rope_freqs {factors} are not llama3 rope scaling's (pair {i}: {factors[i]}); "
                             "other per-pair rope factors are not supported")
    return out


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3's rope scaling of the frequencies: the slow pairs divided by the factor, the fast ones kept, a ramp
    in 1 / wavelength between."""
    factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    lo_wavelen, hi_wavelen = old_len / lo, old_len / hi
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > lo_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < hi_wavelen) & ~(wavelen > lo_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotary_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = rotary_dim(cfg)
    base = cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)  # [d / 2]
    inv_freq = 1.0 / base
    s = cfg.rope_scaling
    if not s:
        return inv_freq
    kind = s.get("rope_type", s.get("type"))
    if kind == "longrope":  # the long factors where the model chose them for a context past the original (phi3.py)
        return 1.0 / (torch.tensor(s["long_factor" if s.get("long") else "short_factor"], dtype=torch.float32) * base)
    if kind == "linear":
        return inv_freq / s["factor"]
    if kind == "yarn":
        return _yarn_inv_freq(s, d, cfg.rope_theta, base)
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, s)
    raise ModelLoadError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3, longrope, yarn)")
