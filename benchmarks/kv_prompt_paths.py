"""Time to first token of one long prompt over each KV pool format through each prompt path (SDPA over the
sequence's dequantized blocks, or the chunk kernel); the engines alternated round by round.

    .venv/bin/python benchmarks/kv_prompt_paths.py [--prompt-len 2048] [--rounds 3] [--model PATH]
      [--kv-dtypes q8_0,bfloat16]   (fp8_e4m3 and fp8_e5m2 too)
"""

from __future__ import annotations

import argparse
import statistics

from pagedllm.bench.latency import measure
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-dtypes", default="q8_0,bfloat16")
    args = p.parse_args()
    engines = {}
    for kv, chunk in [(kv, chunk) for kv in args.kv_dtypes.split(",") for chunk in (True, False)]:
        name = f"{kv}, {'chunk kernel' if chunk else 'SDPA'}"
        e = LLMEngine(EngineConfig(model=args.model, kv_cache_dtype=kv, kv_cache_memory="1GiB",
                                   max_model_len=args.prompt_len + 64, enable_prefix_caching=False))
        e.runner.chunk_op = chunk  # the path under test, whatever this CPU's default is
        engines[name] = e
    runs: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(-1, args.rounds):  # round -1: warm-up
        order = list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]
        for name, e in order:
            m = measure(e, args.prompt_len, 2, seed=r + 5)
            if r >= 0:
                runs[name].append(m["ttft_s"])
    print(f"time to first token of a {args.prompt_len}-token prompt, median of {args.rounds} rounds")
    for name, xs in runs.items():
        print(f"  {name:24s} {statistics.median(xs):7.3f} s   runs {[round(x, 3) for x in xs]}")


if __name__ == "__main__":
    main()
