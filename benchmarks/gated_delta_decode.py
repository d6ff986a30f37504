"""One stream's decode with a Gated DeltaNet model's decode rows through the fused op (csrc/gated_delta_net.cpp)
and through the torch steps it replaces, alternated in one process (the host's speed drifts), with the tokens of
each pair compared. The prompt is not computed (as in long_context_decode.py: decode steps are the real model).
Run: .venv/bin/pagedllm bench random-gguf /tmp/qwen35-9b-q4_0.gguf --shape qwen3.5-9b --type Q4_0
     .venv/bin/python benchmarks/gated_delta_decode.py /tmp/qwen35-9b-q4_0.gguf [--context 1024] [--rounds 4]"""

import argparse
import statistics

from long_context_decode import skip_prompts  # benchmarks/ is the script's directory

import pagedllm.model_executor.layers.backends as backends
from pagedllm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=49)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    fused = backends.CpuKernels.gated_delta_decode
    llm = LLM(model=args.model, max_model_len=args.context + args.output_len + 16, kv_cache_memory="1536MiB")
    skip_prompts(llm)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    rates: dict[str, list[float]] = {"torch steps": [], "fused op": []}
    same = True
    for r in range(args.rounds):
        tokens = {}
        for mode in ("fused op", "torch steps") if r % 2 == 0 else ("torch steps", "fused op"):
            backends.CpuKernels.gated_delta_decode = fused if mode == "fused op" else (lambda *a, **k: None)
            prompt = [(7 * j + 13 * r) % 1000 + 10 for j in range(args.context)]
            out = llm.generate([{"prompt_token_ids": prompt}], sp)[0]
            m = out.metrics
            rates[mode].append((args.output_len - 1) / (m["finished_time"] - m["first_token_time"]))
            tokens[mode] = out.outputs[0].token_ids
            print(f"round {r} {mode}: {rates[mode][-1]:.2f} tok/s", flush=True)
        same &= tokens["fused op"] == tokens["torch steps"]
    backends.CpuKernels.gated_delta_decode = fused
    pairs = [a / b for a, b in zip(rates["fused op"], rates["torch steps"])]
    print(f"medians: torch steps {statistics.median(rates['torch steps']):.2f} tok/s, fused op "
          f"{statistics.median(rates['fused op']):.2f}; per round {' / '.join(f'{x:.2f}' for x in pairs)}x; "
          f"the same tokens: {same}")


if __name__ == "__main__":
    main()
