"""The Triton kernels (model_executor/triton_ops) against the torch reference, in Triton's interpreter here
(conftest turns it on without a GPU): K/V writes byte for byte, attention over the paged pool within fp32
rounding, RMSNorm + residual as the reference rounds it."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model_executor.attention import sdpa
from pagedllm.model_executor.kv_quant import FP8_DTYPES, dequantize, quantize
from pagedllm.model_executor.layers.backends import TorchReference

triton = pytest.importorskip("triton")
from pagedllm.model_executor.triton_ops.attention import (  # noqa: E402
    attend,
    decode_splits,
    device_rows,
)
from pagedllm.model_executor.triton_ops.kv_write import write_kv  # noqa: E402
from pagedllm.model_executor.triton_ops.norm import rms_norm  # noqa: E402


def _pool(seqs, bs, kvh, d, gen):
    """Sequences' K/V [ctx, KVH, D] each, scattered over shuffled blocks of a pool (block 0 left unused)."""
    nbs = [-(-ctx // bs) for _, ctx in seqs]
    perm = (torch.randperm(sum(nbs), generator=gen) + 1).tolist()
    tables, i = [], 0
    for nb in nbs:
        tables.append(perm[i:i + nb])
        i += nb
    ks = [torch.randn(ctx, kvh, d, generator=gen) for _, ctx in seqs]
    vs = [torch.randn(ctx, kvh, d, generator=gen) for _, ctx in seqs]
    return tables, ks, vs, sum(nbs) + 1


def _slots(table, n, bs):
    return torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])


def _expected(q, meta, ks, vs, scale, window, sinks):
    out = torch.empty_like(q)
    for (qs, ql, ctx), k, v in zip(meta, ks, vs):
        qpos = torch.arange(ctx - ql, ctx)[:, None]
        kpos = torch.arange(ctx)[None]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        o = sdpa(q[qs:qs + ql].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                 mask[None, None], False, scale, sinks)
        out[qs:qs + ql] = o[0].transpose(0, 1)
    return out


SEQS = [(1, 9), (1, 70), (1, 1), (7, 7), (5, 37), (2, 19)]  # (rows, context): decodes, a prompt, chunks, spec rows


def _shapes():
    """GQA with 3 query heads a KV head, no GQA, 8 a KV head; blocks of 4, 16, 5 tokens. The first with a window
    and sinks is the fast tier's; the interpreter takes ~2.5 s a case."""
    for i, shape in enumerate([(6, 2, 40, 4), (4, 4, 16, 16), (8, 1, 64, 5)]):
        for window in (None, 6):
            for sinks in (False, True):
                fast = i == 0 and window and sinks
                yield pytest.param(*shape, window, sinks, marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("heads,kv_heads,dim,bs,window,with_sinks", list(_shapes()))
def test_attention_over_the_pool_equals_sdpa_on_the_sequences_own_kv(heads, kv_heads, dim, bs, window, with_sinks):
    """Decodes (split over 1 and 3 programs), a fresh prompt, chunks after a prefix and speculative rows in one
    step, with GQA (3 heads a KV head, and 8), block sizes that are not the key tile's, windows and sinks."""
    gen = torch.Generator().manual_seed(0)
    tables, ks, vs, nblocks = _pool(SEQS, bs, kv_heads, dim, gen)
    k_pool = torch.zeros(nblocks, bs, kv_heads, dim)
    v_pool = torch.zeros_like(k_pool)
    for t, k, v in zip(tables, ks, vs):
        write_kv(k_pool, v_pool, _slots(t, k.shape[0], bs), k, v)
    meta, qs = [], 0
    for ql, ctx in SEQS:
        meta.append((qs, ql, ctx))
        qs += ql
    q = torch.randn(qs, heads, dim, generator=gen)
    sinks = torch.randn(heads, generator=gen) if with_sinks else None
    rows = device_rows(tables, meta, 3, torch.device("cpu"))
    want = _expected(q, meta, ks, vs, 0.3, window, sinks)
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        attend(out, q, k_pool, v_pool, rows, 0.3, window, sinks, splits=splits)
        torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_pool_is_written_as_kv_quant_writes_it_and_read_widened(fmt):
    gen = torch.Generator().manual_seed(1)
    fp8, bs, kvh, d = FP8_DTYPES[fmt], 4, 2, 32
    seqs = [(1, 13), (6, 6)]
    tables, ks, vs, nblocks = _pool(seqs, bs, kvh, d, gen)
    k_pool = torch.zeros(nblocks, bs, kvh, d, dtype=fp8)
    v_pool = torch.zeros_like(k_pool)
    k_scale = torch.zeros(nblocks, bs, kvh, dtype=torch.bfloat16)
    v_scale = torch.zeros_like(k_scale)
    for t, k, v in zip(tables, ks, vs):
        slots = _slots(t, k.shape[0], bs)
        write_kv(k_pool, v_pool, slots, k * 7, v, k_scale, v_scale)
        qk, sk = quantize(k * 7, fp8)
        assert torch.equal(k_pool.view(-1, kvh, d)[slots].view(torch.uint8), qk.view(torch.uint8))
        assert torch.equal(k_scale.view(-1, kvh)[slots], sk)
    q = torch.randn(7, 4, d, generator=gen)
    meta = [(0, 1, 13), (1, 6, 6)]
    deq = [[dequantize(pool.view(-1, kvh, d)[_slots(t, ctx, bs)], sc.view(-1, kvh)[_slots(t, ctx, bs)],
                       torch.float32) for t, (_, ctx) in zip(tables, seqs)] for pool, sc in ((k_pool, k_scale),
                                                                                       (v_pool, v_scale))]
    out = torch.empty_like(q)
    attend(out, q, k_pool, v_pool, device_rows(tables, meta, 1, torch.device("cpu")), 0.2, None, None, k_scale,
           v_scale)
    # scores 7x wider than the other tests': fp32 rounding of the softmax scales with them
    torch.testing.assert_close(out, _expected(q, meta, deq[0], deq[1], 0.2, None, None), atol=1e-5, rtol=1e-5)


def test_a_bf16_pool_is_written_as_rounded_and_attended_near_fp32():
    gen = torch.Generator().manual_seed(2)
    tables, ks, vs, nblocks = _pool([(1, 40), (9, 30)], 16, 2, 64, gen)
    k_pool = torch.zeros(nblocks, 16, 2, 64, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    for t, k, v in zip(tables, ks, vs):
        slots = _slots(t, k.shape[0], 16)
        write_kv(k_pool, v_pool, slots, k.bfloat16(), v.bfloat16())
        assert torch.equal(k_pool.view(-1, 2, 64)[slots], k.bfloat16())
    q = torch.randn(10, 8, 64, generator=gen).bfloat16()
    meta = [(0, 1, 40), (1, 9, 30)]
    out = torch.empty_like(q)
    attend(out, q, k_pool, v_pool, device_rows(tables, meta, 1, torch.device("cpu")), 0.125)
    want = _expected(q.float(), meta, [k.bfloat16().float() for k in ks], [v.bfloat16().float() for v in vs], 0.125,
                     None, None)
    assert (out.float() - want).abs().max() < 2e-2  # bf16 output rounding (|out| < 4) and p rounded to bf16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_rounds_as_the_torch_reference(dtype, with_residual):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 72, generator=gen).to(dtype)
    w = torch.randn(72, generator=gen).to(dtype)
    r = torch.randn(5, 72, generator=gen).to(dtype) if with_residual else None
    want, want_res = TorchReference().rms_norm(w, 1e-6, x, r.clone() if r is not None else None)
    got, got_res = rms_norm(w, 1e-6, x, r)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=2 ** -7)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got_res, want_res)
    if with_residual:
        assert got_res is r  # the sum went into the residual stream in place


def test_decode_splits_fill_the_device_only_when_few_long_sequences_run():
    assert decode_splits(64, 8, 4096, 264, 64) == 1  # 512 programs already
    assert decode_splits(1, 8, 32768, 264, 64) == 33
    assert decode_splits(1, 8, 200, 264, 64) == 1  # a short context is not worth splitting
    assert decode_splits(2, 8, 1 << 20, 264, 64) == 17


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_rounding_edges_match_torch_byte_for_byte(fmt):
    """Values that round up into the next binade, ties, subnormals and the largest value, with the scale 1 (the
    head's amax is the format's max)."""
    fp8 = FP8_DTYPES[fmt]
    fmax = torch.finfo(fp8).max
    edges = torch.tensor([fmax, -124.8, 126.35, 303.76, -335.9, 7.3, 0.5, 0.0013, -0.0031, 2 ** -8, 3 * 2 ** -10,
                          2 ** -17, 1e-9, 0.0, 15.5, 17.0, 40.0, 48.0, 56.0, 60.0, 1.0625, 1.1875, 0.0107, 229.0,
                          232.0, 235.0, 240.0, 44.0, 52.0, 13.0, 11.0, 9.0])
    k = edges.view(1, 1, 32)
    kp = torch.zeros(1, 1, 1, 32, dtype=fp8)
    sc = torch.zeros(1, 1, 1, dtype=torch.bfloat16)
    write_kv(kp, kp.clone(), torch.tensor([0]), k, k, sc, sc.clone())
    q, s = quantize(k, fp8)
    assert torch.equal(sc.view(1, 1), s)
    assert torch.equal(kp.view(1, 1, 32).view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_the_kv_write_in_one_launch_round_as_the_reference(dtype):
    """q after rope equals the reference's (bf16: each product and the sum rounded as torch rounds them); k after
    rope and v land in their slots; a slot of -1 (a padded row) writes nothing."""
    from pagedllm.model_executor.layers.backends import rotate_half
    from pagedllm.model_executor.triton_ops.kv_write import rope_write_kv

    gen = torch.Generator().manual_seed(4)
    t, h, kvh, d = 5, 6, 2, 24
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen).to(dtype)
    ang = torch.randn(t, d // 2, generator=gen)
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(dtype), torch.cat((ang.sin(), ang.sin()), -1).to(dtype)
    k_pool = torch.zeros(3, 4, kvh, d, dtype=dtype)
    v_pool = torch.zeros_like(k_pool)
    slots = torch.tensor([2, 7, -1, 0, 11])
    q = rope_write_kv(qkv, cos, sin, h, kvh, d, k_pool, v_pool, slots)
    rq, rk, rv = qkv.split([h * d, kvh * d, kvh * d], -1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    want_q = rq.view(t, h, d) * c + rotate_half(rq.view(t, h, d)) * s
    want_k = rk.view(t, kvh, d) * c + rotate_half(rk.view(t, kvh, d)) * s
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(q, want_q, **tol)
    flat_k, flat_v = k_pool.view(-1, kvh, d), v_pool.view(-1, kvh, d)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(flat_k[slot], want_k[i], **tol)
            assert torch.equal(flat_v[slot], rv.view(t, kvh, d)[i])
    assert int((flat_k.abs().sum((1, 2)) > 0).sum()) == 4  # the padded row's k went nowhere
