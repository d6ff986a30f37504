"""Turn logits into tokens: penalties, min_tokens, greedy or temperature / top-k / top-p /
min-p sampling with per-request generators, and top-k logprobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .request import Request
from .structured_outputs import StructuredOutputs


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top: list[tuple[int, float, int]]  # (token id, logprob, rank) of the requested top-k + sampled


class Sampler:
    def __init__(self, seed: int = 0, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 structured: StructuredOutputs | None = None) -> None:
        """argmax: row-wise first argmax of fp32 logits (the C++ op: torch's takes ~2.7 ms on 64 x 49k).
        structured: applies the grammar masks of constrained sequences."""
        self.generator = torch.Generator().manual_seed(seed)
        self.structured = structured
        self._argmax = argmax or (lambda x: x.argmax(-1))
        self._req_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._req_generators.pop(request_id, None)

    def _gen(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self.generator
        g = self._req_generators.get(req.request_id)
        if g is None:
            g = self._req_generators[req.request_id] = torch.Generator().manual_seed(req.params.seed)
        return g

    def sample(self, logits: torch.Tensor, reqs: list[Request], rows: list[int],
               eos_ids: set[int]) -> list[SampleResult]:
        """logits: [R, V] fp32; the i-th request samples from row rows[i]."""
        if rows != list(range(len(rows))):
            logits = logits[torch.tensor(rows)]
        processed = [i for i, r in enumerate(reqs) if self._needs_processing(r)]
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
        raw = logits
        if processed or constrained:  # in place on a copy: raw logits stay intact for logprobs
            logits = logits.clone()
            for i in processed:
                self._process(logits[i], reqs[i], eos_ids)
        if constrained:
            self._constrain(logits, raw, [reqs[i] for i in constrained], constrained)
        if all(r.params.logprobs is None for r in reqs):
            raw = None
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        out_ids = [0] * len(reqs)
        if greedy:
            picked = self._argmax(logits if len(greedy) == len(reqs) else logits[greedy])
            for i, t in zip(greedy, picked.tolist()):
                out_ids[i] = t
        for i, req in enumerate(reqs):
            if not req.params.greedy:
                out_ids[i] = self._sample_row(logits[i], req)
        results = []
        logp = torch.log_softmax(raw, -1) if raw is not None else None
        for i, req in enumerate(reqs):
            tok = out_ids[i]
            if logp is None:
                results.append(SampleResult(tok, 0.0, []))
                continue
            row = logp[i]
            lp = float(row[tok])
            top: list[tuple[int, float, int]] = []
            k = req.params.logprobs or 0
            if k:
                vals, idx = row.topk(k)
                top = [(int(t), float(v), r + 1) for r, (v, t) in enumerate(zip(vals, idx))]
            if all(t != tok for t, _, _ in top):
                top.insert(0, (tok, lp, int((row > lp).sum()) + 1))
            results.append(SampleResult(tok, lp, top))
        return results

    def _constrain(self, logits: torch.Tensor, raw: torch.Tensor, reqs: list[Request], rows: list[int]) -> None:
        """Grammar masks, after the other processors. A row they leave empty (min_tokens banning the
        end of a finished JSON value, allowed_token_ids outside the grammar) keeps the grammar only."""
        if self.structured is None:
            raise RuntimeError("a constrained request reached a sampler without structured outputs")
        self.structured.apply_masks(logits, rows, [r.grammar for r in reqs])
        empty = [i for i in rows if not torch.isfinite(logits[i]).any()]
        if empty:
            logits[empty] = raw[empty]
            self.structured.apply_masks(logits, empty, [reqs[rows.index(i)].grammar for i in empty])

    @staticmethod
    def _needs_processing(req: Request) -> bool:
        """Whether _process would change the row (most requests: no, and their logits are not copied)."""
        p = req.params
        return (p.repetition_penalty != 1.0 or bool(req.output_token_ids and (p.presence_penalty or p.frequency_penalty))
                or len(req.output_token_ids) < p.min_tokens or bool(p.logit_bias) or p.allowed_token_ids is not None
                or bool(p.bad_words_token_ids))

    @staticmethod
    def _process(row: torch.Tensor, req: Request, eos_ids: set[int]) -> None:
        """In place on one row of logits [V]."""
        p = req.params
        out = req.output_token_ids
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.prompt_token_ids) | set(out)), dtype=torch.long)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if out and (p.presence_penalty or p.frequency_penalty):
            ids, counts = torch.tensor(out).unique(return_counts=True)
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
        if p.allowed_token_ids is not None:
            keep = torch.tensor(p.allowed_token_ids, dtype=torch.long)
            kept = row[keep]
            row.fill_(float("-inf"))
            row[keep] = kept
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype))
        if p.bad_words_token_ids:
            # a one-token word is always banned; a longer one only as the token that would complete it
            banned = [w[-1] for w in p.bad_words_token_ids if len(w) == 1 or out[len(out) - len(w) + 1:] == w[:-1]]
            if banned:
                row[banned] = float("-inf")
        if len(out) < p.min_tokens:
            banned = [t for t in ({*eos_ids} if not p.ignore_eos else set()) | set(p.stop_token_ids)
                      if 0 <= t < row.shape[0]]
            if banned:
                row[banned] = float("-inf")

    def _sample_row(self, row: torch.Tensor, req: Request) -> int:
        p = req.params
        # extreme but valid parameters (repetition_penalty 1e-300, temperature 1e-5) can overflow a logit:
        # inf stays the largest finite value and nan is never sampled, so one request never fails the batch
        row = torch.nan_to_num(row / p.temperature, nan=float("-inf"), posinf=torch.finfo(row.dtype).max)
        if not torch.isfinite(row).any():  # every token banned (allowed_token_ids minus bad_words)
            return int(row.argmax())
        if p.top_k and p.top_k < row.shape[0]:
            kth = row.topk(p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, -1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sp, si = probs.sort(descending=True)
            keep = sp.cumsum(-1) - sp < p.top_p
            keep[0] = True  # the most likely token, even when top_p rounds to 0 in fp32
            probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
        return int(torch.multinomial(probs, 1, generator=self._gen(req)))
