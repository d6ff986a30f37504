"""Hybrid KV on a Gemma-3-4B-shaped layer pattern (34 layers, one global in six, 1,024-token windows).

(1) The engine itself: one request 32,768 tokens long (prompt + 16 generated) on a model with Gemma-3-4B's layer
    pattern and window but tiny widths (KV blocks do not depend on widths), with the hybrid layout and without.
    Blocks held per group while it decodes at the end of its length, and the most each group held at any step
    (2,048-token prefill chunks: a chunk's K/V and the window behind it are all read in its step), turned into
    bytes at Gemma-3-4B's real KV shape (4 KV heads x 256, bf16), against the window arithmetic: full-layout
    bytes x (global layers + sliding layers x window / length) / layers.
(2) The seed's question at Gemma-3-4B's real KV shape: how many 16k-token requests (16,384-token prompts, 64
    generated) run at once in a 2 GiB pool (and 4 GiB). The engine's own Scheduler and BlockManager (no torch)
    step the requests with stand-in tokens; the figure is the peak of running requests.

Run: .venv/bin/python benchmarks/hybrid_kv.py   (about two minutes on 2 cores)
"""

from __future__ import annotations

import random
import tempfile
import time

import torch
import transformers

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.kv_spec import KVSpec, plan_kv_layout
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.llm_engine import LLMEngine

LAYERS, WINDOW, PATTERN = 34, 1024, 6
KV_HEADS, HEAD_DIM, ELEM = 4, 256, 2  # Gemma-3-4B, bf16
BLOCK = 16
LAYER_TOKEN_BYTES = 2 * KV_HEADS * HEAD_DIM * ELEM
SPECS = [KVSpec(KV_HEADS, HEAD_DIM, None if (i + 1) % PATTERN == 0 else WINDOW) for i in range(LAYERS)]


def tiny_gemma3(path: str) -> None:
    cfg = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=1,
        num_key_value_heads=1, head_dim=16, sliding_window=WINDOW, max_position_embeddings=40960,
        layer_types=["full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(LAYERS)])
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(cfg).save_pretrained(path)


def engine_run(path: str, hybrid: bool, length: int) -> tuple[list[int], list[int], int, float]:
    e = LLMEngine(EngineConfig(model=path, dtype="float32", block_size=BLOCK, num_kv_blocks=2 * length // BLOCK * 8,
                               max_model_len=length, max_num_batched_tokens=2048, hybrid_kv_cache=hybrid))
    rng = random.Random(0)
    prompt = [rng.randrange(3, 256) for _ in range(length - 16)]
    e.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    t0 = time.perf_counter()
    peak = [0] * len(e.block_manager.windows)
    while e.has_unfinished_requests():
        e.step()
        now = e.block_manager.blocks_by_group()
        peak = [max(a, b) for a, b in zip(peak, now)]
        if e.has_unfinished_requests():
            held = now  # decoding at the end of its length
    return held, peak, e.runner.layout.num_slots, time.perf_counter() - t0


def peak_running(pool_bytes: int, hybrid: bool, n: int = 16, prompt: int = 16384, out: int = 64) -> tuple[int, int]:
    layout = plan_kv_layout(SPECS, hybrid)
    num_blocks = pool_bytes // (BLOCK * layout.num_slots * LAYER_TOKEN_BYTES)
    bm = BlockManager(num_blocks, BLOCK, True, layout.windows)
    sc = Scheduler(bm, 256, 2048, 32768)
    rng = random.Random(0)
    for i in range(n):
        req = Request(f"r{i}", [rng.randrange(1 << 20) for _ in range(prompt)],
                      SamplingParams(max_tokens=out, ignore_eos=True))
        try:
            sc.add_request(req)
        except ValueError:
            return 0, num_blocks  # one request needs more than the whole pool
    peak = 0
    while sc.running or sc.waiting:
        step = sc.schedule()
        peak = max(peak, sum(1 for s in step.scheduled if s.request.output_token_ids or s.completes))
        sc.update(step, {s.request.request_id: [7] for s in step.scheduled if s.completes})
        for r in list(sc.running):
            if len(r.output_token_ids) >= out:
                sc.finish(r, RequestStatus.FINISHED_LENGTH)
    return peak, num_blocks


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        tiny_gemma3(d)
        length = 32768
        full_bytes = length * LAYERS * LAYER_TOKEN_BYTES
        arithmetic = full_bytes * (LAYERS // PATTERN + (LAYERS - LAYERS // PATTERN) * WINDOW / length) / LAYERS
        print(f"(1) one request of {length} tokens, Gemma-3-4B layer pattern; bytes at its real KV shape (bf16)")
        print(f"    window arithmetic: {arithmetic / 2**20:.0f} MiB; every layer every token: {full_bytes / 2**20:.0f} MiB")
        for hybrid in (True, False):
            held, peak, slots, secs = engine_run(d, hybrid, length)
            page = BLOCK * slots * LAYER_TOKEN_BYTES
            print(f"    hybrid={hybrid!s:5} ({slots}-layer pages, {secs:.0f} s):")
            for what, blocks in (("held decoding at 32k", held), ("peak (a 2,048-token prefill chunk)", peak)):
                total = sum(blocks) * page
                print(f"      {what:36} blocks by group {blocks} = {total / 2**20:.0f} MiB = "
                      f"{total / arithmetic:.2f}x the arithmetic, {total / full_bytes:.3f}x every-token")
    print("(2) 16 requests of 16,384 prompt + 64 generated tokens, Gemma-3-4B KV shape (bf16): peak running at once")
    for gib in (2, 4):
        runs = {h: peak_running(gib * 2**30, h) for h in (False, True)}
        print(f"    {gib} GiB pool: full layout {runs[False][0]} ({runs[False][1]} blocks), "
              f"hybrid {runs[True][0]} ({runs[True][1]} blocks)")


if __name__ == "__main__":
    main()
