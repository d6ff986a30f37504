"""Sampling parameters, named and validated as in vLLM's offline API."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

from . import limits
from .errors import InvalidRequestError

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output, as vLLM names it: exactly one of a JSON schema (dict or JSON
    text), a regex, a choice list, an EBNF grammar (GBNF / xgrammar syntax), any JSON object, or a
    structural tag (xgrammar's JSON form). Compiled by structured_outputs.py."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | dict | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(f"structured_outputs needs exactly one of {', '.join(_KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or any(not isinstance(c, str) or not c for c in self.choice):
                raise InvalidRequestError("structured_outputs.choice must be a non-empty list of non-empty strings")
            if len(self.choice) > limits.MAX_CHOICES:
                raise InvalidRequestError(f"structured_outputs.choice has {len(self.choice)} entries; the limit is "
                                 f"{limits.MAX_CHOICES}")
            if sum(map(len, self.choice)) > limits.MAX_GRAMMAR_CHARS:
                raise InvalidRequestError(f"structured_outputs.choice is over {limits.MAX_GRAMMAR_CHARS} characters")
            for c in self.choice:
                limits.check_unicode(c, "structured_outputs.choice")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "structural_tag"):
            v = getattr(self, name)
            if isinstance(v, str):
                try:
                    v = json.loads(v)
                except json.JSONDecodeError as e:
                    raise InvalidRequestError(f"structured_outputs.{name} is not valid JSON: {e}") from None
            if v is not None and not isinstance(v, (dict, bool)):
                raise InvalidRequestError(f"structured_outputs.{name} must be a JSON object, got {type(v).__name__}")
            if v is not None:  # canonical text: the compile cache key, and hashable
                object.__setattr__(self, name, json.dumps(v))  # key order kept: it is the output order
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidRequestError(f"structured_outputs.{name} must be a non-empty string")
        for name in ("json", "regex", "grammar", "structural_tag"):
            v = getattr(self, name)
            if isinstance(v, str):
                limits.check_unicode(v, f"structured_outputs.{name}")
            if isinstance(v, str) and len(v) > limits.MAX_GRAMMAR_CHARS:
                raise InvalidRequestError(f"structured_outputs.{name} is {len(v)} characters; the limit is "
                                 f"{limits.MAX_GRAMMAR_CHARS}")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, Any]:
        """What the compile cache is keyed on."""
        return self.kind, getattr(self, self.kind)

    @classmethod
    def from_dict(cls, d: dict) -> StructuredOutputsParams:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise InvalidRequestError(f"structured_outputs: unknown field {unknown[0]!r} (known: {', '.join(sorted(names))})")
        return cls(**{k: v for k, v in d.items() if v is not None})


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI: -100..100)
    allowed_token_ids: list[int] | None = None  # sample only among these (vLLM)
    bad_words: list[str] | None = None  # words never generated (vLLM); the engine tokenizes them
    bad_words_token_ids: list[list[int]] | None = None  # set by the engine from bad_words
    structured_outputs: StructuredOutputsParams | None = None  # a dict is taken too

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (list, tuple)):
                raise InvalidRequestError(f"{name} must be a list, got {type(v).__name__}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError, OverflowError):
                raise InvalidRequestError("logit_bias must map token ids to numbers") from None
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequestError(f"structured_outputs must be a StructuredOutputsParams or a dict, "
                             f"got {type(self.structured_outputs).__name__}")
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> None:
            value = repr(getattr(self, name))
            raise InvalidRequestError(f"{name} {why}, got {value if len(value) <= 80 else value[:77] + '...'}")

        def integer(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def real(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                    and (lo < v if lo_open else lo <= v) and v <= hi):
                bad(name, f"must be a finite number {'>' if lo_open else '>='} {lo}" if hi == math.inf else
                    f"must be a finite number in {'(' if lo_open else '['}{lo}, {hi}]")

        def token_ids(name: str, values: Any) -> None:
            if len(values) > limits.MAX_TOKEN_ID_LIST:
                bad(name, f"has {len(values)} entries; the limit is {limits.MAX_TOKEN_ID_LIST}")
            if any(not integer(t) or t < 0 for t in values):
                bad(name, "must be non-negative integer token ids")

        if not integer(self.n) or not 1 <= self.n <= limits.MAX_N:
            bad("n", f"must be an integer in [1, {limits.MAX_N}]")
        real("temperature", 0, math.inf)
        real("top_p", 0, 1, lo_open=True)
        if not integer(self.top_k) or self.top_k < 0:
            bad("top_k", "must be -1, 0 (disabled) or a positive integer")
        real("min_p", 0, 1)
        real("presence_penalty", -2, 2)
        real("frequency_penalty", -2, 2)
        real("repetition_penalty", 0, math.inf, lo_open=True)
        if self.max_tokens is not None and (not integer(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not integer(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not integer(self.logprobs) or self.logprobs < 0):
            bad("logprobs", "must be an integer >= 0")
        if self.seed is not None and (not integer(self.seed) or not limits.SEED_MIN <= self.seed <= limits.SEED_MAX):
            bad("seed", f"must be an integer in [{limits.SEED_MIN}, {limits.SEED_MAX}]")
        if len(self.stop) > limits.MAX_STOP_STRINGS:
            bad("stop", f"has {len(self.stop)} strings; the limit is {limits.MAX_STOP_STRINGS}")
        if any(not isinstance(s, str) or not s or len(s) > limits.MAX_STOP_STRING_CHARS for s in self.stop):
            bad("stop", f"must be non-empty strings of at most {limits.MAX_STOP_STRING_CHARS} characters")
        for s in self.stop:
            limits.check_unicode(s, "stop")
        token_ids("stop_token_ids", self.stop_token_ids)
        if self.logit_bias:
            token_ids("logit_bias", list(self.logit_bias))
            if any(not math.isfinite(v) or not -100 <= v <= 100 for v in self.logit_bias.values()):
                bad("logit_bias", "values must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
            token_ids("allowed_token_ids", self.allowed_token_ids)
        if self.bad_words is not None:
            if len(self.bad_words) > limits.MAX_BAD_WORDS:
                bad("bad_words", f"has {len(self.bad_words)} words; the limit is {limits.MAX_BAD_WORDS}")
            if any(not isinstance(w, str) or not w.strip() or len(w) > limits.MAX_BAD_WORD_CHARS
                   for w in self.bad_words):
                bad("bad_words", f"must be non-empty strings of at most {limits.MAX_BAD_WORD_CHARS} characters")
            for w in self.bad_words:
                limits.check_unicode(w, "bad_words")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone_for_child(self, index: int) -> SamplingParams:
        """Params of the index-th of n samples: n=1, and a distinct derived seed."""
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed > limits.SEED_MAX:  # wraps into the negative seeds torch also takes
            seed -= 2**64
        return SamplingParams(**{**self.__dict__, "n": 1, "seed": seed})
