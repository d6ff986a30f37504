"""Structured outputs: a request's grammar, compiled once per distinct spec, and one token bitmask
per constrained sequence per step.

Built on xgrammar (vLLM's default backend). The compiler and its TokenizerInfo are made on first
use. `compile` is cached and safe from any thread, so the server compiles in a worker thread before
a request reaches the engine loop: unconstrained requests never wait for a compile, and a
constrained one waits only for its own. Each constrained sequence holds a matcher (`Request.grammar`)
that advances with every accepted token; it survives preemption (recompute keeps the output tokens)
and is made fresh for each of n samples.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutputsParams
from ..tokenizer import Tokenizer

MaskRows = Callable[[torch.Tensor, torch.Tensor, list[int]], bool]  # the layer backend's grammar-mask apply

log = logging.getLogger("pagedllm")
CACHE_ENTRIES = 512  # compiled grammars kept (least recently used dropped): a server sees unbounded distinct schemas

# JSON-schema keywords xgrammar would silently ignore: a schema using one is refused by name,
# since an output that "validates" against the grammar could still fail the schema.
UNSUPPORTED_SCHEMA_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "uniqueItems",
    "contains", "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems", "$dynamicRef",
    "$recursiveRef"})
# keywords whose values are schemas (or maps / lists of them), walked for the check above
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "propertyNames")


def check_json_schema(schema: Any, path: str = "#") -> None:
    """Raise InvalidRequestError naming the first keyword the grammar cannot enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"JSON schema at {path} must be an object or a boolean, got {type(schema).__name__}")
    for kw in schema:
        if kw in UNSUPPORTED_SCHEMA_KEYWORDS:
            raise InvalidRequestError(f"JSON schema keyword {kw!r} (at {path}) is not supported by structured outputs")
    if len(schema.get("allOf", [])) > 1:
        raise InvalidRequestError(f"JSON schema keyword 'allOf' with more than one schema (at {path}) is not "
                                  "supported by structured outputs; merge them into one schema")
    for kw in _SUBSCHEMA_MAPS:
        for name, sub in (schema.get(kw) or {}).items():
            check_json_schema(sub, f"{path}/{kw}/{name}")
    for kw in _SUBSCHEMA_LISTS:
        for i, sub in enumerate(schema.get(kw) or []):
            check_json_schema(sub, f"{path}/{kw}/{i}")
    for kw in _SUBSCHEMA_ONE:
        if kw in schema:
            check_json_schema(schema[kw], f"{path}/{kw}")


def validate_json_schema(schema: Any) -> None:
    """A valid JSON Schema (its metaschema says) that uses only keywords the grammar enforces."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(map(str, e.absolute_path)) or "the root"
        raise InvalidRequestError(f"invalid JSON schema (at {where}): {e.message}") from None
    check_json_schema(schema)


INT64 = (-(2**63), 2**63 - 1)


def bound_integers(schema: Any) -> Any:
    """A copy of schema where every integer without a bound gets int64's: JSON allows any number
    of digits, and a small model at temperature > 0 can write digits until max_tokens runs out."""
    if isinstance(schema, list):
        return [bound_integers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bound_integers(v) if k != "enum" and k != "const" else v for k, v in schema.items()}
    if out.get("type") == "integer":
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = INT64[0]
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = INT64[1]
    return out


def _compiler_message(e: Exception) -> str:
    """xgrammar's C++ errors read '[time] /path/file.cc:LINE: message': keep the message."""
    text = str(e).strip()
    head, sep, rest = text.partition(": ")
    return rest if sep and head.startswith("[") else text


@dataclass
class StructuredOutputStats:
    num_compiles: int = 0
    compile_seconds: float = 0.0
    num_cache_hits: int = 0
    mask_seconds: float = 0.0  # filling and applying bitmasks, all steps
    mask_steps: int = 0
    mask_rows: int = 0
    tokenizer_info_seconds: float = 0.0


class StructuredOutputs:
    """The engine's grammar compiler: specs in, compiled grammars and per-sequence matchers out."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: set[int], max_threads: int = 2,
                 mask_rows: MaskRows | None = None) -> None:
        """mask_rows(logits, bitmask, rows) -> whether it applied the masks (the layer backend's; else, or when it
        declines, xgrammar's CPU apply)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_threads = max_threads
        self.mask_rows = mask_rows
        self.stats = StructuredOutputStats()
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._bitmask: torch.Tensor | None = None

    # ---- compile (any thread) ------------------------------------------------------------
    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                t0 = time.perf_counter()
                self._compiler = xgr.GrammarCompiler(self._tokenizer_info(), max_threads=self.max_threads)
                self.stats.tokenizer_info_seconds = time.perf_counter() - t0
            return self._compiler

    def _tokenizer_info(self) -> Any:
        """xgrammar's view of the vocabulary. Special tokens are blanked (so never allowed inside a
        constrained output: `<|im_end|>` is no JSON text); the stop tokens are allowed where the grammar
        may end. Vocabulary type and prefix space are detected by xgrammar from the tokenizer."""
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        tok = self.tokenizer.tok
        detected = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok),
                                                      vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
        vocab = [tok.id_to_token(i) or "" for i in range(self.vocab_size)]
        for i, added in tok.get_added_tokens_decoder().items():
            if added.special and i < self.vocab_size:
                vocab[i] = ""
        return xgr.TokenizerInfo(vocab, vocab_type=detected.vocab_type, vocab_size=self.vocab_size,
                                 stop_token_ids=self.stop_token_ids, add_prefix_space=detected.add_prefix_space)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of spec (cached). Raises InvalidRequestError with the compiler's message."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.num_cache_hits += 1
                return hit
        compiler = self._get_compiler()
        t0 = time.perf_counter()
        try:
            compiled = self._compile(compiler, spec)
        except InvalidRequestError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own types
            raise InvalidRequestError(f"structured_outputs.{spec.kind}: {_compiler_message(e)}") from None
        if not self._can_start(compiled):
            raise InvalidRequestError(f"structured_outputs.{spec.kind}: the grammar matches no text (no token can "
                                      "begin it)")
        with self._lock:
            self.stats.num_compiles += 1
            self.stats.compile_seconds += time.perf_counter() - t0
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    @staticmethod
    def _compile(compiler: Any, spec: StructuredOutputsParams) -> Any:
        kind = spec.kind
        if kind == "json":
            schema = json.loads(spec.json)  # type: ignore[arg-type]
            validate_json_schema(schema)
            # compact separators: a small model left free to choose whitespace can loop on newlines forever
            return compiler.compile_json_schema(json.dumps(bound_integers(schema)), any_whitespace=False,
                                                strict_mode=True)
        if kind == "json_object":  # any object, written as compactly as a schema's
            return compiler.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(spec.choice))  # type: ignore[arg-type]
        if kind == "grammar":
            return compiler.compile_grammar(spec.grammar)
        import xgrammar as xgr

        try:
            tag = xgr.StructuralTag.model_validate(_bound_tag(json.loads(spec.structural_tag)))  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - pydantic's ValidationError, already a readable message
            raise InvalidRequestError(f"structured_outputs.structural_tag: {e}") from None
        return compiler.compile_structural_tag(tag)

    def _can_start(self, compiled: Any) -> bool:
        """Whether some token may begin an output of the grammar (`root ::= root root` has none)."""
        import xgrammar as xgr

        m = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)  # [1, V/32] int32
        m.fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any())

    def matcher(self, compiled: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    # ---- per step (engine thread) --------------------------------------------------------
    def apply_masks(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """logits: [R, V] fp32, in place: row rows[i] keeps only the tokens matchers[i] allows."""
        import xgrammar as xgr

        t0 = time.perf_counter()
        words = (self.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = torch.empty(max(logits.shape[0], 64), words, dtype=torch.int32)
        bitmask = self._bitmask[:logits.shape[0]]  # [R, V/32] int32, one bit per token
        for row, m in zip(rows, matchers):
            m.fill_next_token_bitmask(bitmask, row)
        if self.mask_rows is None or not self.mask_rows(logits, bitmask, rows):
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
        self.stats.mask_seconds += time.perf_counter() - t0
        self.stats.mask_steps += 1
        self.stats.mask_rows += len(rows)


def _bound_tag(tag: Any) -> Any:
    """bound_integers on every JSON schema inside a structural tag."""
    if isinstance(tag, list):
        return [_bound_tag(t) for t in tag]
    if not isinstance(tag, dict):
        return tag
    return {k: bound_integers(v) if k == "json_schema" else _bound_tag(v) for k, v in tag.items()}


def choice_grammar(choices: tuple[str, ...] | list[str]) -> str:
    """EBNF: exactly one of the strings (JSON string literals are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
