"""The draft model of speculative decoding (method "draft_model"): a smaller model with the same
vocabulary and its own paged KV pool in the same engine.

Its pool mirrors the target's: same block count and size, indexed by the same block tables, so a
position's draft KV sits in the same slot as its target KV, prefix-cache hits and copy-on-write
carry over, and rolling back the target's slots rolls back the draft's. Every step, before the
target runs: the draft applies the step's block copies, computes the same prefill / decode tokens
as the target (no logits), then for each speculating request catches up on the tokens it has not
seen and proposes k tokens autoregressively (one batched pass per proposal), keeping its
distributions q for rejection sampling.
"""

from __future__ import annotations

import torch

from ..core.request import Request
from ..core.scheduler import SchedulerOutput
from ..errors import ConfigError
from ..executor.base import Executor
from ..model_executor.model_loader import LoadedModel
from ..model_executor.model_runner import Batch, BatchItem, Tables
from .ngram import SpeculativeConfig


class DraftModel:
    def __init__(self, config: SpeculativeConfig, executor: Executor, draft: LoadedModel, target_vocab_size: int,
                 sampler, structured) -> None:
        """executor: runs the draft (its pool already made by init_draft_kv_cache) beside the target."""
        if draft.config.vocab_size != target_vocab_size:
            raise ConfigError(f"the draft model's vocabulary ({draft.config.vocab_size}) differs from the target's "
                              f"({target_vocab_size}): a draft must share the tokenizer")
        self.config = config
        self.executor = executor
        self.sampler = sampler
        self.structured = structured
        self.probs: dict[str, torch.Tensor] = {}  # request id -> [k, V] draft distributions (sampled requests)

    def forget(self, request_id: str) -> None:
        self.probs.pop(request_id, None)

    def propose(self, req: Request, k: int) -> list[int]:
        """Before scheduling: k placeholders, so the scheduler reserves the slots the proposals need."""
        return [0] * k

    def run(self, sched: SchedulerOutput, tables: Tables) -> None:
        """After scheduling, before the target: mirror the step's tokens, then propose."""
        mirror = []
        for s in sched.scheduled:
            if s.num_spec:
                continue
            r = s.request
            # from where its draft KV ends (after a fully accepted proposal it lags the target by one)
            start = min(r.draft_computed, r.num_computed_tokens) if r.draft_computed else r.num_computed_tokens
            end = r.num_computed_tokens + s.num_new_tokens
            mirror.append(BatchItem(r.request_id, start, r.all_token_ids[start:end], r.num_prompt_tokens,
                                    completes=end == len(r.all_token_ids)))
        if mirror or sched.copies:  # copy-on-write in the draft's pool too, before anything writes
            self.executor.execute_draft(Batch(mirror, list(sched.copies)), tables, want_logits=False)
        for s in sched.scheduled:
            if not s.num_spec:
                s.request.draft_computed = s.request.num_computed_tokens + s.num_new_tokens
        spec = [s for s in sched.scheduled if s.num_spec]
        self.probs = {}
        if spec:
            self._propose([s.request for s in spec], tables)
        for s in spec:  # a grammar that ended early leaves fewer proposals than slots (freed after the step)
            s.num_new_tokens, s.num_spec = 1 + len(s.request.spec_tokens), len(s.request.spec_tokens)

    def _propose(self, reqs: list[Request], tables: Tables) -> None:
        k = {r.request_id: len(r.spec_tokens) for r in reqs}
        known = {r.request_id: r.all_token_ids for r in reqs}
        drafts: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        qs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in reqs}
        live = list(reqs)
        for i in range(max(k.values())):
            items = []
            for r in live:
                tokens = known[r.request_id] + drafts[r.request_id]
                start = r.draft_computed if i == 0 else len(tokens) - 1  # catch up first, then one at a time
                items.append(BatchItem(r.request_id, start, tokens[start:], r.num_prompt_tokens))
            res = self.executor.execute_draft(Batch(items), tables)
            for row, j in zip(res.logits, res.sampled):
                r = live[j]
                if r.grammar is not None:  # proposals the grammar would reject are never made
                    self.structured.apply_masks(row[None], [0], [r.grammar])
                if r.params.greedy:
                    d = int(row.argmax())
                else:
                    q = self.sampler.probs(row.clone(), r)
                    d = int(row.argmax()) if q is None else int(torch.multinomial(q, 1, generator=self.sampler.generator_for(r)))
                    qs[r.request_id].append(q if q is not None else torch.nn.functional.one_hot(
                        torch.tensor(d), row.shape[0]).float())
                drafts[r.request_id].append(d)
                if r.grammar is not None:
                    r.grammar.accept_token(d)
                    if r.grammar.is_terminated():  # it ended: nothing can follow
                        k[r.request_id] = len(drafts[r.request_id])
            live = [r for r in live if len(drafts[r.request_id]) < k[r.request_id]]
            if not live:
                break
        for r in reqs:
            n = len(drafts[r.request_id])
            if r.grammar is not None and n:
                r.grammar.rollback(n)
            r.spec_tokens = drafts[r.request_id]
            r.draft_computed = r.num_tokens + n - 1  # KV of the last token and all proposals but the final one
            if qs[r.request_id]:
                self.probs[r.request_id] = torch.stack(qs[r.request_id])  # [k, V]

    def after_update(self, reqs: list[Request]) -> None:
        """Draft KV past the target's verified tokens belongs to rejected proposals."""
        for r in reqs:
            r.draft_computed = min(r.draft_computed, r.num_computed_tokens)
