"""KV memory the paged engine really used over time vs what max-length preallocation would have
reserved for the same running requests."""

from __future__ import annotations

import argparse

from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..sampling_params import SamplingParams
from .common import load_workload, make_report, write_json


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="mixed", help="mixed | shared-prefix | FILE.jsonl")
    p.add_argument("--num-requests", type=int, default=64)


def main(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    engine = LLMEngine(EngineConfig(**engine_kwargs))
    work = load_workload(args.workload, args.num_requests, engine.model_config.vocab_size, args.seed, engine.tokenizer)
    for i, w in enumerate(work):
        engine.add_request(f"m{i}", {"prompt_token_ids": w.prompt_token_ids},
                           SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True))
    bpb, bpt = engine.bytes_per_block, engine.kv_bytes_per_token
    max_len = engine.max_model_len
    series: dict[str, list] = {"step": [], "paged_bytes": [], "live_token_bytes": [], "static_bytes": [],
                               "running": []}
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        st = engine.stats()
        live = sum(r.num_computed_tokens for r in engine.scheduler.running)
        series["step"].append(step)
        series["paged_bytes"].append(st.kv_blocks_used * bpb)
        series["live_token_bytes"].append(live * bpt)
        series["static_bytes"].append(st.num_running * max_len * bpt)  # one max_model_len slab each
        series["running"].append(st.num_running)
        step += 1
    peak_paged, peak_static = max(series["paged_bytes"]), max(series["static_bytes"])
    busy = [(p, u, s) for p, u, s in zip(series["paged_bytes"], series["live_token_bytes"], series["static_bytes"]) if p]
    summary = {"steps": step, "peak_paged_bytes": peak_paged, "peak_static_bytes": peak_static,
               "peak_concurrency": max(series["running"]),
               "paged_utilization": sum(u for _, u, _ in busy) / sum(p for p, _, _ in busy),
               "static_utilization": sum(u for _, u, _ in busy) / sum(s for _, _, s in busy),
               "static_over_paged_peak": peak_static / peak_paged if peak_paged else 0.0,
               "max_model_len": max_len, "kv_bytes_per_token": bpt, "block_size": engine.block_manager.block_size}
    mib = 2**20
    print(f"{len(work)} requests, max_model_len {max_len}, {bpt} KV bytes/token, block {summary['block_size']}")
    print(f"  peak KV paged        {peak_paged / mib:10.1f} MiB   utilization {summary['paged_utilization']:.1%}")
    print(f"  peak KV static       {peak_static / mib:10.1f} MiB   utilization {summary['static_utilization']:.1%}")
    print(f"  static / paged peak  {summary['static_over_paged_peak']:10.1f}x   peak concurrency {summary['peak_concurrency']}")
    report = make_report("memory", args, engine_kwargs, summary=summary, series=series)
    write_json(args.json, report)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot(series["step"], [x / mib for x in series["static_bytes"]], label="static: max_model_len per request")
        ax.plot(series["step"], [x / mib for x in series["paged_bytes"]], label="paged: blocks in use")
        ax.plot(series["step"], [x / mib for x in series["live_token_bytes"]], label="live tokens", linestyle=":")
        ax.set_xlabel("engine step")
        ax.set_ylabel("KV MiB")
        ax.set_yscale("log")
        ax.legend()
        ax.set_title(f"{len(work)} requests ({args.workload}): static reserves "
                     f"{summary['static_over_paged_peak']:.0f}x the paged peak", fontsize=10)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        plt.close(fig)
    return report
