"""The paged-attention op alone: one layer's decode / chunk rows over a context, K/V in 30 separate
pools (30 layers: the context streams from memory, as in a step), best of 10, against a float64
reference (of the rounded math for a bf16 pool). Run: .venv/bin/python benchmarks/attention_microbench.py [path/to/pagedllm_ops.so]
(a .so path runs that build instead, e.g. an older one kept for a side-by-side comparison; SHAPES="32/8/128"
for one geometry; POOLS="fp8_e4m3,fp8_e5m2" for other pool formats: float32, bfloat16, fp8_e4m3, fp8_e5m2, the last
two with a bf16 scale per slot and KV head as the engine stores them)."""

import importlib.util
import os
import re
import sys
import time

import torch

if len(sys.argv) > 1:
    # the module's name as the library exports it (a masked build's is pagedllm_ops_<hash of its flags>)
    with open(sys.argv[1], "rb") as f:
        name = re.search(rb"PyInit_(pagedllm_ops\w*)", f.read()).group(1).decode()
    spec = importlib.util.spec_from_file_location(name, sys.argv[1])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    attention = mod.paged_attention
else:
    from pagedllm.platforms.cpu import load_ops

    attention = load_ops().paged_attention
torch.set_num_threads(2)
BS = 16
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def pool(shape: tuple[int, ...], pool_format: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(pool, its [NB, BS, KVH] bf16 scales or None) of random values in the format"""
    x = torch.randn(shape, generator=g)
    if pool_format not in FP8:
        return x.to(getattr(torch, pool_format)), None
    fp8 = FP8[pool_format]
    scale = (x.abs().amax(-1) / torch.finfo(fp8).max).bfloat16()
    return (x / scale.float()[..., None]).to(fp8).view(torch.uint8), scale


def case(ctx: int, pool_format: str, heads: int, kv_heads: int, d: int, rows: int, layers: int = 30) -> tuple[float, float]:
    g = torch.Generator().manual_seed(0)
    nb = -(-ctx // BS)
    pools = [(*pool((nb + 8, BS, kv_heads, d), pool_format, g), *pool((nb + 8, BS, kv_heads, d), pool_format, g))
             for _ in range(layers)]
    lut = torch.arange(256, dtype=torch.uint8).view(FP8[pool_format]).float() if pool_format in FP8 else None
    table = torch.randperm(nb + 8, generator=g)[:nb].view(1, nb)
    q = torch.randn(rows, heads, d, generator=g)
    meta = (table, torch.zeros(rows, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.tensor([rows]),
            torch.tensor([ctx]))
    out = torch.empty_like(q)

    def run() -> None:
        for k, ks, v, vs in pools:
            attention(out, q, k, v, *meta, d ** -0.5, 0, ks, vs, lut)

    run()

    def values(p: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:  # [ctx, H, D] float64, as stored
        x = lut[p.long()] * scale.float()[..., None] if scale is not None else p
        return x[table[0]].flatten(0, 1)[:ctx].double().repeat_interleave(heads // kv_heads, 1)

    k, v = values(*pools[-1][:2]), values(*pools[-1][2:])
    bf16 = pool_format == "bfloat16"  # the op's math over a bf16 pool: q and p rounded to bf16
    s = torch.einsum("thd,khd->htk", q.bfloat16().double() if bf16 else q.double(), k) * d ** -0.5
    causal = torch.arange(ctx)[None, :] <= (ctx - rows + torch.arange(rows))[:, None]
    e = (s.masked_fill(~causal, float("-inf")) - s.masked_fill(~causal, float("-inf")).amax(-1, keepdim=True)).exp()
    ref = torch.einsum("htk,khd->thd", e.bfloat16().double() if bf16 else e, v) / e.sum(-1).transpose(0, 1)[..., None]
    err = (out.double() - ref).abs().max().item()
    best = 1e9
    for _ in range(10):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best / layers * 1e6, err


# SHAPES="9/3/64" runs one geometry (heads / KV heads / head dim)
SHAPES = [tuple(map(int, x.split("/"))) for x in os.environ.get("SHAPES", "9/3/64,32/8/128").split(",")]
POOLS = os.environ.get("POOLS", "float32,bfloat16").split(",")
for heads, kv_heads, d in SHAPES:
    for rows in (1, 8, 64):
        for ctx in (64, 576, 2048):
            for pool_format in POOLS:
                us, err = case(ctx, pool_format, heads, kv_heads, d, rows, 30 if d == 64 else 8)
                print(f"heads {heads}/{kv_heads} D {d:3d} rows {rows:2d} ctx {ctx:4d} {pool_format:8s} {us:8.1f} us/layer"
                      f"  max err {err:.1e}", flush=True)
