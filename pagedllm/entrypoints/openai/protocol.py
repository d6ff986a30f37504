"""Request bodies of the OpenAI-compatible API (pydantic), with vLLM's extra parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from ... import limits

NonNegInt = Annotated[int, Field(ge=0)]
Text = Annotated[StrictStr, Field(min_length=1)]
# a token id: an integer, or a float with no fraction (JSON's 5.0 is the integer 5), never a string
TokenId = Annotated[StrictInt, Field(ge=0),
                    BeforeValidator(lambda v: int(v) if isinstance(v, float) and v.is_integer() else v)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# described here, checked by tool_calls.check_tools (whose message names the bad name)
ToolName = Annotated[str, Field(json_schema_extra={"pattern": r"^[A-Za-z0-9_-]{1,64}$"})]
# what the schema says of every body: a field it does not list is refused (unsupported_field), never ignored
_CLOSED = {"additionalProperties": False}

_NONE: Callable[[Any], bool] = lambda v: v is None
_FALSY: Callable[[Any], bool] = lambda v: not v

# Fields of the OpenAI and vLLM APIs that this server does not implement, each with the test for
# its no-op value: a request that sets one to anything else gets a 400 naming it, never a 200 that
# ignores it.
_NOT_IMPLEMENTED: dict[str, Callable[[Any], bool]] = {
    "guided_decoding_backend": lambda v: v in (None, "xgrammar", "auto"), "guided_whitespace_pattern": _NONE,
    "functions": _FALSY, "function_call": lambda v: v in (None, "none"),  # deprecated: use tools / tool_choice
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


class JSONSchemaSpec(BaseModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(True, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` body field: exactly one of these (checked by StructuredOutputsParams)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1, "maxProperties": 1})

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = Field(None, min_length=1, max_length=limits.MAX_CHOICES)
    grammar: Text | None = None
    json_object: Literal[True] | None = None
    structural_tag: dict[str, Any] | str | None = None


class _Structured(BaseModel):
    """Fields constraining the output, shared by completions and chat (vLLM's and OpenAI's names)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names for structured_outputs.*
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = Field(None, min_length=1, max_length=limits.MAX_CHOICES)
    guided_grammar: Text | None = None
    guided_json_object: bool | None = None
    structural_tag: str | None = None

    def structured_spec(self) -> tuple[str, dict] | None:
        """(field, StructuredOutputsParams fields) of the one constraint this request asks for, or None.
        Raises ValueError when two are given."""
        given: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ValueError("response_format of type json_schema needs a json_schema field")
            given.append(("response_format", {"json": rf.json_schema.json_schema}))
        if self.structured_outputs is not None:
            d = self.structured_outputs.model_dump(exclude_none=True)
            if "json_" in d:
                d["json"] = d.pop("json_")
            given.append(("structured_outputs", d))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar"), ("guided_json_object", "json_object"),
                          ("structural_tag", "structural_tag")):
            v = getattr(self, name)
            if v not in (None, False):
                given.append((name, {key: v}))
        if len(given) > 1:
            raise ValueError(f"give at most one output constraint; got {given[0][0]} and {given[1][0]}")
        return given[0] if given else None


class FunctionDefinition(BaseModel):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    class Function(BaseModel):
        name: ToolName

    type: Literal["function"]
    function: Function


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=_CLOSED)  # extras: checked by unsupported_field

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
    stop: Text | Annotated[list[Text], Field(max_length=16)] | None = None
    stop_token_ids: list[NonNegInt] | None = Field(None, max_length=limits.MAX_TOKEN_ID_LIST)
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
    bad_words: list[Annotated[StrictStr, Field(min_length=1, max_length=limits.MAX_BAD_WORD_CHARS, pattern=r"\S")]] \
        | None = Field(None, max_length=limits.MAX_BAD_WORDS)

    # token ids as keys; the ids are checked against the vocabulary by the engine
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[float, Field(ge=-100, le=100)]] | None = \
        Field(None, max_length=1024)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop must be at most 16 non-empty strings")
        return v


class CompletionRequest(_Sampling, _Structured):
    prompt: Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info):
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported by this server")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and len(v) > 256 and isinstance(v[0], (str, list)):
            raise ValueError("at most 256 prompts per request")
        return v


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class MessageToolCall(BaseModel):
    class Function(BaseModel):
        name: str
        arguments: str

    id: str
    type: Literal["function"] = "function"
    function: Function


def _message_schema(schema: dict[str, Any]) -> None:
    """The schema of a message per role, as _tool_fields accepts it (fields beyond these reach the template)."""
    props = schema["properties"]

    def role(roles: list[str], extra: dict, required: tuple[str, ...] = ()) -> dict:
        return {"type": "object", "required": ["role", *required],
                "properties": {"role": {"type": "string", "enum": roles}, "content": props["content"],
                               "name": props["name"], **extra}}

    schema.pop("properties")
    schema.pop("required", None)
    schema["oneOf"] = [role(["system", "user", "developer"], {}),
                       role(["assistant"], {"tool_calls": props["tool_calls"]}),
                       role(["tool"], {"tool_call_id": {"type": "string", "minLength": 1}}, ("tool_call_id",))]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=_message_schema)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs the tool_call_id it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def template_dict(self) -> dict:
        """The message as the chat template sees it: every field given (HF convention), text content."""
        return {**self.model_dump(exclude_none=True), "content": self.text()}


class ChatCompletionRequest(_Sampling, _Structured):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        taken = sorted(set(v or ()) & {"messages", "chat_template", "tools", "documents"})
        if taken:
            raise ValueError(f"{taken[0]} is a request field, not a chat_template_kwargs entry")
        return v


# per endpoint: fields with a no-op value that the other endpoint does not have
COMPLETION_NOOPS: dict[str, Callable[[Any], bool]] = {
    "suffix": _FALSY, "add_special_tokens": lambda v: v in (None, True)}
CHAT_NOOPS: dict[str, Callable[[Any], bool]] = {"echo": _FALSY, "add_special_tokens": _FALSY}


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(json_schema_extra=_CLOSED)

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(json_schema_extra=_CLOSED)

    model: str | None = None
    tokens: list[StrictInt]
