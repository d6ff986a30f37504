"""One request at a time: time to first token (prefill) and decode tokens/s."""

from __future__ import annotations

import argparse
import random
import statistics

from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
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
    p.add_argument("--speculative", default=None,
                   help="a speculative_config (JSON) to compare with no speculation, iterations alternated, e.g. "
                        '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the measured requests "
                                                                     "(seeded per iteration)")
    p.add_argument("--workload", default="random", choices=["random", "grounded"],
                   help="random token prompts, or chat prompts that rewrite / copy / quote a passage (bench/passages.py; "
                        "greedy, each run stops at EOS or --output-len)")


def prompt_ids(vocab_size: int, input_len: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(input_len)]


def grounded_ids(engine: LLMEngine, i: int) -> list[int]:
    from .passages import grounded_messages

    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template(grounded_messages(i + 1)[i]), add_special_tokens=False)


def measure(engine: LLMEngine, input_len: int, output_len: int, seed: int, ids: list[int] | None = None,
            temperature: float = 0.0) -> dict:
    """ids given (a grounded prompt): until EOS or output_len; else random tokens, EOS ignored."""
    grounded = ids is not None
    ids = ids if grounded else prompt_ids(engine.model_config.vocab_size, input_len, seed)
    st = engine.stats()
    engine.add_request(None, {"prompt_token_ids": ids},
                       SamplingParams(temperature=temperature, seed=seed, max_tokens=output_len, ignore_eos=not grounded))
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
    st2 = engine.stats()
    return {"ttft_s": first - t0, "decode_tokens_per_s": (n - 1) / decode_s if n > 1 else 0.0,
            "e2e_s": end - t0, "output_tokens": n, "prompt_tokens": len(ids),
            "draft_tokens": st2.spec_num_draft_tokens - st.spec_num_draft_tokens,
            "accepted_tokens": st2.spec_num_accepted_tokens - st.spec_num_accepted_tokens,
            "drafts": st2.spec_num_drafts - st.spec_num_drafts}


def speculative(args: argparse.Namespace, kw: dict) -> dict:
    """No speculation vs args.speculative, same prompts, iterations alternated between two engines."""
    plain = LLMEngine(EngineConfig(**kw))
    spec = LLMEngine(EngineConfig(**{**kw, "speculative_config": args.speculative}))
    runs: dict[str, list[dict]] = {"pagedllm": [], "pagedllm + speculative": []}
    n = args.num_iters
    for i in range(-args.num_iters_warmup, n):
        pair = (("pagedllm", plain), ("pagedllm + speculative", spec))
        for name, e in pair if i % 2 == 0 else pair[::-1]:  # who goes first alternates too
            ids = grounded_ids(e, i % max(n, 1)) if args.workload == "grounded" else None
            r = measure(e, args.input_len, args.output_len if i >= 0 else 8, args.seed + i, ids, args.temperature)
            if i >= 0:
                runs[name].append(r)
    keys = ("ttft_s", "decode_tokens_per_s", "e2e_s")
    rows = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
    sr = runs["pagedllm + speculative"]
    drafted, accepted, drafts = (sum(r[k] for r in sr) for k in ("draft_tokens", "accepted_tokens", "drafts"))
    ratios = [b["decode_tokens_per_s"] / a["decode_tokens_per_s"] for a, b in zip(runs["pagedllm"], sr)]
    summary = {"speedup_median": statistics.median(ratios), "speedups": ratios,
               "acceptance_rate": accepted / drafted if drafted else 0.0,
               "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,  # tokens per verification pass
               "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
               "mean_output_tokens": statistics.mean(r["output_tokens"] for r in sr)}
    print(f"{args.workload} prompts, up to {args.output_len} output tokens, {n} runs (median), speculative {args.speculative}:")
    print(f"  {'':24s} {'TTFT ms':>9s} {'decode tok/s':>13s} {'e2e s':>7s}")
    for name, r in rows.items():
        print(f"  {name:24s} {r['ttft_s'] * 1000:9.1f} {r['decode_tokens_per_s']:13.1f} {r['e2e_s']:7.2f}")
    print(f"  decode speedup {summary['speedup_median']:.2f}x (per run: {', '.join(f'{x:.2f}' for x in ratios)}); "
          f"acceptance {summary['acceptance_rate']:.1%} of {drafted} proposed tokens, "
          f"{summary['mean_accepted_length']:.2f} tokens per verification pass")
    report = make_report("latency", args, kw, runs=runs, medians=rows, speculative=summary)
    write_json(args.json, report)
    return report


def main(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    kw = dict(engine_kwargs)
    kw["max_num_batched_tokens"] = max(kw.get("max_num_batched_tokens") or 0, args.input_len)
    kw["enable_prefix_caching"] = False  # every iteration measures a real prefill
    if args.speculative is not None:
        return speculative(args, kw)
    engine = LLMEngine(EngineConfig(**kw))
    for i in range(args.num_iters_warmup):
        measure(engine, args.input_len, min(args.output_len, 8), args.seed + 1000 + i)
    runs = [measure(engine, args.input_len, args.output_len, args.seed + i, temperature=args.temperature)
            for i in range(args.num_iters)]
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
