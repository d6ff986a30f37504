"""Prometheus metrics, `pagedllm:` prefix, units in names. Counters and gauges are read from
the engine's stats snapshot at scrape time; latency histograms are observed per request."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ...engine.llm_engine import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class _StatsCollector:
    def __init__(self, snapshot: Callable[[], EngineStats | None]) -> None:
        self.snapshot = snapshot

    def collect(self):
        s = self.snapshot()
        if s is None:
            return
        G, C = GaugeMetricFamily, CounterMetricFamily
        families = [
            (G, "num_requests_running", "Requests in the running batch", s.num_running),
            (G, "num_requests_waiting", "Requests waiting to be scheduled", s.num_waiting),
            (G, "kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", s.kv_usage),
            (G, "kv_cache_utilization_perc", "Live token slots / slots of used blocks", s.kv_utilization),
            (G, "kv_cache_blocks_total", "KV blocks in the pool", s.kv_blocks_total),
            (G, "kv_cache_blocks_used", "KV blocks in use", s.kv_blocks_used),
            (C, "prompt_tokens", "Prompt tokens processed", s.prompt_tokens),
            (C, "generation_tokens", "Tokens generated", s.generation_tokens),
            (C, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
            (C, "prefix_cache_hits", "Prompt tokens served from the prefix cache", s.prefix_cache_hits),
            (C, "num_preemptions", "Requests preempted (recomputed later)", s.num_preemptions),
            # speculative decoding, vLLM's names
            (C, "spec_decode_num_drafts", "Proposals made", s.spec_num_drafts),
            (C, "spec_decode_num_draft_tokens", "Tokens proposed", s.spec_num_draft_tokens),
            (C, "spec_decode_num_accepted_tokens", "Proposed tokens accepted", s.spec_num_accepted_tokens),
        ]
        if s.kv_offload:  # the disk tier
            o = s.kv_offload
            families += [
                (G, "num_requests_loading_kv", "Requests waiting for the disk tier to read their prefix in",
                 s.num_loading),
                (C, "kv_offload_hit_tokens", "Prompt tokens read from the disk tier", s.disk_cache_hits),
                (C, "kv_offload_blocks_loaded", "Blocks read from the disk tier", o["blocks_loaded"]),
                (C, "kv_offload_blocks_saved", "Blocks written to the disk tier", o["blocks_saved"]),
                (C, "kv_offload_read_bytes", "Bytes read from the disk tier", o["bytes_read"]),
                (C, "kv_offload_written_bytes", "Bytes written to the disk tier", o["bytes_written"]),
                (C, "kv_offload_load_seconds", "Time spent reading blocks in", o["load_seconds"]),
                (C, "kv_offload_saves_dropped", "Blocks not saved: the writer was behind", o["saves_dropped"]),
                (C, "kv_offload_corrupt_files", "Files that failed their checks (recomputed)", o["corrupt_files"]),
                (C, "kv_offload_files_evicted", "Files removed to stay within the budget", o["files_evicted"]),
            ]
        for family, name, doc, value in families:
            m = family(f"pagedllm:{name}", doc)
            m.add_metric([], value)
            yield m
        by_group = GaugeMetricFamily("pagedllm:kv_cache_blocks_used_by_group",
                                     "KV blocks in use by each group of layers (the KV layout's groups)",
                                     labels=["group", "attention"])
        for i, (kind, n) in enumerate(zip(s.kv_groups, s.kv_blocks_by_group)):
            by_group.add_metric([str(i), kind], n)
        yield by_group
        per_pos = CounterMetricFamily("pagedllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Proposed tokens accepted, by position in the proposal", labels=["position"])
        for i, n in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([str(i)], n)
        yield per_pos


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(snapshot))
        r = self.registry
        self.request_success = Counter("pagedllm:request_success", "Finished requests by finish reason",
                                       ["finished_reason"], registry=r)
        self.ttft = Histogram("pagedllm:time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pagedllm:inter_token_latency_seconds", "Time between output tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pagedllm:e2e_request_latency_seconds", "Arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("pagedllm:request_queue_time_seconds", "Arrival to first scheduling",
                               buckets=_LATENCY_BUCKETS, registry=r)
