"""The prefix cache's disk tier: time to first token behind a long cached prefix after a restart (read back vs
recomputed), and a workload over more documents than the RAM pool holds, with and without the tier."""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
from pathlib import Path

from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..sampling_params import SamplingParams
from .common import make_report, now, write_json


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix-len", type=int, default=4096, help="the cached prefix of the restart test, in tokens")
    p.add_argument("--num-docs", type=int, default=50)
    p.add_argument("--doc-len", type=int, default=512, help="tokens of each document of the workload")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--pool-fraction", type=float, default=0.25,
                   help="the RAM pool as a fraction of the documents' KV (0.25: their KV is 4x the pool)")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--dir", default=None, help="the store's directory (default: a temporary one, removed after)")
    p.add_argument("--only", default=None, choices=["restart", "workload"])


def _ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def _drop_page_cache(root: Path) -> None:
    """The store's files out of the page cache (clean pages: no root needed), so reads come from the disk."""
    os.sync()
    for f in root.glob("*/*/*.kv"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _ttft(engine: LLMEngine, ids: list[int]) -> float:
    engine.add_request(None, {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))
    t = now()
    while engine.has_unfinished_requests():
        engine.step()
    return now() - t


def restart(kw: dict, root: Path, prefix_len: int, seed: int) -> dict:
    """One engine computes a prompt of prefix_len + 32 tokens (its blocks saved) and stops; a new engine is
    asked the same prefix with another question: recomputed without the tier, read back with it (from the page
    cache, and from the disk after dropping the files from the page cache)."""
    rng = random.Random(seed)
    first = LLMEngine(EngineConfig(**kw, kv_offload_dir=str(root)))
    vocab = first.model_config.vocab_size
    prefix = _ids(rng, vocab, prefix_len)
    _ttft(first, prefix + _ids(rng, vocab, 32))  # (its first call also warms the kernels' one-time setup)
    first.shutdown()
    out = {}
    for name, tier, cold in (("recompute", False, False), ("disk_page_cache", True, False), ("disk_cold", True, True)):
        if cold:
            _drop_page_cache(root)
        engine = LLMEngine(EngineConfig(**kw, kv_offload_dir=str(root) if tier else None))
        _ttft(engine, _ids(rng, vocab, 48))  # warm-up on unrelated tokens
        out[name] = _ttft(engine, prefix + _ids(rng, vocab, 32))
        if tier:
            st = engine.stats()
            out[name + "_hit_tokens"] = st.disk_cache_hits
            out[name + "_load_s"] = st.kv_offload["load_seconds"]
        engine.shutdown()
        print(f"  {name:16s} time to first token {out[name]:7.3f} s")
    out["speedup_page_cache"] = out["recompute"] / out["disk_page_cache"]
    out["speedup_cold"] = out["recompute"] / out["disk_cold"]
    print(f"  read back vs recomputed: {out['speedup_page_cache']:.1f}x (page cache), {out['speedup_cold']:.1f}x (cold)")
    return out


def workload(kw: dict, root: Path, args: argparse.Namespace) -> dict:
    """num_requests questions about num_docs documents (each request: a document picked at random, then a
    16-token question), all queued at once; the RAM pool holds pool_fraction of the documents' KV."""
    probe = LLMEngine(EngineConfig(**{**kw, "num_kv_blocks": 16}))
    vocab, per_token = probe.model_config.vocab_size, probe.kv_bytes_per_token
    probe.shutdown()
    rng = random.Random(args.seed)
    docs = [_ids(rng, vocab, args.doc_len) for _ in range(args.num_docs)]
    prompts = [docs[rng.randrange(args.num_docs)] + _ids(rng, vocab, 16) for _ in range(args.num_requests)]
    pool = int(args.pool_fraction * args.num_docs * args.doc_len * per_token)
    out = {"pool_bytes": pool, "docs_kv_bytes": args.num_docs * args.doc_len * per_token}
    for name, tier in (("ram_only", False), ("disk_tier", True)):
        engine = LLMEngine(EngineConfig(**{**kw, "kv_cache_memory": pool},
                                        kv_offload_dir=str(root / "workload") if tier else None))
        _ttft(engine, _ids(rng, vocab, 48))
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        t = now()
        for ids in prompts:
            engine.add_request(None, {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            engine.step()
        wall = now() - t
        st = engine.stats()
        out[name] = {"wall_s": wall, "prefix_hit_tokens": st.prefix_cache_hits, "disk_hit_tokens": st.disk_cache_hits,
                     "prompt_tokens": sum(map(len, prompts)), "offload": st.kv_offload}
        engine.shutdown()
        print(f"  {name:10s} {wall:7.1f} s   prefix hits {st.prefix_cache_hits} tokens "
              f"(disk {st.disk_cache_hits}) of {sum(map(len, prompts))}")
    out["speedup"] = out["ram_only"]["wall_s"] / out["disk_tier"]["wall_s"]
    print(f"  disk tier vs RAM only: {out['speedup']:.2f}x")
    return out


def main(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    kw = {k: v for k, v in engine_kwargs.items() if k not in ("kv_offload_dir",)}
    root = Path(args.dir or tempfile.mkdtemp(prefix="pagedllm-kv-"))
    results = {}
    try:
        if args.only in (None, "restart"):
            print(f"restart: a {args.prefix_len}-token prefix")
            results["restart"] = restart(kw, root / "restart", args.prefix_len, args.seed)
        if args.only in (None, "workload"):
            print(f"workload: {args.num_requests} requests over {args.num_docs} documents of {args.doc_len} tokens, "
                  f"RAM pool {args.pool_fraction:.0%} of their KV")
            results["workload"] = workload(kw, root, args)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    report = make_report("offload", args, engine_kwargs, **results)
    write_json(args.json, report)
    return report
