"""Mixtral: the Llama layer (GQA, optional sliding window) with a mixture of SwiGLU experts in place of the
MLP: top-k of n experts, softmax then renormalized. HF `MixtralForCausalLM` (`block_sparse_moe.experts.{e}.w1/w3/w2`);
GGUF architecture `llama` with `llama.expert_count` set (`ffn_gate_inp`, 3-D `ffn_{gate,up,down}_exps`)."""

from __future__ import annotations

import dataclasses

import torch

from .config import ModelConfig
from .llama import LlamaForCausalLM
from .weight_names import Linear, Part

_LLAMA = LlamaForCausalLM.WEIGHTS


class MixtralForCausalLM(LlamaForCausalLM):
    WEIGHTS = dataclasses.replace(
        _LLAMA,
        linears=(*_LLAMA.linears[:2], Linear("mlp.gate", (Part("block_sparse_moe.gate", "ffn_gate_inp"),), "replicated")),
        experts=(
            Linear("mlp.experts.{e}.gate_up_proj", (Part("block_sparse_moe.experts.{e}.w1", "ffn_gate_exps"),
                                                    Part("block_sparse_moe.experts.{e}.w3", "ffn_up_exps"))),
            Linear("mlp.experts.{e}.down_proj", (Part("block_sparse_moe.experts.{e}.w2", "ffn_down_exps"),), "row"),
        ),
    )

    @classmethod
    def config_from_hf(cls, raw: dict) -> ModelConfig:
        cfg = ModelConfig.from_hf(raw)
        cfg.norm_topk_prob = True  # Mixtral always renormalizes its top-k weights
        return cfg

    @classmethod
    def hf_checkpoint(cls, sd: dict[str, torch.Tensor], cfg: dict) -> None:
        """HF's Mixtral config counts its experts as `num_local_experts`; every layer is one of experts."""
        cfg["num_local_experts"] = cfg.pop("num_experts")
        for key in ("mlp_only_layers", "moe_intermediate_size"):
            cfg.pop(key, None)
