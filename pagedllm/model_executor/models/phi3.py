"""Phi-3 and Phi-4-mini: the Llama layer, with q, k and v stored as one `qkv_proj` and gate and up as one
`gate_up_proj` in the checkpoint (GGUF architecture `phi3`: `attn_qkv`, and `ffn_up` holding gate then up); the
loader reads them as stacked pieces, so tensor parallelism still cuts each piece on its own.

Partial rotary (Phi-4-mini: 3/4 of each head): each head's q/k dims are reordered at load so the full-width rope
kernels rotate exactly the rotary dims (`partial_rotary_order`). LongRoPE (the 128k configs), with its attention
factor: the short factors and a context capped at `original_max_position_embeddings` by default; a max_model_len
past it takes the long factors for every position, as llama.cpp does for a context past the original one. (HF
switches a sequence to the long factors once it grows past the original length, so the two agree on every
sequence longer than that, and on shorter ones when the short factors are in use.)"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from ...errors import ModelLoadError
from ..layers.rotary import partial_rotary_order, partial_rotary_rows, rotary_dim
from .config import ModelConfig
from .llama import LlamaForCausalLM
from .weight_names import Linear, Part

log = logging.getLogger("pagedllm")

_LLAMA = LlamaForCausalLM.WEIGHTS


class Phi3ForCausalLM(LlamaForCausalLM):
    WEIGHTS = dataclasses.replace(
        _LLAMA,
        linears=(
            Linear("qkv_proj", (Part("self_attn.qkv_proj", "attn_qkv", split=("q", "kv", "kv")),)),
            Linear("o_proj", (Part("self_attn.o_proj", "attn_output"),), "row"),
            Linear("gate_up_proj", (Part("mlp.gate_up_proj", "ffn_up", split=("ffn", "ffn")),)),
            Linear("down_proj", (Part("mlp.down_proj", "ffn_down"),), "row"),
        ),
        gguf_interleaved_rope=frozenset(),
    )

    @classmethod
    def config_from_hf(cls, raw: dict) -> ModelConfig:
        cfg = ModelConfig.from_hf(raw)
        s = cfg.rope_scaling
        if s and s.get("rope_type", s.get("type")) == "longrope":
            original = s.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
            if original is None:
                raise ModelLoadError("longrope scaling without original_max_position_embeddings")
            # the factor from the advertised context, before the cap below
            cfg.rope_scaling = {**s, "original_max_position_embeddings": original,
                                "factor": s.get("factor") or cfg.max_position_embeddings / original}
        return cfg

    @classmethod
    def fit_context(cls, cfg: ModelConfig, context: int | None) -> ModelConfig:
        s = cfg.rope_scaling
        if not s or s.get("rope_type", s.get("type")) != "longrope":
            return cfg
        original = s["original_max_position_embeddings"]
        if context is not None and context > original:
            log.info("LongRoPE: the long factors (max_model_len %d is past the original context, %d)", context, original)
            cfg.rope_scaling = {**s, "long": True}
        elif cfg.max_position_embeddings > original:
            log.info("LongRoPE: context capped at %d tokens, the short factors (a longer max_model_len takes the "
                     "long ones)", original)
            cfg.max_position_embeddings = original
        return cfg

    @classmethod
    def gguf_row_order(cls, part: Part, n: int, cfg: ModelConfig) -> np.ndarray | None:
        """attn_qkv's q and k rows in the partial-rotary order after_load gives HF's (v keeps the file's): quantized
        rows move whole, so a quantized Phi-4-mini runs in its blocks."""
        d, rot = cfg.head_dim, rotary_dim(cfg)
        if rot == d or part.gguf != "attn_qkv":
            return None
        return partial_rotary_rows(d, rot, cfg.num_heads + cfg.num_kv_heads, d, n)

    def after_load(self, source: str) -> None:
        cfg = self.cfg
        rot = rotary_dim(cfg)
        if rot == cfg.head_dim or source != "hf":  # a GGUF's rows were read in this order (gguf_row_order)
            return
        order = partial_rotary_order(cfg.head_dim, rot)
        first = self.layers[0]  # this rank's heads (under tensor parallelism a slice): q and k lead the rows
        rows = torch.cat([h * cfg.head_dim + order for h in range(first.num_heads + first.num_kv_heads)])
        for layer in self.layers:
            w = layer.qkv_proj.weight.data
            w[:rows.numel()] = w[rows]
            if layer.qkv_proj.bias is not None:
                b = layer.qkv_proj.bias.data
                b[:rows.numel()] = b[rows]
