"""A model's shape and the settings its layers read, parsed from an HF config.json (a GGUF's metadata
is first written as one)."""

from __future__ import annotations

from dataclasses import dataclass


def architecture_of(cfg: dict) -> str:
    return (cfg.get("architectures") or ["LlamaForCausalLM"])[0]


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """The fields every decoder-only family shares; a model's `config_from_hf` adds its own."""
        arch = architecture_of(cfg)
        rope_params = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or rope_params or None
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            sliding_window=cfg.get("sliding_window"),
            architecture=arch,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
        )
