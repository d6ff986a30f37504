"""Hybrid KV on real models' layer patterns: Gemma-3-4B (34 layers, one global in six, 1,024-token windows),
Gemma-4-31B (60 layers, one global in six, 1,024-token windows; sliding layers 16 KV heads x 256, global layers
4 x 512: half the bytes, two of them a page) and Gemma-4-E4B (42 layers, the last 18 reading earlier layers' K/V,
one global in six, 512-token windows; 2 KV heads x 256 sliding, x 512 global: two sliding layers a page).

(1) The engine itself: one request 32,768 tokens long (prompt + 16 generated) on a model with the layer pattern,
    window and page ratios of the shape but tiny widths (KV blocks do not depend on widths), with the hybrid
    layout and without. Blocks held per group while it decodes at the end of its length, and the most each group
    held at any step (2,048-token prefill chunks: a chunk's K/V and the window behind it are all read in its
    step), turned into bytes at the shape's real KV (bf16), against the window arithmetic: global layers x
    length + sliding layers x window.
(2) The seed's question at the real KV shape: how many 16k-token requests (16,384-token prompts, 64 generated)
    run at once in a 2 GiB pool (and 4 and 16 GiB). The engine's own Scheduler and BlockManager (no torch) step the
    requests with stand-in tokens; the figure is the peak of running requests.

Run: .venv/bin/python benchmarks/hybrid_kv.py [--shape gemma3-4b gemma4-31b gemma4-e4b]  (2-4 minutes a shape)
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass

import torch
import transformers

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.kv_spec import KVSpec, plan_kv_layout
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.llm_engine import LLMEngine

BLOCK, ELEM, PATTERN = 16, 2, 6  # bf16; one global layer in six


@dataclass(frozen=True)
class Shape:
    layers: int
    window: int
    sliding: tuple[int, int]  # real (KV heads, head size)
    glob: tuple[int, int]
    tiny_sliding: tuple[int, int]  # the tiny model's, in the same ratio
    tiny_glob: tuple[int, int]
    shared: int = 0  # last layers reading an earlier layer's K/V (Gemma 4)
    k_eq_v: bool = False  # Gemma 4's global layers: v is k (their own KV head count applies only then)

    def specs(self, tiny: bool = False) -> list[KVSpec | None]:
        s, g = (self.tiny_sliding, self.tiny_glob) if tiny else (self.sliding, self.glob)
        return [None if i >= self.layers - self.shared else KVSpec(*g) if (i + 1) % PATTERN == 0
                else KVSpec(*s, self.window) for i in range(self.layers)]


SHAPES = {
    "gemma3-4b": Shape(34, 1024, (4, 256), (4, 256), (1, 16), (1, 16)),
    "gemma4-31b": Shape(60, 1024, (16, 256), (4, 512), (2, 16), (1, 16), k_eq_v=True),
    "gemma4-e4b": Shape(42, 512, (2, 256), (2, 512), (1, 16), (1, 32), shared=18),
}


def token_bytes(spec: KVSpec) -> int:
    return 2 * spec.num_kv_heads * spec.head_dim * ELEM


def page_parts(spec: KVSpec) -> tuple[int, int]:
    return (token_bytes(spec) // 2,) * 2


def tiny_model(name: str, shape: Shape, path: str) -> None:
    types = ["full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(shape.layers)]
    (sh, sd), (gh, gd) = shape.tiny_sliding, shape.tiny_glob
    if name.startswith("gemma3"):
        cfg = transformers.Gemma3TextConfig(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=shape.layers, num_attention_heads=sh,
            num_key_value_heads=sh, head_dim=sd, sliding_window=shape.window, max_position_embeddings=40960,
            layer_types=types)
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        cfg = transformers.Gemma4TextConfig(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=shape.layers, num_attention_heads=2,
            num_key_value_heads=sh, head_dim=sd, global_head_dim=gd, num_global_key_value_heads=gh,
            sliding_window=shape.window, max_position_embeddings=40960, layer_types=types,
            num_kv_shared_layers=shape.shared, hidden_size_per_layer_input=0, attention_k_eq_v=shape.k_eq_v)
        model = transformers.Gemma4ForCausalLM(cfg)
    torch.manual_seed(0)
    model.save_pretrained(path)


def engine_run(path: str, hybrid: bool, length: int) -> tuple[list[int], list[int], object, float]:
    e = LLMEngine(EngineConfig(model=path, dtype="float32", block_size=BLOCK, num_kv_blocks=3 * length // BLOCK,
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
    return held, peak, e.runner.layout, time.perf_counter() - t0


def peak_running(shape: Shape, pool_bytes: int, hybrid: bool, n: int = 16, prompt: int = 16384,
                 out: int = 64) -> tuple[int, int]:
    specs = shape.specs()
    layout = plan_kv_layout(specs, hybrid, page_parts)
    num_blocks = pool_bytes // (BLOCK * sum(token_bytes(s) for s in layout.slot_specs(specs)))
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


def run_shape(name: str, shape: Shape) -> None:
    specs = [s for s in shape.specs() if s is not None]
    length = 32768
    full_bytes = length * sum(token_bytes(s) for s in specs)
    arithmetic = sum(token_bytes(s) * (length if s.sliding_window is None else s.sliding_window) for s in specs)
    with tempfile.TemporaryDirectory() as d:
        tiny_model(name, shape, d)
        print(f"{name}: (1) one request of {length} tokens; bytes at the real KV shape (bf16)")
        print(f"    window arithmetic: {arithmetic / 2**20:.0f} MiB; every layer every token: {full_bytes / 2**20:.0f} MiB")
        for hybrid in (True, False):
            held, peak, layout, secs = engine_run(d, hybrid, length)
            real = shape.specs()
            if hybrid and layout != plan_kv_layout(real, True, page_parts):
                raise SystemExit(f"the tiny model's layout is not the real shape's: {layout}")
            page = BLOCK * sum(token_bytes(s) for s in layout.slot_specs(real))
            packing = "/".join(str(g.per_page) for g in layout.groups)
            print(f"    hybrid={hybrid!s:5} ({layout.num_slots} slots a page, layers a slot's page by group {packing}, "
                  f"{secs:.0f} s):")
            for what, blocks in (("held decoding at 32k", held), ("peak (a 2,048-token prefill chunk)", peak)):
                total = sum(blocks) * page
                print(f"      {what:36} blocks by group {blocks} = {total / 2**20:.0f} MiB = "
                      f"{total / arithmetic:.2f}x the arithmetic, {total / full_bytes:.3f}x every-token")
    print(f"{name}: (2) 16 requests of 16,384 prompt + 64 generated tokens, real KV shape (bf16): peak running at once")
    for gib in (2, 4, 16):
        runs = {h: peak_running(shape, gib * 2**30, h) for h in (False, True)}
        print(f"    {gib} GiB pool: full layout {runs[False][0]} ({runs[False][1]} blocks), "
              f"hybrid {runs[True][0]} ({runs[True][1]} blocks)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    for name in ap.parse_args().shape:
        run_shape(name, SHAPES[name])


if __name__ == "__main__":
    main()
