"""From sampled tokens to what a user sees: a request's n sequences as one group, incremental
detokenization, stop strings (held back while one may still be completing), stop tokens, lengths, and the
RequestOutput of a group. Decides; the engine acts (finishes sequences, frees blocks)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..core.request import Request, RequestStatus
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams
from ..tokenizer import IncrementalDetokenizer


@dataclass
class RequestGroup:
    """One user request: n sequences sharing a prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer | None]
    texts: list[str] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    error: BaseException | None = None  # what failed it inside a step


Stop = tuple[RequestStatus, int | str | None]  # how a sequence ends and its stop_reason


def check_stop(g: RequestGroup, seq: Request, n_out: int, eos_token_ids: set[int], max_model_len: int) -> Stop | None:
    """Whether the n_out-th output token ends seq (and how); advances its detokenized text either way."""
    tok = seq.output_token_ids[n_out - 1]
    p = seq.params
    detok = g.detoks[seq.index]
    if detok is not None:
        delta = detok.add(tok)
        if p.stop and delta:
            text = detok.text
            longest = max(map(len, p.stop))
            window_start = max(0, len(text) - len(delta) - longest + 1)
            hits = [(text.find(st, window_start), st) for st in p.stop]
            hits = [(i, st) for i, st in hits if i >= 0]
            if hits:
                i, st = min(hits)
                g.texts[seq.index] = text[:i + len(st)] if p.include_stop_str_in_output else text[:i]
                return RequestStatus.FINISHED_STOPPED, st
    if seq.grammar is not None and n_out == len(seq.output_token_ids) and seq.grammar.is_terminated():
        return RequestStatus.FINISHED_STOPPED, None  # it accepted a stop token where it may end
    if n_out >= p.min_tokens:
        if not p.ignore_eos and tok in eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if tok in p.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, tok
    if n_out >= p.max_tokens or seq.num_prompt_tokens + n_out >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    if detok is not None:
        hold = max(map(len, p.stop), default=1) - 1  # a stop string may still be completing
        g.texts[seq.index] = detok.text[:len(detok.text) - hold] if hold else detok.text
    return None


def finish_text(g: RequestGroup, seq: Request, reason: int | str | None) -> None:
    """A sequence that ends on anything but a stop string shows all of its text."""
    detok = g.detoks[seq.index]
    if detok is not None and not isinstance(reason, str):
        detok.flush()
        g.texts[seq.index] = detok.text


def make_output(g: RequestGroup) -> RequestOutput:
    comps = []
    for seq, text in zip(g.seqs, g.texts):
        comps.append(CompletionOutput(
            index=seq.index, text=text, token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            finish_reason=seq.status.value if seq.is_finished else None,
            stop_reason=seq.stop_reason))
    leader = g.seqs[0]
    finished = all(s.is_finished for s in g.seqs)
    metrics = {"arrival_time": leader.arrival_time, "first_scheduled_time": leader.first_scheduled_time,
               "first_token_time": leader.first_token_time,
               "finished_time": max((s.finished_time or 0) for s in g.seqs) if finished else None,
               "num_preemptions": sum(s.num_preemptions for s in g.seqs)}
    error = None if g.error is None else f"{type(g.error).__name__}: {g.error}"
    return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, comps, finished,
                         leader.num_cached_tokens, metrics, error)
