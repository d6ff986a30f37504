"""Each family's logits on one GGUF file, pagedllm against llama.cpp, and both against HF transformers.

For every architecture the tests build (tiny random HF models, norms / biases / sinks perturbed off their init),
the HF checkpoint is written as an F32 GGUF in llama.cpp's tensor naming (tests/helpers.py, with a placeholder
vocabulary llama.cpp needs to load it); then on 100 teacher-forced tokens (past every sliding window):
  pagedllm   the GGUF, fp32, fp32 KV, one prefill;
  llama.cpp  the same file through llama-cpp-python, F32 KV, one batch;
  HF         the checkpoint the file came from (fp32, eager).
Columns: the largest logit difference over all positions and the share of positions whose argmax agrees.
Needs llama-cpp-python (or its package plus LLAMA_CPP_LIB_PATH pointing at a libllama built from llama.cpp's
source), and the repository's tests/ folder (its tiny-model recipes).
Run: .venv/bin/python benchmarks/llamacpp_logits_by_family.py [--json FILE]"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import ARCHS, make_tiny_model
from helpers import gemma4_gguf_keys, qwen35_converter_values, qwen35_gguf_keys, write_gguf_from_folder

from pagedllm import LLM
from pagedllm.model_executor.models.registry import default_registry
from pagedllm.tools.evaluate import chunk_logits

# test recipe -> GGUF architecture: for Gemma 3, gpt-oss, Qwen3-MoE, OLMoE and Phi-3 the variants llama.cpp can
# express. Its qwen3moe has no dense layers; its olmoe no grouped KV heads (the q/k norms must be hidden-wide) and no
# clip_qkv (OLMoE-1B-7B has none); its phi3 turns the sliding window off ("Phi SWA is currently disabled"), so
# past the window the file would differ from HF in llama.cpp, not in pagedllm.
ARCHS["qwen3-moe-gguf"] = (*ARCHS["qwen3-moe"][:2], {**ARCHS["qwen3-moe"][2], "mlp_only_layers": []})
ARCHS["olmoe-gguf"] = (*ARCHS["olmoe"][:2], {**ARCHS["olmoe"][2], "num_key_value_heads": 4, "clip_qkv": None})
ARCHS["phi3-gguf"] = (*ARCHS["phi3"][:2], {**ARCHS["phi3"][2], "sliding_window": None})
# llama.cpp's gemma4 has a KV-shared layer read the last own layer if global, the one before if sliding (as in the
# released models), where HF reads the last own layer of its kind: own layers that end sliding, global here
ARCHS["gemma4-gguf"] = (*ARCHS["gemma4"][:2], {**ARCHS["gemma4"][2], "layer_types": [
    "sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention",
    "sliding_attention", "sliding_attention", "full_attention"]})
FAMILIES = {"llama": "llama", "llama3-rope": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3-gguf": "phi3",
            "gemma3-gguf": "gemma3", "mixtral": "llama", "qwen3-moe-gguf": "qwen3moe", "olmoe-gguf": "olmoe",
            "gpt-oss-gguf": "gpt-oss", "gemma4-gguf": "gemma4", "gemma4-moe": "gemma4", "qwen3.5": "qwen35",
            "qwen3.5-moe-gguf": "qwen35moe"}
# the families whose files carry keys or values of their own (as llama.cpp's converter writes them)
WRITER = {"gemma3": {"norm_shift": 1.0}, "gemma4": {"meta": gemma4_gguf_keys},
          "qwen35": {"meta": qwen35_gguf_keys, "transform": qwen35_converter_values},
          "qwen35moe": {"meta": qwen35_gguf_keys, "transform": qwen35_converter_values}}


def llamacpp_logits(path: str, ids: list[int]) -> np.ndarray | None:
    """None: llama.cpp does not load the file."""
    from llama_cpp import Llama

    threads = len(os.sched_getaffinity(0))
    try:
        llm = Llama(model_path=path, n_ctx=len(ids) + 8, n_batch=len(ids), n_ubatch=len(ids), logits_all=True,
                    n_threads=threads, n_threads_batch=threads, type_k=0, type_v=0, verbose=False)
    except ValueError:
        return None
    llm.eval(ids)
    out = np.array(llm.scores[:len(ids)], dtype=np.float32)
    del llm
    return out


def compare(a: np.ndarray, b: np.ndarray | None) -> tuple[float, float] | None:
    return None if b is None else (float(np.abs(a - b).max()), float((a.argmax(-1) == b.argmax(-1)).mean()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ids = [(i * 37 + i * i * 11) % 320 for i in range(100)]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for recipe, gguf_arch in FAMILIES.items():
            folder = Path(tmp) / recipe
            hf = make_tiny_model(recipe, folder)
            names = default_registry().model_class(hf.config.architectures[0]).WEIGHTS
            path = str(Path(tmp) / f"{recipe}.gguf")
            write_gguf_from_folder(folder, path, gguf_arch, names, vocab=True, **WRITER.get(gguf_arch, {}))
            with torch.no_grad():
                ref = hf(torch.tensor([ids])).logits[0].numpy()
            llm = LLM(model=path, dtype="float32", kv_cache_dtype="float32", kv_cache_memory="64MiB")
            ours = np.concatenate([lg.numpy() for _, lg in chunk_logits(llm.engine, ids, len(ids))])
            del llm
            theirs = llamacpp_logits(path, ids)
            rows[recipe] = {"gguf_arch": gguf_arch, "logit_scale": float(np.abs(ref).max()),
                            "pagedllm_vs_llamacpp": compare(ours, theirs), "pagedllm_vs_hf": compare(ours, ref),
                            "llamacpp_vs_hf": None if theirs is None else compare(theirs, ref)}
    print(f"{len(ids)} positions, F32 GGUF of each tiny random model; max |logit difference| (top-1 agreement)")
    print(f"{'family (GGUF arch)':28} {'|logits|':>9} {'pagedllm vs llama.cpp':>24} {'pagedllm vs HF':>20} "
          f"{'llama.cpp vs HF':>20}")
    for recipe, r in rows.items():
        cells = [f"{c[0]:.1e} ({c[1]:.0%})" if c else "llama.cpp fails to load"
                 for c in (r["pagedllm_vs_llamacpp"], r["pagedllm_vs_hf"], r["llamacpp_vs_hf"])]
        print(f"{recipe + ' (' + r['gguf_arch'] + ')':28} {r['logit_scale']:9.2f} {cells[0]:>24} {cells[1]:>20} "
              f"{cells[2]:>20}")
    if args.json:
        Path(args.json).write_text(json.dumps({"positions": len(ids), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
