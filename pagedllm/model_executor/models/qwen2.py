"""Qwen2 / Qwen2.5: the Llama family with q/k/v biases (found in the checkpoint) and a sliding window
that applies only when `use_sliding_window` is set (its config carries a window size either way)."""

from __future__ import annotations

from .config import ModelConfig
from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_from_hf(cls, raw: dict) -> ModelConfig:
        cfg = ModelConfig.from_hf(raw)
        if not raw.get("use_sliding_window", False):
            cfg.sliding_window = None
        return cfg
