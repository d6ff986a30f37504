"""The KV dashboard in a real browser: headless Chromium (Debian's package, driven by playwright)
loads /dashboard while a shared-prefix workload runs on the default model."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest
from helpers import Server

pytestmark = pytest.mark.slow  # end to end: server processes, peers, workers, the default model

# the README's picture of the dashboard is this test's screenshot: PAGEDLLM_UPDATE_DOCS=1 writes it there (a plain run
# leaves the tree as it found it)
DOCS = Path(__file__).resolve().parents[2] / "docs"
SYSTEM = "You are a careful assistant. Answer in two short sentences, citing one fact. " * 6
STATES = ("free", "cached", "used", "shared")

# one evaluate: what the page drew and the snapshot it drew from, at the same instant
DRAWN = """() => {
  const d = window.kvDashboard, pool = d.snapshot.pool;
  const dom = {};
  for (const s of ["free", "cached", "used", "shared"]) dom[s] = document.querySelectorAll(`#grid .cell.${s}`).length;
  const legend = {};
  for (const el of document.querySelectorAll("#legend [data-state]")) {
    legend[el.dataset.state] = Number(el.querySelector("b").textContent);
  }
  const shared = [...document.querySelectorAll("#grid .cell.shared")].map((c) => [Number(c.dataset.block), Number(c.textContent)]);
  return {dom, legend, shared, state: pool.state, ref: pool.ref, running: d.snapshot.stats.num_running,
          step: d.snapshot.step, tooltip: d.grid.describe(shared.length ? shared[0][0] : 0),
          rows: document.querySelectorAll("#requests tr").length, requests: d.snapshot.requests.length,
          waste: Number(document.getElementById("compare").dataset.waste), updates: d.updates};
}"""


def _counts(state: list[int]) -> dict[str, int]:
    c = Counter(state)
    return {s: c.get(i, 0) for i, s in enumerate(STATES)}


def _workload(url: str, done: threading.Event) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(timeout=300) as c:
            async def one(i: int) -> None:
                await asyncio.sleep(0.15 * i)
                r = await c.post(url + "/v1/chat/completions", json={
                    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Fact number {i}?"}],
                    "max_tokens": 48, "n": 2, "temperature": 0.8, "seed": i, "ignore_eos": True})
                r.raise_for_status()
            await asyncio.gather(*(one(i) for i in range(24)))

    try:
        asyncio.run(main())
    finally:
        done.set()


def test_dashboard_draws_the_pool_the_server_reports(tmp_path):
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:  # .ci/run installs it; a missing browser is a failure, not a skip
        pytest.fail("no chromium on PATH: apt-get install -y chromium")
    srv = Server(None, "--num-kv-blocks", "320", "--block-size", "16", "--max-num-seqs", "16", "--max-model-len", "2048")
    done = threading.Event()
    load = threading.Thread(target=_workload, args=(srv.url, done), daemon=True)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
            page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
            page.goto(srv.url + "/dashboard")
            page.wait_for_function("window.kvDashboard && window.kvDashboard.updates > 0", timeout=30_000)
            load.start()
            # while it runs: shared blocks (n = 2 forks and the common system prompt) drawn with their counts
            page.wait_for_function("window.kvDashboard.snapshot.pool.state.includes(3) && window.kvDashboard.updates > 6",
                                   timeout=120_000)
            live = page.evaluate(DRAWN)
            assert live["dom"] == _counts(live["state"]) == live["legend"], live
            assert live["shared"] and all(n == live["ref"][b] and n > 1 for b, n in live["shared"]), live["shared"]
            assert live["running"] > 0 and live["rows"] == live["requests"] > 0
            assert "ref count" in live["tooltip"] and "tokens" in live["tooltip"], live["tooltip"]
            assert 0.5 < live["waste"] < 1.0  # max-length reservation of 2048 slots for ~200-token requests
            shots = DOCS if os.environ.get("PAGEDLLM_UPDATE_DOCS") == "1" else tmp_path
            page.screenshot(path=str(shots / "dashboard.png"), full_page=True)
            assert done.wait(300), "the workload did not finish"
            # idle: the page's drawing equals a snapshot the test fetches itself
            page.wait_for_function("window.kvDashboard.snapshot.stats.num_running === 0 && "
                                   "window.kvDashboard.snapshot.stats.num_waiting === 0", timeout=30_000)
            before = page.evaluate("window.kvDashboard.updates")
            page.wait_for_function(f"window.kvDashboard.updates > {before + 1}", timeout=30_000)
            idle = page.evaluate(DRAWN)
            server = httpx.get(srv.url + "/kv/snapshot", timeout=30).json()
            assert idle["dom"] == _counts(server["pool"]["state"]) == idle["legend"], (idle["dom"], server["pool"]["state"])
            assert idle["dom"]["cached"] > 0 and idle["dom"]["used"] == idle["dom"]["shared"] == 0
            browser.close()
        assert not errors, errors
    finally:
        assert srv.stop() == 0


def test_simulate_html_replays_both_pools_in_the_browser(tmp_path):
    import subprocess
    import sys

    from playwright.sync_api import sync_playwright

    out = tmp_path / "sim.html"
    r = subprocess.run([sys.executable, "-m", "pagedllm", "simulate", "--preset", "seed-13b", "--kv-memory", "46GB",
                        "--num-requests", "120", "--html", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail("no chromium on PATH: apt-get install -y chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(out.as_uri())
        page.wait_for_function("window.kvReplay && window.kvReplay.ready", timeout=30_000)
        frames = page.evaluate("window.kvReplay.frames")
        # a pixel inside the drawn area of the paged pool is not the free color: something was painted
        painted = page.evaluate("""() => {
          const c = document.getElementById("paged"), ctx = c.getContext("2d");
          const d = ctx.getImageData(0, 0, c.width, c.height).data;
          let n = 0;
          for (let i = 0; i < d.length; i += 4) if (!(d[i] === 0xe5 && d[i + 1] === 0xe7 && d[i + 2] === 0xeb)) n++;
          return n;
        }""")
        rows = page.evaluate("document.querySelectorAll('#summary tr').length")
        browser.close()
    assert not errors, errors
    assert frames["static"] > 10 and frames["paged"] > 10 and painted > 100 and rows == 8
