"""Tensors for one step: flat inputs, slot mapping, block tables; runs the model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..core.request import Request
from ..core.scheduler import ScheduledRequest, SchedulerOutput
from .attention import AttentionMetadata, ChunkRows, PagedRows, PrefillSeq, build_decode_mask, build_mask
from .kv_cache import KVCache
from .kv_quant import FP8KVCache

PAGED_CHUNK_MAX = 16  # query rows of a mid-sequence chunk above which it goes to SDPA (measured: shared prefix)
# over a bf16 pool, to the chunk kernel instead: 8 rows over 548 keys 82 vs 98 us a layer (4 rows: 77 vs 50)
PAGED_CHUNK_MAX_BF16 = 8


@dataclass
class StepResult:
    logits: torch.Tensor  # [R, vocab] fp32: the rows of the requests that sample this step
    requests: list[Request]  # those requests, in order
    num_rows: list[int]  # rows of each: 1, or 1 + k for a speculating request (one per scored token)


class ModelRunner:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype, cache_factory=KVCache) -> None:
        self.model = model
        self.block_size = block_size
        cfg = model.cfg
        ops = model.ops  # the loader packed the weights for them (or left the model on torch)
        self.dtype = model.embed_tokens.weight.dtype  # of the activations
        self.sliding_window = cfg.sliding_window
        kv_heads = model.layers[0].num_kv_heads  # this rank's, under tensor parallelism
        self.caches = [cache_factory(num_blocks, block_size, kv_heads, cfg.head_dim, kv_dtype, self.dtype)
                       for _ in range(cfg.num_layers)]
        self.argmax = ops.argmax_rows if ops is not None else None
        op_pool = kv_dtype in (torch.float32, torch.bfloat16) or cache_factory is FP8KVCache
        self.op = ops.paged_attention if ops is not None and op_pool else None
        # a bf16 pool's prefills go to the op's chunk kernel (bf16 dot products) instead of SDPA where its tiles
        # fit (head dims of whole 8s, at most 48 query heads a KV head); whoever turns self.op off turns this off
        layer = model.layers[0]
        self.chunk_op = (self.op is not None and not self.caches[0].lossy and kv_dtype == torch.bfloat16
                         and cfg.head_dim % 8 == 0 and layer.num_heads // layer.num_kv_heads <= 48)
        self.paged_chunk_max = PAGED_CHUNK_MAX_BF16 if self.chunk_op else PAGED_CHUNK_MAX

    def execute(self, sched: SchedulerOutput, tables: Mapping[str, list[int]], all_logits: bool = False,
                want_logits: bool = True) -> StepResult:
        """all_logits: logits of every scheduled token (scoring), not just the sampled rows;
        want_logits False: KV only (a draft model mirroring the target's step)."""
        for src, dst in sched.copies:  # copy-on-write before anything writes
            for c in self.caches:
                c.copy_block(src, dst)
        bs = self.block_size

        def kind(s: ScheduledRequest) -> int:
            """0 decodes, 1 short mid-sequence chunks (with 0: the op's rows, which must come first),
            2 long mid-sequence chunks (the chunk kernel or gathered SDPA: matrix products beat the op's
            row-at-a-time loop), 3 fresh prompts (the chunk kernel or SDPA over their own K/V).
            A decode computes an output token; prompt rows left by a prefix hit are never decodes, even one
            of them, and over a bf16 pool they take the chunk kernel as a whole prompt's rows do (only
            speculative rows take the op), so a hit does not change how a prompt's last row is computed."""
            req = s.request
            if s.num_new_tokens == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
                return 0
            if req.num_computed_tokens:
                short = s.num_new_tokens < self.paged_chunk_max and (s.num_spec > 0 or not self.chunk_op)
                return 1 if self.op is not None and short else 2
            return 3

        kinds = {id(s): kind(s) for s in sched.scheduled}
        order = sorted(sched.scheduled, key=lambda s: kinds[id(s)])
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Request] = []
        num_rows: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        paged_tables: list[list[int]] = []
        paged_meta: list[tuple[int, int, int]] = []  # (q_start, q_len, ctx_len)
        chunk_tables: list[list[int]] = []  # prefills for the chunk kernel (instead of `prefills`)
        chunk_meta: list[tuple[int, int, int]] = []
        for s in order:
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            table = tables[req.request_id]
            q_start = len(ids)
            ids.extend(req.tokens_slice(start, start + n))
            pos.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            ctx = start + n
            nb = -(-ctx // bs)
            paged = kinds[id(s)] < 2
            if paged:
                paged_tables.append(table[:nb])
                paged_meta.append((q_start, n, ctx))
            if kinds[id(s)] == 0:
                dec_tables.append(table[:nb])
                dec_lens.append(ctx)
            elif self.chunk_op and not paged:
                chunk_tables.append(table[:nb])
                chunk_meta.append((q_start, n, ctx))
            elif not paged:
                prefills.append(PrefillSeq(q_start, n, ctx, torch.tensor(table[:nb]),
                                           build_mask(n, ctx, self.sliding_window)))
            if all_logits:
                logits_rows.extend(range(q_start, q_start + n))
            elif s.completes and want_logits:
                logits_rows.extend(range(len(ids) - 1 - s.num_spec, len(ids)))
                sampled.append(req)
                num_rows.append(1 + s.num_spec)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots), num_decodes=len(dec_tables), prefills=prefills,
                                 sliding_window=self.sliding_window, op=self.op)
        if self.op is not None and paged_meta:
            row_seq = [i for i, (_, n, _) in enumerate(paged_meta) for _ in range(n)]
            meta.paged = PagedRows(len(row_seq), _padded(paged_tables), torch.tensor(row_seq),
                                   *(torch.tensor(v) for v in zip(*paged_meta)))
        elif dec_tables:
            meta.decode_block_tables = _padded(dec_tables)
            meta.decode_mask = build_decode_mask(dec_lens, meta.decode_block_tables.shape[1] * bs, self.sliding_window)
        if chunk_meta:
            meta.chunks = ChunkRows(_padded(chunk_tables), *(torch.tensor(v) for v in zip(*chunk_meta)))
        logits = self.model(torch.tensor(ids), torch.tensor(pos), self.caches, meta,
                            torch.tensor(logits_rows, dtype=torch.long))
        return StepResult(logits, sampled, num_rows)


def _padded(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one [S, max_blocks] int64 tensor, rows padded with block 0 (never read: lengths bound it)."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])
