"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention (q/k norms per head) with a mixture of SwiGLU experts,
top-k of n after a softmax, renormalized where `norm_topk_prob` is set; layers listed in `mlp_only_layers` (or
off the `decoder_sparse_step`) keep a dense MLP. HF `Qwen3MoeForCausalLM` (`mlp.experts.{e}.gate_proj/up_proj/
down_proj`, router `mlp.gate`); GGUF architecture `qwen3moe`."""

from __future__ import annotations

import dataclasses

from .config import GGUFInfo
from .qwen3 import Qwen3ForCausalLM
from .weight_names import Linear, Part

_QWEN3 = Qwen3ForCausalLM.WEIGHTS

MOE_EXPERTS = (
    Linear("mlp.experts.{e}.gate_up_proj", (Part("mlp.experts.{e}.gate_proj", "ffn_gate_exps"),
                                            Part("mlp.experts.{e}.up_proj", "ffn_up_exps"))),
    Linear("mlp.experts.{e}.down_proj", (Part("mlp.experts.{e}.down_proj", "ffn_down_exps"),), "row"),
)
ROUTER = Linear("mlp.gate", (Part("mlp.gate", "ffn_gate_inp"),), "replicated")


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    WEIGHTS = dataclasses.replace(_QWEN3, linears=(*_QWEN3.linears, ROUTER), experts=MOE_EXPERTS)

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict, gguf: GGUFInfo) -> dict:
        """llama.cpp renormalizes a `qwen3moe` file's top-k weights in code (as the released models' configs set)."""
        return {"norm_topk_prob": True, **super().hf_config_from_gguf(cfg, gguf)}
