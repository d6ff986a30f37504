"""Executors: what runs a scheduled step on the model, wherever its ranks are. The engine loads through
one, sizes the KV pool, then hands it each step and each finished request; it never talks to workers.

`Executor` runs everything in this process; `TPExecutor` (tp.py) adds the tensor-parallel workers, which
load their shards, mirror the block tables and run every step beside the driver."""

from __future__ import annotations

import torch

from ..config import EngineConfig
from ..core.kv_spec import KVLayout
from ..core.scheduler import SchedulerOutput
from ..distributed import TPGroup
from ..model_executor.model_loader import LoadedModel, load_model
from ..model_executor.model_runner import Batch, ModelRunner, StepResult, Tables, profile_forward


class Executor:
    """One process: the model runner and nothing else."""

    group: TPGroup | None = None  # this process's tensor-parallel group (None: the whole model here)

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner: ModelRunner | None = None
        self.draft_runner: ModelRunner | None = None  # speculative decoding's draft model, beside the target

    def load_model(self) -> LoadedModel:
        c = self.config
        return load_model(c.model, c.dtype, c.quantization, self.group, c.model_registry, c.device, c.max_model_len,
                          c.attention_backend, c.load_format)

    def profile_activations(self, model: torch.nn.Module) -> int | None:
        """Peak bytes of a forward at the largest step (model_runner.profile_forward) where the device counts
        them (a GPU); None elsewhere."""
        from ..platforms import current_platform

        c = self.config
        if c.device == "cpu" or c.num_kv_blocks is not None or c.kv_cache_memory is not None:
            return None
        platform = current_platform(c.device, c.attention_backend)
        return profile_forward(model, c.max_num_batched_tokens, c.max_num_seqs, c.block_size, platform.peak_bytes)

    def capture_decode_graphs(self, max_batch: int, max_model_len: int) -> bool:
        """CUDA graphs for decode steps where the platform replays them (a GPU) and enforce_eager is off."""
        from ..platforms import current_platform

        c = self.config
        if c.enforce_eager or not current_platform(c.device, c.attention_backend).decode_graphs:
            return False
        return self.runner.use_decode_graphs(max_batch, max_model_len)

    def init_kv_cache(self, model: torch.nn.Module, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                      cache_cls: type, layout: KVLayout | None = None, num_state_slots: int = 0) -> ModelRunner:
        """The KV pool (every rank's share of it), the linear-attention states if any, and the runner over them."""
        self.runner = ModelRunner(model, num_blocks, block_size, kv_dtype, cache_cls, layout, num_state_slots)
        return self.runner

    def execute_model(self, sched: SchedulerOutput, tables: Tables,
                      all_logits: bool = False) -> StepResult:
        return self.runner.execute(sched, tables, all_logits=all_logits)

    def load_draft_model(self, model: str) -> LoadedModel:
        c = self.config
        return load_model(model, c.dtype, c.quantization, None, c.model_registry, c.device, c.max_model_len,
                          c.attention_backend, c.load_format)

    def init_draft_kv_cache(self, model: torch.nn.Module, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                            cache_cls: type) -> None:
        """The draft's KV pool mirrors the target's block for block (the same tables address both)."""
        self.draft_runner = ModelRunner(model, num_blocks, block_size, kv_dtype, cache_cls)

    def execute_draft(self, batch: Batch, tables: Tables, want_logits: bool = True) -> StepResult:
        return self.draft_runner.execute_batch(batch, tables, want_logits=want_logits)

    def forget(self, request_id: str) -> None:
        """A request's blocks were freed: ranks that mirror block tables drop its table."""

    def shutdown(self) -> None:
        """Stop whatever the executor started."""

