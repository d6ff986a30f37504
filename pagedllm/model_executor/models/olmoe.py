"""OLMoE: Llama attention whose q and k are RMS-normalized over their full width (all heads together, before
rope) and optionally clipped (`clip_qkv`), with a mixture of SwiGLU experts (top-k of n after a softmax, not
renormalized unless `norm_topk_prob`). HF `OlmoeForCausalLM`; GGUF architecture `olmoe`.

The full-width q/k norm needs every head's values, so the model does not run under tensor parallelism yet."""

from __future__ import annotations

import dataclasses

import torch

from .config import ModelConfig
from .llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from .qwen3_moe import MOE_EXPERTS, ROUTER
from .weight_names import Param

_LLAMA = LlamaForCausalLM.WEIGHTS


class OlmoeDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, biases: frozenset[str] = frozenset(), index: int = 0) -> None:
        super().__init__(cfg, biases, index)
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)
        self.clip_qkv = cfg.clip_qkv

    def project_qkv(self, h: torch.Tensor, decode_rows: int) -> torch.Tensor:
        qkv = self.qkv_proj(h, decode_rows)  # [T, (H + 2 KVH) D]
        q, k = qkv[:, :self.q_size].contiguous(), qkv[:, self.q_size:self.q_size + self.kv_size].contiguous()
        qkv[:, :self.q_size] = self.q_norm(q, None, self.backend)[0]
        qkv[:, self.q_size:self.q_size + self.kv_size] = self.k_norm(k, None, self.backend)[0]
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        return qkv


class OlmoeForCausalLM(LlamaForCausalLM):
    layer_cls = OlmoeDecoderLayer
    supports_tensor_parallel = False
    WEIGHTS = dataclasses.replace(
        _LLAMA,
        linears=(*_LLAMA.linears[:2], ROUTER),
        norms=(*_LLAMA.norms, Param("q_norm", "self_attn.q_norm", "attn_q_norm"),
               Param("k_norm", "self_attn.k_norm", "attn_k_norm")),
        experts=MOE_EXPERTS,
        gguf_interleaved_rope=frozenset(),
    )

    @classmethod
    def config_from_hf(cls, raw: dict) -> ModelConfig:
        cfg = ModelConfig.from_hf(raw)
        cfg.norm_topk_prob = bool(raw.get("norm_topk_prob", False))
        cfg.clip_qkv = raw.get("clip_qkv")
        return cfg
