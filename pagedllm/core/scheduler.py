"""Continuous batching: every step decides which requests run and how many tokens each.

Decodes (1 token) and prefill chunks share the per-step token budget. Running requests go
first; when one needs a block and none is free, the lowest-priority, most recently admitted
running request is preempted (blocks freed, requeued for recomputation). Waiting requests are
admitted in (priority, arrival) order while the budget, max_num_seqs and the free blocks (less
a small watermark) allow. No torch here.

With a disk tier (`offload`: how many of a run of block keys it holds), a request whose prefix misses in RAM
and hits on disk is admitted with blocks for those keys and waits in `loading`, out of the batch, while they
are read in; `finish_loading` then offers them to the prefix cache and lets it run from there.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import InvalidRequestError
from .block_manager import BlockManager
from .request import Request, RequestStatus
from .state_slots import StateSlots


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # including num_spec proposed tokens
    num_spec: int = 0  # speculative decoding: proposals scored after the last known token

    @property
    def completes(self) -> bool:
        """After this step the request has KV for all its known tokens: sample one more."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - self.num_spec == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[Request] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # forks' state slots (src, dst), first
    # disk-tier reads to start: (request id, [(key, block id, token ids)]), finish_loading when done
    loads: list[tuple[str, list[tuple[bytes, int, tuple[int, ...]]]]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class SchedulerCounters:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    disk_cache_hits: int = 0  # prompt tokens read from the disk tier (also counted in prefix_cache_hits)
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    peak_kv_blocks_used: int = 0
    peak_num_running: int = 0


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True,
                 preemption_mode: str = "recompute", watermark: float = 0.01,
                 state_slots: StateSlots | None = None, offload: Callable[[list[bytes]], int] | None = None) -> None:
        """state_slots: for models with linear-attention layers, a state slot per admitted sequence.
        offload: a disk tier's lookup, how many leading keys of a list it holds (one group of layers only)."""
        self.bm = block_manager
        self.offload = offload
        self.loading: dict[str, tuple[Request, int]] = {}  # reading blocks in: (request, tokens hit in RAM)
        self.state_slots = state_slots
        self._state_copies: list[tuple[int, int]] = []  # forks made since the last schedule()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked = enable_chunked_prefill
        self.reserve = preemption_mode == "reserve"
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.running: list[Request] = []
        self._waiting: list[tuple[int, int, str]] = []  # heap of (priority, arrival no, id)
        self.waiting: dict[str, Request] = {}
        self._arrival_no: dict[str, int] = {}
        self._counter = itertools.count()
        self._admit_counter = itertools.count()
        self.counters = SchedulerCounters()

    # ---- requests in and out -------------------------------------------------------------
    def check_fits(self, req: Request) -> None:
        total = req.max_total_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({req.num_prompt_tokens} tokens) + max_tokens ({req.max_tokens}) = {total} "
                f"exceeds max_model_len ({self.max_model_len})")
        need = (len(self.bm.windows) * self.bm.blocks_needed(total) if self.reserve
                else self.bm.max_blocks_held(total, self.max_num_batched_tokens))
        if need > self.bm.num_blocks:
            raise InvalidRequestError(
                f"prompt + max_tokens = {total} tokens needs {need} KV blocks, "
                f"more than the whole pool ({self.bm.num_blocks} blocks of {self.bm.block_size} tokens)")
        group = 1 + len(req.pending_forks)
        if self.state_slots is not None and group > self.state_slots.num_slots:
            raise InvalidRequestError(f"n={group} needs {group} linear-attention state slots at once; the engine has "
                                      f"{self.state_slots.num_slots} (a larger KV pool holds more)")
        if not self.chunked and req.num_prompt_tokens > self.max_num_batched_tokens:
            raise InvalidRequestError(
                f"prompt of {req.num_prompt_tokens} tokens exceeds max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) with chunked prefill disabled")

    def add_request(self, req: Request) -> None:
        self.check_fits(req)
        self._arrival_no[req.request_id] = next(self._counter)
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        self.waiting[req.request_id] = req
        heapq.heappush(self._waiting, (req.priority, self._arrival_no[req.request_id], req.request_id))

    def _peek_waiting(self) -> Request | None:
        while self._waiting:
            rid = self._waiting[0][2]
            req = self.waiting.get(rid)
            if req is not None and req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                return req
            heapq.heappop(self._waiting)  # stale entry (aborted)
        return None

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove a request (finished or aborted) and free its blocks at once."""
        if req.is_finished:
            return
        if req in self.running:
            self.running.remove(req)
        self.waiting.pop(req.request_id, None)
        self._arrival_no.pop(req.request_id, None)
        if req.request_id not in self.loading:  # else blocks being read into are freed once the read is over
            self.bm.free(req.request_id)
        self._give_slots(req)
        req.status = status
        req.finished_time = time.monotonic()
        for child in req.pending_forks:  # never forked: they end with their leader
            child.status = status
            child.finished_time = req.finished_time
        if status is not RequestStatus.FINISHED_ABORTED:
            req.pending_forks = []

    def fork(self, parent: Request, child: Request) -> None:
        """Child starts where the parent's prompt ends, sharing its blocks."""
        self.bm.fork(parent.request_id, child.request_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = RequestStatus.RUNNING
        child.admitted_seq = next(self._admit_counter)
        child.first_scheduled_time = parent.first_scheduled_time
        self._arrival_no[child.request_id] = next(self._counter)
        self.running.append(child)
        if child.state_slot is not None:  # taken at the parent's admission: the parent's state after the prompt
            self._state_copies.append((parent.state_slot, child.state_slot))

    def _give_slots(self, req: Request) -> None:
        for seq in (req, *req.pending_forks):
            if seq.state_slot is not None:
                self.state_slots.give(seq.state_slot)
                seq.state_slot = None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.free(req.request_id)
        self._give_slots(req)
        req.num_computed_tokens = 0
        req.draft_computed = 0
        req.spec_tokens = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.counters.num_preemptions += 1
        self._enqueue(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.loading)

    def describe(self) -> str:
        """The unfinished requests, one per line (for a log when nothing could be scheduled): id, status,
        tokens computed of known, blocks held, forks not yet made."""
        lines = [f"{self.bm.num_free_blocks} blocks free"]
        for where, reqs in (("running", self.running), ("waiting", list(self.waiting.values())),
                            ("loading", [r for r, _ in self.loading.values()])):
            for r in reqs:
                lines.append(f"{where} {r.request_id} {r.status.name} {r.num_computed_tokens}/{r.num_tokens} "
                             f"tokens, {self.bm.num_blocks_of(r.request_id)} blocks, {len(r.pending_forks)} forks")
        return "\n".join(lines)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        out.state_copies, self._state_copies = self._state_copies, []
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new > budget and not self.chunked:
                continue
            num_new = min(num_new, budget)
            if num_new <= 0:
                continue
            copies = None
            if num_new == 1 and req.spec_tokens:  # a decode with proposals: score them too, if they fit
                del req.spec_tokens[budget - 1:]
                copies = self.bm.allocate_slots(req.request_id, req.all_token_ids, req.num_computed_tokens,
                                                1 + len(req.spec_tokens), salt=req.cache_salt) if req.spec_tokens else None
                if copies is None:
                    req.spec_tokens.clear()  # proposals never preempt anyone
            while copies is None:
                copies = self.bm.allocate_slots(
                    req.request_id, req.all_token_ids, req.num_computed_tokens, num_new,
                    salt=req.cache_salt)
                if copies is not None:
                    break
                if self.reserve:
                    raise RuntimeError("reserve mode ran out of reserved blocks (a bug)")
                victim = max((r for r in self.running if r.request_id not in scheduled_ids),
                             key=lambda r: (r.priority, r.admitted_seq))
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if copies is None:
                continue
            spec = len(req.spec_tokens) if num_new == 1 else 0
            out.copies.extend(copies)
            out.scheduled.append(ScheduledRequest(req, num_new + spec, spec))
            scheduled_ids.add(req.request_id)
            budget -= num_new + spec

        if not out.preempted:
            self._admit(out, budget)
        self.counters.peak_kv_blocks_used = max(self.counters.peak_kv_blocks_used, self.bm.num_used_blocks)
        self.counters.peak_num_running = max(self.counters.peak_num_running, len(self.running))
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while budget > 0:
            req = self._peek_waiting()
            if req is None:
                break
            group = 1 + len(req.pending_forks)
            if len(self.running) + len(self.loading) + group > self.max_num_seqs and self.running:
                break
            if self.state_slots is not None and self.state_slots.num_free < group:
                break  # a slot for it and each of its forks
            tokens = req.all_token_ids
            hits = self.bm.prefix_hits(req.request_id, tokens, req.cache_salt)
            num_cached = len(hits[0]) * self.bm.block_size
            if self.offload is not None and self.bm.enable_caching:
                keys = self.bm.prefix_keys(req.request_id, tokens, req.cache_salt)[len(hits[0]):]
                on_disk = self.offload(keys) if keys else 0
                if on_disk:
                    if not self._admit_loading(req, hits, keys[:on_disk], out):
                        break
                    continue
            num_new = len(tokens) - num_cached
            if num_new > budget and not self.chunked:
                break
            num_new = min(num_new, budget)
            lookahead = req.max_total_tokens - num_cached - num_new if self.reserve else 0
            copies = self.bm.allocate_slots(
                req.request_id, tokens, num_cached, num_new, computed_blocks=hits,
                num_lookahead=lookahead, salt=req.cache_salt,
                reserve_free=self.watermark_blocks if self.running else 0)
            if copies is None:
                break  # head of line waits for memory; lower priorities must not overtake it
            heapq.heappop(self._waiting)
            del self.waiting[req.request_id]
            if self.state_slots is not None:
                for seq, slot in zip((req, *req.pending_forks), self.state_slots.take(group)):
                    seq.state_slot = slot
            if req.status is RequestStatus.WAITING:  # first admission, not a readmission
                req.num_cached_tokens = num_cached
            self.counters.prefix_cache_queries += len(tokens)
            self.counters.prefix_cache_hits += num_cached
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            req.admitted_seq = next(self._admit_counter)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.copies.extend(copies)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new

    def _admit_loading(self, req: Request, hits: list[list[int]], keys: list[bytes], out: SchedulerOutput) -> bool:
        """Blocks for the keys the disk tier holds after the RAM hits, to be read in (out.loads) while the
        request waits in `loading`; False: the pool cannot give them now."""
        bs, tokens = self.bm.block_size, req.all_token_ids
        num_cached = len(hits[0]) * bs
        copies = self.bm.allocate_slots(req.request_id, tokens, num_cached, len(keys) * bs, computed_blocks=hits,
                                        salt=req.cache_salt, cache_upto=num_cached,
                                        reserve_free=self.watermark_blocks if self.running else 0)
        if copies is None:
            return False
        heapq.heappop(self._waiting)
        del self.waiting[req.request_id]
        self.loading[req.request_id] = (req, num_cached)
        self.counters.prefix_cache_queries += len(tokens)
        self.counters.prefix_cache_hits += num_cached
        table, first = self.bm.table(req.request_id), len(hits[0])
        out.loads.append((req.request_id, [(k, table[first + i], tuple(tokens[(first + i) * bs:(first + i + 1) * bs]))
                                           for i, k in enumerate(keys)]))
        return True

    def finish_loading(self, request_id: str, num_loaded: int) -> None:
        """The disk tier read the first num_loaded blocks of a load (the rest failed: they are computed): the
        request joins the batch after them. One aborted meanwhile has its blocks freed now."""
        req, num_cached = self.loading.pop(request_id)
        if req.is_finished:
            self.bm.free(request_id)
            return
        num = num_cached + num_loaded * self.bm.block_size
        self.bm.cache_blocks(request_id, req.all_token_ids, num, req.cache_salt)
        if req.status is RequestStatus.WAITING:  # first admission, not a readmission
            req.num_cached_tokens = num
        self.counters.prefix_cache_hits += num - num_cached
        self.counters.disk_cache_hits += num - num_cached
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num
        req.admitted_seq = next(self._admit_counter)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self.running.append(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, int | list[int]]) -> None:
        """Advance progress after the model ran; append the sampled tokens. A speculating request
        gets a list: its accepted proposals and one more; the slots of rejected ones roll back."""
        for s in out.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue
            toks = sampled.get(req.request_id)
            toks = [toks] if isinstance(toks, int) else toks
            if s.num_spec:
                req.num_computed_tokens += len(toks)  # the last known token + the accepted proposals
                req.spec_tokens = []
                self.bm.truncate(req.request_id, req.num_computed_tokens)
            else:
                req.num_computed_tokens += s.num_new_tokens
            if toks:
                if not req.output_token_ids:
                    self.counters.prompt_tokens += req.num_prompt_tokens
                req.output_token_ids.extend(toks)
                self.counters.generation_tokens += len(toks)
