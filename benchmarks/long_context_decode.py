"""One stream's decode speed at a short and a long context, e.g. a Qwen3.5-shaped model (linear-attention layers
whose state is constant in the context, a full-attention layer in four whose KV grows with it) at 1k and 32k.

The prompt is not computed: on two cores a 32k-token prefill of a 9B model takes the better part of an hour. While
the request's prompt steps run, the model's forward returns zero logits without touching the model, so the KV
slots and the linear layers' states keep the zeros they were allocated with; every decode step after it is the real
model, attending over all of the context's positions (the kernels' work does not depend on the values).
Run: .venv/bin/pagedllm bench random-gguf /tmp/qwen35-9b-q4_0.gguf --shape qwen3.5-9b --type Q4_0
     .venv/bin/python benchmarks/long_context_decode.py /tmp/qwen35-9b-q4_0.gguf --contexts 1024 32768
--mask-isa "-mno-amx-tile -mno-amx-bf16 -mno-amx-int8" runs kernels built without this CPU's AMX (as a Zen 4's
compiler builds them), so one host measures the paths of another CPU class."""

import argparse
import statistics

import torch

from pagedllm import LLM, SamplingParams


def skip_prompts(llm: LLM):
    """The engine's model with prompt steps not computed (zero logits; the KV slots and states keep their zeros):
    every decode step after them is the real model over all of the context's positions. Returns the model."""
    model = llm.engine.runner.model
    forward = model.forward

    def prompt_free(input_ids, positions, caches, meta, logits_indices):
        if meta.num_decode_rows == 0:  # a prompt step: nothing computed
            return torch.zeros(len(logits_indices), model.cfg.vocab_size)
        return forward(input_ids, positions, caches, meta, logits_indices)

    model.forward = prompt_free
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--output-len", type=int, default=65)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-memory", default="1536MiB")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--mask-isa", default="", help="compiler flags that mask instruction sets of this CPU")
    args = ap.parse_args()
    if args.mask_isa:
        from pagedllm.platforms import cpu

        ops = cpu.build_ops(tuple(args.mask_isa.split()))
        cpu.load_ops = lambda: ops  # every caller asks the platform module at call time
        print(f"kernels built with {args.mask_isa}: linear_bf16 on {ops.linear_bf16_isa}", flush=True)
    longest = max(args.contexts) + args.output_len + 16
    llm = LLM(model=args.model, max_model_len=longest, kv_cache_memory=args.kv_cache_memory,
              kv_cache_dtype=args.kv_cache_dtype)
    model = skip_prompts(llm)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    rates: dict[int, list[float]] = {n: [] for n in args.contexts}
    for r in range(args.rounds):  # interleaved: the host's speed drifts
        for n in args.contexts:
            prompt = [(7 * j + 13 * r) % 1000 + 10 for j in range(n)]
            m = llm.generate([{"prompt_token_ids": prompt}], sp)[0].metrics
            rates[n].append((args.output_len - 1) / (m["finished_time"] - m["first_token_time"]))
            print(f"round {r} context {n}: decode {rates[n][-1]:.2f} tok/s", flush=True)
    base = statistics.median(rates[min(args.contexts)])
    print(f"{args.model}: KV layers {sum(s is not None for s in model.kv_specs())} of {len(model.layers)}, "
          f"state {model.state_bytes_per_seq() / 2**20:.1f} MiB per sequence" if hasattr(model, "state_bytes_per_seq")
          else args.model)
    short = min(args.contexts)
    for n in args.contexts:
        med = statistics.median(rates[n])
        # each round's two contexts ran back to back, so their ratio is the paired figure; the ratio of the two
        # medians can mix rounds run at different host speeds
        paired = [a / b for a, b in zip(rates[short], rates[n])]
        print(f"context {n:6d}: decode median {med:.2f} tok/s; time a token vs {short}: per round "
              f"{' / '.join(f'{x:.2f}' for x in paired)}, median {statistics.median(paired):.2f}x "
              f"(medians' ratio {base / med:.2f}x)")


if __name__ == "__main__":
    main()
