"""Tensor parallelism at TP=2 (gloo, two processes of one thread each) against TP=1."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
from conftest import full_layout_kv_memory

from pagedllm import LLM, ConfigError, SamplingParams
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.kv_spec import NULL_BLOCK
from pagedllm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedllm.executor.tp import StepPlan, TPDriver, WorkerDiedError, apply_tables

pytestmark = pytest.mark.slow  # end to end: server processes, peers, workers, the default model

OPTIONS = dict(dtype="float32", num_threads=1, block_size=4, max_num_batched_tokens=24)


def _prompts(seed: int) -> list[dict]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 320) for _ in range(12)]  # 3 blocks every prompt shares: prefix hits
    return [{"prompt_token_ids": shared + [rng.randrange(3, 320) for _ in range(rng.randint(3, 30))]}
            for _ in range(6)]


def _run(llm: LLM, seed: int) -> list[list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2)
    first = llm.generate(_prompts(seed)[:1], params)  # computed first: the others hit its prefix
    rest = llm.generate(_prompts(seed)[1:], params)
    return [[c.token_ids for c in o.outputs] for o in first + rest]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "phi3", "phi4-mini", "gemma3", "mixtral", "qwen3-moe",
                                  "gpt-oss", "olmoe", "gemma4-tp", "gemma4-moe", "qwen3.5",
                                  "qwen3.5-moe-gguf"])
def test_tp2_greedy_equals_tp1_with_chunking_prefix_hits_and_preemption(tiny_models, arch):
    """qwen3.5: grouped 2 key / 4 value DeltaNet heads, each rank one key head; qwen3.5-moe-gguf: the same heads
    on a MoE with a shared expert. Their recurrent state is not a prefix-cacheable block, so no hits there."""
    path, hf = tiny_models[arch]
    stateful = arch.startswith("qwen3.5")
    options = dict(OPTIONS, kv_cache_memory=full_layout_kv_memory(hf.config, 48, 4))  # small enough to preempt
    base = LLM(path, **options)
    expected = _run(base, 1)
    assert base.stats().num_preemptions > 0 and (stateful or base.stats().prefix_cache_hits > 0)  # exercised
    with LLM(path, tensor_parallel_size=2, **options) as tp:
        assert _run(tp, 1) == expected
        st = tp.stats()
        assert st.num_preemptions > 0 and (stateful or st.prefix_cache_hits > 0)
        runner = tp.engine.runner
        kv = next(c for c in runner.caches if hasattr(c, "k"))
        assert kv.k.shape[2] == 1  # each rank holds 1 of the 2 KV heads
        if stateful:  # and half the DeltaNet's value heads' states
            assert runner.state_caches[0].recurrent.shape[1] == hf.config.linear_num_value_heads // 2


def test_plan_diffs_rebuild_the_drivers_tables():
    """What the workers reconstruct equals the driver's state after appends, copy-on-write, rollback, frees,
    in a full-attention group and a sliding-window group (whose blocks leave its window)."""
    bm = BlockManager(num_blocks=32, block_size=2, windows=(None, 3))
    driver = TPDriver.__new__(TPDriver)  # only its diffing, no processes
    driver._sent = {}
    sent: list[StepPlan] = []
    driver._send = sent.append
    worker: list[dict[str, list[int]]] = [{}, {}]

    class Req:
        def __init__(self, rid: str, toks: list[int]) -> None:
            self.request_id, self.toks, self.num_computed_tokens = rid, toks, 0
            self.num_prompt_tokens = len(toks)
            self.state_slot = None

        @property
        def num_tokens(self) -> int:
            return len(self.toks)

        def tokens_slice(self, a: int, b: int) -> list[int]:
            return self.toks[a:b]

    a = Req("a", [1, 2, 3])
    bm.allocate_slots("a", a.toks, 0, 3)
    driver.step(SchedulerOutput([ScheduledRequest(a, 3)]), bm.group_tables, [])
    bm.fork("a", "b")
    b = Req("b", [1, 2, 3, 9])
    b.num_computed_tokens = 3
    copies = bm.allocate_slots("b", b.toks, 3, 1)  # copy-on-write of the shared half block
    driver.step(SchedulerOutput([ScheduledRequest(b, 1)], copies), bm.group_tables, [])
    bm.allocate_slots("a", a.toks + [4, 5, 6, 7, 8], 3, 5)
    bm.truncate("a", 5)  # rolled back
    a.num_computed_tokens = 3
    driver.step(SchedulerOutput([ScheduledRequest(a, 1)]), bm.group_tables, [])
    a.toks, a.num_computed_tokens = [1, 2, 3, 4, 5, 6], 5
    bm.allocate_slots("a", a.toks, 5, 1)  # token 5 reads keys 3..5: block 0 leaves the window
    bm.free("b")
    driver.step(SchedulerOutput([ScheduledRequest(a, 1)]), bm.group_tables, ["b"])
    for plan in sent:
        apply_tables(worker, plan)
    assert worker == [{"a": bm.group_tables[0]["a"]}, {"a": bm.group_tables[1]["a"]}] and sent[1].copies == copies
    assert worker[1]["a"][0] == NULL_BLOCK  # the window's release reached the worker too
    rebuilt = sent[1].work[0]  # what the worker's runner reads of the request
    assert (rebuilt.token_ids, rebuilt.completes) == ([9], True)


def test_divisibility_is_a_clear_startup_error(tiny_models):
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 does not divide the model's num_attention_heads"):
        LLM(tiny_models["llama"][0], tensor_parallel_size=3)


def test_a_layer_kind_whose_kv_heads_do_not_cut_is_a_startup_error(tiny_models):
    with pytest.raises(ConfigError, match=r"a layer's num_key_value_heads \(1\)"):  # Gemma 4's one global KV head
        LLM(tiny_models["gemma4"][0], tensor_parallel_size=2)


def test_each_rank_takes_its_share_of_the_cores(tiny_models, monkeypatch):
    """The driver's threads are its share too (its default of every core put two compute threads on the core a
    worker runs on); one rank a node under torchrun takes every core of its node."""
    import torch

    from pagedllm.config import EngineConfig
    from pagedllm.executor.tp import threads_per_rank

    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    with LLM(tiny_models["llama"][0], tensor_parallel_size=2, dtype="float32") as tp:
        assert torch.get_num_threads() == max(1, cores // 2)
        assert tp.generate(_prompts(3)[:1], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    assert torch.get_num_threads() == before  # the process's count again after shutdown
    config = EngineConfig(model=tiny_models["llama"][0])
    assert threads_per_rank(config, 4) == max(1, cores // 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert threads_per_rank(config, 4) == cores
    config.num_threads = 3
    assert threads_per_rank(config, 4) == 3


def test_a_killed_worker_fails_the_step_and_the_engine_shuts_down(tiny_models):
    llm = LLM(tiny_models["llama"][0], tensor_parallel_size=2, **OPTIONS)
    try:
        llm.generate(_prompts(2)[:2], SamplingParams(max_tokens=4))
        (worker,) = llm.engine.executor.driver.procs
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=f"pid {worker.pid}"):  # found by the liveness check
            llm.generate(_prompts(2)[:1], SamplingParams(max_tokens=4))
        print(f"detected in {time.monotonic() - t0:.3f} s")
    finally:
        llm.shutdown()
    assert llm.engine.executor.driver.closed


def test_server_fails_requests_and_exits_1_when_a_worker_dies(tiny_models):
    from pathlib import Path

    import httpx
    from helpers import Server

    srv = Server(tiny_models["llama"][0], "--tensor-parallel-size", "2", "--dtype", "float32")
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        children = [int(p) for t in Path(f"/proc/{srv.proc.pid}/task").iterdir()  # the engine starts in a thread
                    for p in (t / "children").read_text().split()]
        workers = [p for p in children if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
        assert r.status_code >= 500 and "worker" in r.text, r.text
        assert srv.proc.wait(timeout=60) == 1  # it shut itself down
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


@pytest.mark.parametrize(("shape", "qtype"), [("tiny", "Q8_0"), ("tiny", "Q4_1"), ("tiny", "Q6_K"),
                                             ("tiny-qwen3.5", "Q8_0")])
def test_tp2_runs_a_gguf_in_its_own_formats_sharded_along_whole_blocks(tmp_path, shape, qtype):
    """tiny-qwen3.5: llama.cpp's tiled DeltaNet heads (16 key, 32 value): each rank keeps all 16 key heads."""
    from pagedllm.bench.random_gguf import SHAPES, write_random_gguf

    path = str(write_random_gguf(tmp_path / f"{qtype}.gguf", SHAPES[shape], qtype, seed=1, std=0.08))
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(320) for _ in range(rng.randint(5, 40))]} for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    base = LLM(path, dtype="float32", num_threads=1)
    expected = [o.outputs[0] for o in base.generate(prompts, params)]
    with LLM(path, dtype="float32", num_threads=1, tensor_parallel_size=2) as tp:
        assert qtype.lower() in tp.engine.runner.model.weight_format  # blocks, not a dequantized copy
        got = [o.outputs[0] for o in tp.generate(prompts, params)]
    # Not the same bits: the row-parallel sums add in another order, and that fp32 noise flips a rounding of
    # an activation to int8 (the decode dot) or bf16 (the prefill panels) now and then, a step that this random
    # model (std 0.08) carries to the logits: measured up to 0.026 on a chosen token's logprob on a Zen 3 (Q8_0).
    # Q6_K's row-parallel halves (128 inputs) are not whole 256-weight blocks, so they run dequantized, without
    # rounding activations at all: up to 0.063 from TP=1's rounding. A block sharded wrongly is off by whole
    # units. So: each token's logprob within 0.1 of the base's, and the same tokens but where the base's top two
    # are closer than that (a near-tie either may break: the texts part there).
    compared = 0
    for a, b in zip(expected, got):
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            top = sorted((lp.logprob for lp in a.logprobs[i].values()), reverse=True)
            if ta != tb:
                assert top[0] - top[1] < 0.1, (i, ta, tb, top)
                break
            assert abs(a.logprobs[i][ta].logprob - b.logprobs[i][tb].logprob) < 0.1, (i, ta)
            compared += 1
    assert compared >= 48  # most of the 96 tokens (the texts part rarely)


def test_tp3_on_the_default_model_is_tp1_within_the_formats_tolerance(int8_decode):
    """SmolLM2's Q4_1 / Q8_0 blocks at TP=3: the row-parallel sums add in another order, and the prefill
    kernels round activations to bf16, which turns that fp32 noise into bf16 steps (a value near a rounding
    boundary flips). So not the same bits, but the same answer: first-token logprobs within 1e-2 (measured
    ~1e-3) and the same greedy tokens here. Where decode steps take int8 activations (AVX2: ggml's arithmetic), a
    flip moves a value by half a step of 1/127 of its block's max, and the 10 tokens part ways after a few (at
    the sixth on a Zen 3); the prompt's rows are fp32 panels there, so the first token still agrees."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0)
    with LLM(num_threads=1) as one:
        base = one.generate(prompts, params)
    with LLM(num_threads=1, tensor_parallel_size=3) as tp:
        outs = tp.generate(prompts, params)
    for a, b in zip(base, outs):
        ca, cb = a.outputs[0], b.outputs[0]
        assert cb.token_ids[:1] == ca.token_ids[:1] if int8_decode else cb.token_ids == ca.token_ids
        first = ca.token_ids[0]
        assert abs(ca.logprobs[0][first].logprob - cb.logprobs[0][first].logprob) < 1e-2
