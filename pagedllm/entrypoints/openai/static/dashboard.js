// dashboard.js: polls /kv/snapshot a few times a second and draws it with kvmap.js.
// An API key, when the server has one, goes in the page's fragment: /dashboard#key=KEY
// (a fragment never leaves the browser; it is sent as a Bearer header to the snapshot endpoint).
"use strict";

const HISTORY = 240;  // samples kept for the charts (one minute at 4 Hz)
const PERIOD_MS = 250;
const key = new URLSearchParams(location.hash.slice(1)).get("key");
const grid = new KVGrid(document.getElementById("grid"), document.getElementById("tooltip"));
const series = {usage: [], util: [], tps: [], hit: [], preempt: [], queue: []};
let prev = null;
window.kvDashboard = {grid, series, snapshot: null, updates: 0};

function push(name, v) {
  const s = series[name];
  s.push(v);
  if (s.length > HISTORY) s.shift();
}

function render(snap) {
  const st = snap.stats, pool = snap.pool;
  grid.draw(snap);
  for (const el of document.querySelectorAll("#legend [data-state]")) {
    el.querySelector("b").textContent = grid.drawn[el.dataset.state];
  }
  document.getElementById("usage-fill").style.width = `${100 * st.kv_usage}%`;
  document.getElementById("watermark").style.left = `${100 * (1 - snap.watermark_blocks / pool.num_blocks)}%`;
  document.getElementById("meta").textContent =
    `${snap.model} · ${pool.num_blocks} blocks × ${pool.block_size} tokens · step ${snap.step} · ` +
    `${st.num_running} running, ${st.num_waiting} waiting · snapshot ${snap.build_ms.toFixed(2)} ms` +
    // a hybrid layout: the blocks each group of layers holds (sliding-window groups only their window)
    (st.kv_groups.length > 1 ? " · blocks by layer group: " +
      st.kv_groups.map((kind, i) => `${kind.replace("sliding_window=", "window ")} ${st.kv_blocks_by_group[i]}`).join(", ") : "");
  const s = snap.static;
  kvCompare(document.getElementById("compare"), {blocks: st.kv_blocks_used, utilization: st.kv_utilization}, s,
            pool.num_blocks, pool.block_size);
  if (prev) {
    const dt = Math.max(1e-3, snap.time - prev.time);
    const p = prev.stats;
    const dq = st.prefix_cache_queries - p.prefix_cache_queries;
    push("usage", 100 * st.kv_usage);
    push("util", 100 * st.kv_utilization * st.kv_usage);
    push("tps", (st.prompt_tokens + st.generation_tokens - p.prompt_tokens - p.generation_tokens) / dt);
    push("hit", dq > 0 ? 100 * (st.prefix_cache_hits - p.prefix_cache_hits) / dq : (series.hit.at(-1) ?? 0));
    push("preempt", st.num_preemptions - p.num_preemptions);
    push("queue", st.num_waiting);
    kvLineChart(document.getElementById("c-kv"), [{values: series.usage, color: "#2563eb"},
                                                  {values: series.util, color: "#16a34a"}], {max: 100, unit: "%"});
    kvLineChart(document.getElementById("c-tps"), [{values: series.tps, color: "#2563eb"}]);
    kvLineChart(document.getElementById("c-hit"), [{values: series.hit, color: "#0d9488"}], {max: 100, unit: "%"});
    kvLineChart(document.getElementById("c-queue"), [{values: series.preempt, color: "#dc2626"},
                                                     {values: series.queue, color: "#9333ea"}]);
  }
  prev = snap;
  const safe = (t) => t.replace(/[<>&"]/g, "");
  const rows = snap.requests.map((r) => `<tr><td title="${safe(r.id)}"><span class="swatch" style="background:${kvRequestColor(r.id)}"></span>` +
    `${r.id.length > 18 ? "…" + safe(r.id.slice(-16)) : safe(r.id)}</td><td>${r.status}</td><td>${r.prompt_tokens}</td><td>${r.output_tokens}</td>` +
    `<td>${r.computed_tokens}</td><td>${r.blocks}</td><td>${r.cached_tokens}</td><td>${r.preemptions}</td></tr>`);
  document.getElementById("requests").innerHTML = rows.slice(0, 200).join("") +
    (rows.length > 200 ? `<tr><td colspan="8">and ${rows.length - 200} more</td></tr>` : "");
  window.kvDashboard.snapshot = snap;
  window.kvDashboard.updates++;
}

async function poll() {
  try {
    const r = await fetch("/kv/snapshot", {headers: key ? {Authorization: `Bearer ${key}`} : {}});
    if (r.status === 401) throw new Error("this server needs its API key: open /dashboard#key=YOUR_KEY");
    if (!r.ok) throw new Error(`snapshot: HTTP ${r.status}`);
    render(await r.json());
    document.getElementById("error").textContent = "";
  } catch (e) {
    document.getElementById("error").textContent = String(e.message || e);
  }
  setTimeout(poll, document.hidden ? 2000 : PERIOD_MS);
}
poll();
