"""gpt-oss (20B, 120B): a mixture of experts (top-4 of 32 or 128, the router's top logits softmaxed) with biases
on the router, the experts and the attention's q/k/v/o; the experts' clamped SwiGLU ((up + 1) * gate *
sigmoid(1.702 gate), gate and up clamped at 7); a learned attention sink per head (one more logit in the
softmax, with no value); sliding-window (128) and global layers alternating; YaRN rope. HF
`GptOssForCausalLM` (experts stacked in one tensor per layer, gate and up interleaved); GGUF architecture
`gpt-oss` (experts in MXFP4 as OpenAI released them, or any block format).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ...errors import ModelLoadError
from ..layers.backends import ClampedSwiGLU
from ..layers.fused_moe import FusedMoE
from .config import ModelConfig
from .llama import DecoderLayer, LlamaForCausalLM
from .weight_names import Linear, Param, Part

SLIDING = "sliding_attention"
_LLAMA = LlamaForCausalLM.WEIGHTS


class GptOssDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, biases: frozenset[str] = frozenset(), index: int = 0) -> None:
        super().__init__(cfg, biases, index)
        act = ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit)
        self.mlp = FusedMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                            True, bias=True, act=act)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads), requires_grad=False)
        self.sliding_window = cfg.sliding_window if cfg.layer_types[index] == SLIDING else None


class GptOssForCausalLM(LlamaForCausalLM):
    layer_cls = GptOssDecoderLayer
    WEIGHTS = dataclasses.replace(
        _LLAMA,
        linears=(*_LLAMA.linears[:2], Linear("mlp.gate", (Part("mlp.router", "ffn_gate_inp"),), "replicated")),
        experts=(
            Linear("mlp.experts.{e}.gate_up_proj", (Part("mlp.experts.{e}.gate_proj", "ffn_gate_exps"),
                                                    Part("mlp.experts.{e}.up_proj", "ffn_up_exps"))),
            Linear("mlp.experts.{e}.down_proj", (Part("mlp.experts.{e}.down_proj", "ffn_down_exps"),), "row"),
        ),
        norms=(Param("input_layernorm", "input_layernorm", "attn_norm"),
               Param("post_attention_layernorm", "post_attention_layernorm", "post_attention_norm"),
               Param("sinks", "self_attn.sinks", "attn_sinks", heads=True)),
        gguf_interleaved_rope=frozenset(),
    )

    @classmethod
    def config_from_hf(cls, raw: dict) -> ModelConfig:
        cfg = ModelConfig.from_hf(raw)
        n = cfg.num_layers
        cfg.layer_types = tuple(raw.get("layer_types") or [SLIDING if i % 2 == 0 else "full_attention" for i in range(n)])
        cfg.moe_intermediate_size = raw["intermediate_size"]
        cfg.norm_topk_prob = True  # softmax over the top-k logits: the top-k of a softmax, renormalized
        cfg.swiglu_alpha, cfg.swiglu_limit = raw.get("swiglu_alpha", 1.702), raw.get("swiglu_limit", 7.0)
        return cfg

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict) -> dict:
        """llama.cpp fixes these for `gpt-oss` in code: every other layer (from the first) attends over the
        sliding window, and the experts' activation constants."""
        n = cfg["num_hidden_layers"]
        return {**cfg, "layer_types": [SLIDING if i % 2 == 0 else "full_attention" for i in range(n)],
                "swiglu_alpha": 1.702, "swiglu_limit": 7.0}

    @classmethod
    def hf_tensors(cls, sd: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
        """HF stacks a layer's experts: gate_up_proj [E, hidden, 2 I] with gate and up interleaved along the last
        axis, down_proj [E, I, hidden], biases [E, 2 I] and [E, hidden]; each expert's linears are views of them."""
        for i in range(cfg.num_layers):
            p = cls.WEIGHTS.hf_layer.format(i)
            if f"{p}mlp.experts.gate_up_proj_blocks" in sd:
                raise ModelLoadError("MXFP4 experts in an HF folder are not read yet: load the model's GGUF (llama.cpp's "
                                     "converter keeps them MXFP4, which runs as stored) or a dequantized checkpoint")
            if f"{p}self_attn.sinks" in sd:
                sd[f"{p}self_attn.sinks.weight"] = sd.pop(f"{p}self_attn.sinks")
            if f"{p}mlp.experts.gate_up_proj" not in sd:
                continue
            gate_up, gate_up_b = sd.pop(f"{p}mlp.experts.gate_up_proj"), sd.pop(f"{p}mlp.experts.gate_up_proj_bias")
            down, down_b = sd.pop(f"{p}mlp.experts.down_proj"), sd.pop(f"{p}mlp.experts.down_proj_bias")
            for e in range(gate_up.shape[0]):
                x = f"{p}mlp.experts.{e}."
                sd[x + "gate_proj.weight"], sd[x + "up_proj.weight"] = gate_up[e, :, 0::2].T, gate_up[e, :, 1::2].T
                sd[x + "gate_proj.bias"], sd[x + "up_proj.bias"] = gate_up_b[e, 0::2], gate_up_b[e, 1::2]
                sd[x + "down_proj.weight"], sd[x + "down_proj.bias"] = down[e].T, down_b[e]
