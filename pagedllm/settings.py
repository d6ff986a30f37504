"""Settings given as JSON or a dict (vLLM's `--speculative-config`, `--kv-events-config`): one parser for all."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from .errors import ConfigError


def config_from(cls: type, name: str, value: Any) -> Any:
    """A dataclass of settings from a dict or its JSON text (an instance passes through): the `name` option's
    unknown fields and malformed JSON are ConfigErrors that say so."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a dict or JSON text, got {type(value).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"{name}: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
    return cls(**value)
