"""The Llama family in one implementation: Llama 2/3 (llama3 rope scaling), Mistral (sliding
window), Qwen2 (q/k/v bias), SmolLM. GQA; tied or untied embeddings.

The model works on a flat batch: all scheduled tokens of all sequences in one `[num_tokens]`
row, so every linear layer runs once per step; only attention looks at sequence boundaries.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...distributed import TPGroup
from ...errors import ModelLoadError
from ...platforms.cpu import Ops
from ..attention import AttentionMetadata, attention_from_qkv, paged_attention
from ..kv_cache import KVCache
from ..layers.weight_formats import DensePanels, GGMLWeight, PackedWeight
from .config import ModelConfig
from .weight_names import Linear, Param, Part, WeightNames


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if not s:
        return inv_freq
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return inv_freq / s["factor"]
    if kind == "llama3":
        factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_len = s.get("original_max_position_embeddings", 8192)
        lo_wavelen, hi_wavelen = old_len / lo, old_len / hi
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > lo_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < hi_wavelen) & ~(wavelen > lo_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ModelLoadError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                ops: Ops | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(residual + x), residual + x); without a residual, x is the residual stream.
        The C++ op adds in place into `residual` and normalizes in the same pass."""
        if ops is not None:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps, None), x
            return ops.rms_norm(x, self.weight, self.eps, residual), residual
        if residual is not None:
            x = x + residual
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype), x


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """nn.Linear plus `packed`: the PackedWeight its matmul runs on once the C++ kernels are in use (or
    as the GGUF file stores it), None for torch's F.linear on `weight`."""
    lin = nn.Linear(in_features, out_features, bias=bias)
    lin.packed = None
    return lin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, biases: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = _linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, "qkv_proj" in biases)
        self.o_proj = _linear(self.q_size, cfg.hidden_size, "o_proj" in biases)
        self.gate_up_proj = _linear(cfg.hidden_size, 2 * cfg.intermediate_size, "gate_up_proj" in biases)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, "down_proj" in biases)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.scale = cfg.head_dim ** -0.5
        self.ops: Ops | None = None
        self.tp: TPGroup | None = None  # tensor parallelism: this rank's heads and MLP slice

    def _linear(self, x: torch.Tensor, layer: nn.Linear, decode_rows: int) -> torch.Tensor:
        if layer.packed is None:
            return layer(x)
        return layer.packed.matmul(x, decode_rows)  # [T, out] fp32 whatever the weights' format

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this layer's input delta, residual: the stream before it (None at layer 0).
        cos, sin: [T, D / 2] with the C++ ops, else [T, 1, D]. Returns (mlp output, residual)."""
        t = x.shape[0]
        h, residual = self.input_layernorm(x, residual, self.ops)
        nd = meta.num_decodes  # the leading rows are decodes: a weight format may choose its path by them
        qkv = self._linear(h, self.qkv_proj, nd)  # [T, q_size + 2 * kv_size]
        if self.ops is not None:
            a = attention_from_qkv(self.ops, qkv, cos, sin, self.num_heads, cache, meta, self.scale)  # [T, H, D]
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            q = q * cos + rotate_half(q) * sin  # cos, sin: [T, 1, D]
            k = k * cos + rotate_half(k) * sin
            a = paged_attention(q, k, v, cache, meta, self.scale)  # [T, H, D]
        o = self._linear(a.view(t, self.q_size), self.o_proj, nd)
        if self.tp is not None:  # row-parallel: the ranks' partial sums
            self.tp.all_reduce(o)
        h, residual = self.post_attention_layernorm(o, residual, self.ops)
        if self.ops is not None:  # set_ops packed every linear
            act = self.gate_up_proj.packed.matmul_silu_and_mul(h, nd)  # [T, intermediate]
        else:
            gate, up = self._linear(h, self.gate_up_proj, nd).chunk(2, dim=-1)  # [T, intermediate] each
            act = F.silu(gate) * up
        out = self._linear(act, self.down_proj, nd)
        if self.tp is not None:
            self.tp.all_reduce(out)
        return out, residual


class LlamaForCausalLM(nn.Module):
    # llama.cpp's converter interleaves q/k rotary halves for its `llama` architecture only
    WEIGHTS = WeightNames(
        embed=Param("embed_tokens", "model.embed_tokens", "token_embd"),
        norm=Param("norm", "model.norm", "output_norm"),
        lm_head=Linear("lm_head", (Part("lm_head", "output"),)),
        linears=(
            Linear("qkv_proj", (Part("self_attn.q_proj", "attn_q", "num_heads"),
                                Part("self_attn.k_proj", "attn_k", "num_kv_heads"), Part("self_attn.v_proj", "attn_v"))),
            Linear("o_proj", (Part("self_attn.o_proj", "attn_output"),), "row"),
            Linear("gate_up_proj", (Part("mlp.gate_proj", "ffn_gate"), Part("mlp.up_proj", "ffn_up"))),
            Linear("down_proj", (Part("mlp.down_proj", "ffn_down"),), "row"),
        ),
        norms=(Param("input_layernorm", "input_layernorm", "attn_norm"),
               Param("post_attention_layernorm", "post_attention_layernorm", "ffn_norm")),
        gguf_interleaved_rope=frozenset({"llama"}),
    )

    @classmethod
    def config_from_hf(cls, raw: dict) -> ModelConfig:
        return ModelConfig.from_hf(raw)

    def __init__(self, cfg: ModelConfig, biases: frozenset[str] = frozenset()) -> None:
        """biases: the attribute names of the layers' linears that have one in the checkpoint."""
        super().__init__()
        self.cfg = cfg
        # _weight: no random init (the loader fills it; nn.init.normal_ under a meta device context goes
        # through torch._refs, which imports torch._dynamo and triton: ~70 MiB of RSS and ~1 s of startup)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, biases) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size, False)
        self.embed_packed: GGMLWeight | None = None  # a quantized table, looked up row by row
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._rope_len = 0
        self.ops: Ops | None = None
        self.tp: TPGroup | None = None  # tensor parallelism: vocab-parallel embedding and lm_head over vocab_range
        self.vocab_range = (0, cfg.vocab_size)

    def use_tensor_parallel(self, tp: TPGroup) -> None:
        """The loader cut this rank's shards; the layers now count this rank's heads and reduce across ranks."""
        cfg, n = self.cfg, tp.world
        hq, hk, d = cfg.num_heads // n, cfg.num_kv_heads // n, cfg.head_dim
        self.vocab_range = tp.span(cfg.vocab_size)
        self.tp = tp
        for layer in self.layers:
            layer.num_heads, layer.num_kv_heads = hq, hk
            layer.q_size, layer.kv_size = hq * d, hk * d
            layer.tp = tp

    def _linears(self) -> list[nn.Linear]:
        per_layer = [[lay.qkv_proj, lay.o_proj, lay.gate_up_proj, lay.down_proj] for lay in self.layers]
        return [lin for group in per_layer for lin in group] + [self.lm_head]

    @property
    def weight_format(self) -> str:
        """The linears' storage formats, e.g. "bf16", "q4_1", "q4_k+q6_k"."""
        names = [lin.packed.format_name if lin.packed is not None else str(lin.weight.dtype).removeprefix("torch.")
                 for lin in self._linears()]
        return "+".join(dict.fromkeys("+".join(names).split("+")))

    def linear_weight_bytes(self) -> int:
        """Bytes the linears' weights take as stored (a tied lm_head counted once, as the table)."""
        seen: set[int] = set()
        total = 0
        for lin in self._linears():
            stored = lin.packed if lin.packed is not None else lin.weight
            if id(stored) in seen:
                continue
            seen.add(id(stored))
            total += stored.nbytes
        return total

    def matmul_params(self) -> int:
        """Weights every token multiplies through (all linears, lm_head included), however stored."""
        return sum(lin.in_features * lin.out_features for lin in self._linears())

    def step_weight_bytes(self) -> int:
        """Bytes one decode step reads: the linears as stored, their biases and the norms (not the
        embedding table, of which a step gathers a few rows, unless it is the tied lm_head)."""
        others = sum(p.numel() * p.element_size() for name, p in self.named_parameters()
                     if "norm" in name or name.endswith("bias"))
        return self.linear_weight_bytes() + others

    def set_ops(self, ops: Ops | None, weight_dtype: torch.dtype = torch.float32) -> None:
        """Use the C++ kernels. Dense linears are packed into column panels, fp32 or bf16 (weight_dtype),
        and their plain [out, in] copies dropped (rebuilt from the panels if the ops are turned off),
        except a tied lm_head's, which is the embedding table; linears already packed (GGUF blocks) stay
        as they are. Activations, norms and the residual stream stay fp32 either way."""
        self.ops = ops
        for layer in self.layers:
            layer.ops = ops
        for lin in self._linears():
            if ops is not None and lin.packed is None:
                w = lin.weight.data
                lin.packed = DensePanels(ops, w, lin.bias.data if lin.bias is not None else None, weight_dtype)
                if lin.weight is not self.embed_tokens.weight:
                    lin.weight.data = w.new_empty(0)
            elif ops is None and lin.packed is not None:
                if lin.weight is not self.embed_tokens.weight or self.embed_packed is not None:
                    lin.weight.data = lin.packed.dequantize().to(lin.weight.dtype)
                lin.packed = None
        if ops is None and self.embed_packed is not None:
            self.embed_tokens.weight.data = self.embed_packed.dequantize()
            self.embed_packed = None

    def set_packed(self, lin: nn.Linear, packed: PackedWeight) -> None:
        """Give a linear its weights already packed (GGUF blocks, quantized at load); the dense copy goes."""
        lin.packed = packed
        if lin.weight is not self.embed_tokens.weight:
            lin.weight = nn.Parameter(torch.empty(0, device="cpu"), requires_grad=False)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1
        if need > self._rope_len:  # tables grow on demand, computed in fp32 as HF does
            n = max(need, min(self.cfg.max_position_embeddings, 4096))
            freqs = torch.outer(torch.arange(n, dtype=torch.float32), rope_inv_freq(self.cfg))
            emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]
            self._cos, self._sin, self._rope_len = emb.cos(), emb.sin(), n
        if self.ops is not None:  # the C++ op reads the first half of each (duplicated) table row
            half = self._cos.shape[1] // 2
            return self._cos[positions, :half], self._sin[positions, :half]  # [T, D / 2]
        cos = self._cos[positions].to(dtype).unsqueeze(1)  # [T, 1, D]
        sin = self._sin[positions].to(dtype).unsqueeze(1)
        return cos, sin

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[KVCache],
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]. Returns logits [len(logits_indices), vocab] in fp32."""
        if self.tp is not None:  # this rank's rows of the table; the others' come from the all-reduce
            lo, hi = self.vocab_range
            mine = (input_ids >= lo) & (input_ids < hi)
            local = (input_ids - lo).clamp(0, hi - lo - 1)
            x = self.embed_packed.rows(local) if self.embed_packed is not None else self.embed_tokens(local)
            x = x * mine.unsqueeze(1)  # [T, hidden]
            self.tp.all_reduce(x)
        elif self.embed_packed is not None:
            x = self.embed_packed.rows(input_ids)  # [T, hidden] fp32
        else:
            x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self._rope(positions, x.dtype)
        residual = None
        for layer, cache in zip(self.layers, caches):
            x, residual = layer(x, residual, cos, sin, cache, meta)
        if logits_indices.numel() == 0:  # KV only (a draft model mirroring a step)
            return torch.zeros(0, self.cfg.vocab_size)
        # only the rows we sample from reach the final norm and the lm_head
        x, _ = self.norm(x[logits_indices], residual[logits_indices], self.ops)
        # the sampled rows keep the step's order: the decodes' rows first
        logits = self.lm_head.packed.matmul(x, meta.num_decodes) if self.lm_head.packed is not None \
            else self.lm_head(x).float()
        return logits if self.tp is None else self.tp.all_gather_last(logits)  # [R, vocab]
