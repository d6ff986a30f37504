"""The decode op over rows that share a prefix: 64 decode rows behind 512 shared keys (32 blocks of 16, prefix
caching's system prompt) plus 20-119 keys of their own, SmolLM2's heads (9 / 3, D 64), one layer over a bf16
pool; the same rows with private copies of the prefix blocks (no groups: every row reads and multiplies the
512 keys itself) alternated in one run, median of 20 after a warm-up.
Run: .venv/bin/python benchmarks/shared_prefix_microbench.py"""

import time

import torch

from pagedllm.platforms.cpu import load_ops

ops = load_ops()
g = torch.Generator().manual_seed(0)
heads, kv_heads, d, bs, shared, nseq = 9, 3, 64, 16, 32, 64
own = torch.randint(20, 120, (nseq,), generator=g).tolist()
ctx = [shared * bs + o for o in own]
nb = shared * (nseq + 1) + sum(-(-o // bs) for o in own)
perm = torch.randperm(nb, generator=g).tolist()
prefix, free = perm[:shared], iter(perm[shared:])
tables = [prefix + [next(free) for _ in range(-(-c // bs) - shared)] for c in ctx]
width = max(map(len, tables))
grouped = torch.tensor([t + [0] * (width - len(t)) for t in tables])
private = grouped.clone()
k_pool = torch.randn(nb, bs, kv_heads, d, generator=g).bfloat16()
v_pool = torch.randn(nb, bs, kv_heads, d, generator=g).bfloat16()
for s in range(nseq):
    copy = [next(free) for _ in range(shared)]
    private[s, :shared] = torch.tensor(copy)
    k_pool[copy], v_pool[copy] = k_pool[prefix], v_pool[prefix]
q_len, q_start, ctx_len, row_seq = torch.ones(nseq, dtype=torch.long), torch.arange(nseq), torch.tensor(ctx), torch.arange(nseq)
q = torch.randn(nseq, heads, d, generator=g)
groups = ops.shared_prefix_groups(grouped, row_seq, q_len, ctx_len, bs, heads // kv_heads)
print(f"groups: {[(p, len(rows)) for p, rows in groups]} (shared keys, rows); private tables: "
      f"{ops.shared_prefix_groups(private, row_seq, q_len, ctx_len, bs, heads // kv_heads)}")
outs = {}


def run(table: torch.Tensor, name: str) -> float:
    out = torch.zeros_like(q)
    f = lambda: ops.paged_attention(out, q, k_pool, v_pool, table, row_seq, q_start, q_len, ctx_len,
                                    d ** -0.5, 0, None, None, None)
    for _ in range(3):
        f()
    times = []
    for _ in range(20):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    outs[name] = out
    return sorted(times)[len(times) // 2]


for i in range(2):
    a, b = run(private, "private"), run(grouped, "grouped")
    print(f"run {i + 1}: private blocks {a * 1e3:.2f} ms, shared blocks (grouped) {b * 1e3:.2f} ms: {a / b:.2f}x")
print(f"max |grouped - private| {(outs['grouped'] - outs['private']).abs().max().item():.1e}")
