"""One-stream decode with the fused op calls against the same engine without them, alternated in one process (the
host's speed drifts too much between processes for a few percent): `norms` runs the layers' forward against one
that calls each norm on its own; `silu` runs GGML gate_up + silu as one op against two (both with separate norms).

    .venv/bin/python benchmarks/decode_fused_calls.py [norms|silu] [--pairs 12] [--tokens 128] [--model PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.layers import weight_formats as wf


def separate_norms(self, x, residual, cos, sin, cache, meta):  # DecoderLayer.forward with each norm its own call
    meta = meta.for_window(self.sliding_window)
    h, residual = self.input_layernorm(x, residual, self.backend)
    o = self.self_attention(h, cos, sin, cache, meta)
    h, residual = self.post_attention_layernorm(o, residual, self.backend)
    return self.feed_forward(h, meta.num_decode_rows), residual


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", nargs="?", default="norms", choices=["norms", "silu"])
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--model", default=None)
    args = p.parse_args()
    llm = LLM(args.model, kv_cache_memory="256MiB") if args.model else LLM(kv_cache_memory="256MiB")
    layers = llm.engine.runner.model.layers
    fused_silu = wf.GGMLWeight.matmul_silu_and_mul
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)

    def use(fused: bool) -> None:
        for layer in layers:
            if args.what == "silu" or not fused:
                layer.forward = types.MethodType(separate_norms, layer)
            else:
                layer.__dict__.pop("forward", None)
        if args.what == "silu":
            wf.GGMLWeight.matmul_silu_and_mul = fused_silu if fused else wf.PackedWeight.matmul_silu_and_mul

    def run() -> tuple[float, list[int]]:
        t = time.perf_counter()
        out = llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, params)
        return args.tokens / (time.perf_counter() - t), out[0].outputs[0].token_ids

    run()  # warm-up
    rates: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[int]] = {}
    for i in range(args.pairs):
        for fused in (i % 2 == 0, i % 2 == 1):  # which goes first alternates
            use(fused)
            rate, tokens[fused] = run()
            rates[fused].append(rate)
    use(True)
    diff = [f - u for f, u in zip(rates[True], rates[False])]
    print(f"{args.what}: fused {statistics.median(rates[True]):.1f} tok/s, separate {statistics.median(rates[False]):.1f} "
          f"(medians of {args.pairs}); fused faster in {sum(d > 0 for d in diff)} of {len(diff)} pairs; "
          f"same tokens: {tokens[True] == tokens[False]}")


if __name__ == "__main__":
    main()
