"""The cost of structured outputs: one batch unconstrained, the same batch with a fraction of its
requests constrained, same prompts and token counts, alternated in one process.

A constrained request's grammar never lets it finish inside max_tokens (a JSON array of at least
64 person objects, or free text that may open a tool call), and unconstrained ones ignore EOS, so
both batches do exactly the same model work and the difference is the grammar's: compile, the
per-step bitmask fill + apply, and each accepted token.
"""

from __future__ import annotations

import argparse
import statistics

from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..entrypoints.openai.tool_calls import HERMES, structural_tag
from ..sampling_params import SamplingParams, StructuredOutputsParams
from .common import make_report, now, write_json

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
    "role": {"type": "string", "enum": ["admin", "dev", "ops", "sales"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    "required": ["name", "age", "email", "role", "tags"]}
PEOPLE = {"type": "array", "items": PERSON, "minItems": 64}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--fraction", type=float, default=0.5, help="share of the batch that is constrained")
    p.add_argument("--kinds", default="json,tools-auto", help="json (an array of person objects) | tools-auto "
                                                              "(free text, a tool call may open)")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the unconstrained and constrained batch")


def spec_of(kind: str) -> StructuredOutputsParams:
    if kind == "json":
        return StructuredOutputsParams(json=PEOPLE)
    if kind == "tools-auto":
        return StructuredOutputsParams(structural_tag=structural_tag(HERMES, TOOLS, "auto", parallel=True))
    raise ValueError(f"unknown kind {kind!r} (json | tools-auto)")


def run_batch(engine: LLMEngine, prompts: list[list[int]], spec: StructuredOutputsParams | None, fraction: float,
              output_len: int) -> dict:
    st = engine.structured.stats
    mask0, steps0, rows0 = st.mask_seconds, st.mask_steps, st.mask_rows
    n_constrained = round(len(prompts) * fraction) if spec is not None else 0
    t0 = now()
    for i, p in enumerate(prompts):
        constrained = (i * n_constrained) // len(prompts) != ((i + 1) * n_constrained) // len(prompts)  # spread evenly
        engine.add_request(f"b{i}", {"prompt_token_ids": p}, SamplingParams(
            temperature=0.8, seed=i, max_tokens=output_len, ignore_eos=True,
            structured_outputs=spec if constrained else None))
    tokens, steps = 0, 0
    while engine.has_unfinished_requests():
        steps += 1
        for o in engine.step():
            if o.finished:
                tokens += len(o.outputs[0].token_ids)
    wall = now() - t0
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall, "steps": steps,
            "constrained": n_constrained, "mask_s": st.mask_seconds - mask0, "mask_steps": st.mask_steps - steps0,
            "mask_rows": st.mask_rows - rows0}


def main(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    engine = LLMEngine(EngineConfig(**{**engine_kwargs, "enable_prefix_caching": False}))
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"List the staff of office {i} as JSON."}]),
                          add_special_tokens=False) for i in range(args.requests)]
    run_batch(engine, prompts[:4], None, 0, 8)  # warm-up: kernels, allocator
    summary: dict = {"requests": args.requests, "output_len": args.output_len, "fraction": args.fraction}
    for kind in args.kinds.split(","):
        spec = spec_of(kind)
        t = now()
        engine.compile_grammar(spec)
        cold = now() - t
        t = now()
        engine.compile_grammar(spec)
        hot = now() - t
        free, constrained = [], []
        for _ in range(args.rounds):
            free.append(run_batch(engine, prompts, None, 0, args.output_len))
            constrained.append(run_batch(engine, prompts, spec, args.fraction, args.output_len))
        a = statistics.median(r["tokens_per_s"] for r in free)
        b = statistics.median(r["tokens_per_s"] for r in constrained)
        mask_ms = 1000 * sum(r["mask_s"] for r in constrained) / max(1, sum(r["mask_steps"] for r in constrained))
        rows = sum(r["mask_rows"] for r in constrained) / max(1, sum(r["mask_steps"] for r in constrained))
        summary[kind] = {"compile_cold_s": cold, "compile_cached_s": hot, "unconstrained_tokens_per_s": a,
                         "constrained_tokens_per_s": b, "ratio": b / a, "mask_ms_per_step": mask_ms,
                         "constrained_rows_per_step": rows, "runs": {"unconstrained": free, "constrained": constrained}}
        print(f"{kind:11s} compile {cold * 1000:6.1f} ms cold, {hot * 1e6:5.1f} us cached | "
              f"{a:7.1f} tok/s unconstrained, {b:7.1f} tok/s with {args.fraction:.0%} constrained = {b / a:.1%} | "
              f"mask {mask_ms:.2f} ms/step for {rows:.1f} rows")
    summary["tokenizer_info_s"] = engine.structured.stats.tokenizer_info_seconds
    print(f"grammar compiler set up in {summary['tokenizer_info_s'] * 1000:.0f} ms (first constrained request only)")
    report = make_report("structured", args, engine_kwargs, summary=summary)
    write_json(args.json, report)
    return report
