"""Where the mixed (or shared-prefix) workload's time goes: the engine's calls wrapped with timers (linears by
row count, SDPA over prompts where the pool is fp32, the whole attention call split by whether the step had
prompt chunks), the default model, bf16 dense parts (float32: fp32 ones, what dtype=auto picks without native
bf16 dot products).
Run: .venv/bin/python benchmarks/mixed_breakdown.py [mixed|shared-prefix] [none] [float32]   (none: the GGUF
dequantized to dense panels, the HF-folder benchmark's setting; the wrappers add ~1 us a call)"""

import collections
import sys
import time

import pagedllm.model_executor.attention as attention
import pagedllm.model_executor.layers.backends as backends
import pagedllm.model_executor.layers.weight_formats as weight_formats
import pagedllm.model_executor.model_runner as model_runner
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.tools.workloads import mixed, shared_prefix

spent: collections.Counter = collections.Counter()
inside: set[str] = set()  # the buckets being timed now: a fused call that falls back to matmul counts once


def timed(f, name=None, key=None):
    def run(*a, **k):
        bucket = key(*a) if key else name
        if bucket in inside:
            return f(*a, **k)
        inside.add(bucket)
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spent[bucket] += time.perf_counter() - t
            inside.discard(bucket)
    return run


def rows(_w, x, *_) -> str:
    m = x.shape[0]
    return "linears, 512+ rows" if m >= 512 else "linears, 16-511 rows" if m >= 16 else "linears, < 16 rows"


weight_formats.GGMLWeight.matmul = timed(weight_formats.GGMLWeight.matmul, key=rows)
weight_formats.DensePanels.matmul = timed(weight_formats.DensePanels.matmul, key=rows)
# the bf16 gate_up with silu in one pass (an intermediate size of whole panels, as SmolLM2's): counted in its
# row bucket, silu included; where it falls back to matmul + silu_and_mul its matmul would count twice
weight_formats.DensePanels.matmul_silu_and_mul = timed(weight_formats.DensePanels.matmul_silu_and_mul, key=rows)
# GGML weights' fused calls (the gate_up with its silu; a norm with the projection it feeds), counted likewise
weight_formats.GGMLWeight.matmul_silu_and_mul = timed(weight_formats.GGMLWeight.matmul_silu_and_mul, key=rows)
weight_formats.GGMLWeight.matmul_normed = timed(weight_formats.GGMLWeight.matmul_normed, key=rows)
attention._attend_prefills = timed(attention._attend_prefills, "SDPA over prompts (fp32 pools only)")


def attention_kind(_ops, _qkv, _cos, _sin, _heads, _cache, meta, _scale, _sinks=None) -> str:
    return "attention, steps with chunks" if meta.chunks is not None else "attention, rows only"


backends.attention_from_qkv = timed(backends.attention_from_qkv, key=attention_kind)
model_runner.ModelRunner.execute = timed(model_runner.ModelRunner.execute, "model runner")
dtype = "float32" if "float32" in sys.argv[1:] else "bfloat16"
engine = LLMEngine(EngineConfig(dtype=dtype, quantization="none" if "none" in sys.argv[1:] else None))
workload = shared_prefix if "shared-prefix" in sys.argv[1:] else mixed
for i, w in enumerate(workload(64, engine.model_config.vocab_size, 0)):
    engine.add_request(f"r{i}", {"prompt_token_ids": w.prompt_token_ids},
                       SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True))
t0 = time.perf_counter()
while engine.has_unfinished_requests():
    engine.step()
print(f"wall {time.perf_counter() - t0:.2f} s (SDPA over prompts is part of the attention calls)")
for name, s in spent.most_common():
    print(f"  {name:34s} {s:6.2f} s")
