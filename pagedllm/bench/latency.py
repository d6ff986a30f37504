"""One request at a time: time to first token (prefill) and decode tokens/s."""

from __future__ import annotations

import argparse
import random
import statistics

from ..config import EngineConfig
from ..engine import LLMEngine
from ..sampling_params import SamplingParams
from .common import make_report, now, write_json


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--baseline", default="none", choices=["none", "llama-cpp"],
                   help="llama-cpp: the same prompts through llama.cpp on the same weights (the same GGUF file; "
                        "its F32 copy with --quantization none)")


def prompt_ids(vocab_size: int, input_len: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(input_len)]


def measure(engine: LLMEngine, input_len: int, output_len: int, seed: int) -> dict:
    ids = prompt_ids(engine.model_config.vocab_size, input_len, seed)
    engine.add_request(None, {"prompt_token_ids": ids},
                       SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    t0 = now()
    first = None
    n = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            n = len(o.outputs[0].token_ids)
            if first is None and n:
                first = now()
    end = now()
    decode_s = end - first
    return {"ttft_s": first - t0, "decode_tokens_per_s": (n - 1) / decode_s if n > 1 else 0.0,
            "e2e_s": end - t0, "output_tokens": n}


def main(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    kw = dict(engine_kwargs)
    kw["max_num_batched_tokens"] = max(kw.get("max_num_batched_tokens") or 0, args.input_len)
    kw["enable_prefix_caching"] = False  # every iteration measures a real prefill
    engine = LLMEngine(EngineConfig(**kw))
    for i in range(args.num_iters_warmup):
        measure(engine, args.input_len, min(args.output_len, 8), args.seed + 1000 + i)
    runs = [measure(engine, args.input_len, args.output_len, args.seed + i) for i in range(args.num_iters)]
    keys = ("ttft_s", "decode_tokens_per_s", "e2e_s")
    summary = {k: statistics.median(r[k] for r in runs) for k in keys}
    rows = {"pagedllm": summary}
    baseline_runs = None
    if args.baseline == "llama-cpp":
        from .llamacpp import LlamaCpp

        vocab = engine.model_config.vocab_size
        del engine  # one model in memory at a time
        f32 = kw.get("quantization") == "none"
        lc = LlamaCpp(kw.get("model"), args.input_len + args.output_len + 8, f32=f32)
        for i in range(args.num_iters_warmup):
            lc.measure(prompt_ids(vocab, args.input_len, args.seed + 1000 + i), min(args.output_len, 8))
        baseline_runs = [lc.measure(prompt_ids(vocab, args.input_len, args.seed + i), args.output_len)
                         for i in range(args.num_iters)]
        rows["llama.cpp (F32)" if f32 else "llama.cpp"] = {k: statistics.median(r[k] for r in baseline_runs) for k in keys}
    print(f"input {args.input_len} tokens, output {args.output_len} tokens, {args.num_iters} runs (median):")
    print(f"  {'':16s} {'TTFT ms':>9s} {'prompt tok/s':>13s} {'decode tok/s':>13s} {'e2e s':>7s}")
    for name, r in rows.items():
        print(f"  {name:16s} {r['ttft_s'] * 1000:9.1f} {args.input_len / r['ttft_s']:13.0f} "
              f"{r['decode_tokens_per_s']:13.1f} {r['e2e_s']:7.2f}")
    report = make_report("latency", args, kw, runs=runs, median=summary,
                         prompt_tokens_per_s=args.input_len / summary["ttft_s"], baseline_runs=baseline_runs,
                         medians=rows)
    write_json(args.json, report)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(8, 3.5))
        names = list(rows)
        ax[0].bar(names, [rows[n]["ttft_s"] * 1000 for n in names])
        ax[0].set_title(f"time to first token, {args.input_len} tokens (ms)")
        ax[1].bar(names, [rows[n]["decode_tokens_per_s"] for n in names], color="tab:green")
        ax[1].set_title("decode tokens/s (median)")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        plt.close(fig)
    return report
