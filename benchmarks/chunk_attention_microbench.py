"""A fresh prompt's attention: the chunk kernel (csrc/attention_chunks.cpp) over a bf16 pool (bf16 dot products)
and over an fp32 pool (fp32 tiles) against SDPA in fp32 on the same stored values, the default model's geometry
(9 heads, 3 KV heads, head dim 64), 2 threads, best of a few calls.
Run: .venv/bin/python benchmarks/chunk_attention_microbench.py"""

import time

import torch
import torch.nn.functional as F

from pagedllm.platforms.cpu import load_ops

ops = load_ops()
torch.set_num_threads(2)
H, KVH, D, BS = 9, 3, 64, 16
scratch = torch.empty(0, dtype=torch.uint8)


def best_ms(fn, flops: float) -> float:
    fn()
    n, best = max(3, int(2e8 / flops)), 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e3


def case(L: int) -> None:
    g = torch.Generator().manual_seed(L)
    nb = -(-L // BS)
    k_pool, v_pool = (torch.randn(nb, BS, KVH, D, generator=g).bfloat16() for _ in range(2))
    q, out = torch.randn(L, H, D, generator=g), torch.empty(L, H, D)
    meta = (torch.arange(nb).unsqueeze(0), torch.tensor([0]), torch.tensor([L]), torch.tensor([L]))
    k, v = (p.reshape(-1, KVH, D)[:L].float().transpose(0, 1).unsqueeze(0) for p in (k_pool, v_pool))
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
    k32, v32 = k_pool.float(), v_pool.float()
    flops = 4 * H * D * L * L / 2  # causal: q.k and p.v over half the square
    runs = {"SDPA fp32": lambda: F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=D ** -0.5,
                                                                 enable_gqa=True),
            "chunk, bf16": lambda: ops.attend_chunks(out, q, k_pool, v_pool, *meta, D ** -0.5, 0, scratch),
            "chunk, fp32": lambda: ops.attend_chunks(out, q, k32, v32, *meta, D ** -0.5, 0, scratch)}
    for name, fn in runs.items():
        ms = best_ms(fn, flops)
        print(f"{L:5d} tokens  {name:12s} {ms:8.3f} ms  {flops / ms / 1e6:5.0f} GFLOP/s", flush=True)


for L in (64, 200, 512, 2048):
    case(L)
