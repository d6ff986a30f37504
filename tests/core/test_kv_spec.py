"""Each layer's KV spec, as the model declares it, drives sizing and the runner's caches."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.core.kv_spec import MAX_GROUPS, KVGroup, KVSpec, group_layers, pages_per_kind, plan_kv_layout


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


def _bf16_parts(spec: KVSpec) -> tuple[int, int]:
    """K and V bytes of one 16-token block in bf16."""
    return (16 * spec.num_kv_heads * spec.head_dim * 2,) * 2


def test_gemma3_layers_make_one_full_group_and_window_groups_of_its_size() -> None:
    full, window = KVSpec(4, 256), KVSpec(4, 256, 1024)
    specs = [full if (i + 1) % 6 == 0 else window for i in range(34)]  # Gemma-3-4B: 5 global of 34
    layout = plan_kv_layout(specs)
    assert [(g.sliding_window, len(g.layers), g.per_page) for g in layout.groups] == \
        [(None, 5, 1)] + [(1024, 5, 1)] * 5 + [(1024, 4, 1)]
    assert layout.num_slots == 5 and not layout.packed and layout.views == [(g, 0) for g in range(7)]
    assert layout.groups[0].layers == (5, 11, 17, 23, 29)


def test_smaller_pages_pack_into_the_largest_kinds_pages() -> None:
    """Gemma-4-E4B-shaped: sliding layers' heads are half the global ones', two of them fill a page."""
    glob, window = KVSpec(2, 512), KVSpec(2, 256, 512)
    specs = [glob if (i + 1) % 6 == 0 else window for i in range(42)]
    assert plan_kv_layout(specs).groups == (KVGroup(None, tuple(i for i, s in enumerate(specs) if s is not None)),)
    layout = plan_kv_layout(specs, page_parts=_bf16_parts)
    assert [(g.sliding_window, len(g.layers), g.per_page) for g in layout.groups] == \
        [(None, 7, 1), (512, 14, 2), (512, 14, 2), (512, 7, 2)]
    assert layout.num_slots == 7 and layout.packed
    assert layout.views == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    first = layout.groups[1].layers  # 0, 1, 2, 3, 4, 6, ...: slot k // 2, part k % 2
    assert [(layout.slot_of_layer[i], layout.part_of_layer[i]) for i in first[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert layout.view_of_layer(first[1]) == 2 and layout.view_of_layer(5) == 0
    assert layout.slot_specs(specs) == [glob] * 7  # the page: one global layer's block
    assert layout.slot_kinds(specs)[0] == {glob: 1, window: 2}


def test_the_slot_count_keeps_full_attention_pages_full() -> None:
    """Gemma-4-31B-shaped: global layers' pages are half the sliding ones' (4 KV heads of 512 against 16 of 256).
    Ten global layers fill five slots' pages exactly; eight slots (fewer groups) would leave 3 of 8 pages of
    every token's block empty."""
    glob, window = KVSpec(4, 512), KVSpec(16, 256, 1024)
    specs = [glob if (i + 1) % 6 == 0 else window for i in range(60)]
    layout = plan_kv_layout(specs, page_parts=_bf16_parts)
    assert [(g.sliding_window, len(g.layers), g.per_page) for g in layout.groups] == \
        [(None, 10, 2)] + [(1024, 5, 1)] * 10
    assert layout.num_slots == 5 and len(layout.groups) <= MAX_GROUPS


def test_pages_that_do_not_divide_keep_one_group() -> None:
    """Per-head scales kept in the page: K and V halve with the head size but the scales do not, so no whole ratio
    fills a page (FP8KVCache keeps its scales apart, OWN_POOLS, for this reason)."""
    glob, window = KVSpec(2, 512), KVSpec(2, 256, 512)

    def fp8(spec: KVSpec) -> tuple[int, ...]:
        return (16 * spec.num_kv_heads * spec.head_dim,) * 2 + (16 * spec.num_kv_heads * 2,) * 2

    specs = [glob, window, window, None]
    layout = plan_kv_layout(specs, page_parts=fp8)
    assert layout.groups == (KVGroup(None, (0, 1, 2)),) and layout.group_of_layer == (0, 0, 0, -1)
    assert pages_per_kind([glob, window], fp8) is None
    assert pages_per_kind([glob, window], _bf16_parts) == {glob: 1, window: 2}


def test_layers_of_a_smaller_shape_keep_their_blocks_in_the_pages_of_a_larger(tiny_models) -> None:
    """gemma4-moe: sliding layers of 16-value heads, two a page of a global layer's 32-value heads. Two global
    layers: two slots; the two sliding layers fill slot 0's page."""
    engine = LLM(tiny_models["gemma4-moe"][0], dtype="float32", num_kv_blocks=16, block_size=4).engine
    runner, layout = engine.runner, engine.runner.layout
    assert [(g.sliding_window, g.per_page) for g in layout.groups] == [(None, 1), (24, 2)]
    assert [tuple(c.k.shape) for c in runner.slot_caches] == [(16, 4, 2, 32)] * 2
    host = runner.slot_caches[0]
    for i, spec in enumerate(runner.model.kv_specs()):
        cache = runner.caches[i]
        if spec.sliding_window is None:
            assert cache is runner.slot_caches[layout.slot_of_layer[i]]
        else:  # 32 blocks of its shape over the same bytes
            assert tuple(cache.k.shape) == (32, 4, 2, 16) and cache.k.data_ptr() == host.k.data_ptr()
            assert cache.v.untyped_storage().data_ptr() == host.v.untyped_storage().data_ptr()
    assert engine.bytes_per_block == 2 * 4 * 2 * 2 * 32 * 4  # two pages of a global layer's K and V, fp32


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3", "bfloat16"])
@pytest.mark.parametrize("arch", ["gemma4", "gemma4-moe", "gemma3"])
def test_the_pool_allocates_what_sizing_counted(tiny_models, arch, kv_dtype) -> None:
    """Every byte the caches hold (pages shared once, fp8 scales kept apart counted too) is what the budget paid."""
    engine = LLM(tiny_models[arch][0], dtype="float32", num_kv_blocks=16, block_size=4, kv_cache_dtype=kv_dtype).engine
    storages = {}
    for cache in engine.runner.caches:
        if cache is not None:
            for t in cache.pools():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert sum(storages.values()) == 16 * engine.bytes_per_block
