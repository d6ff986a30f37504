"""Gemma 4 (text: `Gemma4ForCausalLM`; the language model of `Gemma4ForConditionalGeneration` checkpoints).

What differs from Gemma 3:
- Layers of two kinds with their own shapes: sliding-window layers (`head_dim`, `num_key_value_heads`, the
  local rope) and global layers (their own head size and KV heads: `per_layer_config`, or `global_head_dim` and
  `num_global_key_value_heads`; a "proportional" rope that rotates the leading `partial_rotary_factor` of each
  head's frequency pairs and leaves the others at frequency 0, so one full-width rope table serves it).
- q and k normalized per head with weights, v per head without; attention unscaled (scale 1).
- `attention_k_eq_v`: a global layer has no v projection; v is its k projection (before the k norm and rope).
- KV sharing: the last `num_kv_shared_layers` layers project only q and attend over the K/V of the last earlier
  layer of their kind, so they keep nothing in the KV pool (`kv_specs` None); their MLPs may be twice as wide.
- Per-layer inputs (PLE): a second token table holds a small vector per token for every layer, mixed with a
  projection of the embeddings; each layer gates it with its output and adds it to the stream.
- Norms scale by w (not 1 + w); each layer's output stream is multiplied by a learned `layer_scalar`.
- `enable_moe_block` (26B-A4B): beside the dense MLP, routed GeGLU experts; the router reads the stream before
  the MLP (normalized, scaled per channel and by hidden ** -0.5), renormalizes its top k and scales each pick by
  its expert's learned scale; the two outputs are normalized apart and summed.

Layers of the two kinds differ in shape: the KV layout packs the smaller kind's blocks into pages of the larger
kind's bytes (kv_spec.py), so the sliding layers hold their window. Under tensor parallelism each layer's heads
are cut by its own shape; the per-layer inputs run whole on every rank. Not yet: bidirectional attention.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ...core.kv_spec import KVSpec
from ...errors import ModelLoadError
from ..attention import AttentionMetadata
from ..kv_cache import KVCache
from ..layers.fused_moe import FusedMoE
from ..layers.linear import PackedLinear, VocabEmbedding
from .config import GGUFInfo, ModelConfig, gemma4_gguf_fields, per_layer_attention, text_config_of
from .gemma3 import FULL, SLIDING, Gemma3DecoderLayer, Gemma3ForCausalLM
from .llama import RMSNorm, stack_experts
from .weight_names import Linear, Param, Part

_GEMMA3 = Gemma3ForCausalLM.WEIGHTS


@dataclasses.dataclass
class Gemma4Config(ModelConfig):
    layer_shapes: tuple[tuple[int, int], ...] = ()  # per layer: (head_dim, num_kv_heads)
    kv_sources: tuple[int, ...] = ()  # per layer: the layer whose K/V it attends over (itself, or a shared one's)
    attention_k_eq_v: bool = False
    per_layer_input_size: int = 0  # hidden_size_per_layer_input; 0: no per-layer inputs
    per_layer_vocab_size: int = 0
    double_wide_mlp: bool = False


def _v_norm(v: torch.Tensor, eps: float) -> None:
    """RMSNorm without a weight over each head of v [T, KVH, D], in place, in fp32 as HF computes it."""
    f = v.float()
    v.copy_(f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps))


class _Weight(nn.Module):
    """A tensor the model multiplies by itself (the per-layer inputs' projection, the experts' scales)."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape), requires_grad=False)


class Gemma4MoE(FusedMoE):
    """Routed GeGLU experts whose router reads its own input (the stream before the MLP)."""

    def __init__(self, cfg: Gemma4Config) -> None:
        super().__init__(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                         renormalize=True, act="gelu_tanh")
        self.router_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # its weight: the router's per-channel scale
        self.expert_scale = _Weight(cfg.num_experts)
        self.hidden_scale = cfg.hidden_size ** -0.5

    def route_stream(self, stream: torch.Tensor, decode_rows: int, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k], expert ids [T, top_k]) of the stream before the MLP [T, hidden]."""
        x, _ = self.router_norm(stream, None, backend)
        weights, ids = self.route(x * torch.tensor(self.hidden_scale, dtype=x.dtype), decode_rows)
        return weights * self.expert_scale.weight[ids].to(weights.dtype), ids

    def forward_routed(self, stream: torch.Tensor, h: torch.Tensor, decode_rows: int, backend) -> torch.Tensor:
        """Routed by the stream, the experts run on h (the stream normalized for them): [T, hidden]."""
        weights, ids = self.route_stream(stream, decode_rows, backend)
        out = backend.moe_experts(self, h, ids, weights, decode_rows)
        if out is None:
            out = self.run_experts(h, ids, weights, decode_rows, backend)
        if self.reduce is not None:
            self.reduce.all_reduce(out)
        return out.to(h.dtype)


class Gemma4DecoderLayer(Gemma3DecoderLayer):
    def __init__(self, cfg: Gemma4Config, biases: frozenset[str] = frozenset(), index: int = 0) -> None:
        head_dim, kv_heads = cfg.layer_shapes[index]
        self.shares_kv = cfg.kv_sources[index] != index
        wide = 2 if cfg.double_wide_mlp and self.shares_kv else 1
        own = dataclasses.replace(cfg, head_dim=head_dim, num_kv_heads=kv_heads,
                                  intermediate_size=cfg.intermediate_size * wide, num_experts=0)
        super().__init__(own, biases, index)  # the dense MLP; the experts, if any, beside it
        if cfg.num_experts:
            self.mlp = Gemma4MoE(cfg)
            self.post_feedforward_layernorm_1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm_2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.scale = 1.0
        self.k_eq_v = cfg.attention_k_eq_v and cfg.layer_types[index] == FULL
        q_size, kv_size = self.q_size, self.kv_size
        del self.qkv_proj
        if self.shares_kv:  # q alone: k and v are the source layer's
            self.q_proj = PackedLinear(cfg.hidden_size, q_size, "q_proj" in biases)
            del self.k_norm
        elif self.k_eq_v:
            self.qk_proj = PackedLinear(cfg.hidden_size, q_size + kv_size, "qk_proj" in biases)
        else:
            self.qkv_proj = PackedLinear(cfg.hidden_size, q_size + 2 * kv_size, "qkv_proj" in biases)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.per_layer_input_size = cfg.per_layer_input_size
        if cfg.per_layer_input_size:
            self.per_layer_input_gate = PackedLinear(cfg.hidden_size, cfg.per_layer_input_size, False)
            self.per_layer_projection = PackedLinear(cfg.per_layer_input_size, cfg.hidden_size, False)
            self.post_per_layer_input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def project_qkv(self, h: torch.Tensor, decode_rows: int) -> torch.Tensor:
        """[T, (H + 2 KVH) D]: q and k normalized with their weights, v without (k_eq_v: v is k's projection)."""
        if self.k_eq_v:
            qk = self.qk_proj(h, decode_rows)  # [T, (H + KVH) D]
            qkv = torch.cat([qk, qk[:, self.q_size:]], dim=1)
        else:
            qkv = self.qkv_proj(h, decode_rows)
        self.backend.qk_norm(qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.num_heads,
                             self.num_kv_heads, self.head_dim)
        _v_norm(qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim), self.q_norm.eps)
        return qkv

    def attend(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
               meta: AttentionMetadata, shared: dict[int, torch.Tensor], source: int) -> torch.Tensor:
        """The attention block: [T, hidden] -> [T, hidden]. A layer others share keeps its normalized k and v
        (before rope) in `shared` under its index; a sharing layer hands the source's back with its q, so the
        write puts the same bytes in the same slots and the attention reads the source's K/V."""
        nd = meta.num_decode_rows
        if self.shares_kv:
            q = self.q_proj(h, nd)  # [T, H D]
            t, d = q.shape[0], self.head_dim
            rows = q.view(-1, d).contiguous()  # [T H, D]
            q = self.backend.rms_norm(self.q_norm.weight, self.q_norm.eps, rows, None)[0].view(t, -1)
            qkv = torch.cat([q, shared[source]], dim=1)
        else:
            qkv = self.project_qkv(h, nd)
            if source in shared:  # a later layer reads these: kept before the kernels rope k in place
                shared[source] = qkv[:, self.q_size:].clone()
        a = self.backend.attention(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, cache, meta,
                                   self.scale, None)  # [T, H, D]
        return self.o_proj(a.view(h.shape[0], self.q_size), nd)

    def forward_stream(self, x: torch.Tensor, per_layer: torch.Tensor | None, cos: torch.Tensor,
                       sin: torch.Tensor, cache: KVCache, meta: AttentionMetadata, shared: dict[int, torch.Tensor],
                       source: int) -> torch.Tensor:
        """x: the residual stream [T, hidden] (the kernels may add into it in place) -> the next one."""
        be = self.backend
        meta = meta.for_window(self.sliding_window)
        h, stream = self.input_layernorm(x, None, be)
        o, _ = self.post_attention_layernorm(self.attend(h, cos, sin, cache, meta, shared, source), None, be)
        nd = meta.num_decode_rows
        h, stream = self.pre_feedforward_layernorm(o, stream, be)
        m = self.down_proj(be.gate_up_act(self.gate_up_proj, h, nd, self.act), nd)  # the dense MLP
        if self.mlp is not None:
            m, _ = self.post_feedforward_layernorm_1(m, None, be)
            h2, _ = self.pre_feedforward_layernorm_2(stream, None, be)
            e, _ = self.post_feedforward_layernorm_2(self.mlp.forward_routed(stream, h2, nd, be), None, be)
            m = m + e
        m, _ = self.post_feedforward_layernorm(m, None, be)
        stream = stream + m
        if self.per_layer_input_size:
            g = F.gelu(self.per_layer_input_gate(stream, nd), approximate="tanh") * per_layer
            p, _ = self.post_per_layer_input_norm(self.per_layer_projection(g, nd), None, be)
            stream = stream + p
        return stream * self.layer_scalar


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    layer_cls = Gemma4DecoderLayer
    WEIGHTS = dataclasses.replace(
        _GEMMA3,
        linears=(
            *_GEMMA3.linears,
            Linear("qk_proj", (Part("self_attn.q_proj", "attn_q"), Part("self_attn.k_proj", "attn_k"))),
            Linear("q_proj", (Part("self_attn.q_proj", "attn_q"),)),
            # whole on every rank under tensor parallelism: the per-layer inputs are small (a few % of a layer)
            Linear("per_layer_input_gate", (Part("per_layer_input_gate", "inp_gate"),), "replicated"),
            Linear("per_layer_projection", (Part("per_layer_projection", "proj"),), "replicated"),
            Linear("mlp.gate", (Part("router.proj", "ffn_gate_inp"),), "replicated"),
        ),
        norms=(*_GEMMA3.norms, Param("post_per_layer_input_norm", "post_per_layer_input_norm", "post_norm"),
               Param("layer_scalar", "layer_scalar", "layer_output_scale"),
               Param("post_feedforward_layernorm_1", "post_feedforward_layernorm_1", "post_ffw_norm_1"),
               Param("pre_feedforward_layernorm_2", "pre_feedforward_layernorm_2", "pre_ffw_norm_2"),
               Param("post_feedforward_layernorm_2", "post_feedforward_layernorm_2", "post_ffw_norm_2"),
               Param("mlp.router_norm", "router.scale", "ffn_gate_inp", gguf_suffix=".scale"),
               Param("mlp.expert_scale", "router.per_expert_scale", "ffn_down_exps", gguf_suffix=".scale")),
        experts=(Linear("mlp.experts.{e}.gate_up_proj", (Part("experts.{e}.gate_up_proj", "ffn_gate_up_exps",
                                                              split=("moe", "moe")),)),
                 Linear("mlp.experts.{e}.down_proj", (Part("experts.{e}.down_proj", "ffn_down_exps"),), "row")),
        extras=(Param("embed_tokens_per_layer", "model.embed_tokens_per_layer", "per_layer_token_embd"),
                Param("per_layer_model_projection", "model.per_layer_model_projection", "per_layer_model_proj"),
                Param("per_layer_projection_norm", "model.per_layer_projection_norm", "per_layer_proj_norm")),
    )

    @classmethod
    def config_from_hf(cls, raw: dict) -> Gemma4Config:
        if raw.get("use_bidirectional_attention") == "all":
            raise ModelLoadError("Gemma 4 with bidirectional attention is not supported (decoding is causal)")
        base = Gemma3ForCausalLM.config_from_hf(raw)
        shapes, sources = per_layer_attention(raw, base.layer_types)
        params = raw.get("rope_parameters") or {}
        rope = {kind: dict(p) for kind, p in params.items() if p and kind in (SLIDING, FULL)}
        for kind, p in rope.items():
            if p.get("rope_type", "default") not in ("default", "proportional"):
                raise ModelLoadError(f"Gemma 4 {kind} layers: rope type {p['rope_type']!r} is not supported")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
        moe = bool(raw.get("enable_moe_block"))  # every layer: the dense MLP and the experts beside it
        per_layer = raw.get("hidden_size_per_layer_input") or 0
        fields.update(rope_by_layer_type=rope, num_experts=raw["num_experts"] if moe else 0,
                      num_experts_per_tok=raw["top_k_experts"] if moe else 0,
                      moe_intermediate_size=raw["moe_intermediate_size"] if moe else 0, dense_layers=())
        return Gemma4Config(
            **fields,
            layer_shapes=shapes,
            kv_sources=sources,
            attention_k_eq_v=bool(raw.get("attention_k_eq_v", False)),
            per_layer_input_size=per_layer,
            per_layer_vocab_size=(raw.get("vocab_size_per_layer_input") or raw["vocab_size"]) if per_layer else 0,
            double_wide_mlp=bool(raw.get("use_double_wide_mlp", False)),
        )

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict, gguf: GGUFInfo) -> dict:
        """A `gemma4` GGUF: the per-layer keys (gemma4_gguf_fields) and the two ropes. llama.cpp's converter writes
        the global layers' proportional rope as a full rotation whose unrotated pairs have a frequency factor of
        1e30 (`rope_freqs`, [head_dim / 2]); the sliding layers rotate whole heads at `rope.freq_base_swa`."""
        raw = {**cfg, **gemma4_gguf_fields(gguf)}
        d_full = int(gguf.get("attention.key_length"))
        if int(gguf.get("rope.dimension_count_swa", raw["head_dim"])) != raw["head_dim"]:
            raise ModelLoadError("gemma4 GGUF: sliding layers that rotate part of each head are not supported")
        partial = 1.0
        if "rope_freqs.weight" in gguf.shapes and gguf.read is not None:
            factors = gguf.read("rope_freqs.weight")
            if len(factors) != d_full // 2 or any(f != 1.0 and f < 1e29 for f in factors):
                raise ModelLoadError(f"gemma4 GGUF: rope_freqs of {len(factors)} values other than 1 and 1e30 "
                                     "(only a proportional rope's rotated and unrotated pairs are supported)")
            partial = sum(f == 1.0 for f in factors) / (d_full // 2)
        raw["rope_parameters"] = {
            FULL: {"rope_type": "proportional", "rope_theta": cfg["rope_theta"], "partial_rotary_factor": partial},
            SLIDING: {"rope_type": "default", "rope_theta": float(gguf.get("rope.freq_base_swa", 10000.0))}}
        if cfg.get("num_experts"):
            raw.update(enable_moe_block=True, top_k_experts=cfg["num_experts_per_tok"])
            if cfg.get("mlp_only_layers"):
                raise ModelLoadError("gemma4 GGUF: experts in some layers only (every layer has them in Gemma 4)")
        return raw

    @classmethod
    def hf_tensors(cls, sd: dict[str, torch.Tensor], cfg: Gemma4Config) -> None:
        """HF's checkpoints keep the per-layer output scale and the router's scales without `.weight`, and every
        expert of a layer in one tensor: [E, 2 I, H] (gate | up) and [E, H, I], sliced here per expert."""
        for name in [k for k in sd if k.endswith((".layer_scalar", ".router.scale", ".router.per_expert_scale"))]:
            sd[name + ".weight"] = sd.pop(name)
        for name in [k for k in sd if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
            stacked = sd.pop(name)
            head, _, proj = name.rpartition(".")
            for e in range(stacked.shape[0]):
                sd[f"{head}.{e}.{proj}.weight"] = stacked[e]

    @classmethod
    def hf_checkpoint(cls, sd: dict[str, torch.Tensor], cfg: dict) -> None:
        """hf_tensors' inverse: the per-layer output scale and the router's scales without `.weight`, each layer's
        experts stacked. The norms are w in both formats."""
        for name in [k for k in sd if k.endswith((".layer_scalar.weight", ".router.scale.weight",
                                                   ".router.per_expert_scale.weight"))]:
            sd[name.removesuffix(".weight")] = sd.pop(name)
        for i in range(cfg["num_hidden_layers"]):
            p = cls.WEIGHTS.hf_layer.format(i) + "experts."
            for proj in ("gate_up_proj", "down_proj"):
                if (stacked := stack_experts(sd, p, proj + ".weight")) is not None:
                    sd[p + proj] = stacked

    def __init__(self, cfg: Gemma4Config, biases: frozenset[str] = frozenset()) -> None:
        super().__init__(cfg, biases)
        self.kv_sources = cfg.kv_sources
        p = cfg.per_layer_input_size
        if p:
            self.embed_tokens_per_layer = VocabEmbedding(cfg.per_layer_vocab_size, cfg.num_layers * p)
            self.per_layer_model_projection = _Weight(cfg.num_layers * p, cfg.hidden_size)
            self.per_layer_projection_norm = RMSNorm(p, cfg.rms_norm_eps)

    def kv_specs(self) -> list[KVSpec | None]:
        """A KV-shared layer keeps nothing of its own."""
        return [None if layer.shares_kv else KVSpec(layer.num_kv_heads, layer.head_dim, layer.sliding_window)
                for layer in self.layers]

    def rope_inv_freq(self, key: str) -> torch.Tensor:
        """The layers of a kind share a head size; "proportional": the leading pairs rotate, the rest do not."""
        r = self.cfg.rope_by_layer_type[key]
        d = self._head_dim_of(key)
        rotated = int(r.get("partial_rotary_factor", 1.0) * d // 2) if r.get("rope_type") == "proportional" else d // 2
        inv = 1.0 / (r["rope_theta"] ** (torch.arange(0, 2 * rotated, 2, dtype=torch.float32) / d))
        return torch.cat([inv, torch.zeros(d // 2 - rotated)]) / r.get("factor", 1.0)

    def rope_attention_scale(self, key: str) -> torch.Tensor:
        return torch.ones(self._head_dim_of(key) // 2)

    def _head_dim_of(self, key: str) -> int:
        return next(layer.head_dim for layer in self.layers if layer.rope_key == key)

    def after_load(self, source: str) -> None:
        """Gemma 4's norms scale by w in both formats: nothing to shift."""

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """[T, layers, P]: the token's own vectors and the embeddings' projection, normalized, mixed."""
        if not self.cfg.per_layer_input_size:
            return None
        t, n, p = x.shape[0], self.cfg.num_layers, self.cfg.per_layer_input_size
        own = self.embed_tokens_per_layer(input_ids).view(t, n, p) * torch.tensor(math.sqrt(p), dtype=x.dtype)
        proj = F.linear(x, self.per_layer_model_projection.weight) * torch.tensor(self.cfg.hidden_size ** -0.5,
                                                                                   dtype=x.dtype)
        proj, _ = self.per_layer_projection_norm(proj.view(t * n, p).contiguous(), None, self.backend)
        return (proj.view(t, n, p) + own) * torch.tensor(2.0 ** -0.5, dtype=x.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[KVCache | None],
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]. Returns logits [len(logits_indices), vocab] in fp32."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        per_layer = self.per_layer_inputs(input_ids, x)  # before layer 0 adds into x in place
        ropes = {key: self._rope(positions, x.dtype, key) for key in dict.fromkeys(lay.rope_key for lay in self.layers)}
        # the source layers' normalized k and v, [T, 2 KVH D], for the layers that share them
        shared: dict[int, torch.Tensor | None] = {src: None for i, src in enumerate(self.kv_sources) if src != i}
        for i, layer in enumerate(self.layers):
            src = self.kv_sources[i]
            x = layer.forward_stream(x, per_layer[:, i] if per_layer is not None else None, *ropes[layer.rope_key],
                                     caches[src], meta.for_layer(src), shared, src)
        if logits_indices.numel() == 0:
            return torch.zeros(0, self.cfg.vocab_size, device=x.device)
        h, _ = self.norm(x[logits_indices], None, self.backend)
        logits = self.lm_head(h, h.shape[0]).float()  # [R, vocab]: every sampled row as a decode's (see Llama's)
        if self.final_logit_softcapping is not None:
            c = self.final_logit_softcapping
            logits = torch.tanh(logits / c) * c
        return logits


class Gemma4TextTower(Gemma4ForCausalLM):
    """The language model of a `Gemma4ForConditionalGeneration` checkpoint (the released Gemma 4 models): text in,
    text out; the vision and audio towers' tensors are not read."""

    WEIGHTS = dataclasses.replace(
        Gemma4ForCausalLM.WEIGHTS,
        embed=Param("embed_tokens", "model.language_model.embed_tokens", "token_embd"),
        norm=Param("norm", "model.language_model.norm", "output_norm"),
        hf_layer="model.language_model.layers.{}.",
        extras=tuple(dataclasses.replace(p, hf=p.hf.replace("model.", "model.language_model.", 1))
                     for p in Gemma4ForCausalLM.WEIGHTS.extras),
    )

    @classmethod
    def config_from_hf(cls, raw: dict) -> Gemma4Config:
        return super().config_from_hf(text_config_of(raw))
