"""How far each engine's native execution of a GGUF is from the file's own fp32 reference, teacher-forced
on pagedllm/tools/data/english.txt (llama.cpp's `llama-perplexity --kl-divergence` convention):
  pagedllm native  vs pagedllm on the file dequantized to fp32 (quantization="none", dtype float32);
  llama.cpp native vs llama.cpp on the F32 copy of the file (bench/llamacpp.py's f32_gguf).
Both: perplexity, mean KL(ref || native) per position, top-1 agreement; every run with an fp32 KV cache, so
the difference is the weights' execution alone. Needs llama-cpp-python (or its
package plus LLAMA_CPP_LIB_PATH pointing at a libllama built from llama.cpp's source).
Run: .venv/bin/python benchmarks/fidelity_llamacpp.py [MODEL.gguf] [--json FILE]
     ... --tokens 600 --chunk 8   (decode-sized batches: pagedllm's integer dot, llama.cpp n_batch 8)"""

import argparse
import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from pagedllm import LLM
from pagedllm.bench.llamacpp import f32_gguf
from pagedllm.tools.evaluate import chunk_logits
from pagedllm.model_executor.model_loader import default_model_path


def stats(ref: np.ndarray, other: np.ndarray, targets: np.ndarray) -> dict:
    la = torch.log_softmax(torch.from_numpy(ref).double(), -1)
    lb = torch.log_softmax(torch.from_numpy(other).double(), -1)
    t = torch.from_numpy(targets)
    rows = torch.arange(len(t))
    return {"perplexity_ref": math.exp(-float(la[rows, t].mean())), "perplexity": math.exp(-float(lb[rows, t].mean())),
            "mean_kl": float((la.exp() * (la - lb)).sum(-1).mean()),
            "top1_agreement": float((la.argmax(-1) == lb.argmax(-1)).double().mean())}


def pagedllm_logits(model: str, ids: list[int], chunk: int, **kw) -> np.ndarray:
    llm = LLM(model=model, kv_cache_dtype="float32", kv_cache_memory="1GiB", max_model_len=4096, **kw)
    out = np.concatenate([lg.numpy() for _, lg in chunk_logits(llm.engine, ids, chunk)])
    del llm
    return out


def llamacpp_logits(model: str, ids: list[int], chunk: int) -> np.ndarray:
    from llama_cpp import Llama

    threads = len(os.sched_getaffinity(0))
    llm = Llama(model_path=model, n_ctx=len(ids) + 8, n_batch=chunk, n_ubatch=chunk, logits_all=True, n_threads=threads,
                n_threads_batch=threads, type_k=0, type_v=0, verbose=False)  # F32 KV, as pagedllm's runs here
    llm.eval(ids)
    out = np.array(llm.scores[:len(ids)], dtype=np.float32)
    del llm
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(default_model_path()))
    ap.add_argument("--text", default="pagedllm/tools/data/english.txt")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tokens", type=int, default=None, help="only the text's first N tokens")
    ap.add_argument("--chunk", type=int, default=512, help="rows per forward pass, both engines")
    args = ap.parse_args()
    text = open(args.text, encoding="utf-8").read()
    ref_llm = LLM(model=args.model, dtype="float32", quantization="none", kv_cache_memory="64MiB")
    ids = ref_llm.get_tokenizer().encode(text)[:args.tokens]
    del ref_llm
    targets = np.array(ids[1:], dtype=np.int64)
    rows = {}
    ours_ref = pagedllm_logits(args.model, ids, 512, dtype="float32", quantization="none")[:-1]
    ours = pagedllm_logits(args.model, ids, args.chunk, dtype="float32")[:-1]
    rows["pagedllm native vs pagedllm fp32"] = stats(ours_ref, ours, targets)
    theirs_ref = llamacpp_logits(str(f32_gguf(Path(args.model))), ids, 512)[:-1]
    theirs = llamacpp_logits(args.model, ids, args.chunk)[:-1]
    rows["llama.cpp native vs llama.cpp F32"] = stats(theirs_ref, theirs, targets)
    rows["llama.cpp F32 vs pagedllm fp32"] = stats(ours_ref, theirs_ref, targets)
    print(f"{len(targets)} positions of {args.text} in chunks of {args.chunk}, {args.model}")
    print(f"{'':38} {'ppl ref':>9} {'ppl':>9} {'mean KL':>10} {'top-1 same':>11}")
    for name, r in rows.items():
        print(f"{name:38} {r['perplexity_ref']:9.4f} {r['perplexity']:9.4f} {r['mean_kl']:10.2e} {r['top1_agreement']:11.2%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "text": args.text, "positions": len(targets), "chunk": args.chunk,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
