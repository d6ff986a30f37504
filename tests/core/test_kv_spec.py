"""Each layer's KV spec, as the model declares it, drives sizing and the runner's caches."""

from __future__ import annotations

from pagedllm import LLM
from pagedllm.core.kv_spec import KVSpec, group_layers


def test_layers_group_by_spec_in_first_seen_order() -> None:
    full, window = KVSpec(4, 64), KVSpec(4, 64, sliding_window=512)
    specs = [window, window, full, window, window, full]
    assert group_layers(specs) == {window: [0, 1, 3, 4], full: [2, 5]}
    assert (full.kind, window.kind) == ("full", "sliding_window=512")


def test_the_model_declares_its_layers_and_the_pool_follows(tiny_models) -> None:
    llm = LLM(tiny_models["mistral"][0], dtype="float32", num_kv_blocks=16)
    engine = llm.engine
    specs = engine.runner.model.kv_specs()
    cfg = engine.model_config
    assert specs == [KVSpec(cfg.num_kv_heads, cfg.head_dim, 48)] * cfg.num_layers
    assert [tuple(c.k.shape) for c in engine.runner.caches] == [(16, 16, cfg.num_kv_heads, cfg.head_dim)] * cfg.num_layers
    # K and V, fp32, every layer
    assert engine.kv_bytes_per_token == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
