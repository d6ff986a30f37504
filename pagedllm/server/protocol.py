"""Request bodies of the OpenAI-compatible API (pydantic), with vLLM's extra parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

NonNegInt = Annotated[int, Field(ge=0)]

_NONE: Callable[[Any], bool] = lambda v: v is None
_FALSY: Callable[[Any], bool] = lambda v: not v

# Fields of the OpenAI and vLLM APIs that this server does not implement, each with the test for
# its no-op value: a request that sets one to anything else gets a 400 naming it, never a 200 that
# ignores it. Structured outputs and tools are their own issue.
_NOT_IMPLEMENTED: dict[str, Callable[[Any], bool]] = {
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "structured_outputs": _NONE, "guided_json": _NONE, "guided_regex": _NONE, "guided_choice": _NONE,
    "guided_grammar": _NONE, "guided_json_object": _FALSY, "guided_decoding_backend": _NONE,
    "guided_whitespace_pattern": _NONE, "structural_tag": _NONE,
    "tools": _FALSY, "tool_choice": lambda v: v in (None, "none"), "functions": _FALSY,
    "function_call": lambda v: v in (None, "none"), "parallel_tool_calls": lambda v: True,  # moot without tools
    "prompt_logprobs": _NONE, "use_beam_search": _FALSY, "length_penalty": lambda v: v in (None, 1, 1.0),
    "truncate_prompt_tokens": _NONE, "logits_processors": _FALSY, "return_tokens_as_token_ids": _FALSY,
    "return_token_ids": _FALSY, "prompt_embeds": _NONE, "documents": _FALSY, "mm_processor_kwargs": _FALSY,
    "kv_transfer_params": _NONE, "vllm_xargs": _FALSY, "request_id": _NONE, "continue_final_message": _FALSY,
    "spaces_between_special_tokens": lambda v: v in (None, True), "audio": _NONE, "prediction": _NONE,
    "modalities": lambda v: v in (None, ["text"]), "web_search_options": _NONE, "reasoning_effort": _NONE,
    "verbosity": _NONE, "store": _FALSY, "service_tier": lambda v: v in (None, "auto", "default"),
    "top_logprobs": _NONE,  # completions take logprobs=N instead
}
# Identifiers and bookkeeping that change nothing about the output: accepted.
_ACCEPTED = {"user", "metadata", "prompt_cache_key", "safety_identifier"}


def unsupported_field(extra: dict[str, Any] | None, endpoint_defaults: dict[str, Callable[[Any], bool]]
                      ) -> tuple[str, str] | None:
    """(field, message) for the first field of a request body that would be silently ignored."""
    for name, value in (extra or {}).items():
        if name in _ACCEPTED:
            continue
        test = endpoint_defaults.get(name) or _NOT_IMPLEMENTED.get(name)
        if test is None:
            return name, f"unrecognized request argument supplied: {name}"
        if not test(value):
            return name, f"{name} is not supported by this server (got {value!r})"
    return None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # extras are checked by unsupported_field, never ignored

    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = None
    allowed_token_ids: list[NonNegInt] | None = Field(None, min_length=1)
    bad_words: list[StrictStr] | None = None

    # keys and the -100..100 range are checked by SamplingParams, the ids against the vocabulary by the engine
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):  # noqa: ANN001, ANN206
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop must be at most 16 non-empty strings")
        return v


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info):  # noqa: ANN001, ANN206
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported by this server")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):  # noqa: ANN001, ANN206
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and len(v) > 256 and isinstance(v[0], (str, list)):
            raise ValueError("at most 256 prompts per request")
        return v


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def template_dict(self) -> dict:
        """The message as the chat template sees it: every field given (HF convention), text content."""
        return {**self.model_dump(exclude_none=True), "content": self.text()}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# per endpoint: fields with a no-op value that the other endpoint does not have
COMPLETION_NOOPS: dict[str, Callable[[Any], bool]] = {
    "suffix": _FALSY, "add_special_tokens": lambda v: v in (None, True)}
CHAT_NOOPS: dict[str, Callable[[Any], bool]] = {"echo": _FALSY, "add_special_tokens": _FALSY}


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[StrictInt]
