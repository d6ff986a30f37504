"""llama.cpp as a single-stream baseline (`bench latency --baseline llama-cpp`).

llama.cpp runs through the optional `llama-cpp-python` package (it compiles llama.cpp for the
machine at hand: `pip install llama-cpp-python`; or set LLAMA_CPP_LIB_PATH to a libllama you built).
For a like-for-like comparison it gets the weights pagedllm computes with: the GGUF file itself when
pagedllm runs it in its own formats, or the file with every tensor dequantized to F32 (cached) when
pagedllm dequantizes (`--quantization none`); the same prompt token ids, greedy, one thread per core.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from ..config import cache_dir
from ..errors import ModelLoadError
from ..model_executor.model_loader import gguf_cache_key
from .common import now

log = logging.getLogger("pagedllm")


def f32_gguf(src: Path) -> Path:
    """The GGUF at src with every tensor dequantized to F32 (metadata, tokenizer included, kept)."""
    out = cache_dir() / f"{src.stem}-{gguf_cache_key(src)}.f32.gguf"
    if out.exists():
        return out
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    from ..model_executor.model_loader.gguf_file import open_gguf

    reader = open_gguf(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_suffix(".tmp")
    writer = GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        value = field.contents()
        if name == "general.file_type":
            value = 0  # LLAMA_FTYPE_ALL_F32
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dims fastest-first
        data = np.ascontiguousarray(dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32))
        writer.add_tensor(t.name, data, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    log.info("wrote the F32 GGUF for llama.cpp: %s", out)
    return out


class LlamaCpp:
    def __init__(self, model: str | None, n_ctx: int, f32: bool = False) -> None:
        try:
            from llama_cpp import Llama
        except (ImportError, OSError, RuntimeError) as e:  # not installed, or its libllama not found
            raise ModelLoadError(f"the llama-cpp baseline needs `pip install llama-cpp-python` (it builds llama.cpp "
                                 f"for this machine), or LLAMA_CPP_LIB_PATH set to a libllama you built: {e}") from e
        from ..model_executor.model_loader import default_model_path

        src = Path(model) if model else default_model_path()
        if src.suffix != ".gguf":
            raise ModelLoadError("the llama-cpp baseline needs a .gguf model (the default model is one)")
        self.path = f32_gguf(src) if f32 else src
        threads = len(os.sched_getaffinity(0))
        self.llm = Llama(model_path=str(self.path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=n_ctx, verbose=False)

    def measure(self, ids: list[int], output_len: int) -> dict:
        """Greedy generation of output_len tokens after the prompt ids: same fields as pagedllm's."""
        self.llm.reset()
        t0 = now()
        first = None
        n = 0
        for _ in self.llm.generate(ids, top_k=1, temp=0.0, reset=True):
            n += 1
            if first is None:
                first = now()
            if n == output_len:
                break
        end = now()
        return {"ttft_s": first - t0, "decode_tokens_per_s": (n - 1) / (end - first) if n > 1 else 0.0,
                "e2e_s": end - t0, "output_tokens": n}
