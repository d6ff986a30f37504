"""A GGUF's weights as an HF folder (fp32 safetensors, config.json, tokenizer files), for peers that
read only HF checkpoints (vLLM) and for the tokenizer oracle test. The engine itself never needs it:
it runs a GGUF in place. Each family's model file undoes what llama.cpp's converter changed
(`hf_checkpoint`: norms stored as 1 + w, stacked experts, Qwen3.5's decay rates and value-head order), so
HF transformers reads the folder as the model the file was made from. Written once per file content
into the cache."""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from pathlib import Path

import torch

from ..config import cache_dir
from ..model_executor.model_loader import gguf_cache_key
from ..model_executor.model_loader.gguf import GGUFTensors, gguf_hf_config, unpermute_rows
from ..model_executor.models.registry import default_registry
from ..tokenizer import Tokenizer

log = logging.getLogger("pagedllm")

# part of the cached folder's name: changed whenever the export writes something else for the same file, so that
# a folder an older export wrote is not reused
EXPORT_FORMAT = 3


def gguf_to_hf_folder(path: Path) -> Path:
    out = cache_dir() / f"{path.stem}-{gguf_cache_key(path)}-hf{EXPORT_FORMAT}"
    if (out / "config.json").exists():
        return out
    from safetensors.torch import save_file

    log.info("writing %s as an fp32 HF folder for HF-only peers: %s", path, out)
    f = GGUFTensors(path)  # the engine's own reader: dense fp32 in HF's shape, q/k rows unpermuted
    meta = f.meta
    cfg = gguf_hf_config(meta, f.shapes(), read=f.dense)
    registry = default_registry()
    cls = registry.model_class(cfg["architectures"][0])
    weights = cls.WEIGHTS
    names = weights.hf_names(meta["general.architecture"])
    layer_re = re.compile(re.escape(weights.gguf_layer).replace(re.escape("{}"), r"(\d+)"))
    heads = {"num_heads": cfg["num_attention_heads"], "num_kv_heads": cfg["num_key_value_heads"]}
    sd: dict[str, torch.Tensor] = {}
    for name, t in f.by_name.items():
        m = layer_re.match(name)  # a layer's tensor: its template and index
        key, layer = (weights.gguf_layer + name[m.end():], m.group(1)) if m else (name, None)
        if key not in names:
            continue  # e.g. rope_freqs: read into the config (llama3 rope, Gemma 4's partial rotary)
        hf, rope_heads = names[key]
        if "{e}" in hf:  # every expert's matrix in one 3-D tensor: [E, out, in]
            for e, w in enumerate(f.dense(name)):
                sd[hf.format(layer, e=e)] = w.clone()
            continue
        rows = int(t.shape[-1])  # gguf shapes are reversed: the last is HF's first (rows, or a bias' length)
        sd[hf.format(layer)] = f.dense(name, unpermute_rows(rows, heads[rope_heads]) if rope_heads is not None else None)
    cls.hf_checkpoint(sd, cfg)
    cfg = {"model_type": registry.model_type(cfg["architectures"][0]),
           **{k: v for k, v in cfg.items() if v is not None and k != "model_type"}}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        save_file(sd, str(tmp / "model.safetensors"))
        tok_meta = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
        try:
            tok = Tokenizer.from_gguf_metadata(tok_meta, meta.get("general.architecture"))
            tok.save(tmp)
            # the tokens that end generation, as llama.cpp reads the file: where an HF folder lists them
            (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(tok.eos_token_ids)}))
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
