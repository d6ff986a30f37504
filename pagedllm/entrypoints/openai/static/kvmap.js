// kvmap.js: the KV pool drawn block by block. Shared by the live dashboard (/dashboard) and the
// static trace replay (pagedllm simulate --html). No library, no build step.
//
// A snapshot's pool (see BlockManager.snapshot) is columnar: state[b] 0 free, 1 cached-free,
// 2 in use by one request, 3 shared; owner[b] / index[b] = first holder and the block's position
// in its table; fill[b] = token slots holding KV; (shared_blocks[j], shared_holders[j]) pairs.
"use strict";

const KV_STATES = ["free", "cached", "used", "shared"];
const KV_COLORS = {free: "#e5e7eb", cached: "#a7f3d0", shared: "#4c1d95", reserved: "#fde68a"};

// a stable, distinct-enough color per request id
function kvRequestColor(id) {
  let h = 0;
  for (let i = 0; i < id.length; i++) h = (h * 31 + id.charCodeAt(i)) >>> 0;
  return `hsl(${(h * 137.508) % 360}, 62%, ${48 + (h % 3) * 8}%)`;
}

class KVGrid {
  // el: an empty element; the grid fills it with one div per block
  constructor(el, tooltip) {
    this.el = el;
    this.tooltip = tooltip;
    this.cells = [];
    this.snap = null;
    this.drawn = {free: 0, cached: 0, used: 0, shared: 0};
    this.sharedDrawn = {};
    el.classList.add("kvgrid");
    el.addEventListener("mousemove", (e) => this.hover(e));
    el.addEventListener("mouseleave", () => { if (this.tooltip) this.tooltip.style.display = "none"; });
  }

  resize(n) {
    if (this.cells.length === n) return;
    this.el.textContent = "";
    this.cells = [];
    const frag = document.createDocumentFragment();
    for (let b = 0; b < n; b++) {
      const c = document.createElement("div");
      c.className = "cell free";
      c.dataset.block = b;
      frag.appendChild(c);
      this.cells.push(c);
    }
    this.el.appendChild(frag);
    this.el.style.setProperty("--cols", Math.ceil(Math.sqrt(n * 2.2)));
  }

  // snap: {pool, requests}; every cell is repainted from it, and what was painted is counted
  draw(snap) {
    const pool = snap.pool;
    this.snap = snap;
    this.resize(pool.num_blocks);
    const holders = {};
    for (let j = 0; j < pool.shared_blocks.length; j++) {
      (holders[pool.shared_blocks[j]] = holders[pool.shared_blocks[j]] || []).push(pool.shared_holders[j]);
    }
    this.holders = holders;
    const drawn = {free: 0, cached: 0, used: 0, shared: 0};
    const sharedDrawn = {};
    for (let b = 0; b < pool.num_blocks; b++) {
      const st = KV_STATES[pool.state[b]];
      const c = this.cells[b];
      const cls = "cell " + st;
      if (c.className !== cls) c.className = cls;
      let bg = "";
      let text = "";
      if (st === "used") bg = kvRequestColor(snap.requests[pool.owner[b]].id);
      if (st === "shared") { text = String(pool.ref[b]); sharedDrawn[b] = pool.ref[b]; }
      if (c.style.background !== bg) c.style.background = bg;
      if (c.textContent !== text) c.textContent = text;
      drawn[st]++;
    }
    this.drawn = drawn;
    this.sharedDrawn = sharedDrawn;
  }

  describe(b) {
    const snap = this.snap, pool = snap.pool, bs = pool.block_size;
    const st = KV_STATES[pool.state[b]];
    const lines = [`block ${b}: ${st === "cached" ? "cached-free (reusable prefix, evictable)" : st}`];
    const ids = (this.holders[b] || (pool.owner[b] >= 0 ? [pool.owner[b]] : [])).map((r) => snap.requests[r].id);
    if (ids.length) {
      const lo = pool.index[b] * bs;
      lines.push(`tokens ${lo}..${lo + pool.fill[b]} of ${ids.length > 1 ? "each of " : ""}${ids.slice(0, 6).join(", ")}` +
                 (ids.length > 6 ? ` and ${ids.length - 6} more` : ""));
    }
    if (pool.ref[b] > 1) lines.push(`ref count ${pool.ref[b]}`);
    if (pool.hash[b]) lines.push(`prefix hash ${pool.hash[b]}`);
    return lines.join("\n");
  }

  hover(e) {
    const b = e.target.dataset ? e.target.dataset.block : undefined;
    if (b === undefined || !this.snap || !this.tooltip) return;
    this.tooltip.textContent = this.describe(Number(b));
    this.tooltip.style.display = "block";
    this.tooltip.style.left = `${e.pageX + 12}px`;
    this.tooltip.style.top = `${e.pageY + 12}px`;
  }
}

// a tiny line chart: series = [{values, color}], drawn as SVG polylines stretched to the box; the
// scale's top is written into a `.max` element next to the svg, if there is one
function kvLineChart(svg, series, {max = null, unit = ""} = {}) {
  const w = 300, h = 70;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.setAttribute("preserveAspectRatio", "none");
  const top = max ?? Math.max(1e-9, ...series.flatMap((s) => s.values));
  svg.textContent = "";
  const ns = "http://www.w3.org/2000/svg";
  for (const s of series) {
    const n = s.values.length;
    if (!n) continue;
    const pts = s.values.map((v, i) => `${(n === 1 ? w : (i / (n - 1)) * w).toFixed(1)},${(h - 2 - (v / top) * (h - 6)).toFixed(1)}`);
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", pts.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", s.color);
    line.setAttribute("stroke-width", "1.6");
    line.setAttribute("vector-effect", "non-scaling-stroke");
    svg.appendChild(line);
  }
  const label = svg.parentElement && svg.parentElement.querySelector(".max");
  if (label) label.textContent = `(top ${top >= 100 ? Math.round(top).toLocaleString() : top.toPrecision(3)}${unit})`;
}

// static max-length reservation next to paging: two bars on one scale.
// paged = {blocks, utilization}; stat = the snapshot's static block (see LLMEngine.kv_snapshot)
function kvCompare(el, paged, stat, poolBlocks, blockSize) {
  const scale = Math.max(poolBlocks, stat.reserved_blocks, 1);
  const pct = (x) => `${Math.min(100, 100 * x / scale).toFixed(2)}%`;
  const live = stat.live_tokens / blockSize;
  el.innerHTML = `
    <div class="bar-label">paged: <b>${paged.blocks}</b> blocks allocated, ${(100 * (1 - paged.utilization)).toFixed(1)}% of
      their slots empty; a shared prefix is stored once</div>
    <div class="bar"><div class="fill paged" style="width:${pct(paged.blocks)}"></div><div class="pool-end" style="left:${pct(poolBlocks)}" title="the pool"></div></div>
    <div class="bar-label">static, each of the ${stat.requests} running requests holding max_model_len slots: <b>${stat.reserved_blocks}</b> blocks
      (${(stat.reserved_blocks / Math.max(poolBlocks, 1)).toFixed(2)}&times; the pool), <b class="waste">${(100 * stat.wasted_fraction).toFixed(1)}%</b>
      of it reserved for tokens that do not exist (${(100 * stat.declared_wasted_fraction).toFixed(1)}% if each reserved only prompt + max_tokens)</div>
    <div class="bar"><div class="fill static-live" style="width:${pct(live)}"></div><div class="fill static-reserved" style="width:${pct(Math.max(0, stat.reserved_blocks - live))}"></div><div class="pool-end" style="left:${pct(poolBlocks)}" title="the pool"></div></div>`;
  el.dataset.waste = stat.wasted_fraction.toFixed(4);
}
