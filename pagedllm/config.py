"""Engine configuration: every option of `LLM(...)`, validated in one place."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .platforms.memory import host_available_memory


def cache_dir() -> Path:
    """Where converted weights and compiled kernels live (PAGEDLLM_CACHE_DIR, else ~/.cache/pagedllm)."""
    return Path(os.environ.get("PAGEDLLM_CACHE_DIR", Path.home() / ".cache" / "pagedllm"))


_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string like "512MiB", "2GiB", "80GB", "1.5e9"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ConfigError(f"memory size must be positive, got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot parse memory size {value!r} (try '512MiB', '2GiB' or bytes)")
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size <= 0:
        raise ConfigError(f"memory size must be positive, got {value!r}")
    return size


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "q8_0", "q4_0")
INT_KV_DTYPES = ("q8_0", "q4_0")  # llama.cpp's cache types; K and V may differ: "q8_0/q4_0" or {"k": .., "v": ..}


def parse_kv_cache_dtype(value: Any) -> str:
    """One KV cache dtype for K and V, or "K/V" integer formats (from "q8_0/q4_0" or {"k": "q8_0", "v": "q4_0"})."""
    if isinstance(value, dict):
        if set(value) != {"k", "v"}:
            raise ConfigError(f'kv_cache_dtype as a dict needs the keys "k" and "v", got {sorted(value)}')
        value = f"{value['k']}/{value['v']}"
    if not isinstance(value, str):
        raise ConfigError(f"kv_cache_dtype must be a string or a {{'k': .., 'v': ..}} dict, got {value!r}")
    if "/" in value:
        k, _, v = value.partition("/")
        if k not in INT_KV_DTYPES or v not in INT_KV_DTYPES:
            raise ConfigError(f"K and V formats of their own are integer formats {INT_KV_DTYPES}, got {value!r}")
        return k if k == v else value
    if value not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} or K/V integer formats such as "
                          f"'q8_0/q4_0', got {value!r}")
    return value
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = (None, "none", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")  # at-load targets: gguf-py's quantizers


def check_device(config: EngineConfig) -> None:
    """A device name torch would parse ("cpu", "cuda", "cuda:1"), and no option that runs on the CPU only beside
    another device (whether the device exists is the platform's question, asked when the model loads)."""
    if not isinstance(config.device, str) or not re.fullmatch(r"[a-z][a-z0-9_]*(:\d+)?", config.device):
        raise ConfigError(f"device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {config.device!r}")
    if config.device == "cpu" and config.attention_backend != "triton":
        return
    cpu_only = [name for name, used in (("tensor_parallel_size > 1", config.tensor_parallel_size > 1),
                                        ("kv_offload_dir", config.kv_offload_dir is not None)) if used]
    if cpu_only:
        raise ConfigError(f"{cpu_only[0]} runs on the CPU only; device={config.device!r} cannot use it")


@dataclass
class EngineConfig:
    model: str | None = None
    dtype: str = "auto"
    quantization: str | None = None  # None: weights as stored; "none": dequantize a GGUF; q8_0, q4_0, ...
    kv_cache_dtype: str | dict = "auto"  # or q8_0 / q4_0 blocks, K and V each its own: "q8_0/q4_0", {"k":, "v":}
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # bytes or "2GiB"; default 2GiB when nothing is set
    num_kv_blocks: int | None = None
    memory_utilization: float | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # layers grouped by attention kind, each group with its own block tables: sliding-window layers keep only
    # their window (kv_spec.plan_kv_layout); False: every layer keeps K/V for every token
    hybrid_kv_cache: bool = True
    preemption_mode: str = "recompute"  # or "reserve": reserve prompt+max_tokens, never preempt
    watermark: float = 0.01  # fraction of blocks admission keeps free
    num_threads: int | None = None
    tensor_parallel_size: int = 1  # worker processes over torch.distributed (tensor_parallel.py)
    max_logprobs: int = 20  # the most top logprobs a request may ask for per token (vLLM's max_logprobs)
    speculative_config: Any = None  # vLLM's: {"method": "ngram" | "draft_model", ...} or JSON; parsed into a SpeculativeConfig
    kv_events_config: Any = None  # vLLM's: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ...} or JSON
    kv_offload_dir: str | None = None  # the prefix cache's disk tier (engine/kv_offload.py); None: none
    kv_offload_bytes: int | str = "16GiB"  # its budget on disk (least recently used blocks go first)
    model_registry: Any = None  # a ModelRegistry with architectures of one's own (None: the built-in ones)
    # a torch device ("cpu", "cuda", "cuda:1"): the model and its KV pool there (platforms/); auto: a GPU if torch
    # sees one, else the CPU
    device: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs for decode steps on a GPU
    load_format: str = "auto"  # or "dummy": random weights of the model folder's config.json (benchmarks)
    attention_backend: str = "auto"  # auto (C++ on the CPU, Triton on a GPU), torch (reference), triton (any device)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        self.kv_cache_dtype = parse_kv_cache_dtype(self.kv_cache_dtype)
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ConfigError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ConfigError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.memory_utilization is not None and not 0 < self.memory_utilization <= 1:
            raise ConfigError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.preemption_mode not in ("recompute", "reserve"):
            raise ConfigError(f"preemption_mode must be 'recompute' or 'reserve', got {self.preemption_mode!r}")
        if not 0 <= self.watermark < 1:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")
        from .platforms.selection import ATTENTION_BACKENDS, resolve_device

        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        tp = isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size > 1
        if isinstance(self.device, str):
            self.device = resolve_device(self.device, cpu_only=tp or self.kv_offload_dir is not None)
        if tp and self.attention_backend != "auto":
            raise ConfigError("tensor parallelism runs the CPU's kernels: leave attention_backend at auto")
        check_device(self)
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
            if self.device == "cpu" and self.kv_cache_memory > host_available_memory():  # before a model loads or a port is bound
                raise ConfigError(f"kv_cache_memory of {self.kv_cache_memory / 2**30:.2f} GiB is more than the "
                                  f"{host_available_memory() / 2**30:.2f} GiB of memory available")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.speculative_config is not None:
            from .spec_decode.ngram import SpeculativeConfig

            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.kv_offload_bytes = parse_size(self.kv_offload_bytes)
        if self.kv_events_config is not None:
            from .engine.kv_events import KVEventsConfig

            self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            # without chunking a whole prompt must fit in one step
            self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_model_len)
