"""OLMoE: Llama attention whose q and k are RMS-normalized over their full width (all heads together, before
rope) and optionally clipped (`clip_qkv`), with a mixture of SwiGLU experts (top-k of n after a softmax, not
renormalized unless `norm_topk_prob`). HF `OlmoeForCausalLM`; GGUF architecture `olmoe`.

Under tensor parallelism a rank holds its heads' slice of q and k and of the norms' weights; the full-width mean
of squares is the ranks' sums all-reduced (one all-reduce of [T, 2] a layer)."""

from __future__ import annotations

import dataclasses

import torch

from ...distributed import TPGroup
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
        self.tp: TPGroup | None = None

    def finish_qkv(self, qkv: torch.Tensor) -> torch.Tensor:  # [T, (H + 2 KVH) D]
        q, k = qkv[:, :self.q_size].contiguous(), qkv[:, self.q_size:self.q_size + self.kv_size].contiguous()
        if self.tp is None:
            qkv[:, :self.q_size] = self.q_norm(q, None, self.backend)[0]
            qkv[:, self.q_size:self.q_size + self.kv_size] = self.k_norm(k, None, self.backend)[0]
        else:
            qkv[:, :self.q_size + self.kv_size] = self.sharded_norms(q, k)
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        return qkv

    def sharded_norms(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q and k RMS-normalized over the whole layer's width from this rank's slices (in fp32, as HF's norm)."""
        q32, k32 = q.float(), k.float()
        sums = torch.stack([q32.square().sum(-1), k32.square().sum(-1)], dim=-1)  # [T, 2]
        self.tp.all_reduce(sums)
        widths = torch.tensor([self.q_size, self.kv_size], dtype=torch.float32) * self.tp.world
        scale = torch.rsqrt(sums / widths + self.q_norm.eps)  # [T, 2]
        q32 = q32 * scale[:, :1] * self.q_norm.weight.float()
        k32 = k32 * scale[:, 1:] * self.k_norm.weight.float()
        return torch.cat([q32, k32], dim=-1).to(q.dtype)


class OlmoeForCausalLM(LlamaForCausalLM):
    layer_cls = OlmoeDecoderLayer
    WEIGHTS = dataclasses.replace(
        _LLAMA,
        linears=(*_LLAMA.linears[:2], ROUTER),
        norms=(*_LLAMA.norms, Param("q_norm", "self_attn.q_norm", "attn_q_norm", split=("q",)),
               Param("k_norm", "self_attn.k_norm", "attn_k_norm", split=("kv",))),
        experts=MOE_EXPERTS,
        gguf_interleaved_rope=frozenset(),
    )

    def use_tensor_parallel(self, tp: TPGroup) -> None:
        super().use_tensor_parallel(tp)
        for layer in self.layers:
            layer.tp = tp

    @classmethod
    def config_from_hf(cls, raw: dict) -> ModelConfig:
        cfg = ModelConfig.from_hf(raw)
        cfg.norm_topk_prob = bool(raw.get("norm_topk_prob", False))
        cfg.clip_qkv = raw.get("clip_qkv")
        return cfg
