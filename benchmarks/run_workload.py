"""One workload through the engine, nothing else, for profilers and old/new comparisons: a 4-request warm-up,
then the 64 requests; prints the wall time of their steps.
Run: .venv/bin/python benchmarks/run_workload.py mixed|shared [bfloat16|float32] [none]   (none: dequantize the
GGUF, the weights vLLM reads; default: its own formats)
Profile: .venv/bin/py-spy record -r 100 -f raw -o mixed.raw -- .venv/bin/python benchmarks/run_workload.py mixed"""

import sys
import time

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.tools.workloads import mixed, shared_prefix

workload = mixed if sys.argv[1] == "mixed" else shared_prefix
engine = LLMEngine(EngineConfig(dtype=sys.argv[2] if len(sys.argv) > 2 else "bfloat16",
                                quantization=sys.argv[3] if len(sys.argv) > 3 else None))


def run(n: int, seed: int, tag: str) -> float:
    for i, w in enumerate(workload(n, engine.model_config.vocab_size, seed)):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": w.prompt_token_ids},
                           SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


run(4, 1, "warm")
engine.block_manager.reset_prefix_cache()
print(f"wall {run(64, 0, 'r'):.2f}")
