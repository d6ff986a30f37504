"""One workload through the engine, nothing else, for profilers: prints the wall time of the steps.
Run: .venv/bin/python docs/bench/run_workload.py mixed|shared [bfloat16|float32]
Profile: .venv/bin/py-spy record -r 100 -f raw -o mixed.raw -- .venv/bin/python docs/bench/run_workload.py mixed"""

import sys
import time

from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.workloads import mixed, shared_prefix

workload = sys.argv[1]
engine = LLMEngine(EngineConfig(dtype=sys.argv[2] if len(sys.argv) > 2 else "bfloat16"))
work = (mixed if workload == "mixed" else shared_prefix)(64, engine.model_config.vocab_size, 0)
for i, w in enumerate(work):
    engine.add_request(f"r{i}", {"prompt_token_ids": w.prompt_token_ids},
                       SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True))
t0 = time.perf_counter()
while engine.has_unfinished_requests():
    engine.step()
print("wall", time.perf_counter() - t0)
