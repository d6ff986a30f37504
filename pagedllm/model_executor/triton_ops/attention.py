"""Attention of a step's rows over the paged pool: two kernels and a merge.

Rows are ordered as the metadata builder orders them: the decodes first (one query row each), then every other
sequence's rows (prompt chunks, speculative rows), each sequence's rows contiguous from its q_start.

Tiles. A program takes one KV head and a tile of rows: BLOCK_Q tokens x G_PAD query heads of that KV head (G heads
share it; G_PAD is G rounded up to a power of two, the padded heads masked), so a K/V tile is read once for all
of them. Keys come BLOCK_N at a time, each key's address looked up through the block table (slot = table[pos //
block_size] * block_size + pos % block_size), so any block size works. Softmax is online in fp32 on exp2, scores
pre-scaled by scale * log2(e). An attention sink (gpt-oss) starts each row's running max at the sink's logit and
its sum at 1: one more logit in the softmax, with no value. fp8 pools are widened in the kernel (bytes bitcast
to fp8, times the slot's bf16 scale) to the compute dtype, as kv_quant.FP8KVCache.gather does.

- `_attend_chunks`: grid (sequences, query tiles, KV heads); causal within the chunk (a row at position p sees
  keys <= p), keys from the window's start (or 0) to the tile's last position.
- `_decode_split` + `_merge_splits`: flash-decoding. Grid (decodes, KV heads, splits): each program runs the
  online softmax over its share of the context and writes (max, sum, unnormalized output); the merge rescales
  and adds the splits. Many splits for few long sequences (the GPU's programs otherwise idle), one for many.
fp32 models use IEEE dot products (not TF32), so that fp32 runs match the torch reference token for token; in
Triton's interpreter (CPU tensors) bf16 operands are widened to fp32 before the product, as its bf16 dot is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _kv_tile(pool, scales, tables, seq, n, nm, h, d, dm, stride_tab, BS: tl.constexpr, KVH: tl.constexpr,
             D: tl.constexpr, FP8: tl.constexpr, E5M2: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """K or V of keys n [BLOCK_N] (mask nm) of KV head h: [BLOCK_N, BLOCK_D] in the compute dtype."""
    blk = tl.load(tables + seq * stride_tab + n // BS, mask=nm, other=0).to(tl.int64)
    slot = blk * BS + n % BS
    x = tl.load(pool + (slot[:, None] * KVH + h) * D + d[None, :], mask=nm[:, None] & dm[None, :], other=0)
    if FP8:
        if E5M2:
            f = x.to(tl.float8e5, bitcast=True).to(tl.float32)
        else:
            f = x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        s = tl.load(scales + slot * KVH + h, mask=nm, other=0.0).to(tl.float32)
        return (f * s[:, None]).to(OUT_DTYPE)
    return x.to(OUT_DTYPE)


@triton.jit
def _online_softmax(qv, qpos, row_ok, m_i, l_i, acc, k_pool, v_pool, k_scale, v_scale, tables, seq, lo, hi, h, d,
                    dm, stride_tab, scale_log2, window, BS: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                    BLOCK_N: tl.constexpr, FP8: tl.constexpr, E5M2: tl.constexpr, IEEE: tl.constexpr):
    """Keys [lo, hi) into the running (max, sum, output) of rows at positions qpos [BLOCK_M]."""
    dt = qv.dtype
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nm = n < hi
        k = _kv_tile(k_pool, k_scale, tables, seq, n, nm, h, d, dm, stride_tab, BS, KVH, D, FP8, E5M2, dt)
        if IEEE:  # fp32 operands (bf16 ones widened: exact products, as the tensor cores' fp32 accumulation)
            s = tl.dot(qv.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(qv, tl.trans(k))
        s = s * scale_log2  # [BLOCK_M, BLOCK_N]
        ok = (n[None, :] <= qpos[:, None]) & nm[None, :] & row_ok[:, None]
        if window > 0:
            ok = ok & (n[None, :] > qpos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: nothing to rescale
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _kv_tile(v_pool, v_scale, tables, seq, n, nm, h, d, dm, stride_tab, BS, KVH, D, FP8, E5M2, dt)
        if IEEE:
            pv = tl.dot(p.to(dt).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(dt), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _start_state(sinks, head, row_ok, HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr):
    if HAS_SINKS:
        m_i = tl.load(sinks + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    return m_i, l_i


@triton.jit
def _attend_chunks(out, q, k_pool, v_pool, k_scale, v_scale, sinks, tables, q_starts, q_lens, ctx_lens, seq0,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_tab, scale_log2, window,
                   KVH: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   BS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr,
                   E5M2: tl.constexpr, HAS_SINKS: tl.constexpr, IEEE: tl.constexpr):
    seq = seq0 + tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    q_len = tl.load(q_lens + seq)
    if tile * BLOCK_Q >= q_len:
        return
    q_start = tl.load(q_starts + seq)
    ctx = tl.load(ctx_lens + seq)
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    r = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + r // G_PAD
    head = h * G + r % G_PAD
    row_ok = (tok < q_len) & (r % G_PAD < G)
    qpos = ctx - q_len + tok  # [BLOCK_M] each row's position in its sequence
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    row = (q_start + tok).to(tl.int64)
    qv = tl.load(q + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                 mask=row_ok[:, None] & dm[None, :], other=0.0)
    m_i, l_i = _start_state(sinks, head, row_ok, HAS_SINKS, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first = ctx - q_len + tile * BLOCK_Q
    hi = tl.minimum(ctx, first + BLOCK_Q)
    lo = 0
    if window > 0:
        lo = tl.maximum(first - window + 1, 0)
    m_i, l_i, acc = _online_softmax(qv, qpos, row_ok, m_i, l_i, acc, k_pool, v_pool, k_scale, v_scale, tables, seq,
                                    lo, hi, h, d, dm, stride_tab, scale_log2, window, BS, KVH, D, BLOCK_N, FP8, E5M2,
                                    IEEE)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :], o.to(out.dtype.element_ty),
             mask=row_ok[:, None] & dm[None, :])


@triton.jit
def _decode_split(part_o, part_m, part_l, q, k_pool, v_pool, k_scale, v_scale, tables, q_starts, ctx_lens,
                  stride_qt, stride_qh, stride_tab, scale_log2, window, num_splits,
                  H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                  BLOCK_D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr,
                  E5M2: tl.constexpr, IEEE: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(ctx_lens + seq)
    r = tl.arange(0, ROWS)  # the KV head's query heads, padded to a tile tl.dot takes
    row_ok = r < G
    head = h * G + r
    qpos = tl.zeros([ROWS], tl.int32) + ctx - 1
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    row = tl.load(q_starts + seq).to(tl.int64)
    qv = tl.load(q + row * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None] & dm[None, :],
                 other=0.0)
    lo0 = 0
    if window > 0:
        lo0 = tl.maximum(ctx - window, 0)
    span = tl.cdiv(tl.cdiv(ctx - lo0, num_splits), BLOCK_N) * BLOCK_N
    lo = lo0 + sp * span
    hi = tl.minimum(lo + span, ctx)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    m_i, l_i, acc = _online_softmax(qv, qpos, row_ok, m_i, l_i, acc, k_pool, v_pool, k_scale, v_scale, tables, seq,
                                    lo, hi, h, d, dm, stride_tab, scale_log2, window, BS, KVH, D, BLOCK_N, FP8, E5M2,
                                    IEEE)
    part = (seq * H + head) * num_splits + sp  # [ROWS]: partials [decodes, H, splits]
    tl.store(part_m + part, m_i, mask=row_ok)
    tl.store(part_l + part, l_i, mask=row_ok)
    tl.store(part_o + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & dm[None, :])


@triton.jit
def _merge_splits(out, part_o, part_m, part_l, sinks, q_starts, stride_ot, stride_oh, num_splits,
                  H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr,
                  HAS_SINKS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    spm = sp < num_splits
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    base = (seq * H + head) * num_splits
    m = tl.load(part_m + base + sp, mask=spm, other=float("-inf"))
    lsum = tl.load(part_l + base + sp, mask=spm, other=0.0)
    m_all = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks + head).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m_all, sink)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_all))  # [SPLITS_PAD]: an empty split weighs nothing
    total = tl.sum(lsum * w, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_all)
    o = tl.load(part_o + (base + sp)[:, None] * D + d[None, :], mask=spm[:, None] & dm[None, :], other=0.0)
    o = tl.sum(o * w[:, None], axis=0) / total
    row = tl.load(q_starts + seq).to(tl.int64)
    tl.store(out + row * stride_ot + head * stride_oh + d, o.to(out.dtype.element_ty), mask=dm)


@dataclass(frozen=True)
class StepRows:
    """One step's sequences as the kernels read them, on the device: the first num_decodes are decodes."""

    tables: torch.Tensor  # [S, max_blocks] int32 block table rows (padding never read)
    q_start: torch.Tensor  # [S] int32 first row of each sequence in the step
    q_len: torch.Tensor  # [S] int32
    ctx_len: torch.Tensor  # [S] int32 tokens of context after the step's rows
    num_decodes: int
    max_q_len: int  # of the sequences after the decodes
    max_decode_ctx: int


def decode_splits(num_decodes: int, kv_heads: int, max_ctx: int, programs: int, block_n: int) -> int:
    """Splits of each decode's context: enough programs to fill the device (programs: its count of parallel
    units, x2), each split at least 4 key tiles, at most 64."""
    if num_decodes * kv_heads >= programs:
        return 1
    want = -(-programs // (num_decodes * kv_heads))
    return max(1, min(want, max_ctx // (4 * block_n), 64))


def attend(out: torch.Tensor, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: StepRows,
           scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, programs: int = 264,
           splits: int | None = None) -> None:
    """out, q: [T, H, D] (head rows contiguous); pools [NB, BS, KVH, D] (fp8 with scales [NB, BS, KVH] bf16);
    sinks [H] or None; window: keys within the last `window` positions (None: all). programs: parallel units
    of the device (2 x its SMs) for the decode split; splits forces a count (tests)."""
    _, h, d = q.shape
    bs, kvh = k_pool.shape[1], k_pool.shape[2]
    g = h // kvh
    fp8 = k_scale is not None
    e5m2 = k_pool.dtype == torch.float8_e5m2
    kp, vp = (k_pool.view(torch.uint8), v_pool.view(torch.uint8)) if fp8 else (k_pool, v_pool)
    # IEEE fp32 dot products: for fp32 models (not TF32), and in the interpreter, whose bf16 dot products are wrong
    ieee = q.dtype == torch.float32 or q.device.type == "cpu"
    block_d = max(16, triton.next_power_of_2(d))
    win = window or 0
    scale_log2 = scale * LOG2E
    nd, s = rows.num_decodes, rows.tables.shape[0]
    common = dict(BS=bs, FP8=fp8, E5M2=e5m2, IEEE=ieee)
    if nd:
        block_n = 64
        ns = splits or decode_splits(nd, kvh, rows.max_decode_ctx, programs, block_n)
        part_o = torch.empty((nd, h, ns, d), dtype=torch.float32, device=q.device)
        part_m = torch.empty((nd, h, ns), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        _decode_split[(nd, kvh, ns)](part_o, part_m, part_l, q, kp, vp, k_scale, v_scale, rows.tables, rows.q_start,
                                     rows.ctx_len, q.stride(0), q.stride(1), rows.tables.stride(0), scale_log2, win,
                                     ns, H=h, KVH=kvh, G=g, ROWS=max(16, triton.next_power_of_2(g)), D=d,
                                     BLOCK_D=block_d, BLOCK_N=block_n, **common)
        _merge_splits[(nd, h)](out, part_o, part_m, part_l, sinks, rows.q_start, out.stride(0), out.stride(1), ns,
                               H=h, D=d, BLOCK_D=block_d, SPLITS_PAD=triton.next_power_of_2(ns),
                               HAS_SINKS=sinks is not None)
    if s > nd:
        g_pad = triton.next_power_of_2(g)
        block_q = max(1, 64 // g_pad)
        if block_q > 1:  # no wider than the longest chunk needs (a speculative row or two: small tiles)
            block_q = min(block_q, max(16 // g_pad, triton.next_power_of_2(rows.max_q_len)))
        tiles = -(-rows.max_q_len // block_q)
        _attend_chunks[(s - nd, tiles, kvh)](out, q, kp, vp, k_scale, v_scale, sinks, rows.tables, rows.q_start,
                                             rows.q_len, rows.ctx_len, nd, q.stride(0), q.stride(1), out.stride(0),
                                             out.stride(1), rows.tables.stride(0), scale_log2, win, KVH=kvh, G=g,
                                             G_PAD=g_pad, D=d, BLOCK_D=block_d, BLOCK_Q=block_q, BLOCK_N=64,
                                             HAS_SINKS=sinks is not None, **common)


def device_rows(tables: list[list[int]], meta: list[tuple[int, int, int]], num_decodes: int,
                device: torch.device) -> StepRows:
    """StepRows from the builder's per-sequence lists: block tables and (q_start, q_len, ctx_len)."""
    width = max(len(t) for t in tables)
    tab = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    cols = torch.tensor(meta, dtype=torch.int32).T.contiguous()  # [3, S]
    tab, cols = tab.to(device, non_blocking=True), cols.to(device, non_blocking=True)
    q_lens = [n for _, n, _ in meta[num_decodes:]]
    ctx = [c for _, _, c in meta[:num_decodes]]
    return StepRows(tab, cols[0], cols[1], cols[2], num_decodes, max(q_lens, default=0), max(ctx, default=0))
