"""pagedllm: LLM inference on a paged KV cache with continuous batching.

The public names are imported on first use, so that `import pagedllm.core.scheduler` (the torch-free
control plane: scheduler, block manager, requests, planning) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "entrypoints.llm", "LLMEngine": "engine.llm_engine", "EngineStats": "engine.llm_engine", "EngineConfig": "config",
    "SamplingParams": "sampling_params", "StructuredOutputsParams": "sampling_params",
    "RequestOutput": "outputs", "CompletionOutput": "outputs", "Logprob": "outputs",
    "InvalidRequestError": "errors", "ConfigError": "errors", "ModelLoadError": "errors", "RequestFailedError": "errors",
}
__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "EngineStats", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
    "CompletionOutput", "Logprob", "InvalidRequestError", "ConfigError", "ModelLoadError", "RequestFailedError",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .config import EngineConfig
    from .engine.llm_engine import EngineStats, LLMEngine
    from .entrypoints.llm import LLM
    from .errors import ConfigError, InvalidRequestError, ModelLoadError, RequestFailedError
    from .outputs import CompletionOutput, Logprob, RequestOutput
    from .sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
