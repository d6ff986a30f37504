"""What the engine reports about itself: counters and gauges (`EngineStats`, for `llm.stats()` and
Prometheus) and the KV pool block by block (`kv_snapshot`, for the dashboard)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from ..core.block_manager import BlockManager
from ..core.scheduler import Scheduler
from ..spec_decode.ngram import SpecDecodeCounters
from .kv_offload import OffloadCounters


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached_free: int
    kv_usage: float
    kv_utilization: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    peak_kv_blocks_used: int
    peak_num_running: int
    num_steps: int
    block_size: int
    kv_bytes_per_block: int
    spec_num_drafts: int = 0  # speculative decoding (vLLM's spec_decode counters)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # the KV layout's groups (kv_spec.plan_kv_layout): their attention kind and the blocks each holds now
    kv_groups: list[str] = field(default_factory=list)
    kv_blocks_by_group: list[int] = field(default_factory=list)
    num_loading: int = 0  # requests waiting for the disk tier to read their prefix in
    disk_cache_hits: int = 0  # prompt tokens read from the disk tier (in prefix_cache_hits too)
    # the disk tier's counters (kv_offload.OffloadCounters); empty without one
    kv_offload: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class EngineView:
    """What the reports read of an engine."""

    block_manager: BlockManager
    scheduler: Scheduler
    spec_counters: SpecDecodeCounters
    num_steps: int
    bytes_per_block: int
    model_name: str
    max_model_len: int
    offload: OffloadCounters | None = None


def engine_stats(engine: EngineView, filled: int | None = None, cached_free: int | None = None) -> EngineStats:
    """filled / cached_free: when the caller has them already (kv_snapshot), not counted again."""
    bm, sc, spec = engine.block_manager, engine.scheduler, engine.spec_counters
    used = bm.num_used_blocks
    if filled is None:
        filled = bm.filled_slots({r.request_id: r.num_computed_tokens for r in sc.running})
    c = sc.counters
    return EngineStats(
        num_running=len(sc.running), num_waiting=len(sc.waiting), kv_blocks_total=bm.num_blocks,
        kv_blocks_used=used,
        kv_blocks_cached_free=bm.num_cached_free_blocks if cached_free is None else cached_free,
        kv_usage=used / bm.num_blocks, kv_utilization=filled / (used * bm.block_size) if used else 0.0,
        prefix_cache_queries=c.prefix_cache_queries, prefix_cache_hits=c.prefix_cache_hits,
        num_preemptions=c.num_preemptions, prompt_tokens=c.prompt_tokens,
        generation_tokens=c.generation_tokens, peak_kv_blocks_used=c.peak_kv_blocks_used,
        peak_num_running=c.peak_num_running, num_steps=engine.num_steps, block_size=bm.block_size,
        kv_bytes_per_block=engine.bytes_per_block, spec_num_drafts=spec.num_drafts,
        spec_num_draft_tokens=spec.num_draft_tokens, spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_accepted_per_pos=list(spec.accepted_per_pos),
        kv_groups=["full" if w is None else f"sliding_window={w}" for w in bm.windows],
        kv_blocks_by_group=bm.blocks_by_group(), num_loading=len(sc.loading), disk_cache_hits=c.disk_cache_hits,
        kv_offload=engine.offload.to_dict() if engine.offload is not None else {})


def kv_snapshot(engine: EngineView) -> dict:
    """The KV pool block by block, the live requests, the counters, and what the running requests would
    reserve under static max-length allocation. Built between steps (from the engine's thread)."""
    t0 = time.perf_counter()
    sc, bm = engine.scheduler, engine.block_manager
    bs, max_len = bm.block_size, engine.max_model_len
    reqs = [*sc.running, *sc.waiting.values(), *(r for r, _ in sc.loading.values())]
    pool = bm.snapshot([r.request_id for r in reqs], {r.request_id: r.num_computed_tokens for r in sc.running})
    rows = [{"id": r.request_id, "status": r.status.value, "prompt_tokens": r.num_prompt_tokens,
             "output_tokens": len(r.output_token_ids), "computed_tokens": r.num_computed_tokens,
             "max_tokens": r.max_tokens, "blocks": bm.num_blocks_of(r.request_id),
             "cached_tokens": r.num_cached_tokens, "preemptions": r.num_preemptions, "priority": r.priority}
            for r in reqs]
    # the seed's static serving: each running request holds max_model_len contiguous slots
    # (declared: prompt + max_tokens, what a smarter static server would reserve)
    live = sum(r.num_computed_tokens for r in sc.running)
    reserved = len(sc.running) * max_len
    declared = sum(min(r.max_total_tokens, max_len) for r in sc.running)
    static = {"requests": len(sc.running), "reserved_tokens": reserved, "reserved_blocks": -(-reserved // bs),
              "declared_tokens": declared, "live_tokens": live,
              "wasted_fraction": 1 - live / reserved if reserved else 0.0,
              "declared_wasted_fraction": 1 - live / declared if declared else 0.0}
    return {"time": time.time(), "step": engine.num_steps, "model": engine.model_name,
            "max_model_len": max_len, "watermark_blocks": sc.watermark_blocks,
            "pool": pool, "requests": rows, "static": static,
            "stats": engine_stats(engine, filled=pool["filled_slots"], cached_free=pool["cached_free"]).to_dict(),
            "build_ms": (time.perf_counter() - t0) * 1000}
