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

from ..layers.backends import ClampedSwiGLU
from ..layers.formats import FORMATS
from ..layers.fused_moe import FusedMoE
from ..layers.weight_formats import BlockRows
from .config import GGUFInfo, ModelConfig
from .llama import DecoderLayer, LlamaForCausalLM, stack_experts
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
        cfg.norm_topk_prob = True  # softmax over the top-k logits: the top-k of a softmax, renormalized
        cfg.swiglu_alpha, cfg.swiglu_limit = raw.get("swiglu_alpha", 1.702), raw.get("swiglu_limit", 7.0)
        return cfg

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict, gguf: GGUFInfo) -> dict:
        """llama.cpp fixes these for `gpt-oss` in code: every other layer (from the first) attends over the
        sliding window, and the experts' activation constants."""
        n = cfg["num_hidden_layers"]
        return {**cfg, "layer_types": [SLIDING if i % 2 == 0 else "full_attention" for i in range(n)],
                "swiglu_alpha": 1.702, "swiglu_limit": 7.0}

    @classmethod
    def hf_checkpoint(cls, sd: dict[str, torch.Tensor], cfg: dict) -> None:
        """hf_tensors' inverse: the sinks without `.weight`; each layer's experts in HF's stacked layout (gate and
        up interleaved along the last axis, matrices [E, in, out]); the experts counted as `num_local_experts`."""
        for i in range(cfg["num_hidden_layers"]):
            layer = cls.WEIGHTS.hf_layer.format(i)
            if layer + "self_attn.sinks.weight" in sd:
                sd[layer + "self_attn.sinks"] = sd.pop(layer + "self_attn.sinks.weight")
            p = layer + "mlp.experts."
            for kind, suffix in (("weight", ""), ("bias", "_bias")):
                gate, up = stack_experts(sd, p, f"gate_proj.{kind}"), stack_experts(sd, p, f"up_proj.{kind}")
                down = stack_experts(sd, p, f"down_proj.{kind}")
                if gate is None:
                    continue
                gate_up = torch.stack((gate, up), 2).flatten(1, 2)  # gate and up rows alternate: [E, 2 I(, H)]
                if kind == "weight":  # HF's matrices are [E, in, out]
                    gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
                sd[p + "gate_up_proj" + suffix], sd[p + "down_proj" + suffix] = gate_up, down
        cfg["num_local_experts"] = cfg.pop("num_experts")
        cfg.pop("mlp_only_layers", None)

    @classmethod
    def hf_tensors(cls, sd: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
        """HF stacks a layer's experts: gate_up_proj [E, hidden, 2 I] with gate and up interleaved along the last
        axis, down_proj [E, I, hidden], biases [E, 2 I] and [E, hidden]; each expert's linears are views of them.
        OpenAI's checkpoints store the experts in MXFP4 instead (`*_blocks` [E, O, K / 32, 16], `*_scales`
        [E, O, K / 32], rows of the output): those become ggml's MXFP4 blocks, which run as stored."""
        for i in range(cfg.num_layers):
            p = cls.WEIGHTS.hf_layer.format(i) + "mlp.experts."
            attn = cls.WEIGHTS.hf_layer.format(i) + "self_attn.sinks"
            if attn in sd:
                sd[attn + ".weight"] = sd.pop(attn)
            if p + "gate_up_proj_blocks" in sd:
                gate_up = _mxfp4_rows(sd.pop(p + "gate_up_proj_blocks"), sd.pop(p + "gate_up_proj_scales"))
                down = _mxfp4_rows(sd.pop(p + "down_proj_blocks"), sd.pop(p + "down_proj_scales"))
                for e, (gu, dn) in enumerate(zip(gate_up, down)):  # gate and up rows alternate
                    sd[f"{p}{e}.gate_proj.weight"] = BlockRows(gu.data[0::2], gu.fmt, gu.in_features)
                    sd[f"{p}{e}.up_proj.weight"] = BlockRows(gu.data[1::2], gu.fmt, gu.in_features)
                    sd[f"{p}{e}.down_proj.weight"] = dn
            elif p + "gate_up_proj" in sd:
                gate_up, down = sd.pop(p + "gate_up_proj"), sd.pop(p + "down_proj")
                for e in range(gate_up.shape[0]):
                    sd[f"{p}{e}.gate_proj.weight"], sd[f"{p}{e}.up_proj.weight"] = gate_up[e, :, 0::2].T, gate_up[e, :, 1::2].T
                    sd[f"{p}{e}.down_proj.weight"] = down[e].T
            if p + "gate_up_proj_bias" in sd:
                gate_up_b, down_b = sd.pop(p + "gate_up_proj_bias"), sd.pop(p + "down_proj_bias")
                for e in range(gate_up_b.shape[0]):
                    sd[f"{p}{e}.gate_proj.bias"], sd[f"{p}{e}.up_proj.bias"] = gate_up_b[e, 0::2], gate_up_b[e, 1::2]
                    sd[f"{p}{e}.down_proj.bias"] = down_b[e]


def _mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor) -> list[BlockRows]:
    """OpenAI's MXFP4 tensor (blocks [E, O, G, 16] uint8: byte i holds codes 2i (low nibble) and 2i + 1; scales
    [E, O, G] e8m0: w = fp4 * 2^(s - 127)) as each expert's rows of ggml MXFP4 blocks [O, G * 17]: the scale byte
    as is (ggml's codes are doubled, its scale halved), then byte j = code j | code j + 16 << 4."""
    e, o, g, _ = blocks.shape
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).view(e, o, g, 32)  # in element order
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # [E, O, G, 16]
    rows = torch.cat((scales.unsqueeze(-1), packed), dim=-1).view(e, o, g * 17)
    return [BlockRows(r, FORMATS["mxfp4"], g * 32) for r in rows]
