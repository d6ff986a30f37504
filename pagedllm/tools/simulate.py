"""Trace simulator: static contiguous max-length reservation vs paged blocks. No torch here.

Time advances in decode steps; a running request gains one token per step and finishes after
its output length. (a) static: on arrival a request reserves prompt + max_tokens tokens in one
contiguous range, first fit; if no free range is long enough it fails (OOM), and the simulator
records whether the total free memory would have sufficed (fragmentation). (b) paged: the
request waits until its prompt's blocks (plus a small watermark) are free, then takes blocks as
tokens arrive; if a running request needs a block and none is free, the newest running request
is preempted and requeued (recompute).
"""

from __future__ import annotations

import json
import random
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class TraceRequest:
    arrival: int  # step
    prompt_len: int
    output_len: int  # tokens it will really generate
    max_tokens: int  # what it declared (what static serving reserves for)


def generate_trace(num_requests: int = 200, seed: int = 0, rate: float = 0.5, max_model_len: int = 4096
                   ) -> list[TraceRequest]:
    """Poisson arrivals; prompts 32..1024; long-tailed outputs; declared max_tokens from a few
    common settings (so static reservations differ in size, as they do in production)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        prompt = rng.randint(32, 1024)
        cap = rng.choice([256, 512, 1024, 2048, 3072]) if max_model_len > 1024 else max_model_len // 2
        cap = max(1, min(cap, max_model_len - prompt))
        output = max(1, min(cap, int(rng.paretovariate(1.2) * 40)))
        out.append(TraceRequest(int(t), prompt, output, cap))
    return out


def load_trace(path: str | Path) -> list[TraceRequest]:
    reqs = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            reqs.append(TraceRequest(int(d["arrival"]), int(d["prompt_len"]), int(d["output_len"]),
                                     int(d.get("max_tokens", d["output_len"]))))
    return sorted(reqs, key=lambda r: r.arrival)


@dataclass
class Timeline:
    step: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)  # tokens
    used: list[int] = field(default_factory=list)
    largest_free: list[int] = field(default_factory=list)
    concurrency: list[int] = field(default_factory=list)


@dataclass
class Result:
    completed: int = 0
    refused: int = 0
    refused_fragmentation: int = 0  # refused although total free memory sufficed
    preemptions: int = 0
    peak_concurrency: int = 0
    mean_utilization: float = 0.0
    mean_concurrency: float = 0.0
    steps: int = 0
    timeline: Timeline = field(default_factory=Timeline)
    events: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("timeline")
        d["events"] = self.events[:20]
        return d


def _record(res: Result, step: int, reserved: int, used: int, largest: int, conc: int) -> None:
    tl = res.timeline
    tl.step.append(step)
    tl.reserved.append(reserved)
    tl.used.append(used)
    tl.largest_free.append(largest)
    tl.concurrency.append(conc)
    res.peak_concurrency = max(res.peak_concurrency, conc)


def _finish_means(res: Result) -> None:
    tl = res.timeline
    busy = [(r, u) for r, u in zip(tl.reserved, tl.used) if r]
    res.mean_utilization = sum(u for _, u in busy) / sum(r for r, _ in busy) if busy else 0.0
    res.mean_concurrency = sum(tl.concurrency) / len(tl.concurrency) if tl.concurrency else 0.0
    res.steps = len(tl.step)


def simulate_static(trace: list[TraceRequest], capacity: int, layout: list | None = None) -> Result:
    """capacity in tokens; reservations are contiguous [start, start + prompt + max_tokens).
    layout: if a list, gets each step's pool: [start, size, used, request index] per running request."""
    res = Result()
    rid = {id(r): i for i, r in enumerate(trace)}
    free: list[tuple[int, int]] = [(0, capacity)]  # sorted (start, length)
    running: list[tuple[TraceRequest, int, int, int]] = []  # (req, start, size, generated)
    pending = deque(sorted(trace, key=lambda r: r.arrival))
    step = 0
    while pending or running:
        while pending and pending[0].arrival <= step:
            r = pending.popleft()
            need = r.prompt_len + r.max_tokens
            hole = next((i for i, (_, ln) in enumerate(free) if ln >= need), None)
            if hole is None:
                res.refused += 1
                total_free = sum(ln for _, ln in free)
                if total_free >= need:
                    res.refused_fragmentation += 1
                    res.events.append(f"step {step}: OOM for {need} tokens with {total_free} free "
                                      f"(largest contiguous {max((ln for _, ln in free), default=0)})")
                continue
            start, ln = free[hole]
            free[hole] = (start + need, ln - need)
            if free[hole][1] == 0:
                free.pop(hole)
            running.append((r, start, need, 0))
        running = [(r, s, n, g + 1) for r, s, n, g in running]
        done = [x for x in running if x[3] >= x[0].output_len]
        running = [x for x in running if x[3] < x[0].output_len]
        for _, s, n, _ in done:
            res.completed += 1
            free.append((s, n))
        free = _coalesce(free)
        used = sum(r.prompt_len + g for r, _, _, g in running)
        reserved = sum(n for _, _, n, _ in running)
        _record(res, step, reserved, used, max((ln for _, ln in free), default=0), len(running))
        if layout is not None:
            layout.append([x for r, st, n, g in running for x in (st, n, r.prompt_len + g, rid[id(r)])])
        step += 1
    _finish_means(res)
    return res


def _coalesce(free: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, ln in sorted(free):
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + ln)
        elif ln:
            out.append((s, ln))
    return out


def simulate_paged(trace: list[TraceRequest], capacity: int, block_size: int = 16, watermark: float = 0.01,
                   layout: list | None = None) -> Result:
    """layout: if a list, gets each step's pool: [blocks held, used tokens, request index] per running request
    (block positions are immaterial to paging: they are drawn packed)."""
    res = Result()
    rid = {id(r): i for i, r in enumerate(trace)}
    num_blocks = capacity // block_size
    wm = int(num_blocks * watermark)
    free_blocks = num_blocks
    blocks = lambda n: -(-n // block_size)
    waiting: deque[list] = deque()  # [req, generated]
    running: list[list] = []  # [req, generated, blocks_held]
    pending = deque(sorted(trace, key=lambda r: r.arrival))
    step = 0
    while pending or running or waiting:
        while pending and pending[0].arrival <= step:
            r = pending.popleft()
            if blocks(r.prompt_len + r.output_len) > num_blocks:
                res.refused += 1
                continue
            waiting.append([r, 0])
        # running requests grow by one token; preempt the newest when blocks run out
        i = 0
        while i < len(running):
            r, g, held = running[i]
            need = blocks(r.prompt_len + g + 1) - held
            while need > free_blocks and len(running) > i + 1:
                victim = running.pop()
                free_blocks += victim[2]
                waiting.appendleft([victim[0], victim[1]])
                res.preemptions += 1
            if need > free_blocks:  # this one itself must go
                running.pop(i)
                free_blocks += held
                waiting.appendleft([r, g])
                res.preemptions += 1
                continue
            free_blocks -= need
            running[i] = [r, g + 1, held + need]
            i += 1
        while waiting:
            r, g = waiting[0]
            need = blocks(r.prompt_len + g)
            if need > free_blocks - (wm if running else 0):
                break
            waiting.popleft()
            free_blocks -= need
            running.append([r, g, need])
        done = [x for x in running if x[1] >= x[0].output_len]
        running = [x for x in running if x[1] < x[0].output_len]
        for x in done:
            res.completed += 1
            free_blocks += x[2]
        used = sum(r.prompt_len + g for r, g, _ in running)
        reserved = sum(h for _, _, h in running) * block_size
        _record(res, step, reserved, used, free_blocks * block_size, len(running))
        if layout is not None:
            layout.append([x for r, g, h in running for x in (h, r.prompt_len + g, rid[id(r)])])
        step += 1
    _finish_means(res)
    return res


def plot(static: Result, paged: Result, bytes_per_token: int, path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gb = bytes_per_token / 1e9
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, res, name in ((axes[0], static, "static max-length, contiguous"), (axes[1], paged, "paged blocks")):
        tl = res.timeline
        ax.plot(tl.step, [x * gb for x in tl.reserved], label="reserved")
        ax.plot(tl.step, [x * gb for x in tl.used], label="used by live tokens")
        ax.plot(tl.step, [x * gb for x in tl.largest_free], label="largest free contiguous" if res is static
                else "free (any block fits)", linestyle=":")
        ax.set_title(f"{name}\nrefused {res.refused} (fragmentation {res.refused_fragmentation}), "
                     f"peak concurrency {res.peak_concurrency}, utilization {res.mean_utilization:.0%}", fontsize=9)
        ax.set_xlabel("decode step")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("KV memory (GB)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_html(static: Result, paged: Result, static_layout: list, paged_layout: list, capacity: int, block_size: int,
               path: str, title: str = "", max_frames: int = 600) -> None:
    """The replay as one self-contained page in the dashboard's visual language (server/static/kvmap.*):
    each system's pool over time, one column per sampled step, each request's tokens in its color."""
    static_dir = Path(__file__).parent.parent / "entrypoints" / "openai" / "static"
    every = max(1, -(-max(len(static_layout), len(paged_layout)) // max_frames))
    data = {"title": title, "capacity": capacity, "block_size": block_size, "every": every,
            "static": {"summary": static.summary(), "layout": static_layout[::every],
                       "reserved": static.timeline.reserved[::every], "used": static.timeline.used[::every]},
            "paged": {"summary": paged.summary(), "layout": paged_layout[::every],
                      "reserved": paged.timeline.reserved[::every], "used": paged.timeline.used[::every]}}
    page = (static_dir / "simulate.html").read_text()
    page = page.replace("/*KVMAP_CSS*/", (static_dir / "kvmap.css").read_text())
    page = page.replace("/*KVMAP_JS*/", (static_dir / "kvmap.js").read_text())
    page = page.replace("/*DATA*/null", json.dumps(data, separators=(",", ":")).replace("</", "<\\/"))
    Path(path).write_text(page)
