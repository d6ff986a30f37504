"""Tensors for one step: flat inputs, slot mapping, block tables; runs the model."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.kv_spec import KVLayout, KVSpec, plan_kv_layout
from ..core.request import Request
from ..core.scheduler import SchedulerOutput
from .attention import MetadataBuilder
from .kv_cache import KVCache
from .layers.gated_delta_net import StateSeq


@dataclass(frozen=True)
class BatchItem:
    """One sequence's rows in a step, all the runner reads of it."""

    request_id: str
    start: int  # its tokens that have KV already: the first new token's position
    token_ids: list[int]  # the new tokens (proposals included)
    num_prompt_tokens: int
    num_spec: int = 0  # proposals scored after its last known token
    completes: bool = True  # its last known token is among the new ones: it samples
    state_slot: int | None = None  # its linear-attention state's slot (models with such layers)


@dataclass
class Batch:
    items: list[BatchItem]
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before any write
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # forks' state slots (src, dst), first too


def batch_of(sched: SchedulerOutput) -> Batch:
    items = []
    for s in sched.scheduled:
        r, start = s.request, s.request.num_computed_tokens
        items.append(BatchItem(r.request_id, start, r.tokens_slice(start, start + s.num_new_tokens),
                               r.num_prompt_tokens, s.num_spec, s.completes, r.state_slot))
    return Batch(items, list(sched.copies), list(sched.state_copies))


@dataclass
class StepResult:
    logits: torch.Tensor  # [R, vocab] fp32: the rows of the items that sample this step
    sampled: list[int]  # those items' indices in the batch, in row order
    num_rows: list[int]  # rows of each: 1, or 1 + k for a speculating request (one per scored token)
    requests: list[Request] = field(default_factory=list)  # the sampled requests (execute() of a SchedulerOutput)


Tables = Sequence[Mapping[str, list[int]]]  # one per group of the layout: request id -> block table


class ModelRunner:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 cache_factory=KVCache, layout: KVLayout | None = None, num_state_slots: int = 0) -> None:
        """layout: how layers share the pool (kv_spec.plan_kv_layout); None: one group, full tables.
        num_state_slots: the states of linear-attention layers (models with them), one per running sequence."""
        self.model = model
        self.block_size = block_size
        cfg = model.cfg
        self.dtype = model.embed_tokens.weight.dtype  # of the activations
        self.device = torch.device(getattr(model, "device", "cpu"))  # the platform's: the model's and its pool's
        specs = model.kv_specs()
        self.layout = layout or plan_kv_layout(specs, hybrid=False)
        # one pool tensor per slot; layer i of every group keeps its K/V in slot i's
        self.slot_caches = [cache_factory(num_blocks, block_size, s.num_kv_heads, s.head_dim, kv_dtype, self.dtype,
                                          self.device)
                            for s in self.layout.slot_specs(specs)]
        # a slot's layers of other shapes keep their blocks in its pages, per_page of them a page
        by_kind = [{spec: self._in_pages(host, spec, per_page, cache_factory, kv_dtype) for spec, per_page in kinds.items()}
                   for host, kinds in zip(self.slot_caches, self.layout.slot_kinds(specs))]
        # those with tensors of their own, which the host's copy-on-write does not move: (cache, per_page)
        self._own_pools = [(c, kinds[spec]) for host, kinds, caches in
                           zip(self.slot_caches, self.layout.slot_kinds(specs), by_kind)
                           for spec, c in caches.items() if c is not host and c.OWN_POOLS]
        # every pool tensor as bytes, block id first: what the disk tier saves and restores of a block
        self.block_pools = [t for c in self.slot_caches for t in c.pools()]
        states = model.state_caches(num_state_slots) if num_state_slots else {}
        self.state_caches = list(states.values())
        # per layer; None for a layer that keeps neither (it reads another layer's K/V: Gemma 4's shared layers)
        self.caches = [by_kind[j][specs[i]] if j >= 0 else states.get(i)
                       for i, j in enumerate(self.layout.slot_of_layer)]
        layer, backend = model.layers[0], model.backend  # the backend chose the kernels once, at load
        self.argmax = backend.argmax_rows
        op, chunk_op = backend.paged_ops(self.slot_caches[0], cfg.head_dim, layer.num_heads // layer.num_kv_heads)
        hybrid = self.layout.hybrid
        all_rows = getattr(backend, "all_rows", False) and op is not None
        # a builder per view of the pool: a group's, or one per part of its pages where it packs several layers
        self.attns = [MetadataBuilder(block_size, grp.sliding_window if hybrid else cfg.sliding_window, op, chunk_op,
                                      self.device, all_rows, (grp.per_page, part))
                      for grp, part in ((self.layout.groups[g], part) for g, part in self.layout.views)]
        self.attn = self.attns[0]
        self._view_of_layer = [self.layout.view_of_layer(i) for i in range(len(specs))]
        self.graphs = None  # decode steps replayed from CUDA graphs (cuda_graphs.DecodeGraphs), where captured

    def _in_pages(self, host: KVCache, spec: KVSpec, per_page: int, cache_factory: Callable, kv_dtype: torch.dtype
                  ) -> KVCache:
        """The cache of spec's layers in a slot whose pages are host's: host itself where the shapes agree."""
        if per_page == 1 and (spec.num_kv_heads, spec.head_dim) == (host.k.shape[2], host.head_dim):
            return host
        cache = cache_factory(0, self.block_size, spec.num_kv_heads, spec.head_dim, kv_dtype, self.dtype, self.device)
        cache.share_pages(host, per_page)
        return cache

    def use_decode_graphs(self, max_batch: int, max_model_len: int, capture: bool = True) -> bool:
        """Decode-only steps of up to max_batch sequences through cuda_graphs.DecodeGraphs (capture False: its
        static buffers, run eagerly). Only where every row goes to the device's kernels, one group of block
        tables and no linear-attention states; False where not taken."""
        if not self.attn.all_rows or len(self.attns) > 1 or self.state_caches:
            return False
        from .cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(self, max_batch, max_model_len, capture)
        if graphs.capture_all():
            self.graphs = graphs
        return self.graphs is not None

    def _graph_step(self, batch: Batch, tables: Tables) -> StepResult | None:
        """A step of decodes only, replayed; None where the step is not one (prompt or speculative rows)."""
        items = batch.items
        if len(items) > self.graphs.buckets[-1] or not all(
                len(s.token_ids) == 1 and s.start >= s.num_prompt_tokens and not s.num_spec and s.completes
                for s in items):
            return None
        logits = self.graphs.run([s.token_ids[0] for s in items], [s.start for s in items],
                                 [tables[0][s.request_id] for s in items])
        return StepResult(self.model.backend.to_host(logits), list(range(len(items))), [1] * len(items))

    # the paths the step takes, switchable to compare them (tests): the paged-row op and the chunk kernel
    @property
    def op(self) -> Callable | None:
        return self.attn.op

    @op.setter
    def op(self, op: Callable | None) -> None:
        for a in self.attns:
            a.op = op

    @property
    def chunk_op(self) -> bool:
        return self.attn.chunk_op

    @chunk_op.setter
    def chunk_op(self, on: bool) -> None:
        for a in self.attns:
            a.chunk_op = on

    def execute(self, sched: SchedulerOutput, tables: Tables, all_logits: bool = False,
                want_logits: bool = True) -> StepResult:
        """The scheduler's step; the result also names the sampled requests."""
        res = self.execute_batch(batch_of(sched), tables, all_logits, want_logits)
        res.requests = [sched.scheduled[i].request for i in res.sampled]
        return res

    def execute_batch(self, batch: Batch, tables: Tables, all_logits: bool = False,
                      want_logits: bool = True) -> StepResult:
        """all_logits: logits of every scheduled token (scoring), not just the sampled rows;
        want_logits False: KV only (a draft model mirroring the target's step)."""
        for src, dst in batch.copies:  # copy-on-write before anything writes
            for c in self.slot_caches:
                c.copy_block(src, dst)
            for c, m in self._own_pools:
                for j in range(m):
                    c.copy_own(src * m + j, dst * m + j)
        for src, dst in batch.state_copies:
            for c in self.state_caches:
                c.copy_slot(src, dst)
        if not batch.items:  # copies only (a draft pool following the target's copy-on-write)
            return StepResult(torch.zeros(0, self.model.cfg.vocab_size), [], [])
        if self.graphs is not None and want_logits and not all_logits:
            res = self._graph_step(batch, tables)
            if res is not None:
                return res
        bs, attn = self.block_size, self.attn
        kinds = [attn.kind(len(s.token_ids), s.start, s.num_prompt_tokens, s.num_spec) for s in batch.items]
        order = sorted(range(len(batch.items)), key=lambda i: kinds[i])
        ids: list[int] = []
        pos: list[int] = []
        slots: list[list[int]] = [[] for _ in self.layout.groups]  # per group (a packed view maps them)
        views = self.layout.views
        logits_rows: list[int] = []
        sampled: list[int] = []
        num_rows: list[int] = []
        state_seqs: list[StateSeq] = []
        for a in self.attns:
            a.begin()
        for i in order:
            s = batch.items[i]
            n, start = len(s.token_ids), s.start
            q_start = len(ids)
            ids.extend(s.token_ids)
            pos.extend(range(start, start + n))
            if s.state_slot is not None:
                state_seqs.append(StateSeq(s.state_slot, q_start, n, s.start == 0))
            elif self.state_caches:  # its linear-attention layers would silently see no state: a caller's bug
                raise RuntimeError(f"request {s.request_id!r} of a model with linear-attention state has no state slot")
            for g in range(len(slots)):
                table = tables[g][s.request_id]
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            for (g, _), a in zip(views, self.attns):
                a.add(kinds[i], q_start, n, start + n, tables[g][s.request_id])
            if all_logits:
                logits_rows.extend(range(q_start, q_start + n))
            elif s.completes and want_logits:
                logits_rows.extend(range(len(ids) - 1 - s.num_spec, len(ids)))
                sampled.append(i)
                num_rows.append(1 + s.num_spec)
        metas = [a.build(slots[g]) for (g, _), a in zip(views, self.attns)]
        meta = metas[0]
        meta.state_seqs = state_seqs
        if len(metas) > 1:  # a layer without KV (group -1) reads the first view's: only its state rows matter
            meta.layer_meta = [metas[v] for v in self._view_of_layer]
        dev = self.device
        logits = self.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), self.caches, meta,
                            torch.tensor(logits_rows, dtype=torch.long, device=dev))
        return StepResult(self.model.backend.to_host(logits), sampled, num_rows)  # sampled on the host


def profile_forward(model: nn.Module, num_tokens: int, num_seqs: int, block_size: int,
                    measure: Callable[[Callable[[], object]], object] = lambda step: step()) -> object:
    """One step at the largest batch a step can hold: num_tokens prompt tokens over up to num_seqs fresh
    sequences, each sampling (the profiling forward whose peak the KV budget leaves room for on a GPU), over a
    pool of just their blocks, freed when it returns. measure(step) runs the step (the platform's peak_bytes:
    the pool is allocated before it, so only the step's own memory counts); its answer is returned."""
    seqs = max(1, min(num_seqs, num_tokens))
    lens = [num_tokens // seqs + (i < num_tokens % seqs) for i in range(seqs)]
    stateful = getattr(model, "has_state", False)
    runner = ModelRunner(model, sum(-(-n // block_size) for n in lens), block_size,
                         model.embed_tokens.weight.dtype, num_state_slots=seqs if stateful else 0)
    items, tables, nxt = [], {}, 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[str(i)] = list(range(nxt, nxt + nb))
        nxt += nb
        items.append(BatchItem(str(i), 0, [0] * n, n, state_slot=i if stateful else None))
    with torch.inference_mode():
        return measure(lambda: runner.execute_batch(Batch(items), [tables]))
