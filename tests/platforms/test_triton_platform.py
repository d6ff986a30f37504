"""The Triton platform end to end: the engine on the Triton kernels (Triton's interpreter here, on CPU tensors)
gives the C++ kernels' greedy tokens in fp32 (HF's, by the model tests), through chunked prompts, decodes, prefix
hits, sliding windows, sinks and hybrid layouts; the options that choose it are checked before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.errors import ConfigError, ModelLoadError

pytest.importorskip("triton")

PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 30)]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
OPTS = dict(dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=16, device="cpu")


def _tokens(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def _families():
    fast = ["llama"]
    slow = ["gemma3", "gemma4", "gpt-oss", "qwen3.5", "mixtral", "phi4-mini"]
    return fast + [pytest.param(a, marks=pytest.mark.slow) for a in slow]


@pytest.mark.parametrize("arch", _families())
def test_the_triton_kernels_give_the_cpu_kernels_tokens(tiny_models, arch):
    path, _ = tiny_models[arch]
    want = _tokens(LLM(model=path, **OPTS))
    llm = LLM(model=path, attention_backend="triton", **OPTS)
    assert type(llm.engine.runner.model.backend).__name__ == "TritonKernels"
    assert llm.engine.runner.attn.all_rows
    # the second round hits the prefix cache: its prompts' first blocks are read from the pool
    assert _tokens(llm) == want
    assert _tokens(llm) == want


def test_an_fp8_pool_reads_the_same_bytes_on_both_backends(llama_dir):
    """fp8 blocks are written byte for byte as kv_quant writes them, so the torch reference over them and the
    kernels pick the same tokens."""
    ref = LLM(model=llama_dir, kv_cache_dtype="fp8_e4m3", attention_backend="torch", **OPTS)
    tri = LLM(model=llama_dir, kv_cache_dtype="fp8_e4m3", attention_backend="triton", **OPTS)
    assert _tokens(tri) == _tokens(ref)
    a, b = ref.engine.runner.slot_caches[0], tri.engine.runner.slot_caches[0]
    assert torch.equal(a.k.view(torch.uint8), b.k.view(torch.uint8))
    assert torch.equal(a.k_scale, b.k_scale)


def test_a_pool_the_kernels_do_not_read_takes_the_reference_path(tmp_path):
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=320, hidden_size=64,
               intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               max_position_embeddings=1024, rms_norm_eps=1e-6)  # heads of 32: whole q8_0 blocks
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    opts = dict(OPTS, model=str(tmp_path), load_format="dummy", kv_cache_dtype="q8_0")
    ref = LLM(attention_backend="torch", **opts)
    tri = LLM(attention_backend="triton", **opts)
    assert not tri.engine.runner.attn.all_rows
    assert _tokens(tri) == _tokens(ref)


def test_backend_and_format_options_are_checked_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ConfigError, match="load_format must be"):
        EngineConfig(load_format="pt")
    with pytest.raises(ConfigError, match="tensor parallelism runs the CPU's kernels"):
        EngineConfig(attention_backend="triton", tensor_parallel_size=2)
    if not torch.cuda.is_available():
        assert EngineConfig().device == "cpu"  # auto: no GPU here


def test_dummy_weights_need_only_the_config(tmp_path, llama_dir):
    cfg = json.loads((Path(llama_dir) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    runs = [_tokens(LLM(model=str(tmp_path), load_format="dummy", attention_backend=b, **OPTS)) for b in
            ("auto", "triton")]
    assert runs[0] == runs[1]  # the same random weights (seeded) on either backend
    assert all(len(t) == 8 for t in runs[0])
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        LLM(load_format="dummy", **OPTS)  # the embedded default model is a GGUF


def test_the_profiling_forward_runs_the_largest_step(llama_dir):
    from pagedllm.model_executor.model_runner import profile_forward

    llm = LLM(model=llama_dir, **OPTS)
    profile_forward(llm.engine.runner.model, 64, 5, 16)  # 5 sequences of 12-13 tokens, each sampling
    assert _tokens(llm)  # the engine's own pool is untouched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_kv_budget_leaves_room_for_the_weights_and_activations(llama_dir):
    free, total = torch.cuda.mem_get_info()
    llm = LLM(model=llama_dir, dtype="float32", device="cuda", memory_utilization=0.5)
    pool = sum(t.nbytes for c in llm.engine.runner.slot_caches for t in c.pools())
    assert pool <= 0.5 * total - (total - free)


def test_decode_steps_through_the_graphs_static_buffers_give_the_same_tokens(llama_dir):
    """What a CUDA graph replays (static buffers, a bucket's padded rows that write nowhere), run eagerly here:
    the same tokens as the eager steps, and decode steps took that path."""
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 30, 12)]  # 3 decodes: bucket 4, 1 padded
    want = _tokens(LLM(model=llama_dir, attention_backend="triton", **OPTS), prompts)
    llm = LLM(model=llama_dir, attention_backend="triton", **OPTS)
    runner = llm.engine.runner
    assert runner.use_decode_graphs(5, 256, capture=False)
    assert runner.graphs.buckets == [1, 2, 4, 5]
    calls = []
    run = runner.graphs.run
    runner.graphs.run = lambda *a: calls.append(len(a[0])) or run(*a)
    assert _tokens(llm, prompts) == want
    assert 3 in calls


def test_graph_buckets_cover_every_batch_size():
    from pagedllm.model_executor.cuda_graphs import buckets

    b = buckets(256)
    assert b[:6] == [1, 2, 4, 8, 16, 24] and b[-1] == 256 and b == sorted(set(b))
    assert all(any(x >= n for x in b) for n in range(1, 257))
    assert buckets(1) == [1] and buckets(3) == [1, 2, 3]
