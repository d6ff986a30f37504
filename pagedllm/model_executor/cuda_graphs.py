"""Decode-only steps replayed from CUDA graphs.

A small model's decode step is a thousand short kernels; launched one by one from Python the GPU idles between
them (SmolLM2-135M on an H200: 1.2 ms of kernels in a 14 ms step). A graph captured once per batch size replays
all of them in one launch. Captured at bucketed batch sizes (1, 2, 4, 8, then steps of 8, 16, 32 up to the most
running sequences); a step of B decodes replays the smallest bucket >= B, its extra rows padded: slot -1 (the
K/V write skips it), context 1 over block 0 (read, never written), logits dropped.

Everything a step changes lives in static buffers the graph reads: token ids, positions, slots, block tables
(as wide as max_model_len needs), context lengths. The metadata is built once per bucket over them, with the
decode kernel's split count fixed for the longest context. Only single-group layouts without linear-attention
states are captured (hybrid groups and state rows change shape from step to step); a model whose forward cannot
be captured (a host sync in it, data-dependent shapes: MoE routing) runs eagerly, as `enforce_eager` does.
"""

from __future__ import annotations

import logging

import torch

from .attention import AttentionMetadata
from .triton_ops.attention import StepRows

log = logging.getLogger("pagedllm")


def buckets(max_batch: int) -> list[int]:
    out = [b for b in (1, 2, 4) if b < max_batch]
    b, step = 8, 8
    while b < max_batch:
        out.append(b)
        b += step
        step = 16 if b >= 64 else step
        step = 32 if b >= 256 else step
    return out + [max_batch]


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_model_len: int, capture: bool = True) -> None:
        """runner: the model runner whose model and pools the graphs read; capture False runs the same static
        buffers eagerly (what the graphs replay, checked where there is no GPU)."""
        self.runner, self.capture = runner, capture
        self.max_model_len = max_model_len
        self.buckets = buckets(max_batch)
        n, dev = self.buckets[-1], runner.device
        self.width = -(-max_model_len // runner.block_size)
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.tables = torch.zeros((n, self.width), dtype=torch.int32, device=dev)
        self.ctx = torch.ones(n, dtype=torch.int32, device=dev)
        self.q_start = torch.arange(n, dtype=torch.int32, device=dev)
        self.q_len = torch.ones(n, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, dtype=torch.long, device=dev)
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}  # bucket -> (graph or None, its logits)
        self.metas = {b: self._meta(b) for b in self.buckets}
        runner.model.reserve_rope(max_model_len)  # no table growth (a host sync) inside a captured forward

    def _meta(self, b: int) -> AttentionMetadata:
        attn = self.runner.attn
        meta = AttentionMetadata(slot_mapping=self.slots[:b], num_decodes=b, num_decode_rows=b,
                                 sliding_window=attn.sliding_window, op=attn.op)
        meta.device_rows = StepRows(self.tables[:b], self.q_start[:b], self.q_len[:b], self.ctx[:b], b, 0,
                                    self.max_model_len)
        return meta

    def _forward(self, b: int) -> torch.Tensor:
        r = self.runner
        return r.model(self.ids[:b], self.pos[:b], r.caches, self.metas[b], self.rows[:b])

    def capture_all(self) -> bool:
        """Captures every bucket, largest first (the smaller ones reuse its memory pool); False (and nothing kept)
        where the model's forward cannot be captured."""
        if not self.capture:
            return True
        pool = None
        try:
            for b in reversed(self.buckets):
                for _ in range(2):  # compiles the kernels and settles the allocator outside the capture
                    self._forward(b)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    logits = self._forward(b)
                pool = g.pool()
                self.graphs[b] = (g, logits)
        except Exception as e:  # noqa: BLE001 - any capture failure means: this model runs eagerly
            log.warning("decode steps run eagerly: the forward could not be captured (%s)", e)
            self.graphs.clear()
            return False
        log.info("captured decode graphs for batch sizes %s", self.buckets)
        return True

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def run(self, token_ids: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Logits [B, vocab] of B decodes (one token each at positions, block tables as lists), B <= the largest
        bucket."""
        n = len(token_ids)
        b = self.bucket(n)
        bs = self.runner.block_size
        pad = b - n
        ctx = [p + 1 for p in positions] + [1] * pad
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)] + [-1] * pad
        width = max(-(-c // bs) for c in ctx)
        tab = torch.zeros((b, width), dtype=torch.int32)
        for i, t in enumerate(tables):
            k = -(-ctx[i] // bs)
            tab[i, :k] = torch.tensor(t[:k], dtype=torch.int32)
        self.ids[:b].copy_(torch.tensor(token_ids + [0] * pad), non_blocking=True)
        self.pos[:b].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        self.slots[:b].copy_(torch.tensor(slots), non_blocking=True)
        self.ctx[:b].copy_(torch.tensor(ctx, dtype=torch.int32), non_blocking=True)
        self.tables[:b, :width].copy_(tab, non_blocking=True)
        graph = self.graphs.get(b)
        if graph is None:
            return self._forward(b)[:n]
        graph[0].replay()
        return graph[1][:n]
