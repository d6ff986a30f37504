"""How fast a KV pool streams from memory in the order the decode op reads it, against a plain sequential read, on
this host (the 32k-context decode step's extra time is this read: Qwen3.5-9B's 8 full-attention layers, 1.07 GB).

The pool is the op's: [blocks, 16 slots, KV heads, head dim] bf16, here 4 KV heads x 256 (Qwen3.5 / Gemma 3), K and V
of `--layers` layers of `--context` keys each, the keys split over the two threads as the op splits one row's. The
orders, interleaved round by round (the host's read rate drifts by a third within minutes):
- sequential: each thread's half in address order (what a stream prefetcher is built for);
- op order: tiles of 8 keys, within a tile one KV head at a time (its 512 bytes of each key's 2 KiB row), each KV
  head's share of the keys 16 ahead prefetched into L2 before it (attention.cpp's sweep_tiles);
- head-major: the order of the same sweep over a [blocks, KV heads, 16 slots, head dim] pool (one KV head of a block
  at a time: 8 KiB in a run, so each block is read in address order); the bytes are the same, only the order differs;
- the op itself (paged_attention, one decode row over the same K and V).

    python benchmarks/kv_read_order.py [--context 32768] [--layers 8] [--rounds 7]

The read loops are a few lines of C compiled here with the system compiler (-O3 -march=native -fopenmp).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pagedllm.platforms.cpu import load_ops

KVH, D, BS = 4, 256, 16
ROW = KVH * D * 2  # bytes of one slot's row (all KV heads), bf16

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stddef.h>
#define KVH 4
#define D 256
#define BS 16
#define ROW (KVH * D * 2)

static inline __m512 line(const char* p, __m512 a) { return _mm512_add_ps(a, _mm512_load_ps((const float*)p)); }

/* order 0 sequential, 1 the op's (8-key tiles, per KV head, its share 16 keys ahead prefetched), 2 head-major
   blocks; returns a sum so that nothing is optimized away */
float read_pool(const char* pool, long n, int order) {
  float total = 0.f;
#pragma omp parallel num_threads(2) reduction(+ : total)
  {
    const int th = omp_get_thread_num();
    const long lo = th * n / 2, hi = (th + 1) * n / 2;
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    if (order == 0) {
      for (size_t o = (size_t)lo * ROW; o < (size_t)hi * ROW; o += 128) { a = line(pool + o, a); b = line(pool + o + 64, b); }
    } else if (order == 1) {
      for (long t0 = lo; t0 < hi; t0 += 8)
        for (int kh = 0; kh < KVH; ++kh) {
          for (long t = t0 + 16; t < t0 + 24 && t < hi; ++t)
            for (int o = 0; o < D * 2; o += 64) _mm_prefetch(pool + (size_t)t * ROW + kh * D * 2 + o, _MM_HINT_T1);
          for (long t = t0; t < t0 + 8; ++t)
            for (int o = 0; o < D * 2; o += 128) {
              const char* p = pool + (size_t)t * ROW + kh * D * 2 + o;
              a = line(p, a); b = line(p + 64, b);
            }
        }
    } else {
      for (long blk = lo / BS; blk < hi / BS; ++blk)
        for (int kh = 0; kh < KVH; ++kh) {
          const char* p = pool + (size_t)blk * BS * ROW + (size_t)kh * BS * D * 2;
          for (int o = 0; o < BS * D * 2; o += 128) { a = line(p + o, a); b = line(p + o + 64, b); }
        }
    }
    total += _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
  return total;
}
"""


def build() -> ctypes.CDLL:
    where = Path(tempfile.mkdtemp(prefix="kv_read_order_"))
    (where / "read.c").write_text(SOURCE)
    subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(where / "read.c"), "-o",
                    str(where / "read.so")], check=True)
    lib = ctypes.CDLL(str(where / "read.so"))
    lib.read_pool.restype = ctypes.c_float
    lib.read_pool.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    return lib


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(2)
    n = args.context // BS * BS
    lib = build()
    g = torch.Generator().manual_seed(0)
    pools = [(torch.randn(n // BS, BS, KVH, D, generator=g).bfloat16(), torch.randn(n // BS, BS, KVH, D, generator=g)
              .bfloat16()) for _ in range(args.layers)]
    attention = load_ops().paged_attention
    q = torch.randn(1, 4 * KVH, D, generator=g)
    out = torch.empty_like(q)
    meta = (torch.arange(n // BS).view(1, -1), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
            torch.tensor([1]), torch.tensor([n]))

    def reader(order: int):
        return lambda: [lib.read_pool(p.data_ptr(), n, order) for kv in pools for p in kv]

    def op() -> None:
        for k, v in pools:
            attention(out, q, k, v, *meta, D ** -0.5, 0, None, None, None)

    cases = {"sequential": reader(0), "op order": reader(1), "head-major": reader(2), "the op": op}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, run in cases.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    total = 2 * n * ROW * args.layers
    print(f"{args.layers} layers x {n} keys of K and V ({total / 1e9:.2f} GB a pass), 2 threads, {args.rounds} "
          f"interleaved rounds")
    for name, ts in times.items():
        print(f"{name:>11}: best {total / min(ts) / 1e9:5.1f} GB/s, median {total / statistics.median(ts) / 1e9:5.1f}"
              f" GB/s")


if __name__ == "__main__":
    main()
