"""The hybrid KV layout end to end: sliding-window layers hold their window, outputs do not change."""

from __future__ import annotations

import random

import pytest
from conftest import full_layout_kv_memory
from helpers import hf_greedy

from pagedllm import LLM, ConfigError, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine


@pytest.mark.parametrize("arch", ["gemma3", "gpt-oss", "gemma4", "gemma4-moe"])
def test_a_long_request_holds_only_the_window_in_sliding_groups(tiny_models, arch):
    """Gemma 4's layers of two shapes too: its sliding layers' blocks live in pages of the global layers' bytes."""
    path, hf = tiny_models[arch]
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", block_size=4, num_kv_blocks=4096,
                                    max_num_batched_tokens=32))
    bm, window = engine.block_manager, hf.config.sliding_window
    assert bm.windows[0] is None and set(bm.windows[1:]) == {window}
    rng = random.Random(0)
    prompt = [rng.randrange(3, hf.config.vocab_size) for _ in range(150)]
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    peak = [0] * len(bm.windows)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        peak = [max(p, n) for p, n in zip(peak, bm.blocks_by_group())]
    # the full group every token's block; a window group what a 32-token chunk and the window behind it span
    assert peak[0] == -(-(150 + 29) // 4)
    assert all(p <= -(-(window - 1 + 32) // 4) + 1 for p in peak[1:])
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 30)
    assert bm.num_used_blocks == 0


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_the_same_memory_serves_more_requests_with_the_same_tokens(tiny_models, arch):
    """Prompts of several windows in a pool of two full-layout requests' bytes: the hybrid layout runs more of
    them at once (fewer preemptions), and every greedy continuation is the full layout's and HF's."""
    path, hf = tiny_models[arch]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(rng.randint(90, 140))] for _ in range(6)]
    memory = full_layout_kv_memory(hf.config, 2 * 40, 4)  # two 160-token requests, every layer
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {}
    for hybrid in (True, False):
        llm = LLM(model=path, dtype="float32", block_size=4, kv_cache_memory=memory, max_num_batched_tokens=32,
                  hybrid_kv_cache=hybrid)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs[hybrid] = ([o.outputs[0].token_ids for o in outs], llm.stats())
    assert runs[True][0] == runs[False][0] == [hf_greedy(hf, p, 16) for p in prompts]
    hybrid, full = runs[True][1], runs[False][1]
    assert hybrid.peak_num_running > full.peak_num_running and hybrid.num_preemptions < full.num_preemptions


def test_the_kv_map_shows_every_groups_blocks(tiny_models):
    path, hf = tiny_models["gemma3"]
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", block_size=4, num_kv_blocks=1024,
                                    max_num_batched_tokens=32))
    rng = random.Random(2)
    for i in range(3):
        prompt = [rng.randrange(3, hf.config.vocab_size) for _ in range(60 + 10 * i)]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(6):
        engine.step()
    snap = engine.kv_snapshot()
    bm = engine.block_manager
    held = sum(1 for s in snap["pool"]["state"] if s >= 2)
    assert held == sum(bm.blocks_by_group()) == bm.num_used_blocks == sum(snap["stats"]["kv_blocks_by_group"])
    assert [r["blocks"] for r in snap["requests"]] == [bm.num_blocks_of(f"r{i}") for i in range(3)]
    assert all(o >= 0 for o, s in zip(snap["pool"]["owner"], snap["pool"]["state"]) if s >= 2)
    assert snap["stats"]["kv_groups"] == ["full"] + ["sliding_window=24"] * 6


def test_linear_attention_state_is_constant_in_length_and_its_limits_are_clear(tiny_models):
    """Qwen3.5: its linear-attention layers hold one state slot per sequence whatever the length; only the full-
    attention layer holds KV blocks; what a state cannot do (roll back, be shared at a prefix) is refused or off."""
    path, hf = tiny_models["qwen3.5"]
    llm = LLM(model=path, dtype="float32", block_size=4, num_kv_blocks=512, max_num_batched_tokens=64)
    engine = llm.engine
    assert engine.block_manager.windows == [None] and not engine.block_manager.enable_caching
    states = engine.runner.state_caches
    assert len(states) == 3 and engine.runner.caches[2] is engine.runner.slot_caches[0]  # layer 2 keeps KV
    bytes_per_slot = sum(c.conv[0].nbytes + c.recurrent[0].nbytes for c in states)
    assert bytes_per_slot == engine.runner.model.state_bytes_per_seq()
    rng = random.Random(3)
    for length in (20, 400):
        prompt = [rng.randrange(3, hf.config.vocab_size) for _ in range(length)]
        engine.add_request(str(length), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        while engine.has_unfinished_requests():
            out = engine.step()
            if engine.has_unfinished_requests():  # while it runs: one slot of state, KV blocks of one layer
                assert engine.scheduler.state_slots.num_free == engine.scheduler.state_slots.num_slots - 1
        assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 8)
    with pytest.raises(ConfigError, match="speculative decoding is not supported"):
        LLM(model=path, dtype="float32", num_kv_blocks=64,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "bfloat16"])
def test_packed_pages_give_the_full_layouts_tokens(tiny_models, kv_dtype):
    """gemma4-moe keeps two sliding layers' blocks a page (fp8: their per-head scales apart). Through preemption,
    prefix hits and n = 2 (copy-on-write of shared blocks, scales included), every continuation is the one the
    full layout gives in the same format."""
    path, hf = tiny_models["gemma4-moe"]
    rng = random.Random(4)
    shared = [rng.randrange(3, hf.config.vocab_size) for _ in range(14)]
    prompts = [shared + [rng.randrange(3, hf.config.vocab_size) for _ in range(rng.randint(20, 40))] for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
    runs = {}
    for hybrid in (True, False):
        llm = LLM(model=path, dtype="float32", block_size=4, kv_cache_dtype=kv_dtype, hybrid_kv_cache=hybrid,
                  num_kv_blocks=40, max_num_batched_tokens=16)
        assert llm.engine.runner.layout.packed == hybrid
        first = llm.generate({"prompt_token_ids": prompts[0]}, params)  # the others hit its prefix
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
        runs[hybrid] = [[c.token_ids for c in o.outputs] for o in first + rest]
        st = llm.stats()
        assert st.num_preemptions > 0 and st.prefix_cache_hits > 0
    assert runs[True] == runs[False]
