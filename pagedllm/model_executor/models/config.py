"""A model's shape and the settings its layers read, parsed from an HF config.json (a GGUF's metadata
is first written as one)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import ModelLoadError


def architecture_of(cfg: dict) -> str:
    return (cfg.get("architectures") or ["LlamaForCausalLM"])[0]


def text_config_of(raw: dict) -> dict:
    """A multimodal checkpoint's language model config (`text_config`), with the top-level fields it inherits."""
    text = {**raw["text_config"], "architectures": raw.get("architectures")}
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key in raw and key not in raw["text_config"]:
            text[key] = raw[key]
    return text


def per_layer_attention(raw: dict, types: Sequence[str]) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """Each layer's (head_dim, KV heads) and the layer whose K/V it attends over, for configs whose layers differ
    (Gemma 4): global layers of their own shape (`per_layer_config`, or the released configs' `global_head_dim`
    and `num_global_key_value_heads`), and the last `num_kv_shared_layers` layers reading the K/V of the last
    earlier layer of their kind (types: each layer's, "sliding_attention" / "full_attention") rather than keeping
    their own."""
    n, heads = raw["num_hidden_layers"], raw["num_attention_heads"]
    own = (raw.get("head_dim") or raw["hidden_size"] // heads, raw.get("num_key_value_heads") or heads)
    overrides = {int(k): v for k, v in (raw.get("per_layer_config") or {}).items()}
    if not overrides and "global_head_dim" in raw:
        glob = {"head_dim": raw["global_head_dim"]}
        if raw.get("attention_k_eq_v", True) and raw.get("num_global_key_value_heads") is not None:
            glob["num_key_value_heads"] = raw["num_global_key_value_heads"]
        overrides = {i: glob for i in range(n) if types[i] == "full_attention"}
    shapes = tuple((overrides.get(i, {}).get("head_dim", own[0]), overrides.get(i, {}).get("num_key_value_heads", own[1]))
                   for i in range(n))
    first_shared = n - (raw.get("num_kv_shared_layers") or 0)
    sources = []
    for i in range(n):
        src = i if i < first_shared else next((j for j in range(first_shared - 1, -1, -1) if types[j] == types[i]), None)
        if src is None:
            raise ModelLoadError(f"layer {i} shares the K/V of an earlier {types[i]} layer; there is none")
        sources.append(src)
    return shapes, tuple(sources)


@dataclass(frozen=True)
class GGUFInfo:
    """What a model's `hf_config_from_gguf` may read of a GGUF beyond the shared keys: its `{arch}.*` metadata,
    its tensors' shapes (ggml's order: innermost first) and, in a loader, a small tensor's values."""

    arch: str
    meta: Mapping[str, Any]
    shapes: Mapping[str, tuple[int, ...]]
    read: Callable[[str], Sequence[float]] | None = None

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{key}", default)


def first_layer(value: Any) -> Any:
    """A GGUF key some architectures store per layer (KV heads, MLP width): the first layer's, for the shared
    fields (the model's `hf_config_from_gguf` reads the rest)."""
    return value[0] if isinstance(value, (list, tuple)) else value


def _per_layer(value: Any, n: int) -> list[int]:
    """A GGUF key stored as one number or one per layer."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ModelLoadError(f"a per-layer GGUF key has {len(value)} values for {n} layers")
        return [int(v) for v in value]
    return [int(value)] * n


def gemma4_gguf_fields(gguf: GGUFInfo) -> dict:
    """The Gemma 4 fields of an HF config, as llama.cpp's converter writes them into a `gemma4` GGUF: which layers
    slide (`sliding_window_pattern`), the global layers' head size (`key_length`; `key_length_swa` the sliding
    ones'), KV heads and MLP widths per layer (arrays), the KV-shared tail, the per-layer inputs' width; v = k on
    the global layers is a file without their `attn_v`."""
    n = int(gguf.get("block_count"))
    pattern = gguf.get("attention.sliding_window_pattern")
    if pattern is None:
        raise ModelLoadError("a gemma4 GGUF without gemma4.attention.sliding_window_pattern")
    types = ["sliding_attention" if s else "full_attention" for s in _per_layer(pattern, n)]
    kv = _per_layer(gguf.get("attention.head_count_kv", gguf.get("attention.head_count")), n)
    ff = _per_layer(gguf.get("feed_forward_length"), n)
    d_full = int(gguf.get("attention.key_length"))
    d_swa = int(gguf.get("attention.key_length_swa", d_full))
    shared = int(gguf.get("attention.shared_kv_layers", 0))
    first_shared = n - shared
    base = next(i for i, t in enumerate(types) if t == "sliding_attention") if "sliding_attention" in types else 0
    own = (d_swa if types[base] == "sliding_attention" else d_full, kv[base])
    per_layer = {str(i): {"head_dim": d, "num_key_value_heads": kv[i]}
                 for i, d in ((i, d_swa if t == "sliding_attention" else d_full) for i, t in enumerate(types))
                 if (d, kv[i]) != own}
    wide = [ff[i] == 2 * ff[0] and i >= first_shared for i in range(n)]
    if any(ff[i] != ff[0] and not wide[i] for i in range(n)) or (any(wide) and not all(wide[first_shared:])):
        raise ModelLoadError(f"gemma4 MLP widths {ff}: only the KV-shared layers may be twice as wide")
    k_eq_v = any(t == "full_attention" and i < first_shared and f"blk.{i}.attn_v.weight" not in gguf.shapes
                 for i, t in enumerate(types))
    table = gguf.shapes.get("per_layer_token_embd.weight")
    return {"model_type": "gemma4_text", "layer_types": types, "head_dim": own[0], "num_key_value_heads": own[1],
            "per_layer_config": per_layer, "num_kv_shared_layers": shared, "attention_k_eq_v": k_eq_v,
            "intermediate_size": ff[0], "use_double_wide_mlp": any(wide),
            "hidden_size_per_layer_input": int(gguf.get("embedding_length_per_layer_input", 0) or 0),
            "vocab_size_per_layer_input": int(table[1]) if table else None}


def qwen35_gguf_fields(gguf: GGUFInfo) -> dict:
    """The Qwen3.5 fields of an HF config from a `qwen35` / `qwen35moe` GGUF: the linear-attention layers
    (`attention.recurrent_layers`, or one full layer every `full_attention_interval`), the Gated DeltaNet's shape in
    llama.cpp's `ssm.*` keys (key heads = group_count, value heads = time_step_rank, key head size = state_size,
    inner_size = all value heads' width), the shared expert's width. llama.cpp's converter orders the value heads
    tiled (see ModelConfig.linear_value_heads_tiled)."""
    n = int(gguf.get("block_count"))
    recurrent = gguf.get("attention.recurrent_layers")
    if recurrent is None:
        every = int(gguf.get("full_attention_interval", 4))
        recurrent = [(i + 1) % every != 0 for i in range(n)]
    value_heads = int(gguf.get("ssm.time_step_rank"))
    return {"model_type": "qwen3_5_text",
            "layer_types": ["linear_attention" if r else "full_attention" for r in _per_layer(recurrent, n)],
            "linear_num_key_heads": int(gguf.get("ssm.group_count")), "linear_num_value_heads": value_heads,
            "linear_key_head_dim": int(gguf.get("ssm.state_size")),
            "linear_value_head_dim": int(gguf.get("ssm.inner_size")) // value_heads,
            "linear_conv_kernel_dim": int(gguf.get("ssm.conv_kernel", 4)), "linear_value_heads_tiled": True,
            "shared_expert_intermediate_size": int(gguf.get("expert_shared_feed_forward_length", 0) or 0)}


# the architectures whose GGUF keys need more than the shared ones to describe their layers (loader and planner)
GGUF_FIELDS = {"gemma4": gemma4_gguf_fields, "qwen35": qwen35_gguf_fields, "qwen35moe": qwen35_gguf_fields}


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
    # mixture of experts (0 experts: a dense MLP in every layer)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP in a MoE model
    partial_rotary_factor: float = 1.0  # the leading fraction of each head's dims that rope rotates (Phi-4-mini)
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to +-clip_qkv after their projection
    # layers that differ (Gemma 3): each layer's kind ("sliding_attention" / "full_attention") and each kind's rope
    layer_types: tuple[str, ...] = ()
    rope_by_layer_type: dict | None = None  # kind -> {"rope_theta": ..., "rope_scaling": ... or None}
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim)
    final_logit_softcapping: float | None = None
    swiglu_alpha: float = 1.702  # gpt-oss's clamped SwiGLU
    swiglu_limit: float = 7.0
    # linear-attention layers (Qwen3.5's Gated DeltaNet)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # the value heads ordered k-head-minor (v0 of every key head, then v1 ...: llama.cpp's files) rather than
    # grouped by key head (HF's)
    linear_value_heads_tiled: bool = False
    shared_expert_intermediate_size: int = 0  # a MoE layer's always-on expert, gated per token (Qwen3.5-MoE)

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.dense_layers

    def linear_key_span(self, world: int, rank: int) -> tuple[int, int] | None:
        """The key heads one rank of `world` keeps of each Gated DeltaNet layer. Its value heads are the span
        [a, a + m) of m = Hv / world, and it keeps the key heads they read: a span of them, or one (or all) kept
        by several ranks. Inside the rank the value heads read its key heads as the whole layer's did (tiled or
        grouped). None: the heads do not cut so."""
        hk, hv = self.linear_num_key_heads, self.linear_num_value_heads
        if not hk or hv % world:
            return None
        m = hv // world
        a = rank * m
        if self.linear_value_heads_tiled:  # value head j reads key head j % Hk
            if m % hk == 0:
                return 0, hk
            return (a % hk, a % hk + m) if hk % m == 0 else None
        r = hv // hk  # value head j reads key head j // r
        if m % r == 0:
            return a // r, (a + m) // r
        return (a // r, a // r + 1) if r % m == 0 else None

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """The fields every decoder-only family shares; a model's `config_from_hf` adds its own."""
        arch = architecture_of(cfg)
        rope_params = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or rope_params or None
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        heads = cfg["num_attention_heads"]
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        step = cfg.get("decoder_sparse_step") or 1
        dense = {i for i in range(cfg["num_hidden_layers"]) if (i + 1) % step} | set(cfg.get("mlp_only_layers") or ())
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
            num_experts=experts,
            num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
            norm_topk_prob=cfg.get("norm_topk_prob", True),
            dense_layers=tuple(sorted(dense)) if experts else (),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor")
                                        or 1.0),
        )
