"""Attention over block tables.

The KV pool of a layer is `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V.
Each step the new tokens' K/V are written to their slots (block_id * block_size + offset), then
every sequence attends over its own blocks. The rows of a step are ordered:
1. "paged" rows: decodes and prefill chunks that start mid-sequence. They attend over the pool.
   With the C++ op (fp32 model; fp32, bf16, fp8, q8_0 or q4_0 pool) all of them go through one call that reads K/V rows straight
   from their blocks. Otherwise (pure torch): decodes are batched over gathered blocks masked by
   context length, and each mid-sequence chunk gathers its blocks under an offset causal mask.
2. prefills: fresh prompts (nothing cached before them) and long mid-sequence chunks. Over a bf16 pool
   with the C++ op, one call attends them all on bf16 dot products, K/V read from the pool (q and p
   rounded to bf16, as the op's paged rows do for that pool); over an fp8 or q8_0 / q4_0 pool the same call
   where the CPU has bf16 dot products, the blocks widened and rounded to bf16 as it gathers them. Otherwise
   SDPA: fresh prompts on their own new K/V, chunks on their gathered blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..platforms.cpu import Ops
from .kv_cache import KVCache
from .kv_quant import FP8KVCache


@dataclass
class PrefillSeq:
    q_start: int
    q_len: int
    ctx_len: int
    block_table: torch.Tensor  # [num_blocks_of_seq]
    mask: torch.Tensor | None  # [1, 1, q_len, ctx_len] bool; None: causal over the new tokens alone


@dataclass
class PagedRows:
    """Inputs of the C++ op for rows [0, num_rows)."""

    num_rows: int
    block_tables: torch.Tensor  # [S, max_blocks] int64
    row_seq: torch.Tensor  # [num_rows] int64
    q_start: torch.Tensor  # [S]
    q_len: torch.Tensor  # [S]
    ctx_len: torch.Tensor  # [S]


@dataclass
class ChunkRows:
    """Prefill chunks (meta.prefills) for the C++ chunk kernel of a bf16 or integer pool."""

    block_tables: torch.Tensor  # [P, max_blocks] int64
    q_start: torch.Tensor  # [P]
    q_len: torch.Tensor  # [P]
    ctx_len: torch.Tensor  # [P]
    scratch: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))  # the op grows it once a step


@dataclass
class AttentionMetadata:
    """Per-step context shared by all layers; built once by the model runner."""

    slot_mapping: torch.Tensor  # [num_tokens]
    num_decodes: int  # the first num_decodes rows are single-token sequences
    # the leading rows that compute output tokens of generating sequences: the decodes, then speculative rows
    # (a weight format may run them on its decode path; prompt rows never take it, so a prompt's logits do not
    # depend on how it was chunked or cached)
    num_decode_rows: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] (torch path)
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size] (torch path)
    prefills: list[PrefillSeq] = field(default_factory=list)
    paged: PagedRows | None = None  # set when the C++ op serves the paged rows
    chunks: ChunkRows | None = None  # set when the C++ chunk kernel serves the prefills (bf16, integer pools)
    sliding_window: int | None = None
    op: Callable | None = None
    decode_ctx_lens: list[int] = field(default_factory=list)  # the decodes' context lengths (torch path's masks)
    _windows: dict = field(default_factory=dict, repr=False)  # window -> this step's metadata for it
    # per layer, when the layout has several groups: the metadata over that layer's group's tables
    layer_meta: list[AttentionMetadata] | None = field(default=None, repr=False)
    state_seqs: list = field(default_factory=list)  # linear-attention layers' sequences (gated_delta_net.StateSeq)
    device_rows: object | None = None  # every row for a device's kernels (triton_ops.attention.StepRows)

    def for_layer(self, index: int) -> AttentionMetadata:
        return self if self.layer_meta is None else self.layer_meta[index]

    def for_window(self, window: int | None) -> AttentionMetadata:
        """This step's metadata for a layer that attends over `window` tokens (None: all): the same rows and
        tables, masks built for that window once a step (models whose layers differ: Gemma 3, gpt-oss)."""
        if window == self.sliding_window:
            return self
        view = self._windows.get(window)
        if view is None:
            dev = self.slot_mapping.device
            prefills = [dataclasses.replace(p, mask=build_mask(p.q_len, p.ctx_len, window, dev)) for p in self.prefills]
            view = dataclasses.replace(self, sliding_window=window, prefills=prefills, _windows={}, layer_meta=None)
            if self.decode_mask is not None:
                view.decode_mask = build_decode_mask(self.decode_ctx_lens, self.decode_mask.shape[-1], window, dev)
            self._windows[window] = view
        return view


def build_mask(q_len: int, ctx_len: int, sliding_window: int | None,
               device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Causal mask of a chunk whose q_len tokens are the last of ctx_len; None when plain
    causal attention over the chunk alone is exact (nothing before it, no window)."""
    start = ctx_len - q_len
    if start == 0 and (sliding_window is None or ctx_len <= sliding_window):
        return None
    q_pos = torch.arange(start, ctx_len, device=device).unsqueeze(1)  # [q_len, 1]
    k_pos = torch.arange(ctx_len, device=device).unsqueeze(0)  # [1, ctx_len]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask.view(1, 1, q_len, ctx_len)


def build_decode_mask(ctx_lens: list[int], width: int, sliding_window: int | None,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    lens = torch.tensor(ctx_lens, device=device).unsqueeze(1)  # [B, 1]
    k_pos = torch.arange(width, device=device).unsqueeze(0)  # [1, width]
    mask = k_pos < lens
    if sliding_window is not None:
        mask &= k_pos >= lens - sliding_window
    return mask.view(len(ctx_lens), 1, 1, width)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool, scale: float,
         sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA with grouped KV heads; q [B, H, L, D], k and v [B, KVH, S, D]. sinks [H]: each head's attention sink,
    one more logit in the softmax with no value (gpt-oss), which SDPA has no argument for: spelled out then."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)).float() * scale  # [B, H, L, S]
    if is_causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*s.shape[:3], 1)  # [B, H, L, 1]
    p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]
    return (p.to(v.dtype) @ v).to(q.dtype)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, scale: float, sinks: torch.Tensor | None = None,
                    written: bool = False) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] of the new tokens (in the pool already where written); sinks [H] fp32 or
    None. Returns [T, H, D]."""
    if not written:
        cache.write(meta.slot_mapping, k, v)
    out = torch.empty_like(q)
    p = meta.paged
    if p is not None:
        n = p.num_rows
        _attend_paged_rows(cache.rotate(q[:n]) if cache.rotated else q[:n], cache, meta, scale, out, sinks)
        if cache.rotated:  # sum p (v R) = (sum p v) R
            out[:n] = cache.rotate(out[:n])
    elif meta.num_decodes:
        nd = meta.num_decodes
        kc, vc = cache.gather(meta.decode_block_tables)  # [B, L, KVH, D]
        o = sdpa(q[:nd].unsqueeze(2), kc.transpose(1, 2), vc.transpose(1, 2),  # q: [B, H, 1, D]
                 meta.decode_mask, False, scale, sinks)  # [B, H, 1, D]
        out[:nd] = o.squeeze(2)
    _attend_prefills(q, k, v, cache, meta, scale, out, sinks)
    return out


def attention_from_qkv(ops: Ops, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                       cache: KVCache, meta: AttentionMetadata, scale: float,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The C++ path from a layer's fused qkv [T, (H + 2 KVH) D]: rope, the K/V write and the paged rows in
    one call where the pool stores K/V as computed (fp32, bf16; fp8 and integer pools are written by their cache), then
    SDPA for fresh prompts. cos, sin: [T, D / 2]. Returns [T, H, D]."""
    t, kvh, d = qkv.shape[0], cache.k.shape[2], cache.head_dim

    def heads() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, H, D], k and v [T, KVH, D]: views
        q, k, v = qkv.split([num_heads * d, kvh * d, kvh * d], dim=-1)
        return q.view(t, num_heads, d), k.view(t, kvh, d), v.view(t, kvh, d)

    if meta.op is not None and cache.rotated:
        ops.rope_(qkv, cos, sin, num_heads + kvh, d)
        return _attend_rotated(ops, qkv, heads(), cache, meta, scale, sinks)
    if meta.op is None or cache.lossy:
        ops.rope_(qkv, cos, sin, num_heads + kvh, d)
        q, k, v = heads()
        fp8 = isinstance(cache, FP8KVCache)
        if fp8:  # the C++ writer: kv_quant.quantize's bytes, without a dozen torch calls a layer
            ops.quantize_fp8_kv_(cache.k.view(torch.uint8), cache.k_scale, meta.slot_mapping, k, cache.e5m2)
            ops.quantize_fp8_kv_(cache.v.view(torch.uint8), cache.v_scale, meta.slot_mapping, v, cache.e5m2)
        out = paged_attention(q, k, v, cache, meta, scale, sinks, written=fp8)
        if meta.chunks is not None:  # an fp8 pool's prompts
            _attend_chunks(ops, q, cache, meta, scale, out, sinks)
        return out
    p = meta.paged
    rows, tables = (p.num_rows, (p.block_tables, p.row_seq, p.q_start, p.q_len, p.ctx_len)) if p else (0, (None,) * 5)
    c = meta.chunks
    chunks = (c.block_tables, c.q_start, c.q_len, c.ctx_len, c.scratch) if c else (None,) * 5
    out = ops.attention_qkv(qkv, cos, sin, cache.k, cache.v, meta.slot_mapping, num_heads, rows, *tables, scale,
                            meta.sliding_window or 0, *chunks, sinks)
    if meta.prefills and c is None:
        _attend_prefills(*heads(), cache, meta, scale, out, sinks)
    return out


def _attend_rotated(ops: Ops, qkv: torch.Tensor, heads: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cache: KVCache,
                    meta: AttentionMetadata, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """paged_attention over a rotated integer pool with the C++ ops: q, k and v rotated by one product, k and v
    quantized into the pool by the op (kv_quant.cpp, quantize_int's bytes), the paged rows attended in that basis
    and rotated back; prompts by the chunk kernel where the metadata has chunks (in the same basis), else as
    paged_attention's. qkv [T, (H + 2 KVH) D] after rope; heads: its views q [T, H, D],
    k and v [T, KVH, D]."""
    q, k, v = heads
    h, kvh = q.shape[1], k.shape[1]
    rot = cache.rotate(qkv.reshape(q.shape[0], h + 2 * kvh, -1))  # [T, H + 2 KVH, D]
    qr, kr, vr = rot.split([h, kvh, kvh], 1)
    ops.quantize_kv_(cache.k, meta.slot_mapping, kr)
    ops.quantize_kv_(cache.v, meta.slot_mapping, vr)
    out = torch.empty_like(q)
    n = meta.paged.num_rows if meta.paged is not None else 0
    if n:
        _attend_paged_rows(qr[:n], cache, meta, scale, out, sinks)
        out[:n] = cache.rotate(out[:n])  # sum p (v R) = (sum p v) R
    if meta.chunks is not None:
        _attend_chunks(ops, qr, cache, meta, scale, out, sinks)
        out[n:] = cache.rotate(out[n:])
    else:
        _attend_prefills(q, k, v, cache, meta, scale, out, sinks)
    return out


def _attend_chunks(ops: Ops, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                   sinks: torch.Tensor | None) -> None:
    """The chunk kernel for the rows of meta.chunks (every row after the paged ones), q [T, H, D] in the pool's basis,
    into out: it widens the blocks of an fp8 or integer pool as it gathers them."""
    c = meta.chunks
    k_pool, v_pool, k_scale, v_scale, lut = cache.op_args()
    ops.attend_chunks(out, q, k_pool, v_pool, c.block_tables, c.q_start, c.q_len, c.ctx_len, scale,
                      meta.sliding_window or 0, c.scratch, sinks, k_scale, v_scale, lut)


def _attend_paged_rows(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                       sinks: torch.Tensor | None) -> None:
    """The C++ op over the pool for the paged rows, q [n, H, D] in the pool's basis (q R for a rotated pool),
    into out[:n]."""
    p = meta.paged
    k_pool, v_pool, k_scale, v_scale, lut = cache.op_args()
    meta.op(out[:p.num_rows], q, k_pool, v_pool, p.block_tables, p.row_seq, p.q_start, p.q_len, p.ctx_len, scale,
            meta.sliding_window or 0, k_scale, v_scale, lut, sinks)


def _attend_prefills(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                     scale: float, out: torch.Tensor, sinks: torch.Tensor | None) -> None:
    """SDPA for the rows of meta.prefills (their K/V already in the pool), into out."""
    for s in meta.prefills:
        sl = slice(s.q_start, s.q_start + s.q_len)
        qs = q[sl].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if s.mask is None and not cache.lossy:
            ks, vs = k[sl], v[sl]
            if cache.k.dtype != ks.dtype:  # attend to what the pool holds (rounded), as chunks and prefix hits do
                ks, vs = ks.to(cache.k.dtype).to(ks.dtype), vs.to(cache.v.dtype).to(vs.dtype)
        else:
            ks, vs = cache.gather(s.block_table.unsqueeze(0))
            ks, vs = ks[0, :s.ctx_len], vs[0, :s.ctx_len]  # [ctx_len, KVH, D]
        o = sdpa(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0), s.mask, s.mask is None, scale,
                 sinks)
        out[sl] = o[0].transpose(0, 1)


PAGED_CHUNK_MAX = 16  # query rows of a mid-sequence chunk above which it goes to SDPA (measured: shared prefix)
# over a bf16 pool, to the chunk kernel instead: 8 rows over 548 keys 82 vs 98 us a layer (4 rows: 77 vs 50)
PAGED_CHUNK_MAX_BF16 = 8


class MetadataBuilder:
    """One step's attention metadata over the pool, for the ops a backend offers: op, the paged-row op (None:
    torch gathers), chunk_op, whether prefills go to the chunk kernel. It also decides the order of the rows
    (the op's rows first), which the runner follows."""

    def __init__(self, block_size: int, sliding_window: int | None, op: Callable | None, chunk_op: bool,
                 device: torch.device | str = "cpu", all_rows: bool = False, pages: tuple[int, int] = (1, 0)) -> None:
        """device: where the torch paths and a device's kernels read the metadata (the pool's); the C++ ops' run
        on the CPU only. all_rows: the op takes every row of the step (a device's kernels: triton_ops), decodes
        first, then speculative rows, then prompt rows. pages: (per_page, part) where the layers keep their
        blocks as part `part` of pages holding per_page blocks (kv_spec.py): block b is their block
        b * per_page + part, in tables and slots alike."""
        self.block_size, self.sliding_window, self.device = block_size, sliding_window, torch.device(device)
        self.per_page, self.part = pages
        self.op, self.chunk_op, self.all_rows = op, chunk_op, all_rows
        self.paged_chunk_max = PAGED_CHUNK_MAX_BF16 if chunk_op else PAGED_CHUNK_MAX

    def kind(self, num_new: int, start: int, num_prompt_tokens: int, num_spec: int) -> int:
        """0 decodes, 1 speculative rows and 2 short mid-sequence prompt chunks (with 0: the op's rows, which
        must come first; decodes and speculative rows lead, as the rows that compute output tokens),
        3 long mid-sequence chunks (the chunk kernel or gathered SDPA: matrix products beat the op's
        row-at-a-time loop), 4 fresh prompts (the chunk kernel or SDPA over their own K/V).
        A decode computes an output token; prompt rows left by a prefix hit are never decodes, even one
        of them, and over a bf16 pool they take the chunk kernel as a whole prompt's rows do (only
        speculative rows take the op), so a hit does not change how a prompt's last row is computed."""
        if num_new == 1 and start >= num_prompt_tokens:
            return 0
        if self.all_rows and self.op is not None:
            return 1 if num_spec else 2
        if start:
            short = num_new < self.paged_chunk_max and (num_spec > 0 or not self.chunk_op)
            if self.op is not None and short:
                return 1 if num_spec else 2
            return 3
        return 4

    def begin(self) -> None:
        self._dec_tables: list[list[int]] = []
        self._dec_lens: list[int] = []
        self._prefills: list[PrefillSeq] = []
        self._paged_tables: list[list[int]] = []
        self._paged_meta: list[tuple[int, int, int]] = []  # (q_start, q_len, ctx_len)
        self._chunk_tables: list[list[int]] = []  # prefills for the chunk kernel (instead of `prefills`)
        self._chunk_meta: list[tuple[int, int, int]] = []
        self._decode_rows = 0

    def add(self, kind: int, q_start: int, n: int, ctx: int, table: list[int]) -> None:
        """A sequence's n rows from q_start, ctx tokens of context after them, in the order of their kinds."""
        nb = -(-ctx // self.block_size)
        if self.per_page > 1:
            m, part = self.per_page, self.part
            table = [b * m + part if b >= 0 else b for b in table[:nb]]  # NULL_BLOCK stays: never read
        paged = kind < 3
        if kind < 2:
            self._decode_rows += n
        if paged:
            self._paged_tables.append(table[:nb])
            self._paged_meta.append((q_start, n, ctx))
        if kind == 0:
            self._dec_tables.append(table[:nb])
            self._dec_lens.append(ctx)
        elif self.chunk_op and not paged:
            self._chunk_tables.append(table[:nb])
            self._chunk_meta.append((q_start, n, ctx))
        elif not paged:
            self._prefills.append(PrefillSeq(q_start, n, ctx, torch.tensor(table[:nb], device=self.device),
                                             build_mask(n, ctx, self.sliding_window, self.device)))

    def build(self, slots: list[int]) -> AttentionMetadata:
        """slots: the new tokens' slots in the group's blocks."""
        slot_mapping = torch.tensor(slots, device=self.device)
        if self.per_page > 1:
            bs = self.block_size
            slot_mapping = (slot_mapping // bs * self.per_page + self.part) * bs + slot_mapping % bs
        meta = AttentionMetadata(slot_mapping=slot_mapping, num_decodes=len(self._dec_tables),
                                 num_decode_rows=self._decode_rows,
                                 prefills=self._prefills, sliding_window=self.sliding_window, op=self.op,
                                 decode_ctx_lens=self._dec_lens)
        if self.all_rows and self.op is not None:
            from .triton_ops.attention import device_rows

            meta.device_rows = device_rows(self._paged_tables, self._paged_meta, meta.num_decodes, self.device)
        elif self.op is not None and self._paged_meta:
            row_seq = [i for i, (_, n, _) in enumerate(self._paged_meta) for _ in range(n)]
            meta.paged = PagedRows(len(row_seq), _padded(self._paged_tables), torch.tensor(row_seq),
                                   *(torch.tensor(v) for v in zip(*self._paged_meta)))
        elif self._dec_tables:
            meta.decode_block_tables = _padded(self._dec_tables, self.device)
            width = meta.decode_block_tables.shape[1] * self.block_size
            meta.decode_mask = build_decode_mask(self._dec_lens, width, self.sliding_window, self.device)
        if self._chunk_meta:
            meta.chunks = ChunkRows(_padded(self._chunk_tables), *(torch.tensor(v) for v in zip(*self._chunk_meta)))
        return meta


def _padded(tables: list[list[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """Block tables as one [S, max_blocks] int64 tensor, rows padded with block 0 (never read: lengths bound it).
    Filled row by row through numpy: 7x faster than torch.tensor of the nested lists (32 tables of 256 blocks,
    0.16 vs 1.1 ms), which a hybrid layout pays once per view of the pool every step."""
    out = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
    for row, t in zip(out, tables):
        row[:len(t)] = t
    return torch.from_numpy(out).to(device)
