"""Tensors for one step: flat inputs, slot mapping, block tables; runs the model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.request import Request
from ..core.scheduler import SchedulerOutput
from .attention import AttentionMetadata, ChunkRows, PagedRows, PrefillSeq, build_decode_mask, build_mask
from .kv_cache import KVCache

PAGED_CHUNK_MAX = 16  # query rows of a mid-sequence chunk above which it goes to SDPA (measured: shared prefix)
# over a bf16 pool, to the chunk kernel instead: 8 rows over 548 keys 82 vs 98 us a layer (4 rows: 77 vs 50)
PAGED_CHUNK_MAX_BF16 = 8


@dataclass(frozen=True)
class BatchItem:
    """One sequence's rows in a step, all the runner reads of it."""

    request_id: str
    start: int  # its tokens that have KV already: the first new token's position
    token_ids: list[int]  # the new tokens (proposals included)
    num_prompt_tokens: int
    num_spec: int = 0  # proposals scored after its last known token
    completes: bool = True  # its last known token is among the new ones: it samples


@dataclass
class Batch:
    items: list[BatchItem]
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before any write


def batch_of(sched: SchedulerOutput) -> Batch:
    items = []
    for s in sched.scheduled:
        r, start = s.request, s.request.num_computed_tokens
        items.append(BatchItem(r.request_id, start, r.tokens_slice(start, start + s.num_new_tokens),
                               r.num_prompt_tokens, s.num_spec, s.completes))
    return Batch(items, list(sched.copies))


@dataclass
class StepResult:
    logits: torch.Tensor  # [R, vocab] fp32: the rows of the items that sample this step
    sampled: list[int]  # those items' indices in the batch, in row order
    num_rows: list[int]  # rows of each: 1, or 1 + k for a speculating request (one per scored token)
    requests: list[Request] = field(default_factory=list)  # the sampled requests (execute() of a SchedulerOutput)


class ModelRunner:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype, cache_factory=KVCache) -> None:
        self.model = model
        self.block_size = block_size
        cfg = model.cfg
        self.dtype = model.embed_tokens.weight.dtype  # of the activations
        self.sliding_window = cfg.sliding_window
        self.caches = [cache_factory(num_blocks, block_size, spec.num_kv_heads, spec.head_dim, kv_dtype, self.dtype)
                       for spec in model.kv_specs()]
        layer, backend = model.layers[0], model.backend  # the backend chose the kernels once, at load
        self.argmax = backend.argmax_rows
        # whoever turns self.op off (the tests, to compare paths) turns chunk_op off with it
        self.op, self.chunk_op = backend.paged_ops(self.caches[0], cfg.head_dim, layer.num_heads // layer.num_kv_heads)
        self.paged_chunk_max = PAGED_CHUNK_MAX_BF16 if self.chunk_op else PAGED_CHUNK_MAX

    def execute(self, sched: SchedulerOutput, tables: Mapping[str, list[int]], all_logits: bool = False,
                want_logits: bool = True) -> StepResult:
        """The scheduler's step; the result also names the sampled requests."""
        res = self.execute_batch(batch_of(sched), tables, all_logits, want_logits)
        res.requests = [sched.scheduled[i].request for i in res.sampled]
        return res

    def execute_batch(self, batch: Batch, tables: Mapping[str, list[int]], all_logits: bool = False,
                      want_logits: bool = True) -> StepResult:
        """all_logits: logits of every scheduled token (scoring), not just the sampled rows;
        want_logits False: KV only (a draft model mirroring the target's step)."""
        for src, dst in batch.copies:  # copy-on-write before anything writes
            for c in self.caches:
                c.copy_block(src, dst)
        bs = self.block_size

        def kind(s: BatchItem) -> int:
            """0 decodes, 1 short mid-sequence chunks (with 0: the op's rows, which must come first),
            2 long mid-sequence chunks (the chunk kernel or gathered SDPA: matrix products beat the op's
            row-at-a-time loop), 3 fresh prompts (the chunk kernel or SDPA over their own K/V).
            A decode computes an output token; prompt rows left by a prefix hit are never decodes, even one
            of them, and over a bf16 pool they take the chunk kernel as a whole prompt's rows do (only
            speculative rows take the op), so a hit does not change how a prompt's last row is computed."""
            n = len(s.token_ids)
            if n == 1 and s.start >= s.num_prompt_tokens:
                return 0
            if s.start:
                short = n < self.paged_chunk_max and (s.num_spec > 0 or not self.chunk_op)
                return 1 if self.op is not None and short else 2
            return 3

        kinds = [kind(s) for s in batch.items]
        order = sorted(range(len(batch.items)), key=lambda i: kinds[i])
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampled: list[int] = []
        num_rows: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        paged_tables: list[list[int]] = []
        paged_meta: list[tuple[int, int, int]] = []  # (q_start, q_len, ctx_len)
        chunk_tables: list[list[int]] = []  # prefills for the chunk kernel (instead of `prefills`)
        chunk_meta: list[tuple[int, int, int]] = []
        for i in order:
            s = batch.items[i]
            n, start = len(s.token_ids), s.start
            table = tables[s.request_id]
            q_start = len(ids)
            ids.extend(s.token_ids)
            pos.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            ctx = start + n
            nb = -(-ctx // bs)
            paged = kinds[i] < 2
            if paged:
                paged_tables.append(table[:nb])
                paged_meta.append((q_start, n, ctx))
            if kinds[i] == 0:
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
                sampled.append(i)
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
