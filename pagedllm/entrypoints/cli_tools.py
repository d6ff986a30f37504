"""`pagedllm plan | simulate | eval | eval-kv | bench random-gguf`: the planning and evaluation commands."""

from __future__ import annotations

import argparse

from ..config import DTYPES


def cmd_random_gguf(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..bench.random_gguf import SHAPES, write_random_gguf
    from ..model_executor.model_loader import default_model_path

    types = dict(kv.split("=", 1) for kv in args.types.split(",")) if args.types else None
    out = write_random_gguf(Path(args.out), SHAPES[args.shape], args.type, args.seed, types,
                            tokenizer_from=default_model_path(), fast=not args.exact, tie=False)
    print(f"wrote {out} ({out.stat().st_size / 2**30:.2f} GiB)")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from ..tools.planner import format_plan, load_shape, plan

    shape = load_shape(args.model, args.preset)
    p = plan(shape, args.memory, args.kv_dtype, args.block_size, args.max_model_len, args.weights_memory,
             args.activation_memory, args.mean_prompt, args.mean_output, concurrency=args.concurrency,
             weight_format=args.weight_format)
    print(json.dumps(p.to_dict(), indent=1) if args.json else format_plan(p))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    import json

    from ..config import parse_size
    from ..tools.planner import kv_bytes_per_token, load_shape
    from ..tools.simulate import generate_trace, load_trace, plot, simulate_paged, simulate_static, write_html

    shape = load_shape(args.model, args.preset)
    bpt = kv_bytes_per_token(shape, args.kv_dtype)
    capacity = parse_size(args.kv_memory) // bpt
    max_len = args.max_model_len or shape.max_model_len
    trace = load_trace(args.trace) if args.trace else generate_trace(args.num_requests, args.seed, args.rate, max_len)
    layouts: tuple[list, list] | tuple[None, None] = ([], []) if args.html else (None, None)
    static = simulate_static(trace, capacity, layouts[0])
    paged = simulate_paged(trace, capacity, args.block_size, layout=layouts[1])
    report = {"config": {"model": shape.name, "kv_bytes_per_token": bpt, "kv_memory": args.kv_memory,
                         "capacity_tokens": capacity, "block_size": args.block_size, "num_requests": len(trace),
                         "seed": args.seed, "trace": args.trace},
              "static": static.summary(), "paged": paged.summary()}
    print(f"{shape.name}: KV capacity {capacity:,} tokens ({args.kv_memory}, {bpt:,} B/token), {len(trace)} requests")
    print(f"{'':28}{'static':>12}{'paged':>12}")
    for key in ("completed", "refused", "refused_fragmentation", "preemptions", "peak_concurrency",
                "mean_concurrency", "mean_utilization"):
        a, b = report["static"][key], report["paged"][key]
        fmt = (lambda x: f"{x:>12.1%}") if key == "mean_utilization" else \
            (lambda x: f"{x:>12.1f}") if isinstance(a, float) else (lambda x: f"{x:>12}")
        print(f"{key:28}{fmt(a)}{fmt(b)}")
    for e in static.events[:3]:
        print("static:", e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(static, paged, bpt, args.plot, f"{shape.name}, {args.kv_memory} of KV, {len(trace)} requests")
    if args.html:
        write_html(static, paged, layouts[0], layouts[1], capacity, args.block_size, args.html,
                   f"{shape.name}, {args.kv_memory} of KV ({capacity:,} tokens), {len(trace)} requests")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Weight formats against an fp32 engine on the same weights, teacher-forced on one text."""
    import json

    from ..tools.evaluate import EVAL_TEXT, compare_to_reference, read_eval_text
    from .llm import LLM

    text = read_eval_text(args.text)
    common = dict(model=args.model, kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=args.kv_cache_memory,
                  max_model_len=args.max_model_len)
    ref = LLM(dtype=args.reference, quantization="none", **common)  # a GGUF dequantized: the same weights
    ids = ref.get_tokenizer().encode(text)
    rows = []
    for fmt in args.formats.split(","):
        kw = ({"dtype": fmt, "quantization": "none"} if fmt in DTYPES  # a GGUF dequantized to that dtype
              else {"dtype": "float32", "quantization": None if fmt == "native" else fmt})
        llm = LLM(**kw, **common)
        r = compare_to_reference(ref.engine, llm.engine, ids, args.chunk)
        model = llm.engine.runner.model
        rows.append({"format": fmt, "weight_format": model.weight_format, **r,
                     "linear_weight_bytes": model.linear_weight_bytes()})
        del llm
    print(f"reference: {args.reference} weights, {rows[0]['tokens'] if rows else 0} tokens of {args.text or EVAL_TEXT.name}, "
          f"KV {args.kv_cache_dtype}; perplexity {rows[0]['perplexity_ref'] if rows else float('nan'):.4f}")
    print(f"{'format':10} {'stored as':>12} {'perplexity':>11} {'vs ref':>8} {'mean KL':>10} {'top-1 same':>11} "
          f"{'linear MiB':>11}")
    for r in rows:
        print(f"{r['format']:10} {r['weight_format']:>12} {r['perplexity']:>11.4f} "
              f"{r['perplexity'] / r['perplexity_ref'] - 1:>+8.2%} {r['mean_kl']:>10.2e} {r['top1_agreement']:>11.2%} "
              f"{r['linear_weight_bytes'] / 2**20:>11.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args) | {"func": None}, "rows": rows}, f, indent=1)
    return 0


def cmd_eval_kv(args: argparse.Namespace) -> int:
    import json

    from ..sampling_params import SamplingParams
    from ..tools.evaluate import greedy_agreement, perplexity, read_eval_text
    from .llm import LLM

    text = read_eval_text(args.text)
    rows, ref = [], None
    for dt in args.kv_dtypes.split(","):
        llm = LLM(model=args.model, kv_cache_dtype=dt, kv_cache_memory=args.kv_cache_memory,
                  max_model_len=args.max_model_len, dtype=args.dtype)
        ids = llm.get_tokenizer().encode(text)
        ppl = perplexity(llm.engine, ids, args.chunk)
        prompts = [{"prompt_token_ids": ids[i * 300:i * 300 + 64]} for i in range(args.num_prompts)]
        outs = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))]
        ref = ref or outs
        first_diff = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r)) for r, o in zip(ref, outs)]
        rows.append({"kv_cache_dtype": dt, "tokens": len(ids), "perplexity": ppl,
                     "greedy_agreement": greedy_agreement(ref, outs),
                     "mean_tokens_before_divergence": sum(first_diff) / len(first_diff),
                     "num_kv_blocks": llm.engine.block_manager.num_blocks,
                     "kv_bytes_per_token": llm.engine.kv_bytes_per_token})
    base = rows[0]["perplexity"]
    print(f"{'kv dtype':10} {'tokens':>7} {'perplexity':>11} {'vs first':>9} {'greedy same':>12} "
          f"{'tok before diverge':>19} {'blocks':>7} {'B/token':>8}")
    for r in rows:
        print(f"{r['kv_cache_dtype']:10} {r['tokens']:>7} {r['perplexity']:>11.4f} {r['perplexity'] / base - 1:>+9.2%} "
              f"{r['greedy_agreement']:>12.1%} {r['mean_tokens_before_divergence']:>19.1f} {r['num_kv_blocks']:>7} "
              f"{r['kv_bytes_per_token']:>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args) | {"func": None}, "rows": rows}, f, indent=1)
    return 0
