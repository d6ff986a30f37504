"""How a model's modules are named in HF checkpoints and in GGUF files.

A model file declares one `WeightNames`; the generic loaders (model_loader/) read any checkpoint
through it, cut each rank's tensor-parallel shard as they read, and fuse parts (q, k, v -> qkv) by
concatenating along the outputs. Names carry no ".weight" / ".bias" suffix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor of a linear (several are stacked along the outputs: q, k, v)."""

    hf: str  # "self_attn.q_proj" within a layer, "lm_head" at the top
    gguf: str  # "attn_q" within a layer, "output" at the top
    # the ModelConfig field counting this tensor's rope heads, where llama.cpp's converter interleaved the
    # rotary halves of its rows (the loader restores HF's order; rows are whole blocks, so no bytes change)
    rope_heads: str | None = None
    # a checkpoint tensor that stacks several outputs (Phi-3's qkv_proj: "q", "kv", "kv"; gate_up_proj: "ffn",
    # "ffn"; Qwen3.5's in_proj_qkv: "lk", "lk", "lv"): tensor parallelism cuts each piece on its own (piece_rows)
    split: tuple[str, ...] = ()


def piece_rows(split: tuple[str, ...], cfg: Any, world: int, rank: int) -> list[tuple[int, np.ndarray]]:
    """Each piece of a stacked tensor: (its rows, the rows of it one rank keeps). A piece is cut by an even span,
    except the linear-attention key channels ("lk"), of which a rank keeps the key heads its value heads read."""
    sizes = {"q": cfg.num_heads * cfg.head_dim, "kv": cfg.num_kv_heads * cfg.head_dim, "ffn": cfg.intermediate_size,
             "moe": cfg.moe_intermediate_size, "lk": cfg.linear_num_key_heads * cfg.linear_key_head_dim,
             "lv": cfg.linear_num_value_heads * cfg.linear_value_head_dim, "lh": cfg.linear_num_value_heads}
    out = []
    for name in split:
        n = sizes[name]
        if name == "lk":
            lo, hi = cfg.linear_key_span(world, rank)
            lo, hi = lo * cfg.linear_key_head_dim, hi * cfg.linear_key_head_dim
        else:
            lo, hi = rank * n // world, (rank + 1) * n // world
        out.append((n, np.arange(lo, hi)))
    return out


def has_module(owner: Any, path: str) -> bool:
    """Whether an nn.Module has a submodule at a dotted path ("mlp.gate")."""
    try:
        owner.get_submodule(path)
    except AttributeError:
        return False
    return True


@dataclass(frozen=True)
class Linear:
    attr: str  # the nn.Linear's attribute on its layer (or on the model)
    parts: tuple[Part, ...]
    # column: each part's outputs split across ranks (heads, MLP rows, vocabulary); row: the inputs split,
    # outputs all-reduced by the model, a bias added on rank 0 only; replicated: whole on every rank (a router)
    parallel: Literal["column", "row", "replicated"] = "column"


@dataclass(frozen=True)
class Param:
    """A tensor loaded as it is (a norm's weight, the embedding table): `attr` names a module (its weight) or a
    parameter of the layer (gpt-oss's attention sinks)."""

    attr: str
    hf: str
    gguf: str
    heads: bool = False  # one value per head (query heads; a linear-attention layer's value heads): cut by rank
    split: tuple[str, ...] = ()  # rows stacked as a linear's part's are (Qwen3.5's conv channels): cut the same way
    # the GGUF tensor's suffix: Gemma 4's router scales are `ffn_gate_inp.scale`, Qwen3.5's decay rates `ssm_a`
    gguf_suffix: str = ".weight"

    @property
    def gguf_tensor(self) -> str:
        return self.gguf + self.gguf_suffix


@dataclass(frozen=True)
class WeightNames:
    embed: Param  # vocab-parallel rows under tensor parallelism
    norm: Param
    lm_head: Linear  # absent from the checkpoint: tied to the embedding
    linears: tuple[Linear, ...]  # per layer (attrs may be dotted paths: "mlp.gate"); a layer without the module skips it
    norms: tuple[Param, ...]  # per layer
    # per expert of a mixture-of-experts layer: `{e}` in attr and HF names stands for the expert's index; the
    # GGUF name is the 3-D tensor holding every expert (`ffn_gate_exps`), of which expert e is slice e
    experts: tuple[Linear, ...] = ()
    # top-level tensors beyond the table, the final norm and lm_head, loaded as they are where the model has the
    # module (Gemma 4's per-layer input tables); full HF names, GGUF names without a layer prefix
    extras: tuple[Param, ...] = ()
    hf_layer: str = "model.layers.{}."
    gguf_layer: str = "blk.{}."
    gguf_interleaved_rope: frozenset[str] = frozenset()  # GGUF architectures whose q/k rows were interleaved

    def hf_names(self, gguf_arch: str) -> dict[str, tuple[str, str | None]]:
        """GGUF tensor name -> (HF name, rope heads field to undo), suffixes included, for the top-level tensors and
        `{}`-templated layer tensors (the inverse map, for writing a GGUF out as an HF folder). A tensor of a
        family's own suffix (`ssm_a`, `ffn_gate_inp.scale`) maps to its HF name + ".weight", as `hf_tensors` names
        it: the family's `hf_checkpoint` gives it HF's name and value."""
        rope = gguf_arch in self.gguf_interleaved_rope
        out: dict[str, tuple[str, str | None]] = {}

        def linear(gguf: str, hf: str, heads: str | None) -> None:
            for suffix in (".weight", ".bias"):
                out[gguf + suffix] = (hf + suffix, heads)

        for p in (self.embed, self.norm, *self.extras):
            out[p.gguf_tensor] = (p.hf + ".weight", None)
        for p in self.lm_head.parts:
            linear(p.gguf, p.hf, None)
        for lin in self.linears:
            for p in lin.parts:
                linear(self.gguf_layer + p.gguf, self.hf_layer + p.hf, p.rope_heads if rope else None)
        for lin in self.experts:  # stacked along a leading expert axis, `{e}` left in the HF name
            for p in lin.parts:
                linear(self.gguf_layer + p.gguf, self.hf_layer + p.hf, None)
        for n in self.norms:
            out[self.gguf_layer + n.gguf_tensor] = (self.hf_layer + n.hf + ".weight", None)
        return out

    def expert_linears(self, e: int) -> list[Linear]:
        """The expert specs with `{e}` filled in (attr and HF names; GGUF names stay the 3-D tensors')."""
        return [Linear(lin.attr.format(e=e), tuple(Part(p.hf.format(e=e), p.gguf, p.rope_heads, p.split)
                                                   for p in lin.parts), lin.parallel)
                for lin in self.experts]
