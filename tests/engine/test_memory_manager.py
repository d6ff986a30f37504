"""The memory manager end to end on a tiny model: output neutrality, sharing, preemption."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.tools.workloads import mixed, shared_prefix

pytestmark = pytest.mark.slow  # engines end to end: the full suite, not the fast tier

VOCAB = 320


def run(llm: LLM, items) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": w.prompt_token_ids} for w in items],
                        [SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True) for w in items])
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def items():
    return mixed(12, VOCAB, seed=11, prompt_range=(1, 50), output_range=(4, 40))


@pytest.fixture(scope="module")
def reference(llama_dir, items):
    llm = LLM(model=llama_dir, enable_prefix_caching=False)
    return [run(llm, [w])[0] for w in items]  # one request at a time


@pytest.mark.parametrize("opts", [
    dict(enable_prefix_caching=True),
    dict(max_num_batched_tokens=1),
    dict(max_num_batched_tokens=7),
    dict(max_num_batched_tokens=64),
    dict(enable_chunked_prefill=False),
    dict(num_kv_blocks=24, block_size=4),  # tiny pool: preemption
    dict(max_num_seqs=64, block_size=1),
], ids=str)
def test_outputs_neutral(llama_dir, items, reference, opts):
    llm = LLM(model=llama_dir, **opts)
    assert run(llm, items) == reference
    st = llm.stats()
    assert st.kv_blocks_used == 0
    if "num_kv_blocks" in opts:
        assert st.num_preemptions > 0


def test_shared_prefix_is_stored_once(llama_dir):
    work = shared_prefix(64, VOCAB, seed=2, prefix_len=512, suffix_range=(1, 15), output_range=(4, 4))
    llm = LLM(model=llama_dir, block_size=16, max_num_batched_tokens=8192)
    run(llm, work)
    st = llm.stats()
    assert st.prefix_cache_hits == 63 * 512
    # the prefix's 32 blocks once, plus each request's own blocks: suffix + 3 outputs with KV
    # (the last sampled token never needs KV), 1-2 blocks each
    own = sum(-(-(len(w.prompt_token_ids) + 3 - 512) // 16) for w in work)
    assert st.peak_kv_blocks_used == 32 + own
    assert st.peak_kv_blocks_used < 64 * 32 / 10


def test_n4_shares_prompt_blocks(llama_dir):
    llm = LLM(model=llama_dir, block_size=16)
    out = llm.generate({"prompt_token_ids": list(range(200))},
                       SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True))[0]
    assert len(out.outputs) == 4
    # 12 full prompt blocks once; each sample owns the copied partial block 12 and block 13
    assert llm.stats().peak_kv_blocks_used == 12 + 4 * 2


def test_small_pool_200_requests_none_lost(llama_dir):
    work = mixed(200, VOCAB, seed=4, prompt_range=(5, 40), output_range=(4, 30))
    ref = run(LLM(model=llama_dir), work)
    llm = LLM(model=llama_dir, block_size=8, num_kv_blocks=90)  # ~10 requests' worth
    assert run(llm, work) == ref
    st = llm.stats()
    assert st.kv_blocks_used == 0 and st.num_running == st.num_waiting == 0
    assert st.peak_kv_blocks_used <= 90


def test_mixed_workload_kv_utilization_above_95_percent(llama_dir):
    engine = LLMEngine(EngineConfig(model=llama_dir, block_size=16, num_kv_blocks=4096, enable_prefix_caching=False))
    for i, w in enumerate(mixed(64, VOCAB, seed=0)):
        engine.add_request(str(i), {"prompt_token_ids": w.prompt_token_ids},
                           SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True))
    utils = []
    while engine.has_unfinished_requests():
        engine.step()
        st = engine.stats()
        if st.num_running:
            utils.append((st.kv_utilization, st.kv_blocks_used))
    weighted = sum(u * b for u, b in utils) / sum(b for _, b in utils)
    assert weighted > 0.95, weighted
