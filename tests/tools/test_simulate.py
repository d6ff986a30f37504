"""Static contiguous reservation fragments; paging serves the same trace."""

from __future__ import annotations

import json
import subprocess
import sys

from pagedllm.tools.simulate import TraceRequest, generate_trace, simulate_paged, simulate_static


def test_fragmentation_refuses_although_free_memory_suffices():
    # capacity 100 tokens. A [0,40) B [40,70) C [70,100); A and C finish -> 70 free in two holes
    # of 40 and 30; D needs 50 contiguous: refused by static, served by paging.
    trace = [TraceRequest(0, 10, 2, 30), TraceRequest(0, 10, 50, 20), TraceRequest(0, 10, 2, 20),
             TraceRequest(5, 20, 5, 30)]
    static = simulate_static(trace, capacity=100)
    assert static.refused == 1 and static.refused_fragmentation == 1
    assert "70 free (largest contiguous 40)" in static.events[0]
    paged = simulate_paged(trace, capacity=100, block_size=4)
    assert paged.refused == 0 and paged.completed == 4


def test_generated_trace_paged_beats_static():
    trace = generate_trace(200, seed=1)
    static, paged = simulate_static(trace, 56152), simulate_paged(trace, 56152)
    assert paged.completed == 200 and paged.refused == 0
    assert static.refused_fragmentation > 0
    assert paged.mean_utilization > 0.95 > static.mean_utilization
    assert paged.peak_concurrency > static.peak_concurrency


def test_paged_preempts_instead_of_failing():
    trace = [TraceRequest(0, 8, 40, 40) for _ in range(6)]
    paged = simulate_paged(trace, capacity=128, block_size=8, watermark=0)
    assert paged.completed == 6 and paged.preemptions > 0


def test_simulate_cli(tmp_path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    subprocess.run([sys.executable, "-m", "pagedllm", "simulate", "--preset", "seed-13b", "--kv-memory", "46GB",
                    "--num-requests", "150", "--json", str(out), "--plot", str(png)], check=True, capture_output=True)
    d = json.loads(out.read_text())
    for side in ("static", "paged"):
        assert {"refused", "peak_concurrency", "mean_utilization"} <= d[side].keys()
    assert d["static"]["refused"] > d["paged"]["refused"] == 0
    assert png.stat().st_size > 10_000
