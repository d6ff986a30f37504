"""Attention over block tables.

The KV pool of a layer is `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V.
Each step the new tokens' K/V are written to their slots (block_id * block_size + offset), then
every sequence attends over its own blocks:
* sequences with one new token (decodes) are batched: their blocks are gathered into a padded
  `[B, max_blocks * block_size]` context and masked by context length;
* prefill chunks run one sequence at a time; a fresh prompt with nothing cached uses plain
  causal attention on its own new K/V, a chunk that starts mid-sequence gathers its blocks and
  is masked causally with the right offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .kv_cache import KVCache


@dataclass
class PrefillSeq:
    q_start: int
    q_len: int
    ctx_len: int
    block_table: torch.Tensor  # [num_blocks_of_seq]
    mask: torch.Tensor | None  # [1, 1, q_len, ctx_len] bool, None: causal on new tokens only


@dataclass
class AttentionMetadata:
    """Per-step context shared by all layers; built once by the model runner."""

    slot_mapping: torch.Tensor  # [num_tokens]
    num_decodes: int  # the first num_decodes rows of the batch are single-token sequences
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks]
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size]
    prefills: list[PrefillSeq] = field(default_factory=list)


def build_mask(q_len: int, ctx_len: int, sliding_window: int | None) -> torch.Tensor | None:
    """Causal mask of a chunk whose q_len tokens are the last of ctx_len; None when plain
    causal attention over the chunk alone is exact (nothing before it, no window)."""
    start = ctx_len - q_len
    if start == 0 and (sliding_window is None or ctx_len <= sliding_window):
        return None
    q_pos = torch.arange(start, ctx_len).unsqueeze(1)  # [q_len, 1]
    k_pos = torch.arange(ctx_len).unsqueeze(0)  # [1, ctx_len]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask.view(1, 1, q_len, ctx_len)


def build_decode_mask(ctx_lens: list[int], width: int, sliding_window: int | None) -> torch.Tensor:
    lens = torch.tensor(ctx_lens).unsqueeze(1)  # [B, 1]
    k_pos = torch.arange(width).unsqueeze(0)  # [1, width]
    mask = k_pos < lens
    if sliding_window is not None:
        mask &= k_pos >= lens - sliding_window
    return mask.view(len(ctx_lens), 1, 1, width)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] of the new tokens. Returns [T, H, D]."""
    cache.write(meta.slot_mapping, k, v)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        kc, vc = cache.gather(meta.decode_block_tables)  # [B, L, KVH, D]
        qd = q[:nd].unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(
            qd, kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=meta.decode_mask,
            scale=scale, enable_gqa=True)  # [B, H, 1, D]
        out[:nd] = o.squeeze(2)
    for p in meta.prefills:
        sl = slice(p.q_start, p.q_start + p.q_len)
        qp = q[sl].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if p.mask is None and not cache.lossy:
            kp, vp = k[sl], v[sl]
        else:
            kp, vp = cache.gather(p.block_table.unsqueeze(0))
            kp, vp = kp[0, :p.ctx_len], vp[0, :p.ctx_len]  # [ctx_len, KVH, D]
        o = F.scaled_dot_product_attention(
            qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
            attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True)
        out[sl] = o[0].transpose(0, 1)
    return out
