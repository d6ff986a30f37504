"""What both loaders share: the model to build, the dtype to run in, which rows and columns of a tensor this
rank keeps, and the checks once everything is in place (the formats are layers/weight_methods.py's choice)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ...distributed import TPGroup, check_divisible
from ...errors import ModelLoadError
from ...platforms import Platform
from ...tokenizer import Tokenizer
from ..models.config import ModelConfig, architecture_of
from ..models.registry import ModelRegistry, default_registry
from ..models.weight_names import Linear, Param, Part, WeightNames, has_module, piece_rows

log = logging.getLogger("pagedllm")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer | None
    name: str
    path: Path
    dtype: torch.dtype  # the dtype asked for (or picked by auto): dense weights' and the default KV pool's


def model_class(raw: dict, registry: ModelRegistry | None) -> type:
    return (registry or default_registry()).model_class(architecture_of(raw))


def build(cls: type, cfg: ModelConfig, has_bias: dict[str, bool], tp: TPGroup | None) -> nn.Module:
    """The model on the meta device: every parameter is assigned by the loader, none initialized."""
    if tp is not None:
        check_shardable(cls, cfg, tp.world)
    with torch.device("meta"):
        return cls(cfg, frozenset(attr for attr, yes in has_bias.items() if yes))


def check_shardable(cls: type, cfg: ModelConfig, world: int) -> None:
    """A clear startup error where the model cannot run across `world` ranks (a registered architecture may
    declare `supports_tensor_parallel = False`)."""
    if not getattr(cls, "supports_tensor_parallel", True):
        raise ModelLoadError(f"{cfg.architecture} does not run under tensor parallelism")
    check_divisible(cfg, world)


def resolve_dtype(dtype: str, cfg: dict, platform: Platform) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    # the platform decides, not the checkpoint: fp16 and bf16 without native dot products are slow
    picked, why = platform.auto_dtype()
    stored = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    log.info("dtype auto: %s (%s; checkpoint stored as %s)", str(picked).removeprefix("torch."), why, stored)
    return picked


def shard_rows(spec: Linear | None, part: Part | None, n_rows: int, cfg: ModelConfig,
               tp: TPGroup | None) -> np.ndarray | None:
    """The rows of one checkpoint tensor this rank keeps, in order: each piece of a stacked tensor (Phi-3's
    qkv_proj) cut on its own, a plain column-parallel tensor (or the vocabulary: spec None) by its span;
    None: all of them (no tensor parallelism, or a row-parallel linear, which is cut by columns)."""
    if tp is None or (spec is not None and spec.parallel in ("row", "replicated")):
        return None
    if part is None or not part.split:
        return np.arange(*tp.span(n_rows))
    return stacked_rows(part.split, n_rows, cfg, tp, part.hf)


def stacked_rows(split: tuple[str, ...], n_rows: int, cfg: ModelConfig, tp: TPGroup, name: str) -> np.ndarray:
    pieces, lo = [], 0
    for size, keep in piece_rows(split, cfg, tp.world, tp.rank):
        pieces.append(lo + keep)
        lo += size
    if lo != n_rows:
        raise ModelLoadError(f"{name}: {n_rows} rows do not stack {split} of this config ({lo} rows)")
    return np.concatenate(pieces)


def shard_cols(spec: Linear, n_cols: int, tp: TPGroup | None) -> tuple[int, int] | None:
    """The inputs a row-parallel linear keeps on this rank; None: all."""
    return tp.span(n_cols) if tp is not None and spec.parallel == "row" else None


def layer_linears(names: WeightNames, layer: nn.Module) -> list[tuple[Linear, int | None]]:
    """(spec, expert index or None) of the linears this layer has: the map's (a MoE layer has a router, not a
    dense MLP; a dense layer of a MoE model the other way round), then each expert's, its index filled in."""
    specs: list[tuple[Linear, int | None]] = [(spec, None) for spec in names.linears if has_module(layer, spec.attr)]
    experts = getattr(layer, "mlp", None)
    if experts is not None:
        specs += [(spec, e) for e in range(experts.num_experts) for spec in names.expert_linears(e)]
    return specs


def set_param(owner: nn.Module, spec: Param, w: torch.Tensor, cfg: ModelConfig, tp: TPGroup | None) -> None:
    """A loaded tensor into its place: a module's weight, or a parameter of `owner` itself; cut to this rank's
    heads where it has one value per head, or its rows where they stack a linear's pieces."""
    if spec.heads and tp is not None:
        w = w[slice(*tp.span(w.shape[0]))]
    elif spec.split and tp is not None:
        w = w[torch.from_numpy(stacked_rows(spec.split, w.shape[0], cfg, tp, spec.hf))]
    w = nn.Parameter(w, requires_grad=False)
    if has_module(owner, spec.attr):
        owner.get_submodule(spec.attr).weight = w
    else:
        setattr(owner, spec.attr, w)


def row_parallel_bias(bias: torch.Tensor | None, spec: Linear, tp: TPGroup | None) -> torch.Tensor | None:
    """A row-parallel output is all-reduced: its bias is added once, on rank 0."""
    if bias is not None and tp is not None and spec.parallel == "row" and tp.rank:
        return torch.zeros_like(bias)
    return bias


def check_complete(model: nn.Module, path: Path) -> None:
    left = [n for n, t in model.named_parameters() if t.is_meta]
    if left:
        raise ModelLoadError(f"{path}: weights missing from the checkpoint: {left[:4]}")
