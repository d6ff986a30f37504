"""Qwen3.5 (dense and MoE, text): three linear-attention layers (Gated DeltaNet) for each full-attention one.

- Linear-attention layers keep no KV: a fixed-size state per sequence (layers/gated_delta_net.py), in a state slot
  the scheduler gives each running sequence. Their projection fuses HF's in_proj_qkv, in_proj_z, in_proj_b and
  in_proj_a into one linear; a depthwise causal conv (kernel 4, SiLU) runs over the q, k, v channels; the output is
  RMS-normed per value head (a plain weight), gated by SiLU(z), and projected out.
- Full-attention layers are Qwen3's (an RMSNorm over each head of q and k before rope) with rope on the leading
  quarter of each head, and an output gate: q_proj yields each head's q and its gate side by side, and the
  attention's output is multiplied by sigmoid(gate) before o_proj.
- Every RMSNorm but the gated one scales by (1 + w), as Gemma's do.
- Qwen3.5-MoE: every MLP is routed experts (softmax, top-k renormalized) plus a shared expert gated per token.

HF `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM`, and the language model of their `...ForConditionalGeneration`
checkpoints. Text positions only: the multimodal rope's three position streams coincide for text,
which makes it the plain rope. A state cannot be rolled back or shared at a prefix boundary, so speculative
decoding is refused and prefix caching is off for this model. Under tensor parallelism each rank keeps a span of
the linear-attention layers' value heads and the key heads those read (ModelConfig.linear_key_span), and their
states for those heads only.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...core.kv_spec import KVSpec
from ...distributed import TPGroup
from ..layers.gated_delta_net import StateCache, StateSeq, causal_conv, chunked, l2norm, recurrent_step
from ..layers.linear import PackedLinear
from ..layers.rotary import partial_rotary_order, partial_rotary_rows, rotary_dim
from .config import GGUFInfo, ModelConfig, qwen35_gguf_fields, text_config_of
from .llama import DecoderLayer, LlamaForCausalLM, shift_norms, unshift_norms
from .qwen3 import Qwen3DecoderLayer
from .qwen3_moe import MOE_EXPERTS, ROUTER
from .weight_names import Linear, Param, Part

LINEAR = "linear_attention"
_LLAMA = LlamaForCausalLM.WEIGHTS


class SharedExpert:
    """Qwen3.5-MoE's layers: beside the routed experts, an always-on SwiGLU expert whose output is scaled per token
    by sigmoid(shared_expert_gate(h))."""

    def __init__(self, cfg: ModelConfig, biases: frozenset[str] = frozenset(), index: int = 0) -> None:
        super().__init__(cfg, biases, index)
        self.shared = cfg.shared_expert_intermediate_size
        if self.shared:
            self.shared_gate_up = PackedLinear(cfg.hidden_size, 2 * self.shared)
            self.shared_down = PackedLinear(self.shared, cfg.hidden_size)
            self.shared_expert_gate = PackedLinear(cfg.hidden_size, 1)

    def feed_forward(self, h: torch.Tensor, decode_rows: int) -> torch.Tensor:
        out = super().feed_forward(h, decode_rows)
        if not self.shared:
            return out
        act = self.backend.gate_up_act(self.shared_gate_up, h, decode_rows, "silu")  # [T, shared]
        return out + torch.sigmoid(self.shared_expert_gate(h, decode_rows)) * self.shared_down(act, decode_rows)


class Qwen3_5AttentionLayer(SharedExpert, Qwen3DecoderLayer):
    def __init__(self, cfg: ModelConfig, biases: frozenset[str] = frozenset(), index: int = 0) -> None:
        super().__init__(cfg, biases, index)
        # q_proj's rows: per head, its q then its gate (head_dim each)
        self.qkv_proj = PackedLinear(cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size, "qkv_proj" in biases)
        self._gate: torch.Tensor | None = None

    def project_qkv(self, h: torch.Tensor, decode_rows: int) -> torch.Tensor:
        t, d = h.shape[0], self.head_dim
        out = self.qkv_proj(h, decode_rows)  # [T, 2 H D + 2 KVH D]
        q_gate = out[:, :2 * self.q_size].view(t, self.num_heads, 2 * d)
        self._gate = q_gate[..., d:].reshape(t, self.q_size)
        qkv = torch.cat((q_gate[..., :d].reshape(t, self.q_size), out[:, 2 * self.q_size:]), dim=-1)  # [T, (H + 2 KVH) D]
        self.backend.qk_norm(qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.num_heads,
                             self.num_kv_heads, self.head_dim)
        return qkv

    def self_attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, meta) -> torch.Tensor:
        nd = meta.num_decode_rows
        qkv = self.project_qkv(h, nd)
        a = self.backend.attention(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, cache, meta,
                                   self.scale, self.sinks)  # [T, H, D]
        gated = a.reshape(h.shape[0], self.q_size) * torch.sigmoid(self._gate)
        self._gate = None
        return self.o_proj(gated, nd)


class Qwen3_5LinearLayer(SharedExpert, DecoderLayer):
    """A Gated DeltaNet token mixer in place of attention, then the same MLP."""

    def __init__(self, cfg: ModelConfig, biases: frozenset[str] = frozenset(), index: int = 0) -> None:
        super().__init__(cfg, biases, index)
        del self.qkv_proj, self.o_proj
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.tiled = cfg.linear_value_heads_tiled
        self.conv_dim = 2 * self.hk * self.dk + self.hv * self.dv
        self.in_proj = PackedLinear(cfg.hidden_size, self.conv_dim + self.hv * self.dv + 2 * self.hv)
        self.out_proj = PackedLinear(self.hv * self.dv, cfg.hidden_size)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.empty(self.dv), requires_grad=False)
        self.eps = cfg.rms_norm_eps

    def use_heads(self, key_heads: int, value_heads: int) -> None:
        """A tensor-parallel shard's heads (its in_proj rows, conv channels and out_proj columns were cut so)."""
        self.hk, self.hv = key_heads, value_heads
        self.conv_dim = 2 * self.hk * self.dk + self.hv * self.dv

    def state_cache(self, num_slots: int) -> StateCache:
        return StateCache(num_slots, self.conv_dim, self.kernel, self.hv, self.dk, self.dv, self.conv_weight.device)

    def state_bytes(self) -> int:
        return StateCache.bytes_per_slot(self.conv_dim, self.kernel, self.hv, self.dk, self.dv)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [..., conv_dim] -> q, k [..., Hv, Dk] (normalized, q scaled; each key head serves
        Hv / Hk value heads) and v [..., Hv, Dv]."""
        kd = self.hk * self.dk
        q, k, v = mixed.split([kd, kd, self.hv * self.dv], dim=-1)
        r = self.hv // self.hk
        q, k = q.unflatten(-1, (self.hk, self.dk)), k.unflatten(-1, (self.hk, self.dk))
        if self.tiled:  # value head j reads key head j % Hk
            q, k = torch.cat([q] * r, dim=-2), torch.cat([k] * r, dim=-2)
        else:  # value head j reads key head j // r
            q, k = q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2)
        q, k = l2norm(q) * self.dk ** -0.5, l2norm(k)
        return q, k, v.unflatten(-1, (self.hv, self.dv))

    def _gate(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o [n, Hv, Dv] per value head RMS-normed, scaled by its weight, gated by SiLU(z) (z [n, Hv Dv])."""
        normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight.float()
        return normed * F.silu(z.reshape(o.shape))

    def mix(self, h: torch.Tensor, cache: StateCache, seqs: list[StateSeq], decode_rows: int) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]: each sequence's rows continue its state (zero where it is fresh)."""
        t = h.shape[0]
        p = self.in_proj(h, decode_rows).float()
        mixed, z, b, a = p.split([self.conv_dim, self.hv * self.dv, self.hv, self.hv], dim=-1)
        beta = torch.sigmoid(b)  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())  # [T, Hv]: log decay, <= 0
        w = self.conv_weight.float().view(self.conv_dim, self.kernel)
        dev = h.device
        gated = torch.zeros(t, self.hv, self.dv, device=dev)  # each row's output, normed and gated (_gate)
        steps = [s for s in seqs if s.n == 1]
        if steps:  # one token each: batched, in the backend's op where it has one
            rows = [s.q_start for s in steps]
            o = self.backend.gated_delta_decode(self, p, rows, [s.slot for s in steps], [s.fresh for s in steps],
                                                cache)
            if o is None:
                idx = torch.tensor(rows, device=dev)
                slots = torch.tensor([s.slot for s in steps], device=dev)
                keep = torch.tensor([0.0 if s.fresh else 1.0 for s in steps], device=dev)
                conv_state = cache.conv[slots] * keep[:, None, None]
                y, cache.conv[slots] = causal_conv(mixed[idx].unsqueeze(-1), conv_state, w)  # y [B, C, 1]
                q, k, v = self._heads(y[..., 0])
                o, cache.recurrent[slots] = recurrent_step(q, k, v, g[idx], beta[idx],
                                                           cache.recurrent[slots] * keep[:, None, None, None])
                o = self._gate(o, z[idx])
            gated[rows] = o
        for s in seqs:
            if s.n == 1:
                continue
            r = slice(s.q_start, s.q_start + s.n)
            conv_state = cache.conv[s.slot:s.slot + 1] * (0.0 if s.fresh else 1.0)
            y, cache.conv[s.slot:s.slot + 1] = causal_conv(mixed[r].T.unsqueeze(0), conv_state, w)  # y [1, C, n]
            q, k, v = self._heads(y[0].T)  # [n, Hv, D]
            state = cache.recurrent[s.slot] * (0.0 if s.fresh else 1.0)
            o, cache.recurrent[s.slot] = chunked(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 g[r].T, beta[r].T, state)
            gated[r] = self._gate(o.transpose(0, 1), z[r])
        return self.out_proj(gated.view(t, -1).to(h.dtype), decode_rows)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                cache: StateCache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual, self.backend)
        o = self.mix(h, cache, meta.state_seqs, meta.num_decode_rows)
        h, residual = self.post_attention_layernorm(o, residual, self.backend)
        return self.feed_forward(h, meta.num_decode_rows), residual


def _layer(cfg: ModelConfig, biases: frozenset[str] = frozenset(), index: int = 0) -> DecoderLayer:
    cls = Qwen3_5LinearLayer if cfg.layer_types[index] == LINEAR else Qwen3_5AttentionLayer
    return cls(cfg, biases, index)


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    layer_cls = staticmethod(_layer)
    has_state = True  # linear-attention layers: state slots, no prefix caching, no speculative decoding
    WEIGHTS = dataclasses.replace(
        _LLAMA,
        linears=(*_LLAMA.linears, ROUTER,
                 Linear("shared_gate_up", (Part("mlp.shared_expert.gate_proj", "ffn_gate_shexp"),
                                           Part("mlp.shared_expert.up_proj", "ffn_up_shexp"))),
                 Linear("shared_down", (Part("mlp.shared_expert.down_proj", "ffn_down_shexp"),), "row"),
                 Linear("shared_expert_gate", (Part("mlp.shared_expert_gate", "ffn_gate_inp_shexp"),), "replicated"),
                 Linear("in_proj", (Part("linear_attn.in_proj_qkv", "attn_qkv", split=("lk", "lk", "lv")),
                                    Part("linear_attn.in_proj_z", "attn_gate"),
                                    Part("linear_attn.in_proj_b", "ssm_beta"), Part("linear_attn.in_proj_a", "ssm_alpha"))),
                 Linear("out_proj", (Part("linear_attn.out_proj", "ssm_out"),), "row")),
        norms=(Param("input_layernorm", "input_layernorm", "attn_norm"),  # llama.cpp's name for the second norm:
               Param("post_attention_layernorm", "post_attention_layernorm", "post_attention_norm"),
               Param("q_norm", "self_attn.q_norm", "attn_q_norm"),
               Param("k_norm", "self_attn.k_norm", "attn_k_norm"),
               Param("conv_weight", "linear_attn.conv1d", "ssm_conv1d", split=("lk", "lk", "lv")),
               Param("dt_bias", "linear_attn.dt_bias", "ssm_dt", heads=True, gguf_suffix=".bias"),
               Param("A_log", "linear_attn.A_log", "ssm_a", heads=True, gguf_suffix=""),  # a GGUF: -exp(A_log)
               Param("norm_weight", "linear_attn.norm", "ssm_norm")),
        experts=MOE_EXPERTS,
        gguf_interleaved_rope=frozenset(),
    )

    @classmethod
    def config_from_hf(cls, raw: dict) -> ModelConfig:
        if "intermediate_size" not in raw:  # Qwen3.5-MoE: every layer's MLP is experts
            raw = {**raw, "intermediate_size": raw["moe_intermediate_size"]}
        cfg = ModelConfig.from_hf(raw)
        cfg.shared_expert_intermediate_size = raw.get("shared_expert_intermediate_size") or 0
        cfg.layer_types = tuple(raw["layer_types"])
        cfg.linear_num_key_heads, cfg.linear_num_value_heads = raw["linear_num_key_heads"], raw["linear_num_value_heads"]
        cfg.linear_key_head_dim, cfg.linear_value_head_dim = raw["linear_key_head_dim"], raw["linear_value_head_dim"]
        cfg.linear_conv_kernel_dim = raw.get("linear_conv_kernel_dim", 4)
        cfg.linear_value_heads_tiled = bool(raw.get("linear_value_heads_tiled", False))
        return cfg

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict, gguf: GGUFInfo) -> dict:
        return {**cfg, **qwen35_gguf_fields(gguf)}

    @classmethod
    def hf_tensors(cls, sd: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
        """dt_bias and A_log are bare parameters in HF's checkpoints: named as the map's weights. Qwen3.5-MoE stacks
        a layer's experts: gate_up_proj [E, 2 I, hidden] (gate rows, then up rows), down_proj [E, hidden, I]; each
        expert's linears are views of them."""
        for i in range(cfg.num_layers):
            layer = cls.WEIGHTS.hf_layer.format(i)
            for name in ("dt_bias", "A_log"):
                key = layer + "linear_attn." + name
                if key in sd:
                    sd[key + ".weight"] = sd.pop(key)
            p = layer + "mlp.experts."
            if p + "gate_up_proj" in sd:
                gate_up, down = sd.pop(p + "gate_up_proj"), sd.pop(p + "down_proj")
                n = gate_up.shape[1] // 2
                for e in range(gate_up.shape[0]):
                    sd[f"{p}{e}.gate_proj.weight"], sd[f"{p}{e}.up_proj.weight"] = gate_up[e, :n], gate_up[e, n:]
                    sd[f"{p}{e}.down_proj.weight"] = down[e]

    @classmethod
    def hf_checkpoint(cls, sd: dict[str, torch.Tensor], cfg: dict) -> None:
        """The inverse of llama.cpp's converter and of hf_tensors: the norms (but the gated one) as w, the decay
        rates as A_log = log(-a), dt_bias and A_log without `.weight`, the conv kernels [C, 1, K], and the value
        heads grouped by key head again where the file tiled them."""
        unshift_norms(sd, skip=("linear_attn.norm.weight",))
        hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        regroup = cfg.pop("linear_value_heads_tiled", False) and hk != hv

        def grouped(t: torch.Tensor, dim: int, d: int) -> torch.Tensor:  # [.., (hv / hk) hk d, ..] -> [.., hk (hv / hk) d, ..]
            t = t.movedim(dim, 0)
            shape = t.shape
            t = t.reshape(hv // hk, hk, d, *shape[1:]).transpose(0, 1).reshape(shape)
            return t.movedim(0, dim).contiguous()

        for i, kind in enumerate(cfg["layer_types"]):
            if kind != LINEAR:
                continue
            p = cls.WEIGHTS.hf_layer.format(i) + "linear_attn."
            sd[p + "A_log"] = (-sd.pop(p + "A_log.weight")).log()
            sd[p + "dt_bias"] = sd.pop(p + "dt_bias.weight")
            sd[p + "conv1d.weight"] = sd[p + "conv1d.weight"].unsqueeze(1)
            if not regroup:
                continue
            for name, dim, d in (("in_proj_z.weight", 0, dv), ("in_proj_a.weight", 0, 1), ("in_proj_b.weight", 0, 1),
                                 ("A_log", 0, 1), ("dt_bias", 0, 1), ("out_proj.weight", 1, dv)):
                sd[p + name] = grouped(sd[p + name], dim, d)
            for name in ("in_proj_qkv.weight", "conv1d.weight"):  # the key channels, then the value heads'
                t = sd[p + name]
                sd[p + name] = torch.cat((t[:2 * hk * dk], grouped(t[2 * hk * dk:], 0, dv)))

    def after_load(self, source: str) -> None:
        if source == "hf":  # (1 + w), as Gemma's norms
            shift_norms(self)
        else:  # llama.cpp's converter stores the decay rates as -exp(A_log) and the conv kernels [C, K]
            for layer in self.layers:
                if isinstance(layer, Qwen3_5LinearLayer):
                    layer.A_log.data = (-layer.A_log.data.float()).log().to(layer.A_log.dtype)
                    layer.conv_weight.data = layer.conv_weight.data.reshape(layer.conv_dim, 1, layer.kernel)
        cfg, d = self.cfg, self.cfg.head_dim
        rot = rotary_dim(cfg)
        if rot == d:
            return
        # rope on the leading `rot` dims of each head: q and k dims (and their norms' weights) reordered so that the
        # full-width kernels rotate exactly those (partial_rotary_order); the gates and v keep their order. A GGUF's
        # rows were read in this order already (gguf_row_order: quantized rows move whole)
        order = partial_rotary_order(d, rot)
        # this rank's heads (under tensor parallelism a slice): rows = 2 H D + 2 KVH D
        attn = next(layer for layer in self.layers if isinstance(layer, Qwen3_5AttentionLayer))
        heads, kv_heads = attn.num_heads, attn.num_kv_heads
        starts = [h * 2 * d for h in range(heads)] + [2 * heads * d + j * d for j in range(kv_heads)]
        rows = torch.cat([s + order for s in starts])
        at = torch.cat([s + torch.arange(d) for s in starts])
        for layer in self.layers:
            if isinstance(layer, Qwen3_5AttentionLayer):
                for t in (layer.qkv_proj.weight, layer.qkv_proj.bias) if source == "hf" else ():
                    if t is not None:
                        t.data[at] = t.data[rows]
                for norm in (layer.q_norm, layer.k_norm):
                    norm.weight.data = norm.weight.data[order]

    @classmethod
    def gguf_row_order(cls, part: Part, n: int, cfg: ModelConfig) -> np.ndarray | None:
        """q and k rows in the partial-rotary order after_load gives HF's (each head's q then its gate in attn_q)."""
        d, rot = cfg.head_dim, rotary_dim(cfg)
        if rot == d or part.gguf not in ("attn_q", "attn_k"):
            return None
        per_head = 2 * d if part.gguf == "attn_q" else d
        return partial_rotary_rows(d, rot, n // per_head, per_head, n)

    def use_tensor_parallel(self, tp: TPGroup) -> None:
        super().use_tensor_parallel(tp)
        lo, hi = self.cfg.linear_key_span(tp.world, tp.rank)
        for layer in self.layers:
            if isinstance(layer, Qwen3_5LinearLayer):
                layer.use_heads(hi - lo, self.cfg.linear_num_value_heads // tp.world)

    def kv_specs(self) -> list[KVSpec | None]:
        return [None if isinstance(layer, Qwen3_5LinearLayer) else KVSpec(layer.num_kv_heads, layer.head_dim)
                for layer in self.layers]

    def state_caches(self, num_slots: int) -> dict[int, StateCache]:
        """Each linear-attention layer's states, by layer index."""
        return {i: layer.state_cache(num_slots) for i, layer in enumerate(self.layers)
                if isinstance(layer, Qwen3_5LinearLayer)}

    def state_bytes_per_seq(self) -> int:
        return sum(layer.state_bytes() for layer in self.layers if isinstance(layer, Qwen3_5LinearLayer))


class Qwen3_5TextTower(Qwen3_5ForCausalLM):
    """The language model of a `Qwen3_5ForConditionalGeneration` checkpoint (the released Qwen3.5 models): text in,
    text out; its tensors under `model.language_model.`, its config under `text_config`. The vision tower's and the
    multi-token-prediction head's tensors are not read."""

    WEIGHTS = dataclasses.replace(
        Qwen3_5ForCausalLM.WEIGHTS,
        embed=Param("embed_tokens", "model.language_model.embed_tokens", "token_embd"),
        norm=Param("norm", "model.language_model.norm", "output_norm"),
        hf_layer="model.language_model.layers.{}.",
    )

    @classmethod
    def config_from_hf(cls, raw: dict) -> ModelConfig:
        return super().config_from_hf(text_config_of(raw))
