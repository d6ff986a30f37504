"""HF transformers as the oracle: logits and greedy continuations must match."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import full_layout_kv_memory
from helpers import hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.core.request import Request
from pagedllm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedllm.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow  # engines end to end: the full suite, not the fast tier

ARCHS = ["llama", "llama3-rope", "qwen2", "mistral", "qwen3", "phi3", "phi4-mini", "gemma3", "gemma4", "gemma4-moe",
         "mixtral", "qwen3-moe", "olmoe", "gpt-oss", "qwen3.5", "qwen3.5-moe"]
PROMPT_LENS = [1, 7, 16, 17, 60, 129, 250, 300]


def prompts_for(vocab: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_refs(tiny_models):
    refs = {}
    for arch in ARCHS:
        _, model = tiny_models[arch]
        refs[arch] = [hf_greedy(model, p, 32) for p in prompts_for(model.config.vocab_size)]
    return refs


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_hf(tiny_models, arch):
    path, model = tiny_models[arch]
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=256, block_size=16, dtype="float32"))
    prompt = prompts_for(model.config.vocab_size)[6]  # 250 tokens: crosses the sliding window
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]  # [T, V]
    req = Request("r", prompt, SamplingParams(max_tokens=1), state_slot=0)  # slot 0: linear-attention layers' state
    engine.block_manager.allocate_slots("r", prompt, 0, len(prompt))
    # the whole prompt in one step: the last row's logits (chunked starts are tested below)
    out = SchedulerOutput([ScheduledRequest(req, len(prompt))])
    res = engine.runner.execute(out, engine.block_manager.group_tables)
    assert (res.logits[0] - ref[-1]).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("use_op", [True, False])
def test_chunked_prefill_logits_match_hf(tiny_models, arch, use_op):
    """A prefill chunk that starts mid-sequence attends causally to the cached blocks."""
    path, model = tiny_models[arch]
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=256, block_size=16, dtype="float32"))
    if not use_op:
        engine.runner.op = None
    else:
        assert engine.runner.op is not None  # the C++ op builds on this machine
    prompt = prompts_for(model.config.vocab_size)[7]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    req = Request("r", prompt, SamplingParams(max_tokens=1), state_slot=0)
    done = 0
    for chunk in (37, 100, 1, 90, 72):
        engine.block_manager.allocate_slots("r", prompt, done, chunk)
        req.num_computed_tokens = done
        req.output_token_ids = []
        # sample row = last token of the chunk (force it by pretending the prompt ends there)
        req.prompt_token_ids = prompt[:done + chunk]
        res = engine.runner.execute(SchedulerOutput([ScheduledRequest(req, chunk)]), engine.block_manager.group_tables)
        assert (res.logits[0] - ref[done + chunk - 1]).abs().max().item() < 1e-4, (arch, done, chunk)
        done += chunk
    assert done == len(prompt)


@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_together_and_alone(tiny_models, hf_refs, arch, block_size):
    path, model = tiny_models[arch]
    prompts = prompts_for(model.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM(model=path, block_size=block_size, kv_cache_memory="64MiB", max_num_batched_tokens=512, dtype="float32")
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in together] == hf_refs[arch]
    if block_size == 16:
        alone = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]
        assert alone == hf_refs[arch]
        # the pure-torch attention path (used without the C++ op, for fp8 and bf16) agrees too
        llm.engine.runner.op = None
        together = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in together] == hf_refs[arch]
        # and so do the pure-torch norm / rope / activation / linear paths (no C++ ops at all, so prompts go to
        # SDPA as the torch backend's metadata sends them, not to the chunk kernel)
        llm.engine.runner.chunk_op = False
        llm.engine.runner.model.set_ops(None)
        together = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in together] == hf_refs[arch]
    stats = llm.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_through_preemption_prefix_hits_and_n2(tiny_models, arch):
    """A pool too small for the batch (preemption, recompute), a shared prefix (cache hits), small chunks and
    two samples a prompt: every greedy continuation is still HF's."""
    path, model = tiny_models[arch]
    rng = random.Random(3)
    shared = [rng.randrange(model.config.vocab_size) for _ in range(12)]
    prompts = [shared + [rng.randrange(model.config.vocab_size) for _ in range(rng.randint(3, 30))] for _ in range(6)]
    refs = [hf_greedy(model, p, 20) for p in prompts]
    llm = LLM(model=path, dtype="float32", block_size=4, kv_cache_memory=full_layout_kv_memory(model.config, 48, 4),
              max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2)
    first = llm.generate({"prompt_token_ids": prompts[0]}, params)  # computed first: the others hit its prefix
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
    assert [[c.token_ids for c in o.outputs] for o in first + rest] == [[r, r] for r in refs]
    st = llm.stats()
    # a model with linear-attention layers keeps no prefix cache (its state is not kept at block boundaries)
    stateful = getattr(llm.engine.runner.model, "has_state", False)
    assert st.num_preemptions > 0 and (st.prefix_cache_hits > 0) != stateful


def test_packed_weights_keep_the_model_shape_accounting(tiny_models):
    """With the C++ ops the linears hold panel-packed copies; counts and the torch path survive it."""
    path, hf = tiny_models["llama"]
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=16, block_size=16, dtype="float32"))
    model = engine.runner.model
    assert model.ops is not None and model.layers[0].qkv_proj.weight.numel() == 0
    hf_linear = sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Linear))
    assert model.matmul_params() == hf_linear
    model.set_ops(None)  # unpacked back to [out, in], bit for bit
    q, k = hf.model.layers[0].self_attn.q_proj.weight, hf.model.layers[0].self_attn.k_proj.weight
    assert model.layers[0].qkv_proj.weight.shape == (q.shape[0] + 2 * k.shape[0], q.shape[1])
    assert torch.equal(model.layers[0].qkv_proj.weight[:q.shape[0]], q.detach())
