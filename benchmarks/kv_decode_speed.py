"""Decode speed of one stream at a long context over each KV pool format, engines alternated round by round.

    .venv/bin/python benchmarks/kv_decode_speed.py [--context 4096] [--output-len 64] [--rounds 3]
      [--kv-dtypes bfloat16,q8_0,q8_0/q4_0] [--model PATH] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics

from pagedllm.bench.common import machine_info
from pagedllm.bench.latency import measure
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-dtypes", default="bfloat16,q8_0,q8_0/q4_0")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    engines = {kv: LLMEngine(EngineConfig(model=args.model, kv_cache_dtype=kv, kv_cache_memory="1GiB",
                                          max_model_len=args.context + args.output_len + 16,
                                          num_threads=args.num_threads, enable_prefix_caching=False))
               for kv in args.kv_dtypes.split(",")}
    runs: dict[str, list[float]] = {kv: [] for kv in engines}
    for r in range(-1, args.rounds):  # round -1: warm-up
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for kv in order:
            m = measure(engines[kv], args.context, args.output_len, seed=r + 1)
            if r >= 0:
                runs[kv].append(m["decode_tokens_per_s"])
    base = statistics.median(runs[next(iter(runs))])
    print(f"decode tokens/s of one stream after a {args.context}-token prompt, median of {args.rounds} rounds")
    for kv, xs in runs.items():
        med = statistics.median(xs)
        print(f"  {kv:12s} {med:7.1f}  ({med / base:.2f}x the first)   runs {[round(x, 1) for x in xs]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "machine": machine_info(), "decode_tokens_per_s": runs}, f, indent=1)


if __name__ == "__main__":
    main()
