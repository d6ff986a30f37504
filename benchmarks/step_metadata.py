"""The host-side cost of a decode step's inputs when the pool has many views: Gemma-4-31B's hybrid layout lays its
sliding layers two to a page, which gives the runner 12 views of the pool (a group's, or a part of its pages), each
with its own block tables, slot mapping and attention metadata a step; the full layout has one.

The engine itself, on a model with the shape's layer pattern, window and page ratios but tiny widths (what the
runner builds does not depend on widths): `--seqs` requests with `--context`-token prompts decode `--steps` steps
together. Per step, the runner's `execute_batch` time less the model's forward is the host's share (tables, slots,
metadata for every view); it is set against the forward of the real model, whose weights alone take
`--weights-gib` / the host's read bandwidth to stream (e.g. Gemma-4-31B in Q4_0: ~17 GiB).

Run: .venv/bin/python benchmarks/step_metadata.py [--shape gemma4-31b] [--seqs 32] [--context 4096]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from hybrid_kv import BLOCK, SHAPES, tiny_model

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine


def host_ms_per_step(path: str, hybrid: bool, seqs: int, context: int, steps: int) -> tuple[int, float, float]:
    """(views, host ms a decode step: execute_batch less the forward, forward ms) over the decode steps."""
    blocks = (8 if hybrid else 1) * seqs * (context + steps + 2 * BLOCK) // BLOCK  # the hybrid groups: more tables
    e = LLMEngine(EngineConfig(model=path, dtype="float32", block_size=BLOCK, num_kv_blocks=blocks,
                               max_model_len=context + steps, max_num_batched_tokens=8192, max_num_seqs=seqs,
                               hybrid_kv_cache=hybrid))
    runner = e.runner
    rng = random.Random(0)
    for i in range(seqs):
        prompt = [rng.randrange(3, 256) for _ in range(context)]
        e.add_request(f"r{i}", {"prompt_token_ids": prompt},
                      SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    forward = runner.model.forward
    spent: list[float] = []

    def timed_forward(*args, **kwargs):
        t = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t)

    runner.model.forward = timed_forward
    execute = runner.execute_batch
    host: list[float] = []
    fwd: list[float] = []

    def timed_execute(batch, *args, **kwargs):
        spent.clear()
        t = time.perf_counter()
        out = execute(batch, *args, **kwargs)
        if len(batch.items) == seqs and all(len(s.token_ids) == 1 for s in batch.items):  # decode steps only
            host.append((time.perf_counter() - t - sum(spent)) * 1e3)
            fwd.append(sum(spent) * 1e3)
        return out

    runner.execute_batch = timed_execute
    while e.has_unfinished_requests():
        e.step()
    return len(runner.layout.views), statistics.median(host), statistics.median(fwd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="gemma4-31b", choices=sorted(SHAPES))
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--weights-gib", type=float, default=17.0, help="the real model's weights read a step")
    ap.add_argument("--bandwidth-gbs", type=float, default=20.0, help="the host's read bandwidth, GB/s")
    args = ap.parse_args()
    floor_ms = args.weights_gib * 2**30 / (args.bandwidth_gbs * 1e9) * 1e3
    print(f"{args.shape}: {args.seqs} sequences decoding at {args.context} tokens; the real model's forward is at "
          f"least {floor_ms:.0f} ms a step ({args.weights_gib} GiB of weights at {args.bandwidth_gbs} GB/s)")
    with tempfile.TemporaryDirectory() as d:
        tiny_model(args.shape, SHAPES[args.shape], d)
        for hybrid in (False, True, False, True):
            views, host, fwd = host_ms_per_step(d, hybrid, args.seqs, args.context, args.steps)
            print(f"  {'hybrid' if hybrid else 'full  '} layout: {views:2d} views, host {host:6.2f} ms a step "
                  f"({host / floor_ms:.2%} of the real forward's floor), tiny model's forward {fwd:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
