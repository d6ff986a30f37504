"""Phi-3 (mini / medium, the 4k-context configs): the Llama layer, with q, k and v stored as one `qkv_proj` and
gate and up as one `gate_up_proj` in the checkpoint (GGUF architecture `phi3`: `attn_qkv`, and `ffn_up` holding
gate then up); the loader reads them as stacked pieces, so tensor parallelism still cuts each piece on its own.
Partial rotary (Phi-4-mini) and LongRoPE (the 128k configs) are refused by name."""

from __future__ import annotations

import dataclasses

from ...errors import ModelLoadError
from .config import ModelConfig
from .llama import LlamaForCausalLM
from .weight_names import Linear, Part

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
        rope = {**(raw.get("rope_parameters") or {}), **(raw.get("rope_scaling") or {})}
        factor = raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        if factor not in (None, 1, 1.0):
            raise ModelLoadError(f"partial rotary embeddings (partial_rotary_factor={factor}) are not supported yet")
        return ModelConfig.from_hf(raw)
