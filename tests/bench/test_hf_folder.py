"""A GGUF written out as an HF folder (for peers that read only HF checkpoints) is the model HF transformers ran
before llama.cpp's converter wrote it: the same logits, family by family."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ARCHS
from helpers import gemma4_gguf_keys, phi3_gguf_keys, qwen35_converter_values, qwen35_gguf_keys, write_gguf_from_folder

from pagedllm.bench.hf_folder import gguf_to_hf_folder
from pagedllm.model_executor.models.registry import default_registry

# tiny HF model -> (GGUF architecture, how llama.cpp's converter writes it); max |logit difference| allowed
FAMILIES = {
    "llama": ("llama", {}), "llama3-rope": ("llama", {}), "mistral": ("llama", {}), "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}), "phi3": ("phi3", dict(meta=phi3_gguf_keys)), "phi4-mini": ("phi3", dict(meta=phi3_gguf_keys)),
    "gemma3-gguf": ("gemma3", dict(norm_shift=1.0)), "mixtral": ("llama", {}), "qwen3-moe": ("qwen3moe", {}),
    "olmoe": ("olmoe", {}), "gpt-oss-gguf": ("gpt-oss", {}),
    "gemma4": ("gemma4", dict(meta=gemma4_gguf_keys)), "gemma4-moe": ("gemma4", dict(meta=gemma4_gguf_keys)),
    "qwen3.5": ("qwen35", dict(meta=qwen35_gguf_keys, transform=qwen35_converter_values)),
    "qwen3.5-moe-gguf": ("qwen35moe", dict(meta=qwen35_gguf_keys, transform=qwen35_converter_values)),
}


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_gguf_as_an_hf_folder_is_the_model_hf_wrote(tiny_models, tmp_path, monkeypatch, arch) -> None:
    """Llama 3's rope as per-pair divisors, a windowed `llama` file (Mistral), Gemma's (1 + w) norms, the experts
    stacked as each family's HF checkpoints stack them, Qwen3.5's -exp(A_log), conv kernels and tiled value heads:
    each back in HF's form, so transformers loads the folder with nothing missing or unexpected and gives the
    original model's logits (Qwen3.5's decay rates pass through exp and log: a few ulps)."""
    import transformers

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    folder, hf = tiny_models[arch]
    gguf_arch, how = FAMILIES[arch]
    cls = default_registry().model_class(ARCHS[arch][1])
    path = tmp_path / "model.gguf"
    write_gguf_from_folder(folder, path, gguf_arch, cls.WEIGHTS, **how)
    out = gguf_to_hf_folder(path)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [type(hf).__name__] and cfg["model_type"] == hf.config.model_type
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no tensor missing, unexpected or of another shape
    ids = torch.tensor([[(5 * j + 3) % hf.config.vocab_size for j in range(60)]])  # past the sliding windows
    with torch.no_grad():
        want, got = hf(ids).logits, back.eval()(ids).logits
    assert float((want - got).abs().max()) <= (1e-5 if arch.startswith("qwen3.5") else 0.0)
