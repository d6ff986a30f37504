"""A GGUF's weights as an HF folder (fp32 safetensors, config.json, tokenizer files), for peers that
read only HF checkpoints (vLLM) and for the tokenizer oracle test. The engine itself never needs it:
it runs a GGUF in place. Written once per file content into the cache."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from ..config import cache_dir
from ..loader import _GGUF_LAYER, _GGUF_NAMES, _GGUFTensors, _unpermute_rows, gguf_cache_key, gguf_hf_config
from ..tokenizer import Tokenizer

log = logging.getLogger("pagedllm")


def gguf_to_hf_folder(path: Path) -> Path:
    out = cache_dir() / f"{path.stem}-{gguf_cache_key(path)}"
    if (out / "config.json").exists():
        return out
    from safetensors.torch import save_file

    log.info("writing %s as an fp32 HF folder for HF-only peers: %s", path, out)
    f = _GGUFTensors(path)  # the engine's own reader: dense fp32 in HF's shape, q/k rows unpermuted
    meta = f.meta
    cfg = gguf_hf_config(meta, set(f.by_name))
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    sd: dict[str, torch.Tensor] = {}
    for name, t in f.by_name.items():
        if name.startswith("blk."):
            _, i, kind, suffix = name.split(".", 3)
            if kind not in _GGUF_LAYER:
                continue  # e.g. rope_freqs: llama3 factors are recomputed from the config
            hf = f"model.layers.{i}.{_GGUF_LAYER[kind]}.{suffix}"
        elif name in _GGUF_NAMES:
            kind, hf = "", _GGUF_NAMES[name]
        else:
            continue
        unpermute = cfg["model_type"] == "llama" and kind in heads and len(t.shape) > 1
        sd[hf] = f.dense(name, _unpermute_rows(int(t.shape[1]), heads[kind]) if unpermute else None)
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
