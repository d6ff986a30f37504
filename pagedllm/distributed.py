"""This rank's place in a tensor-parallel group, and the rule for which slice of a dimension it keeps.

Shared by the weight loaders (which cut each rank's shard as they read) and the model (which
all-reduces its row-parallel outputs); the worker processes and the per-step message live in
tensor_parallel.py, which imports the loaders, not the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import ConfigError


@dataclass
class TPGroup:
    rank: int
    world: int
    bytes_all_reduced: int = 0  # this rank's contribution, counted for the benchmarks' figures
    bytes_gathered: int = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        self.bytes_all_reduced += x.numel() * x.element_size()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., world * n], rank order."""
        self.bytes_gathered += x.numel() * x.element_size()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, -1)

    def span(self, n: int) -> tuple[int, int]:
        """This rank's [lo, hi) of a dimension of n (heads' rows, MLP rows, vocabulary, columns)."""
        return self.rank * n // self.world, (self.rank + 1) * n // self.world


def check_divisible(cfg: Any, world: int) -> None:
    """Every dimension tensor parallelism cuts must cut into `world` whole parts: a clear startup error if not."""
    kv_heads = sorted({kv for _, kv in getattr(cfg, "layer_shapes", ())} - {cfg.num_kv_heads})  # Gemma 4's own kinds
    for name, n in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                    *(("a layer's num_key_value_heads", kv) for kv in kv_heads),
                    ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size),
                    ("moe_intermediate_size", getattr(cfg, "moe_intermediate_size", 0)),
                    ("shared_expert_intermediate_size", getattr(cfg, "shared_expert_intermediate_size", 0)),
                    ("linear_num_value_heads", getattr(cfg, "linear_num_value_heads", 0))):
        if n % world:
            raise ConfigError(f"tensor_parallel_size={world} does not divide the model's {name} ({n})")
    if getattr(cfg, "linear_num_key_heads", 0) and cfg.linear_key_span(world, 0) is None:
        raise ConfigError(f"tensor_parallel_size={world} does not cut the model's linear-attention heads "
                          f"({cfg.linear_num_key_heads} key, {cfg.linear_num_value_heads} value) so that each rank "
                          "keeps the key heads its value heads read")
