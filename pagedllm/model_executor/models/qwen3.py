"""Qwen3 (dense): Qwen2's layer without q/k/v biases, with an RMSNorm over each head of q and of k before
rope. HF `Qwen3ForCausalLM`; GGUF architecture `qwen3` (q/k rows in HF's order, `attn_q_norm` / `attn_k_norm`)."""

from __future__ import annotations

import dataclasses

import torch

from .config import ModelConfig
from .llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from .qwen2 import Qwen2ForCausalLM
from .weight_names import Param


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, biases: frozenset[str] = frozenset(), index: int = 0) -> None:
        super().__init__(cfg, biases, index)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def finish_qkv(self, qkv: torch.Tensor) -> torch.Tensor:
        self.backend.qk_norm(qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.num_heads,
                             self.num_kv_heads, self.head_dim)  # in place in qkv [T, (H + 2 KVH) D]
        return qkv


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    layer_cls = Qwen3DecoderLayer
    WEIGHTS = dataclasses.replace(
        LlamaForCausalLM.WEIGHTS,
        norms=(*LlamaForCausalLM.WEIGHTS.norms, Param("q_norm", "self_attn.q_norm", "attn_q_norm"),
               Param("k_norm", "self_attn.k_norm", "attn_k_norm")),
        gguf_interleaved_rope=frozenset(),
    )
