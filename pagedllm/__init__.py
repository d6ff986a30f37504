"""pagedllm: LLM inference on a paged KV cache with continuous batching."""

from .config import EngineConfig
from .engine import EngineStats, LLMEngine
from .errors import ConfigError, InvalidRequestError, ModelLoadError, RequestFailedError
from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "EngineStats", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
    "CompletionOutput", "Logprob", "InvalidRequestError", "ConfigError", "ModelLoadError", "RequestFailedError",
]
__version__ = "0.1.0"
