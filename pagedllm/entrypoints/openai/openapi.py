"""The OpenAPI schema with what only the loaded model knows: its name, vocabulary and context.

FastAPI writes the request schemas from the pydantic models; the bounds that depend on the model (the
one model name a request may name, token ids under the vocabulary size, token counts under
max_model_len) are filled in once the engine has loaded, so that clients and fuzzers reading
/openapi.json build requests the server accepts.
"""

from __future__ import annotations

from typing import Any

TOKEN_ID_FIELDS = ("prompt", "stop_token_ids", "allowed_token_ids", "tokens")
TOKEN_COUNT_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens")


def _integers(node: Any) -> list[dict]:
    """Every integer schema inside node (through anyOf / items)."""
    if isinstance(node, list):
        return [i for n in node for i in _integers(n)]
    if not isinstance(node, dict):
        return []
    found = [node] if node.get("type") == "integer" else []
    for key in ("anyOf", "oneOf", "items"):
        if key in node:
            found += _integers(node[key])
    return found


def below(n: int) -> str:
    """A regex of the decimal numbers 0 .. n - 1 (n >= 1), no leading zeros."""
    top = str(n - 1)
    k = len(top)
    if k == 1:
        return f"^[0-{top}]$"
    alts = ["0", f"[1-9][0-9]{{0,{k - 2}}}"]  # fewer digits than n - 1, then k digits up to it
    for i, d in enumerate(top):
        lo = 1 if i == 0 else 0
        if int(d) > lo:
            alts.append(f"{top[:i]}[{lo}-{int(d) - 1}][0-9]{{{k - i - 1}}}")
    alts.append(top)
    return "^(" + "|".join(alts) + ")$"


def with_model_bounds(schema: dict, model: str, vocab_size: int, max_model_len: int) -> dict:
    """schema (FastAPI's openapi()) with the model's bounds written into its request bodies, in place."""
    for body in schema.get("components", {}).get("schemas", {}).values():
        props = body.get("properties", {})
        if "model" in props:
            props["model"] = {"anyOf": [{"type": "string", "enum": [model]}, {"type": "null"}], "default": None,
                              "title": "Model"}
        for name in TOKEN_ID_FIELDS:
            for node in _integers(props.get(name)):
                node["maximum"] = vocab_size - 1
        for name in TOKEN_COUNT_FIELDS:
            for node in _integers(props.get(name)):
                node["maximum"] = max_model_len - 1
        bias = props.get("logit_bias")
        for node in (bias or {}).get("anyOf", []):
            if node.get("type") == "object":
                node["propertyNames"] = {"pattern": below(vocab_size)}
    return schema
