"""Benchmark and test workloads: random token ids with a seed, exact lengths (ignore_eos)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass
class WorkItem:
    prompt_token_ids: list[int]
    max_tokens: int


def mixed(num_requests: int = 64, vocab_size: int = 49152, seed: int = 0,
          prompt_range: tuple[int, int] = (16, 384), output_range: tuple[int, int] = (8, 256)) -> list[WorkItem]:
    """The seed's situation: prompts of 16..384 tokens, long-tailed outputs of 8..256 tokens."""
    rng = random.Random(seed)
    lo, hi = output_range
    items = []
    for _ in range(num_requests):
        n_prompt = rng.randint(*prompt_range)
        # long tail: most outputs short, a few near the maximum
        n_out = min(hi, max(lo, round(lo * (hi / lo) ** (rng.random() ** 2))))
        items.append(WorkItem([rng.randrange(vocab_size) for _ in range(n_prompt)], n_out))
    return items


def shared_prefix(num_requests: int = 64, vocab_size: int = 49152, seed: int = 0, prefix_len: int = 512,
                  suffix_range: tuple[int, int] = (16, 64), output_range: tuple[int, int] = (16, 64)) -> list[WorkItem]:
    """num_requests requests behind one system prompt of prefix_len tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    return [WorkItem(prefix + [rng.randrange(vocab_size) for _ in range(rng.randint(*suffix_range))],
                     rng.randint(*output_range)) for _ in range(num_requests)]


def from_jsonl(path: str | Path, tokenizer=None) -> list[WorkItem]:
    """Lines of {"prompt": str | "prompt_token_ids": [...], "max_tokens": int}."""
    items = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        d = json.loads(line)
        if "prompt_token_ids" in d:
            ids = list(d["prompt_token_ids"])
        elif "prompt" in d and tokenizer is not None:
            ids = tokenizer.encode(d["prompt"])
        else:
            raise ValueError(f"{path}:{i + 1}: needs prompt_token_ids (or prompt with a tokenizer)")
        items.append(WorkItem(ids, int(d.get("max_tokens", 128))))
    return items
