"""What every bench shares: machine info, peak-RSS sampling, JSON and progress output."""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from ..tools.workloads import WorkItem, from_jsonl, mixed, shared_prefix


def machine_info() -> dict:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version(), "platform": platform.platform()}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class PeakRSS:
    peak: int = 0


@contextmanager
def track_peak_rss(interval: float = 0.02):
    """Peak resident memory of this process while the block runs (sampled)."""
    result = PeakRSS(_rss_bytes())
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval):
            result.peak = max(result.peak, _rss_bytes())

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield result
    finally:
        stop.set()
        t.join()
        result.peak = max(result.peak, _rss_bytes())


def load_workload(name: str, num_requests: int, vocab_size: int, seed: int, tokenizer=None) -> list[WorkItem]:
    if name == "mixed":
        return mixed(num_requests, vocab_size, seed)
    if name == "shared-prefix":
        return shared_prefix(num_requests, vocab_size, seed)
    if name.endswith(".jsonl") or os.path.exists(name):
        return from_jsonl(name, tokenizer)[:num_requests]
    raise ValueError(f"unknown workload {name!r}: mixed, shared-prefix or a .jsonl file")


def make_report(bench: str, args, engine_kwargs: dict | None, **results) -> dict:
    """Every number of a bench run with its configuration and the machine, as --json writes it."""
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
    if engine_kwargs is not None:
        config["engine"] = engine_kwargs
    return {"bench": bench, "config": config, "machine": machine_info(), **results}


def write_json(path: str | None, report: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)


def now() -> float:
    return time.perf_counter()


def median_time(fn, reps: int = 7) -> float:
    """Median wall time of fn() over reps calls, after one warm-up call (the microbenchmarks)."""
    import statistics

    fn()
    ts = []
    for _ in range(reps):
        t = now()
        fn()
        ts.append(now() - t)
    return statistics.median(ts)


def result_row(system: str, work: list[WorkItem], wall: float, output_tokens: int, peak_rss: int, **extra) -> dict:
    """One system's numbers in the shape every table, plot and JSON consumer reads."""
    prompt_tokens = sum(len(w.prompt_token_ids) for w in work)
    return {"system": system, "wall_s": wall, "requests": len(work), "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "output_tokens_per_s": output_tokens / wall,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / wall, "peak_rss_bytes": peak_rss,
            "kv_utilization": None, "wasted_token_fraction": 0.0, **extra}
