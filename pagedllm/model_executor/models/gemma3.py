"""Gemma 3 (text: `Gemma3ForCausalLM`, the 1B and the text towers' layout; GGUF architecture `gemma3`).

What differs from Llama: embeddings scaled by sqrt(hidden); RMSNorms that scale by (1 + w) (HF stores w, llama.cpp's
converter stores 1 + w: the HF loader adds the 1, so one kernel serves both); a norm after attention and after
the MLP as well as before each; per-head q/k norms; GeGLU with tanh-approximate gelu; attention scaled by
query_pre_attn_scalar ** -0.5; local layers attending over a sliding window with their own rope base, one global
layer in six (`layer_types`, or the older `sliding_window_pattern`) with the global base and the checkpoint's
rope scaling; optional final-logit soft-capping. Sliding-window layers keep full-length KV for now.
"""

from __future__ import annotations

import dataclasses

import torch

from ...errors import ModelLoadError
from ..attention import AttentionMetadata
from ..kv_cache import KVCache
from ..layers.rotary import rope_inv_freq
from .config import GGUFInfo, ModelConfig, text_config_of
from .llama import LlamaForCausalLM, RMSNorm, shift_norms, unshift_norms
from .qwen3 import Qwen3DecoderLayer
from .weight_names import Linear, Param, Part

SLIDING, FULL = "sliding_attention", "full_attention"
_LLAMA = LlamaForCausalLM.WEIGHTS


class Gemma3DecoderLayer(Qwen3DecoderLayer):
    def __init__(self, cfg: ModelConfig, biases: frozenset[str] = frozenset(), index: int = 0) -> None:
        super().__init__(cfg, biases, index)
        kind = cfg.layer_types[index]
        self.sliding_window = cfg.sliding_window if kind == SLIDING else None
        self.rope_key = kind
        self.act = "gelu_tanh"
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        be = self.backend
        meta = meta.for_window(self.sliding_window)
        h, residual = self.input_layernorm(x, residual, be)
        o, _ = self.post_attention_layernorm(self.self_attention(h, cos, sin, cache, meta), None, be)
        h, residual = self.pre_feedforward_layernorm(o, residual, be)
        m, _ = self.post_feedforward_layernorm(self.feed_forward(h, meta.num_decode_rows), None, be)
        return m, residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma3DecoderLayer
    WEIGHTS = dataclasses.replace(
        _LLAMA,
        norms=(Param("input_layernorm", "input_layernorm", "attn_norm"),
               Param("post_attention_layernorm", "post_attention_layernorm", "post_attention_norm"),
               Param("pre_feedforward_layernorm", "pre_feedforward_layernorm", "ffn_norm"),
               Param("post_feedforward_layernorm", "post_feedforward_layernorm", "post_ffw_norm"),
               Param("q_norm", "self_attn.q_norm", "attn_q_norm"), Param("k_norm", "self_attn.k_norm", "attn_k_norm")),
        gguf_interleaved_rope=frozenset(),
    )

    @classmethod
    def config_from_hf(cls, raw: dict) -> ModelConfig:
        if raw.get("attn_logit_softcapping") is not None:
            raise ModelLoadError("attention logit soft-capping (Gemma 2) is not supported yet")
        cfg = ModelConfig.from_hf(raw)
        n = cfg.num_layers
        types = raw.get("layer_types")
        if not types:  # older configs: every `sliding_window_pattern`-th layer is global
            pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
            types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]
        params = raw.get("rope_parameters") or {}
        if SLIDING in params or FULL in params:  # transformers 5: one rope per kind of layer
            rope = {kind: {"rope_theta": p.get("rope_theta", 10000.0), "rope_scaling": _scaling(p)}
                    for kind, p in params.items() if p}
        else:  # the global base and scaling, and a local base of its own
            rope = {FULL: {"rope_theta": raw.get("rope_theta", 1e6), "rope_scaling": _scaling(raw.get("rope_scaling"))},
                    SLIDING: {"rope_theta": raw.get("rope_local_base_freq", 10000.0), "rope_scaling": None}}
        cfg.layer_types, cfg.rope_by_layer_type = tuple(types), rope
        cfg.query_pre_attn_scalar = raw.get("query_pre_attn_scalar")
        cfg.final_logit_softcapping = raw.get("final_logit_softcapping")
        cfg.tie_word_embeddings = raw.get("tie_word_embeddings", True)
        return cfg

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict, gguf: GGUFInfo) -> dict:
        """llama.cpp fixes these for `gemma3` in code: one global layer in six, a local rope base of 10000, and
        the attention scale of the 62-layer (27B) model from hidden / heads, of the others from head_dim."""
        wide = cfg["num_hidden_layers"] == 62
        return {**cfg, "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
                "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if wide else cfg["head_dim"]}

    @classmethod
    def hf_checkpoint(cls, sd: dict[str, torch.Tensor], cfg: dict) -> None:
        """llama.cpp's converter stores the norms as 1 + w."""
        unshift_norms(sd)

    def __init__(self, cfg: ModelConfig, biases: frozenset[str] = frozenset()) -> None:
        super().__init__(cfg, biases)
        self.embed_scale = cfg.hidden_size ** 0.5
        self.final_logit_softcapping = cfg.final_logit_softcapping

    def rope_inv_freq(self, key: str) -> torch.Tensor:
        r = self.cfg.rope_by_layer_type[key]
        return rope_inv_freq(dataclasses.replace(self.cfg, rope_theta=r["rope_theta"], rope_scaling=r["rope_scaling"]))

    def after_load(self, source: str) -> None:
        if source == "hf":  # (1 + w), as the GGUF stores it
            shift_norms(self)


class Gemma3TextTower(Gemma3ForCausalLM):
    """The language model of a `Gemma3ForConditionalGeneration` checkpoint (Gemma 3 4B, 12B, 27B): text in, text
    out; the vision tower's tensors are not read (images are not supported)."""

    WEIGHTS = dataclasses.replace(
        Gemma3ForCausalLM.WEIGHTS,
        embed=Param("embed_tokens", "language_model.model.embed_tokens", "token_embd"),
        norm=Param("norm", "language_model.model.norm", "output_norm"),
        lm_head=Linear("lm_head", (Part("language_model.lm_head", "output"),)),
        hf_layer="language_model.model.layers.{}.",
    )

    @classmethod
    def config_from_hf(cls, raw: dict) -> ModelConfig:
        return super().config_from_hf(text_config_of(raw))


def _scaling(p: dict | None) -> dict | None:
    if not p or p.get("rope_type", p.get("type", "default")) == "default":
        return None
    return p
