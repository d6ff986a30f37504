"""The Llama family in one implementation: Llama 2/3 (llama3 rope scaling), Mistral (sliding
window), Qwen2 (q/k/v bias), SmolLM. GQA; tied or untied embeddings.

The model works on a flat batch: all scheduled tokens of all sequences in one `[num_tokens]`
row, so every linear layer runs once per step; only attention looks at sequence boundaries.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ...core.kv_spec import KVSpec
from ...distributed import TPGroup
from ...platforms.cpu import Ops
from ..attention import AttentionMetadata
from ..kv_cache import KVCache
from ..layers.backends import Activation, Backend, TorchReference, backend_for
from ..layers.fused_moe import FusedMoE
from ..layers.linear import PackedLinear, VocabEmbedding
from ..layers.module import InferenceModule
from ..layers.rotary import llama3_scaling_from_factors, rope_attention_scale, rope_inv_freq
from ..layers.weight_formats import GGMLWeight, PackedWeight
from .config import GGUFInfo, ModelConfig
from .weight_names import Linear, Param, Part, WeightNames, has_module


class RMSNorm(InferenceModule):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); without a residual, x is the residual stream."""
        return backend.rms_norm(self.weight, self.eps, x, residual)


def shift_norms(model: nn.Module) -> None:
    """Every RMSNorm's weight w -> 1 + w: the families whose HF checkpoints store the norms centered at zero
    (Gemma, Qwen3.5) run them as the GGUF stores them."""
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.weight.data += 1


def unshift_norms(sd: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> None:
    """1 + w -> w for the norms of a GGUF's tensors under HF names (shift_norms' inverse; skip: names ending so
    are norms stored as w in both formats)."""
    for name in sd:
        if name.endswith("norm.weight") and not name.endswith(skip):
            sd[name] = sd[name] - 1


def stack_experts(sd: dict[str, torch.Tensor], prefix: str, name: str) -> torch.Tensor | None:
    """Pop `{prefix}{e}.{name}` for e = 0, 1, ... and return them stacked [E, ...] (None: no such tensor)."""
    parts = []
    while f"{prefix}{len(parts)}.{name}" in sd:
        parts.append(sd.pop(f"{prefix}{len(parts)}.{name}"))
    return torch.stack(parts) if parts else None


class DecoderLayer(InferenceModule):
    def __init__(self, cfg: ModelConfig, biases: frozenset[str] = frozenset(), index: int = 0) -> None:
        """index: the layer's place in the stack (a mixture-of-experts model may keep dense MLPs in some)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = PackedLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size, "qkv_proj" in biases)
        self.o_proj = PackedLinear(self.q_size, cfg.hidden_size, "o_proj" in biases)
        self.mlp: FusedMoE | None = None
        if cfg.is_moe_layer(index):
            self.mlp = FusedMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                                cfg.norm_topk_prob)
        else:
            self.gate_up_proj = PackedLinear(cfg.hidden_size, 2 * cfg.intermediate_size, "gate_up_proj" in biases)
            self.down_proj = PackedLinear(cfg.intermediate_size, cfg.hidden_size, "down_proj" in biases)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.scale = cfg.head_dim ** -0.5
        self.sliding_window = cfg.sliding_window  # None: attends to every earlier token
        self.rope_key = "default"  # which of the model's rope tables this layer reads
        self.act: Activation = "silu"  # the gated MLP's activation (SwiGLU)
        self.sinks: torch.Tensor | None = None  # [H] fp32: each head's attention sink (gpt-oss)
        self.backend: Backend = TorchReference()

    def project_qkv(self, h: torch.Tensor, decode_rows: int) -> torch.Tensor:
        """q, k and v of the normalized input, before rope."""
        return self.finish_qkv(self.qkv_proj(h, decode_rows))

    def finish_qkv(self, qkv: torch.Tensor) -> torch.Tensor:
        """The projection's output [T, (H + 2 KVH) D] made q, k and v (a family that normalizes q and k does it
        here)."""
        return qkv

    def feed_forward(self, h: torch.Tensor, decode_rows: int) -> torch.Tensor:
        """The MLP (or the experts) on the normalized input: [T, hidden] -> [T, hidden]."""
        if self.mlp is not None:
            return self.mlp(h, decode_rows, self.backend)
        act = self.backend.gate_up_act(self.gate_up_proj, h, decode_rows, self.act)  # [T, intermediate]
        return self.down_proj(act, decode_rows)

    def self_attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                       meta: AttentionMetadata) -> torch.Tensor:
        """The normalized input [T, hidden] -> the attention block's output [T, hidden] (after o_proj)."""
        nd = meta.num_decode_rows  # the leading rows compute output tokens: a weight format may choose its path by them
        return self.attend_qkv(self.project_qkv(h, nd), cos, sin, cache, meta)

    def attend_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                   meta: AttentionMetadata) -> torch.Tensor:
        """q, k and v [T, q_size + 2 * kv_size] -> the attention block's output [T, hidden] (after o_proj)."""
        a = self.backend.attention(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, cache, meta,
                                   self.scale, self.sinks)  # [T, H, D]
        return self.o_proj(a.view(qkv.shape[0], self.q_size), meta.num_decode_rows)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this layer's input delta, residual: the stream before it (None at layer 0); cos, sin: the
        backend's rope tables. Returns (mlp output, residual). Where the layer projects and feeds forward as this
        class does, each norm goes to the backend with the projection it feeds (one op call on the CPU)."""
        meta = meta.for_window(self.sliding_window)
        nd, be, cls = meta.num_decode_rows, self.backend, type(self)
        if cls.project_qkv is DecoderLayer.project_qkv and cls.self_attention is DecoderLayer.self_attention:
            qkv, residual = be.norm_linear(self.input_layernorm, self.qkv_proj, x, residual, nd)
            o = self.attend_qkv(self.finish_qkv(qkv), cos, sin, cache, meta)
        else:
            h, residual = self.input_layernorm(x, residual, be)
            o = self.self_attention(h, cos, sin, cache, meta)
        if self.mlp is None and cls.feed_forward is DecoderLayer.feed_forward:
            act, residual = be.norm_linear(self.post_attention_layernorm, self.gate_up_proj, o, residual, nd,
                                           self.act)  # [T, intermediate]
            return self.down_proj(act, nd), residual
        h, residual = self.post_attention_layernorm(o, residual, be)
        return self.feed_forward(h, nd), residual


class LlamaForCausalLM(nn.Module):
    layer_cls = DecoderLayer
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

    @classmethod
    def fit_context(cls, cfg: ModelConfig, context: int | None) -> ModelConfig:
        """The config for the context the engine was asked for (None: the model's own); a model whose rope
        depends on it chooses here."""
        return cfg

    @classmethod
    def hf_tensors(cls, sd: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
        """An HF checkpoint's tensors (in place), as the weight map names them: a family whose checkpoints
        stack tensors otherwise (gpt-oss: all experts in one) renames or slices them here, as views."""

    @classmethod
    def hf_checkpoint(cls, sd: dict[str, torch.Tensor], cfg: dict) -> None:
        """The inverse of `hf_tensors` and of llama.cpp's converter, for writing a GGUF out as an HF folder: sd holds
        the file's tensors (fp32, HF's shapes) under the weight map's HF names, cfg the HF config its metadata gave;
        a family whose HF checkpoints store tensors or keys otherwise changes both here, in place."""
        if cfg["architectures"] == ["LlamaForCausalLM"] and cfg.get("sliding_window"):
            cfg["architectures"] = ["MistralForCausalLM"]  # HF's Llama has no window: a windowed `llama` file is Mistral

    @classmethod
    def gguf_row_order(cls, part: Part, n: int, cfg: ModelConfig) -> np.ndarray | None:
        """The order to read a GGUF linear part's n rows in, where the model keeps them otherwise than the file (None:
        the file's). Rows are whole blocks, so quantized rows move without a change."""
        return None

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict, gguf: GGUFInfo) -> dict:
        """The HF config a GGUF's metadata gave (the keys every family shares), with what llama.cpp fixes for
        this family in code rather than metadata, or what its own keys and tensors say (gguf). Llama 3.1+ files
        carry their rope scaling as per-pair divisors (`rope_freqs`), read back as HF's llama3 parameters."""
        if "rope_freqs.weight" in gguf.shapes and gguf.read is not None and "rope_scaling" not in cfg:
            rot = int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 1.0))
            scaling = llama3_scaling_from_factors(list(gguf.read("rope_freqs.weight")), rot, cfg["rope_theta"])
            if scaling is not None:
                cfg = {**cfg, "rope_scaling": scaling}
        return cfg

    def __init__(self, cfg: ModelConfig, biases: frozenset[str] = frozenset()) -> None:
        """biases: the attribute names of the layers' linears that have one in the checkpoint."""
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(cfg, biases, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = PackedLinear(cfg.hidden_size, cfg.vocab_size, False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._rope_tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # rope key -> fp32 (cos, sin) [n, D]
        self.embed_scale: float | None = None  # the embeddings' multiplier (Gemma: sqrt(hidden))
        self.final_logit_softcapping: float | None = None  # logits -> c * tanh(logits / c)
        self.ops: Ops | None = None
        self.backend: Backend = TorchReference()
        self.tp: TPGroup | None = None

    @property
    def embed_packed(self) -> GGMLWeight | None:
        """A quantized token table, looked up row by row (None: dense)."""
        return self.embed_tokens.packed

    @embed_packed.setter
    def embed_packed(self, packed: GGMLWeight | None) -> None:
        self.embed_tokens.packed = packed

    @property
    def vocab_range(self) -> tuple[int, int]:
        return self.embed_tokens.vocab_range

    def use_tensor_parallel(self, tp: TPGroup) -> None:
        """The loader cut this rank's shards; the layers now count this rank's heads and reduce across ranks."""
        cfg, n = self.cfg, tp.world
        self.tp = tp
        self.embed_tokens.tp, self.embed_tokens.vocab_range = tp, tp.span(cfg.vocab_size)
        self.lm_head.gather = tp  # vocab-parallel logits
        row_parallel = [spec.attr for spec in self.WEIGHTS.linears if spec.parallel == "row"]
        for layer in self.layers:  # (each layer's own shape: Gemma 4's global layers differ)
            layer.num_heads, layer.num_kv_heads = layer.num_heads // n, layer.num_kv_heads // n
            layer.q_size, layer.kv_size = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
            for attr in row_parallel:  # the ranks' partial sums
                if has_module(layer, attr):
                    layer.get_submodule(attr).reduce = tp
            if layer.mlp is not None:  # the experts' partial sums, once after the combine
                layer.mlp.reduce = tp

    def kv_specs(self) -> list[KVSpec]:
        """What each layer keeps per token in the KV pool (this rank's heads)."""
        return [KVSpec(layer.num_kv_heads, layer.head_dim, layer.sliding_window) for layer in self.layers]

    def _linears(self) -> list[PackedLinear]:
        return [m for layer in self.layers for m in layer.modules() if isinstance(m, PackedLinear)] + [self.lm_head]

    def _idle_experts(self, size: Callable[[PackedLinear], int]) -> int:
        """The `size` (weights, bytes) of the experts a token does not multiply through: its router picks top_k
        of num_experts in each MoE layer."""
        idle = 0
        for layer in self.layers:
            if layer.mlp is not None:
                n = sum(size(lin) for lin in layer.mlp.experts.modules() if isinstance(lin, PackedLinear))
                idle += n - n * layer.mlp.top_k // layer.mlp.num_experts
        return idle

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
        """Weights every token multiplies through (all linears, lm_head included, a MoE layer's routed experts
        only), however stored."""
        params = lambda lin: lin.in_features * lin.out_features
        return sum(params(lin) for lin in self._linears()) - self._idle_experts(params)

    def step_weight_bytes(self) -> int:
        """Bytes one decode step of one sequence reads: the linears as stored (a MoE layer's routed experts
        only), their biases and the norms (not the embedding table, of which a step gathers a few rows, unless
        it is the tied lm_head)."""
        others = sum(p.numel() * p.element_size() for name, p in self.named_parameters()
                     if "norm" in name or name.endswith("bias"))
        return self.linear_weight_bytes() + others - self._idle_experts(lambda lin: (lin.packed or lin.weight).nbytes)

    def use_backend(self, backend: Backend) -> None:
        """The compute every layer asks for (layers/backends.py, a device's kernels: triton_ops)."""
        self.backend = backend
        for layer in self.layers:
            layer.backend = backend

    def set_ops(self, ops: Ops | None, weight_dtype: torch.dtype = torch.float32) -> None:
        """Use the C++ kernels. Dense linears are packed into column panels, fp32 or bf16 (weight_dtype),
        and their plain [out, in] copies dropped (rebuilt from the panels if the ops are turned off),
        except a tied lm_head's, which is the embedding table; linears already packed (GGUF blocks) stay
        as they are. Activations, norms and the residual stream stay fp32 either way."""
        self.ops = ops
        self.use_backend(backend_for(ops))
        table = self.embed_tokens.weight
        for lin in self._linears():
            tied = lin.weight is table  # a tied lm_head's dense weight is the table: never dropped
            if ops is not None:
                lin.pack(ops, weight_dtype, shared=tied)
            else:
                lin.unpack(keep_dense=tied and self.embed_packed is None)
        if ops is None:
            self.embed_tokens.unpack()

    def after_load(self, source: str) -> None:
        """Every weight is in place, as the checkpoint stores it (source: "hf" or "gguf"); a family whose two
        formats store a tensor differently evens that out here (Gemma's norms)."""

    def tie_lm_head(self) -> None:
        """The output projection reads the token table as it was loaded (dense or packed, a shard under TP)."""
        table = self.embed_tokens
        self.lm_head.weight = table.weight
        if table.packed is not None:
            self.lm_head.set_packed(table.packed, shared=True)
        else:
            self.lm_head.out_features = table.weight.shape[0]

    def set_packed(self, lin: PackedLinear, packed: PackedWeight) -> None:
        """Give a linear its weights already packed (GGUF blocks, quantized at load)."""
        lin.set_packed(packed, shared=lin.weight is self.embed_tokens.weight)

    def rope_inv_freq(self, key: str) -> torch.Tensor:
        """The inverse frequencies of the rope table layers name by `rope_key` (one table unless the model's
        layers differ: Gemma 3's local and global layers)."""
        return rope_inv_freq(self.cfg)

    def rope_attention_scale(self, key: str) -> torch.Tensor:
        return rope_attention_scale(self.cfg)

    def reserve_rope(self, n: int) -> None:
        """Rope tables of n positions for every key, never grown after (no host sync for the positions' max in a
        step: a captured forward cannot have one); positions stay below n (the engine's max_model_len)."""
        for key in dict.fromkeys(lay.rope_key for lay in self.layers):
            self._rope_tables.pop(key, None)
            self._rope(torch.tensor([n - 1], device=self.device), torch.float32, key)
        self._rope_reserved = n

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._rope_tables.get(key)
        need = 0 if table is not None and getattr(self, "_rope_reserved", 0) else int(positions.max()) + 1
        if table is None or need > table[0].shape[0]:  # tables grow on demand, computed in fp32 as HF does
            # at least doubling: a long decode past the table rebuilds it O(log n) times, not at every step
            grown = 2 * table[0].shape[0] if table is not None else 4096
            n = max(need, min(self.cfg.max_position_embeddings, grown))
            with torch.device("cpu"):  # built on the host whatever the device: the same bits everywhere
                freqs = torch.outer(torch.arange(n, dtype=torch.float32), self.rope_inv_freq(key))
                emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]
                scale = self.rope_attention_scale(key).repeat(2)  # [D]
            dev = positions.device
            table = self._rope_tables[key] = ((emb.cos() * scale).to(dev), (emb.sin() * scale).to(dev))
        return self.backend.rope_tables(*table, positions, dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[KVCache],
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]. Returns logits [len(logits_indices), vocab] in fp32."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        ropes = {key: self._rope(positions, x.dtype, key) for key in dict.fromkeys(lay.rope_key for lay in self.layers)}
        residual = None
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            x, residual = layer(x, residual, *ropes[layer.rope_key], cache, meta.for_layer(i))
        if logits_indices.numel() == 0:  # KV only (a draft model mirroring a step)
            return torch.zeros(0, self.cfg.vocab_size, device=x.device)
        # only the rows we sample from reach the final norm and the lm_head
        x, _ = self.norm(x[logits_indices], residual[logits_indices], self.backend)
        # each sampled row yields one token, a prompt's last row as a decode's: all of them take the format's
        # decode path (a few rows: its integer dot, not a dequantization of the whole vocabulary for one row)
        logits = self.lm_head(x, x.shape[0]).float()  # [R, vocab]
        if self.final_logit_softcapping is not None:
            c = self.final_logit_softcapping
            logits = torch.tanh(logits / c) * c
        return logits
