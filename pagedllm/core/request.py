"""One sequence being generated: its tokens, progress and state. No torch here."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from ..sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """A sequence. With n > 1 the engine makes n of them; children wait in their leader's
    `pending_forks` and are forked from it (sharing its prompt blocks) when its prompt is done."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    group_id: str = ""
    index: int = 0  # which of the group's n samples this is
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    pending_forks: list[Request] = field(default_factory=list)
    admitted_seq: int = -1  # order of (re)admission; the latest admitted is preempted first
    state_slot: int | None = None  # its linear-attention state's slot (state_slots.py), held while admitted
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # sampler state kept across steps
    cumulative_logprob: float = 0.0
    logprobs: list = field(default_factory=list)
    grammar: Any = None  # structured outputs: the matcher of this sequence's grammar (structured_outputs.py)
    # speculative decoding (spec_decode.py): this step's proposed tokens (never outputs until verified),
    # the positions whose draft-model KV is valid, and the acceptance history that gates proposing
    spec_tokens: list[int] = field(default_factory=list)
    draft_computed: int = 0
    spec_history: list[float] = field(default_factory=list)  # accepted fraction of each recent proposal
    spec_pause: int = 0  # steps left without proposals

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end): prompt, then outputs, then this step's proposals."""
        n = self.num_tokens
        if end > n:
            return self.tokens_slice(start, n) + self.spec_tokens[max(0, start - n):end - n] if start < n \
                else self.spec_tokens[start - n:end - n]
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens  # type: ignore[return-value]

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished
