"""Turn logits into tokens: penalties, min_tokens, greedy or temperature / top-k / top-p /
min-p sampling with per-request generators, and top-k logprobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.request import Request
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

    def generator_for(self, req: Request) -> torch.Generator:
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
        logp = torch.log_softmax(raw, -1) if raw is not None else None  # [R, V], once for the batch
        return [self._result(logp[i] if logp is not None else None, out_ids[i], req.params.logprobs)
                for i, req in enumerate(reqs)]

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
        probs = self.probs(row, req)
        if probs is None:
            return int(row.argmax())
        return int(torch.multinomial(probs, 1, generator=self.generator_for(req)))

    def probs(self, row: torch.Tensor, req: Request) -> torch.Tensor | None:
        """The distribution a sampled request draws from (temperature, top-k, min-p, top-p), or None
        when every token is banned."""
        p = req.params
        # extreme but valid parameters (repetition_penalty 1e-300, temperature 1e-5) can overflow a logit:
        # inf stays the largest finite value and nan is never sampled, so one request never fails the batch
        row = torch.nan_to_num(row / p.temperature, nan=float("-inf"), posinf=torch.finfo(row.dtype).max)
        if not torch.isfinite(row).any():  # every token banned (allowed_token_ids minus bad_words)
            return None
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
        return probs

    # ---- speculative decoding --------------------------------------------------------------
    def verify(self, logits: torch.Tensor, req: Request, drafts: list[int], eos_ids: set[int],
               draft_probs: torch.Tensor | None = None) -> tuple[list[SampleResult], int]:
        """logits: [1 + k, V] fp32, row i scoring the token after the i-th scheduled one; drafts: the
        k proposals. Returns the emitted tokens: the accepted proposals, then one of the target's own
        (the correction at the first rejection, or a bonus token after k acceptances). Greedy accepts
        exact matches; sampling accepts d with probability min(1, p(d) / q(d)) and on rejection draws
        from max(p - q, 0) renormalised (q: the draft model's distribution, a point mass for n-gram
        proposals), so the emitted tokens are distributed as p. Each row is processed (penalties,
        min_tokens, grammar) as if the tokens before it were already outputs; a grammar's matcher
        ends having accepted the emitted tokens. Also returns how many proposals were accepted (all
        emitted but the last, unless a stop token among the proposals ended it)."""
        p = req.params
        out: list[SampleResult] = []
        accepted = 0
        n0 = len(req.output_token_ids)
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids)
        try:
            for i in range(len(drafts) + 1):
                row = logits[i].clone()
                if self._needs_processing(req):
                    self._process(row, req, eos_ids)
                if req.grammar is not None:
                    self._constrain(row[None], logits[i:i + 1], [req], [0])
                d = drafts[i] if i < len(drafts) else None
                if p.greedy:
                    tok = int(row.argmax())
                else:
                    probs = self.probs(row, req)
                    if probs is None:
                        tok = int(row.argmax())
                    elif d is None:
                        tok = int(torch.multinomial(probs, 1, generator=self.generator_for(req)))
                    else:
                        q = draft_probs[i] if draft_probs is not None else None
                        qd = float(q[d]) if q is not None else 1.0
                        u = float(torch.rand(1, generator=self.generator_for(req)))
                        if qd > 0 and u < min(1.0, float(probs[d]) / qd):
                            tok = d
                        else:
                            resid = (probs - q).clamp_(min=0) if q is not None else probs.clone()
                            if q is None:
                                resid[d] = 0
                            tok = int(torch.multinomial(resid, 1, generator=self.generator_for(req))) if resid.sum() > 0 \
                                else int(probs.argmax())
                            d = None  # rejected: the token drawn is the target's own, even if it equals d
                out.append(self._result(torch.log_softmax(logits[i], -1) if p.logprobs is not None else None, tok,
                                        p.logprobs))
                accepted += tok == d
                req.output_token_ids.append(tok)  # the next row's context (undone below)
                if req.grammar is not None:
                    req.grammar.accept_token(tok)
                if tok != d or (tok in stops and len(req.output_token_ids) >= p.min_tokens) or \
                        (req.grammar is not None and req.grammar.is_terminated()):
                    break
        finally:
            del req.output_token_ids[n0:]
        return out, accepted

    @staticmethod
    def _result(logp: torch.Tensor | None, tok: int, k: int | None) -> SampleResult:
        """logp: the row's log-probabilities [V] (None: no request of the batch wants logprobs)."""
        if logp is None or k is None:
            return SampleResult(tok, 0.0, [])
        lp = float(logp[tok])
        top: list[tuple[int, float, int]] = []
        if k:
            vals, idx = logp.topk(k)
            top = [(int(t), float(v), r + 1) for r, (v, t) in enumerate(zip(vals, idx))]
        if all(t != tok for t, _, _ in top):
            top.insert(0, (tok, lp, int((logp > lp).sum()) + 1))
        return SampleResult(tok, lp, top)
