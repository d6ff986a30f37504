"""How big the KV pool is: bytes per token of the model (and its draft), blocks that fit the budget,
and the longest request those blocks can hold. Decided once, before anything is allocated."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import EngineConfig, parse_size
from ..core.kv_spec import KVLayout, KVSpec, PageParts, group_layers, plan_kv_layout
from ..errors import ConfigError
from ..model_executor.kv_cache import KVCache
from ..model_executor.models.config import ModelConfig
from ..platforms import current_platform

log = logging.getLogger("pagedllm")

DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3
DEFAULT_GPU_UTILIZATION = 0.9  # vLLM's gpu_memory_utilization default
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVPoolSize:
    num_blocks: int
    block_size: int
    kv_dtype: torch.dtype  # the pool's storage dtype
    cache_cls: type  # KVCache or FP8KVCache
    bytes_per_token: int  # all layers (and the draft model's), all ranks together
    bytes_per_block: int
    max_model_len: int


def kv_storage(kv_cache_dtype: str, model_dtype: torch.dtype) -> tuple[torch.dtype, type]:
    if kv_cache_dtype == "auto":
        return model_dtype, KVCache
    if kv_cache_dtype in _TORCH_DTYPES:
        return _TORCH_DTYPES[kv_cache_dtype], KVCache
    from ..model_executor.kv_quant import INT_FORMATS, FP8KVCache, int_kv_cache

    k, _, v = kv_cache_dtype.partition("/")
    if k in INT_FORMATS:
        return torch.uint8, int_kv_cache(k, v or k)

    return FP8KVCache.storage_dtype(kv_cache_dtype), FP8KVCache


def page_parts(config: EngineConfig, model_dtype: torch.dtype) -> PageParts:
    """A layer's bytes of one block in each pool tensor of its cache, by its spec: how the layout weighs layers of
    different shapes against each other (kv_spec.plan_kv_layout). Measured on the meta device: nothing is
    allocated."""
    kv_dtype, cache_cls = kv_storage(config.kv_cache_dtype, model_dtype)

    def parts(spec: KVSpec) -> tuple[int, ...]:
        try:
            cache = cache_cls(1, config.block_size, spec.num_kv_heads, spec.head_dim, kv_dtype, model_dtype, "meta")
        except ValueError:  # a shape this format cannot hold: refused with its reason when the pool is sized
            return ()
        return cache.page_parts()

    return parts


def num_blocks_for(config: EngineConfig, bytes_per_block: int, activation_bytes: int | None = None) -> int:
    """activation_bytes: the profiling forward's peak on a device that measures it (a GPU): the budget is then
    vLLM's, memory_utilization (default 0.9) of the device's memory less the weights and that peak; elsewhere
    memory_utilization of the memory left, or 2 GiB when nothing is set."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    platform = current_platform(config.device, config.attention_backend)
    gpu_budget = None
    if config.kv_cache_memory is None and activation_bytes is not None:
        gpu_budget = platform.kv_budget(config.memory_utilization or DEFAULT_GPU_UTILIZATION, activation_bytes)
    if config.kv_cache_memory is not None:
        budget = parse_size(config.kv_cache_memory)
    elif gpu_budget is not None:
        budget = gpu_budget
        log.info("KV budget %.2f GiB: %.2f of the device's memory less the weights and %.2f GiB of activations",
                 budget / 2**30, config.memory_utilization or DEFAULT_GPU_UTILIZATION, activation_bytes / 2**30)
    elif config.memory_utilization is not None:
        budget = int(platform.available_memory_bytes() * config.memory_utilization)
    else:
        budget = DEFAULT_KV_CACHE_MEMORY
    n = budget // bytes_per_block
    if n < 1:
        raise ConfigError(f"KV budget of {budget} bytes is smaller than one block ({bytes_per_block} bytes)")
    return n


def check_fits_in_memory(num_blocks: int, bytes_per_block: int, device: str = "cpu",
                         attention_backend: str = "auto") -> None:
    """A pool larger than the memory there is would be zero-filled until the OOM killer ends the
    process (a shared host's global OOM): refused here, with the figures."""
    need, have = num_blocks * bytes_per_block, current_platform(device, attention_backend).available_memory_bytes()
    if need > have:
        raise ConfigError(f"the KV pool needs {need / 2**30:.2f} GiB ({num_blocks} blocks x {bytes_per_block} "
                          f"bytes) but only {have / 2**30:.2f} GiB of memory is available; lower "
                          "kv_cache_memory / num_kv_blocks or use memory_utilization")


def size_kv_pool(config: EngineConfig, mc: ModelConfig, model_dtype: torch.dtype, specs: list[KVSpec],
                 draft_specs: list[KVSpec] | None = None, layout: KVLayout | None = None,
                 activation_bytes: int | None = None) -> KVPoolSize:
    """specs: the model's layers as this rank holds them (each rank holds its heads' share of every block);
    draft_specs: a draft model's, whose pool mirrors the target's block for block; layout: how the layers
    share blocks (None: one group, a block holds a token range of every layer). A block is one page of
    the layout's slots, whichever group holds it."""
    kv_dtype, cache_cls = kv_storage(config.kv_cache_dtype, model_dtype)
    bs = config.block_size
    world = config.tensor_parallel_size
    layout = layout or plan_kv_layout(specs, hybrid=False)
    odd = sorted({s.head_dim for s in [*specs, *(draft_specs or [])] if s is not None and s.head_dim % 32})
    from ..model_executor.kv_quant import IntKVCache

    if issubclass(cache_cls, IntKVCache) and odd:
        raise ConfigError(f"kv_cache_dtype {config.kv_cache_dtype} stores blocks of 32 values of a head; this model "
                          f"has heads of {odd[0]}")
    pages = layout.slot_specs(specs)
    bytes_per_token = sum(world * cache_cls.bytes_per_token(s.num_kv_heads, s.head_dim, kv_dtype) for s in pages)
    # layers in another shape's pages keep their scales apart (KVCache.OWN_POOLS)
    bytes_per_token += sum(world * m * cache_cls.own_bytes_per_token(s.num_kv_heads, s.head_dim, kv_dtype)
                           for page, kinds in zip(pages, layout.slot_kinds(specs)) for s, m in kinds.items()
                           if (s.num_kv_heads, s.head_dim) != (page.num_kv_heads, page.head_dim))
    bytes_per_token += sum(cache_cls.bytes_per_token(s.num_kv_heads, s.head_dim, kv_dtype) for s in draft_specs or []
                           if s is not None)
    bytes_per_block = bytes_per_token * bs
    num_blocks = num_blocks_for(config, bytes_per_block, activation_bytes)
    check_fits_in_memory(num_blocks, bytes_per_block, config.device, config.attention_backend)
    model_max = mc.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > model_max:
        raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's context ({model_max})")
    max_len = config.max_model_len or model_max
    if num_blocks * bs < max_len:
        if config.max_model_len is not None:
            raise ConfigError(
                f"KV cache of {num_blocks} blocks x {bs} tokens = {num_blocks * bs} tokens cannot hold one "
                f"max_model_len={max_len} request; raise kv_cache_memory/num_kv_blocks or lower max_model_len")
        max_len = num_blocks * bs
        log.warning("max_model_len capped to %d tokens: all the KV pool holds", max_len)
    layers = ", ".join(f"{len(ix)} {spec.kind}" for spec, ix in group_layers(specs).items())
    log.info("KV cache: %d bytes/token (%d layers [%s] x 2 x %d kv heads x %d dim x %s), %d blocks x %d tokens "
             "= %d tokens in %.1f MiB", bytes_per_token, mc.num_layers, layers, mc.num_kv_heads, mc.head_dim,
             config.kv_cache_dtype, num_blocks, bs, num_blocks * bs, num_blocks * bytes_per_block / 2**20)
    return KVPoolSize(num_blocks, bs, kv_dtype, cache_cls, bytes_per_token, bytes_per_block, max_len)
