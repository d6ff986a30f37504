"""Accuracy of KV storage choices: perplexity over a text and greedy agreement."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch

from ..core.request import Request
from ..core.scheduler import ScheduledRequest, SchedulerOutput
from ..engine.llm_engine import LLMEngine
from ..errors import ConfigError
from ..sampling_params import SamplingParams

EVAL_TEXT = Path(__file__).parent / "data" / "english.txt"  # the default text of `pagedllm eval` / `eval-kv`


def read_eval_text(path: str | None) -> str:
    try:
        return Path(path or EVAL_TEXT).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the evaluation text {path!r}: {e}") from e


def chunk_logits(engine: LLMEngine, token_ids: list[int], chunk: int = 512) -> Iterator[tuple[int, torch.Tensor]]:
    """Teacher-forced logits of every position, prefilled in chunks through the paged cache:
    yields (start, logits [n, vocab]). Every chunk attends to what the KV cache holds (quantized,
    for fp8) of the earlier tokens."""
    if len(token_ids) > engine.max_model_len:
        raise ValueError(f"text of {len(token_ids)} tokens exceeds max_model_len {engine.max_model_len}")
    bm = engine.block_manager
    rid = "__score__"
    req = Request(rid, token_ids, SamplingParams(max_tokens=1))
    states = engine.scheduler.state_slots  # a model with linear-attention layers: the text's state needs a slot
    if states is not None:
        taken = states.take(1)
        if taken is None:
            raise RuntimeError("no free state slot for the text")
        req.state_slot = taken[0]
    done = 0
    try:
        while done < len(token_ids):
            n = min(chunk, len(token_ids) - done)
            if bm.allocate_slots(rid, token_ids, done, n) is None:
                raise RuntimeError("KV pool too small for the text")
            req.num_computed_tokens = done
            sched = SchedulerOutput([ScheduledRequest(req, n)])
            res = engine.execute(sched, all_logits=True)  # every rank scores the chunk
            yield done, res.logits
            done += n
    finally:
        engine.free_blocks(rid)
        if req.state_slot is not None:
            states.give(req.state_slot)


def perplexity(engine: LLMEngine, token_ids: list[int], chunk: int = 512) -> float:
    nll, count = 0.0, 0
    for start, logits in chunk_logits(engine, token_ids, chunk):
        targets = torch.tensor(token_ids[start + 1:start + len(logits) + 1], dtype=torch.long)
        k = len(targets)  # the text's last token has no target
        nll -= float(torch.log_softmax(logits[:k], -1)[torch.arange(k), targets].sum())
        count += k
    return math.exp(nll / count)


def greedy_agreement(ref: list[list[int]], other: list[list[int]]) -> float:
    """Fraction of positions where two sets of greedy continuations agree."""
    same = total = 0
    for a, b in zip(ref, other):
        total += len(a)
        same += sum(x == y for x, y in zip(a, b))
    return same / total if total else 1.0


def compare_to_reference(ref: LLMEngine, other: LLMEngine, token_ids: list[int], chunk: int = 512) -> dict:
    """Teacher-forced on one text: perplexity of both, mean KL(ref || other) per position, and how often
    the top-1 tokens agree. For weight formats, against an fp32 engine on the same weights."""
    nll = {"ref": 0.0, "other": 0.0}
    kl_sum, agree, count = 0.0, 0, 0
    for (start, a), (_, b) in zip(chunk_logits(ref, token_ids, chunk), chunk_logits(other, token_ids, chunk)):
        targets = torch.tensor(token_ids[start + 1:start + len(a) + 1], dtype=torch.long)
        k = len(targets)
        la, lb = torch.log_softmax(a[:k].double(), -1), torch.log_softmax(b[:k].double(), -1)  # [k, vocab]
        rows = torch.arange(k)
        nll["ref"] -= float(la[rows, targets].sum())
        nll["other"] -= float(lb[rows, targets].sum())
        kl_sum += float((la.exp() * (la - lb)).sum())
        agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
        count += k
    return {"tokens": count, "perplexity_ref": math.exp(nll["ref"] / count),
            "perplexity": math.exp(nll["other"] / count), "mean_kl": kl_sum / count, "top1_agreement": agree / count}
