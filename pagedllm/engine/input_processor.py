"""A request's inputs checked and prepared before it reaches the scheduler: prompts tokenized and their ids
checked against the vocabulary, sampling parameters checked against the model, bad words tokenized,
grammars compiled. Work linear in the request's size; nothing here touches the engine's state, so a
server runs it on any thread, off the step loop."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequestError
from ..sample.structured_outputs import StructuredOutputs
from ..sampling_params import SamplingParams, StructuredOutputsParams
from ..tokenizer import Tokenizer

PromptType = str | list[int] | dict


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int, max_logprobs: int,
                 structured: StructuredOutputs | None) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.max_logprobs, self.structured = max_logprobs, structured

    def prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a string, a list of ids or a {"prompt" | "prompt_token_ids"} dict."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; pass {'prompt_token_ids': [...]}")
            return prompt, self.check_ids(self.tokenizer.encode(prompt, max_tokens=self.max_model_len))
        if isinstance(prompt, (list, tuple)):
            return None, self.check_ids(list(prompt))
        raise InvalidRequestError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def check_ids(self, ids: list) -> list[int]:
        if not ids:
            raise InvalidRequestError("prompt is empty (no tokens)")
        vocab = self.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequestError(f"token id {t!r} is outside the vocabulary [0, {vocab})")
        return list(ids)

    def compile_grammar(self, spec: StructuredOutputsParams) -> Any:
        """Compile (and cache) a structured-outputs spec. Raises InvalidRequestError."""
        if self.structured is None:
            raise InvalidRequestError("structured outputs need a tokenizer; this model has none")
        return self.structured.compile(spec)

    def prepare_params(self, params: SamplingParams) -> SamplingParams:
        """Check what params name against the model (token ids, logprobs), tokenize bad_words and compile
        the grammar (cached, so add_request finds it compiled). Raises InvalidRequestError."""
        vocab = self.vocab_size
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            bad = next((t for t in (getattr(params, name) or []) if t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")
        if params.logprobs is not None and params.logprobs > min(self.max_logprobs, vocab):
            raise InvalidRequestError(f"logprobs of {params.logprobs} is over the limit of "
                                      f"{min(self.max_logprobs, vocab)} (max_logprobs)")
        if params.structured_outputs is not None:
            self.compile_grammar(params.structured_outputs)
        if not params.bad_words or params.bad_words_token_ids is not None:
            return params
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words needs a tokenizer; this model has none")
        seqs: dict[tuple[int, ...], None] = {}  # ordered and de-duplicated in linear time
        for word in params.bad_words:  # as vLLM: the word alone and after a space, as the model would spell it
            for text in (word.strip(), " " + word.strip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids:
                    seqs[tuple(ids)] = None
        return SamplingParams(**{**params.__dict__, "bad_words_token_ids": [list(w) for w in seqs]})
