"""A GGUF file, memory-mapped: linears in a format with a kernel (Q4_0 .. Q8_0, K-quants) run as the file
stores them (weight_formats.py); other formats are dequantized at load (a warning names them). Its config,
tokenizer and chat template come from the metadata. Read through the model's weight-name map; under
tensor parallelism each rank cuts its rows or columns along whole blocks. Nothing is converted or
cached on disk."""

from __future__ import annotations

import ctypes
import gc
import hashlib
import logging
import mmap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ...distributed import TPGroup
from ...errors import ModelLoadError
from ...platforms import current_platform
from ...tokenizer import Tokenizer
from ..layers.formats import FORMATS, WeightFormat, format_of_ggml
from ..layers.weight_formats import block_bytes_of
from ..layers.weight_methods import WeightMethods
from ..models.config import GGUFInfo, first_layer
from ..models.registry import ModelRegistry, default_registry
from ..models.weight_names import Linear, Part, has_module
from .base import (
    LoadedModel,
    build,
    check_complete,
    layer_linears,
    model_class,
    resolve_dtype,
    row_parallel_bias,
    set_param,
    shard_cols,
    shard_rows,
)

log = logging.getLogger("pagedllm")
_DENSE = (FORMATS["f32"], FORMATS["f16"], FORMATS["bf16"])


def gguf_cache_key(path: Path) -> str:
    """Key of a GGUF's content for derived files (bench's F32 copy for llama.cpp): its size and first
    and last MiB (header, metadata, tensor index, tail of the data), not its path or mtime."""
    h = hashlib.sha256(f"{path.stat().st_size}:v3".encode())
    with open(path, "rb") as f:
        h.update(f.read(2**20))
        f.seek(max(0, path.stat().st_size - 2**20))
        h.update(f.read(2**20))
    return h.hexdigest()[:16]


def unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's interleaving of the rotary halves of q/k rows (rotate_half
    rope); rows are whole blocks, so quantized rows are reordered without touching their bytes."""
    d = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, d, 2).swapaxes(1, 2).reshape(-1)


def read_gguf_metadata(reader) -> dict:
    meta = {}
    for k, f in reader.fields.items():
        if k.startswith("GGUF."):
            continue
        meta[k] = f.contents()
    return meta


def _decimal(stored: float) -> float:
    """The shortest decimal a stored float32 stands for (1e-06, not 9.99999997e-07): HF's value, bit for bit."""
    return float(str(np.float32(stored)))


def gguf_hf_config(meta: dict, shapes: dict[str, tuple[int, ...]], registry: ModelRegistry | None = None,
                   read: Callable[[str], torch.Tensor] | None = None) -> dict:
    """The HF config.json a GGUF's metadata describes. shapes: each tensor's, in ggml's order; read: a small
    tensor's values by name (LongRoPE's rope factors are tensors in a GGUF, not metadata)."""
    tensor_names = set(shapes)
    arch = meta.get("general.architecture")
    reg = registry or default_registry()
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    hf_arch = reg.from_gguf(arch, experts > 0)
    wn = reg.model_class(hf_arch).WEIGHTS
    lm_head = wn.lm_head.parts[0].gguf + ".weight"

    def g(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    cfg = {
        "model_type": arch,
        "architectures": [hf_arch],
        "vocab_size": int(g("vocab_size", len(meta.get("tokenizer.ggml.tokens", [])) or 0)), "hidden_size": hidden,
        "intermediate_size": int(first_layer(g("feed_forward_length"))), "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": int(first_layer(g("attention.head_count_kv", heads))),
        "head_dim": int(g("attention.key_length", hidden // heads)),
        "rms_norm_eps": _decimal(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 2048)),
        "tie_word_embeddings": lm_head not in tensor_names, "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if g("rope.dimension_count") is not None and int(g("rope.dimension_count")) != cfg["head_dim"]:
        cfg["partial_rotary_factor"] = int(g("rope.dimension_count")) / cfg["head_dim"]
    if g("attention.clamp_kqv") is not None:
        cfg["clip_qkv"] = _decimal(g("attention.clamp_kqv"))
    if experts:
        expert_tensor = wn.gguf_layer + wn.experts[0].parts[0].gguf + ".weight"
        cfg.update(num_experts=experts, num_experts_per_tok=int(g("expert_used_count")),
                   moe_intermediate_size=int(g("expert_feed_forward_length", cfg["intermediate_size"])),
                   mlp_only_layers=[i for i in range(cfg["num_hidden_layers"])  # layers stored with a dense MLP
                                    if expert_tensor.format(i) not in tensor_names])
        if g("expert_weights_norm") is not None:
            cfg["norm_topk_prob"] = bool(g("expert_weights_norm"))
    if g("rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    elif g("rope.scaling.type") == "yarn":  # llama.cpp rounds the ramp's ends to whole pairs (HF's truncate)
        cfg["rope_scaling"] = {"rope_type": "yarn", "factor": _decimal(g("rope.scaling.factor")), "truncate": True,
                               "original_max_position_embeddings": int(g("rope.scaling.original_context_length")),
                               "beta_fast": _decimal(g("rope.scaling.yarn_beta_fast", 32.0)),
                               "beta_slow": _decimal(g("rope.scaling.yarn_beta_slow", 1.0))}
    if read is not None and {"rope_factors_long.weight", "rope_factors_short.weight"} <= tensor_names:
        cfg["rope_scaling"] = {  # LongRoPE (Phi-3 128k, Phi-4-mini): as llama.cpp's converter wrote it
            "rope_type": "longrope", "original_max_position_embeddings": int(g("rope.scaling.original_context_length")),
            "long_factor": [_decimal(v) for v in read("rope_factors_long.weight").tolist()],
            "short_factor": [_decimal(v) for v in read("rope_factors_short.weight").tolist()]}
        if g("rope.scaling.attn_factor") is not None:
            cfg["rope_scaling"]["attention_factor"] = _decimal(g("rope.scaling.attn_factor"))
    for key, hf in (("attention.sliding_window", "sliding_window"), ("final_logit_softcapping", "final_logit_softcapping"),
                    ("attn_logit_softcapping", "attn_logit_softcapping")):
        if g(key) is not None:
            cfg[hf] = _decimal(g(key)) if "softcapping" in key else int(g(key))
    info = GGUFInfo(arch, meta, shapes, None if read is None else (lambda name: read(name).tolist()))
    return reg.model_class(hf_arch).hf_config_from_gguf(cfg, info)


class GGUFTensors:
    """A GGUF file's tensors, memory-mapped copy-on-write: quantized rows are used in place (never
    written, so they stay the file's pages), everything else is read once and its pages dropped."""

    def __init__(self, path: Path) -> None:
        from .gguf_file import open_gguf

        try:
            self.reader = open_gguf(path, "c")
        except (ValueError, IndexError, KeyError, OSError) as e:  # gguf-py's errors on a cut or corrupt header
            raise ModelLoadError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e
        self.by_name = {t.name: t for t in self.reader.tensors}
        for t in self.reader.tensors:  # a cut file maps short arrays, which only fail later, far from the cause
            if t.data.nbytes < t.n_bytes:
                raise ModelLoadError(f"{path} is truncated or corrupt: tensor {t.name!r} needs {int(t.n_bytes)} bytes "
                                     f"at offset {int(t.data_offset)}, the file holds {t.data.nbytes} of them "
                                     f"({int(t.n_bytes) - t.data.nbytes} missing)")
        self.meta = read_gguf_metadata(self.reader)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape, in ggml's order (innermost first)."""
        return {name: tuple(int(x) for x in t.shape) for name, t in self.by_name.items()}

    def fmt(self, name: str) -> WeightFormat | None:
        return format_of_ggml(self.by_name[name].tensor_type)

    def _data(self, name: str, expert: int | None) -> np.ndarray:
        data = self.by_name[name].data
        return data if expert is None else data[expert]  # a 3-D tensor of experts: [E, O, ...] -> [O, ...]

    def blocks(self, name: str, rows: np.ndarray | None = None, cols: tuple[int, int] | None = None,
               expert: int | None = None) -> torch.Tensor:
        """[O, row_bytes] uint8 in place, or a copy in `rows` order and of the weights [cols) (whole
        blocks: a tensor-parallel shard; the file's pages then dropped). expert: slice e of a 3-D tensor."""
        data = self._data(name, expert)
        if rows is None and cols is None:
            return torch.from_numpy(data)
        if cols is not None:
            lo, hi = block_bytes_of(self.fmt(name), cols, name)
            data = data[:, lo:hi]
        out = torch.from_numpy(np.ascontiguousarray(data if rows is None else data[rows]))
        self.release(name, expert)
        return out

    def dense(self, name: str, rows: np.ndarray | None = None, cols: tuple[int, int] | None = None,
              expert: int | None = None) -> torch.Tensor:
        """fp32 in HF's shape ([out, in] for matrices, [E, out, in] for a tensor of experts, or expert e's
        [out, in]), dequantized; file pages dropped afterwards."""
        from gguf.quants import dequantize

        t = self.by_name[name]
        w = dequantize(self._data(name, expert), t.tensor_type).astype(np.float32, copy=False)
        shape = [int(x) for x in reversed(t.shape)][0 if expert is None else 1:]
        w = w.reshape(shape) if len(shape) > 1 else w.reshape(-1)
        if rows is not None:
            w = w[rows]
        if cols is not None:
            w = w[:, cols[0]:cols[1]]
        out = torch.from_numpy(np.array(w, dtype=np.float32))  # always a copy: the map is not the weight
        self.release(name, expert)
        return out

    def drop_metadata(self) -> None:
        """The parsed metadata (a Python object per token and merge: ~160 MB for a 49k vocabulary) is
        not needed once the config and tokenizer are built; free it and hand the heap back to the OS."""
        self.reader.fields = {}
        self.meta = {}
        gc.collect()
        try:
            ctypes.CDLL(None).malloc_trim(0)  # glibc: return freed heap pages (else they stay in RSS)
        except (OSError, AttributeError):
            pass

    def release(self, name: str, expert: int | None = None) -> None:
        """Drop the pages of a tensor (or of one expert's slice of it) that was copied out, so the copy is
        not counted twice in RSS."""
        t = self.by_name[name]
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is None:
            return
        page = mmap.PAGESIZE
        lo, n = int(t.data_offset), int(t.n_bytes)
        if expert is not None:
            n //= int(t.shape[-1])
            lo += expert * n
        start = lo // page * page
        end = -(-(lo + n) // page) * page
        start, end = start + page, end - page  # neighbours' pages may be in use in place: keep edge pages
        if end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def load_gguf(path: Path, dtype: str = "auto", quantization: str | None = None,
              tp: TPGroup | None = None, registry: ModelRegistry | None = None, device: str = "cpu",
              context: int | None = None, attention_backend: str = "auto") -> LoadedModel:
    """quantization: None runs the file's formats, "none" dequantizes everything (the fp32 / bf16
    reference), a format name requantizes the dense weights into it."""
    f = GGUFTensors(path)
    names = set(f.by_name)
    raw = gguf_hf_config(f.meta, f.shapes(), registry, f.dense)
    cls = model_class(raw, registry)
    wn = cls.WEIGHTS
    cfg = cls.fit_context(cls.config_from_hf(raw), context)
    platform = current_platform(device, attention_backend)
    tdtype = resolve_dtype(dtype, raw, platform)
    methods = WeightMethods(platform.kernels(tdtype), tdtype, quantization)
    if quantization is None and not methods.blocks_in_place:
        log.warning("no C++ kernels: the GGUF's quantized weights are dequantized to %s", tdtype)
    tok_meta = {k: v for k, v in f.meta.items() if k.startswith("tokenizer.")}
    try:
        tok = Tokenizer.from_gguf_metadata(tok_meta, f.meta.get("general.architecture"))
    except ValueError as e:
        log.warning("no tokenizer from %s: %s (token-id prompts only)", path, e)
        tok = None
    model = build(cls, cfg, {lin.attr: any(f"{wn.gguf_layer.format(i)}{lin.parts[0].gguf}.bias" in names
                                           for i in range(cfg.num_layers)) for lin in wn.linears}, tp)
    interleaved = f.meta["general.architecture"] in wn.gguf_interleaved_rope
    dequantized: dict[str, int] = {}

    def rows_of(spec: Linear | None, part: Part | None, name: str) -> np.ndarray | None:
        """The rows to read, in HF's order: q/k rows un-interleaved, a column-parallel shard cut (this
        rank's heads / MLP rows / vocabulary); None = all, in the file's order."""
        n = int(f.by_name[name].shape[1])
        order = unpermute_rows(n, getattr(cfg, part.rope_heads)) if interleaved and part and part.rope_heads else None
        own = cls.gguf_row_order(part, n, cfg) if part is not None else None
        if own is not None:
            order = own if order is None else order[own]
        keep = shard_rows(spec, part, n, cfg, tp)
        if keep is None:
            return order
        return keep if order is None else order[keep]

    def cols_of(spec: Linear, name: str) -> tuple[int, int] | None:
        return shard_cols(spec, int(f.by_name[name].shape[0]), tp)

    packed_experts: dict[str, list[torch.Tensor] | None] = {}

    def experts_packed(name: str, fmt) -> list[torch.Tensor] | None:
        """A 3-D tensor of experts repacked once, in one buffer (its file pages then dropped); None: not here."""
        if name not in packed_experts:  # (the views share the model's buffers: the dict holds no extra memory)
            packed_experts[name] = methods.experts(f.blocks(name), fmt)
            if packed_experts[name] is not None:
                f.release(name)
        return packed_experts[name]

    def linear(lin: nn.Linear, spec: Linear, prefix: str, expert: int | None = None) -> None:
        """The parts stacked along the outputs, e.g. q, k, v (expert: slice e of the parts' 3-D tensors)."""
        parts = [(p, f"{prefix}{p.gguf}.weight") for p in spec.parts]
        rows = [rows_of(spec, p, name) for p, name in parts]
        bias = None
        if lin.bias is not None:
            bias = torch.cat([f.dense(f"{prefix}{p.gguf}.bias", r, expert=expert) for (p, _), r in zip(parts, rows)])
        bias = row_parallel_bias(bias, spec, tp)
        cols = [cols_of(spec, name) for _, name in parts]
        in_features = lin.in_features if cols[0] is None else cols[0][1] - cols[0][0]
        fmts = [f.fmt(name) for _, name in parts]
        if methods.runs_blocks(fmts, in_features):
            stacked = [experts_packed(name, m) if expert is not None and r is None and c is None else None
                       for (_, name), m, c, r in zip(parts, fmts, cols, rows)]
            blocks = [(s[expert] if s is not None else f.blocks(name, r, c, expert), m)
                      for (_, name), m, c, r, s in zip(parts, fmts, cols, rows, stacked)]
            prepacked = [int(f.by_name[name].shape[1]) if s is not None else None for (_, name), s in zip(parts, stacked)]
            weight = methods.blocks(blocks, in_features, bias, prepacked)
            for (_, name), repacked, s in zip(parts, weight.repacked, stacked):
                if repacked and s is None:
                    f.release(name, expert)
            methods.set_blocks(model, lin, weight, bias)
            return
        for (_, name), m in zip(parts, fmts):
            if methods.blocks_in_place and not methods.runs_blocks([m], in_features) and m not in _DENSE:
                key = f.by_name[name].tensor_type.name
                dequantized[key] = dequantized.get(key, 0) + 1
        w = torch.cat([f.dense(name, r, c, expert) for (_, name), c, r in zip(parts, cols, rows)])
        methods.set_dense(lin, w, bias)
        methods.quantize(model, lin)  # now, one linear at a time: dense fp32 copies never pile up

    def param(module: nn.Module, name: str) -> None:
        module.weight = nn.Parameter(f.dense(name), requires_grad=False)

    embed, embed_name = getattr(model, wn.embed.attr), wn.embed.gguf + ".weight"
    head = getattr(model, wn.lm_head.attr)
    embed_fmt = f.fmt(embed_name)
    if methods.runs_blocks([embed_fmt], cfg.hidden_size):
        embed.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        model.embed_packed = methods.blocks([(f.blocks(embed_name, rows_of(None, None, embed_name)), embed_fmt)],
                                            cfg.hidden_size, None)
        if model.embed_packed.repacked[0]:
            f.release(embed_name)
    else:
        embed.weight = nn.Parameter(f.dense(embed_name, rows_of(None, None, embed_name)), requires_grad=False)
    if cfg.tie_word_embeddings:
        model.tie_lm_head()  # a dense table is quantized for it in process(), where the load asks
    else:
        linear(head, wn.lm_head, "")
    param(getattr(model, wn.norm.attr), wn.norm.gguf + ".weight")
    for extra in wn.extras:
        if has_module(model, extra.attr):
            param(model.get_submodule(extra.attr), extra.gguf_tensor)
    from tqdm import tqdm

    # a bar only for loads that take a while (a 7-8B file), on a terminal
    bar = tqdm(model.layers, desc=f"loading {path.name}", unit="layer", delay=2, leave=False, disable=None)
    for i, layer in enumerate(bar):
        prefix = wn.gguf_layer.format(i)
        for spec, expert in layer_linears(wn, layer):
            linear(layer.get_submodule(spec.attr), spec, prefix, expert)
        for n in wn.norms:
            if hasattr(layer, n.attr) or has_module(layer, n.attr):  # a layer of one kind skips the other kind's
                set_param(layer, n, f.dense(prefix + n.gguf_tensor), cfg, tp)
    for kind, n in dequantized.items():
        log.warning("%d tensors of %s have no kernel: dequantized at load to %s", n, kind,
                    str(tdtype).removeprefix("torch."))
    check_complete(model, path)
    if tp is not None:  # first: after_load reads this rank's head counts
        model.use_tensor_parallel(tp)
    model.after_load("gguf")
    model.eval()
    methods.process(model, platform)
    f.drop_metadata()
    model.gguf = f  # keeps the map (the weights used in place) alive as long as the model
    return LoadedModel(model, cfg, tok, path.stem, path, tdtype)


def gguf_config(path: Path, registry: ModelRegistry | None = None) -> dict:
    f = GGUFTensors(path)
    return gguf_hf_config(f.meta, f.shapes(), registry, f.dense)


__all__ = ["GGUFTensors", "gguf_cache_key", "gguf_config", "gguf_hf_config", "load_gguf",
           "read_gguf_metadata", "unpermute_rows"]
