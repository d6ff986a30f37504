"""Speculative decoding: what to propose (n-gram prompt lookup, or a draft model), when to stop
proposing, and the counters. No torch here: the draft model's tensors live in draft_model.py and
verification (exact match when greedy, rejection sampling otherwise) in sampler.py.

A speculating decode schedules 1 + k tokens (its last token and k proposals) in the same batch as
everything else; the target scores them in one pass and keeps the longest verified prefix plus
one token of its own, so outputs are distributed exactly as without speculation. Rejected
proposals' slots are rolled back (BlockManager.truncate).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..core.request import Request
from ..errors import ConfigError
from ..settings import config_from

METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """vLLM's names. disable_by_batch_size: no proposals while more sequences than this run (a full
    batch is compute-bound: scoring proposals there costs what it saves)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # the draft model (method draft_model): same tokenizer
    disable_by_batch_size: int | None = 4
    # adaptive: a request whose last `window` proposals kept under min_acceptance of their tokens
    # stops proposing for `pause_steps` steps
    window: int = 8
    min_acceptance: float = 0.25
    pause_steps: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"speculative_config.num_speculative_tokens must be in [1, 16], "
                              f"got {self.num_speculative_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ConfigError("speculative_config.method 'draft_model' needs a model (an HF folder or .gguf)")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ConfigError(f"speculative_config.disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        return None if value is None else config_from(cls, "speculative_config", value)


@dataclass
class SpecDecodeCounters:
    """vLLM's spec_decode counters: proposals made, tokens proposed, tokens accepted, and accepted
    tokens by position within a proposal."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.append(0)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1


class Proposer(Protocol):
    def propose(self, req: Request, k: int) -> list[int]: ...


class NgramProposer:
    """Prompt lookup: the last n tokens (n from prompt_lookup_max down to min) matched against the
    request's earlier prompt and output; propose what followed the latest match. Each sequence's
    tokens are kept as a byte string, so a match is one C-speed rfind."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._text: dict[str, tuple[bytearray, int]] = {}  # request id -> (int32 bytes, tokens in it)

    def forget(self, request_id: str) -> None:
        self._text.pop(request_id, None)

    def _tokens(self, req: Request) -> bytearray:
        buf, n = self._text.get(req.request_id, (bytearray(), 0))
        if n > req.num_tokens:  # cannot shrink in practice (preemption keeps tokens); rebuild if it does
            buf, n = bytearray(), 0
        if n < req.num_tokens:
            buf += array("i", req.tokens_slice(n, req.num_tokens)).tobytes()
            n = req.num_tokens
        self._text[req.request_id] = (buf, n)
        return buf

    def propose(self, req: Request, k: int) -> list[int]:
        buf = self._tokens(req)
        total = len(buf) // 4
        for n in range(min(self.config.prompt_lookup_max, total - 1), self.config.prompt_lookup_min - 1, -1):
            pattern = bytes(buf[-4 * n:])
            end = len(buf) - 4  # the match must start before the suffix itself
            while True:
                at = buf.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:  # aligned on a token
                    start = at // 4 + n
                    follow = array("i", bytes(buf[4 * start:4 * min(total, start + k)]))
                    if follow:
                        return list(follow)
                    break
                end = at + len(pattern) - 1
        return []


def should_propose(req: Request) -> bool:
    """Adaptive gate: pause a request whose recent proposals were mostly rejected."""
    if req.spec_pause > 0:
        req.spec_pause -= 1
        return False
    return True


def record_acceptance(req: Request, proposed: int, accepted: int, config: SpeculativeConfig) -> None:
    hist = req.spec_history
    hist.append(accepted / proposed)
    del hist[:-config.window]
    if len(hist) == config.window and sum(hist) < config.min_acceptance * config.window:
        req.spec_pause = config.pause_steps
        hist.clear()


def propose_for(running: Sequence[Request], proposer: Proposer, config: SpeculativeConfig, max_model_len: int,
                placeholders: bool) -> None:
    """Set each running decode's `spec_tokens` for this step: none while the batch is large, for paused
    requests, or where the proposer finds nothing; a grammar cuts them at its first rejection (placeholders:
    the proposer's tokens are stand-ins until a draft model runs, so no grammar sees them)."""
    large = config.disable_by_batch_size is not None and len(running) > config.disable_by_batch_size
    for req in running:
        req.spec_tokens = []
        if large or req.num_tokens - req.num_computed_tokens != 1 or req.pending_forks:
            continue
        k = min(config.num_speculative_tokens, req.max_tokens - len(req.output_token_ids) - 1,
                max_model_len - req.num_tokens - 1)
        if k < 1 or not should_propose(req):
            continue
        drafts = proposer.propose(req, k)
        if req.grammar is not None and drafts and not placeholders:
            n = 0
            while n < len(drafts) and req.grammar.accept_token(drafts[n]):
                n += 1
            if n:
                req.grammar.rollback(n)
            del drafts[n:]
        req.spec_tokens = drafts
