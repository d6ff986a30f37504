"""Drive a running server over HTTP: open-loop Poisson arrivals (or a fixed concurrency),
streaming; request throughput, output tokens/s, TTFT / ITL / E2E percentiles, errors.
--big-prompt-chars sends one huge text prompt after another while the streams run (the server must
tokenize it off its event loop), to measure what it does to everyone else's inter-token latency."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics

from ..tools.workloads import WorkItem, mixed
from .common import make_report, now, write_json


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", default="mixed", help="mixed | fixed (--input-len, --output-len)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=None, help="default: from the server's /tokenize count")
    p.add_argument("--input-len", type=int, default=128, help="--workload fixed: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="--workload fixed: output tokens")
    p.add_argument("--big-prompt-chars", type=int, default=0, help="interfering text prompts of this many characters")
    p.add_argument("--big-prompt-interval", type=float, default=0.5, help="seconds between interfering prompts")


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(round(q * (len(s) - 1))))]
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": statistics.fmean(s)}


async def _one(client, url: str, w: WorkItem, headers: dict) -> dict:
    body = {"prompt": w.prompt_token_ids, "max_tokens": w.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = now()
    times: list[float] = []
    tokens = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    return {"ok": False, "error": d["error"]["message"]}
                if d.get("choices") and d["choices"][0]["text"]:
                    times.append(now())
                if d.get("usage"):
                    tokens = d["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - counted as an error of this request
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    end = now()
    return {"ok": True, "ttft": (times[0] - t0) if times else end - t0, "e2e": end - t0, "tokens": tokens,
            "itl": [b - a for a, b in zip(times, times[1:])]}


async def _interfere(client, url: str, chars: int, interval: float, headers: dict, done: asyncio.Event,
                     seed: int) -> list[int]:
    """Big text prompts, one after another until done: their statuses (a prompt past max_model_len is a 400,
    after the server has tokenized it: the cost being measured)."""
    rng = random.Random(seed)
    words = ["memory", "wall", "paged", "block", "token", "cache", "prefix", "batch", "the", "of", "and"]
    statuses = []
    while not done.is_set():
        text = " ".join(rng.choice(words) for _ in range(chars // 5))[:chars]
        r = await client.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 1}, headers=headers)
        statuses.append(r.status_code)
        try:
            await asyncio.wait_for(done.wait(), interval)
        except asyncio.TimeoutError:
            pass
    return statuses


async def run(args: argparse.Namespace, work: list[WorkItem]) -> tuple[list[dict], float, list[int]]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    limits = httpx.Limits(max_connections=max(len(work), 1) + 8, max_keepalive_connections=max(len(work), 1))

    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        async def guarded(w: WorkItem) -> dict:
            if sem is None:
                return await _one(client, args.base_url, w, headers)
            async with sem:
                return await _one(client, args.base_url, w, headers)

        warm = await _one(client, args.base_url, WorkItem(work[0].prompt_token_ids, 4), headers)  # warm-up, untimed
        if not warm["ok"]:
            raise RuntimeError(f"warm-up request failed: {warm['error']}")
        tasks = []
        done = asyncio.Event()
        big = asyncio.create_task(_interfere(client, args.base_url, args.big_prompt_chars, args.big_prompt_interval,
                                             headers, done, args.seed)) if args.big_prompt_chars else None
        t0 = now()
        for w in work:
            tasks.append(asyncio.create_task(guarded(w)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        wall = now() - t0
        done.set()
        return results, wall, (await big) if big else []


def main(args: argparse.Namespace, _engine_kwargs: dict) -> dict:
    import httpx

    vocab = args.vocab_size
    if vocab is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        models = httpx.get(args.base_url + "/v1/models", headers=headers, timeout=30).json()
        vocab = models["data"][0]["vocab_size"]
    if args.workload == "fixed":
        rng = random.Random(args.seed)
        work = [WorkItem([rng.randrange(vocab) for _ in range(args.input_len)], args.output_len)
                for _ in range(args.num_requests)]
    else:
        work = mixed(args.num_requests, vocab, args.seed)
    results, wall, big = asyncio.run(run(args, work))
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["tokens"] for r in ok)
    summary = {"requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
               "wall_s": wall, "request_throughput": len(ok) / wall, "output_tokens": out_tokens,
               "output_tokens_per_s": out_tokens / wall,
               "ttft_s": percentiles([r["ttft"] for r in ok]), "itl_s": percentiles([x for r in ok for x in r["itl"]]),
               "e2e_s": percentiles([r["e2e"] for r in ok]),
               "error_messages": sorted({r["error"] for r in results if not r["ok"]})[:5],
               "itl_max_s": max((x for r in ok for x in r["itl"]), default=None),
               "big_prompts": {"chars": args.big_prompt_chars, "sent": len(big),
                               "statuses": {str(c): big.count(c) for c in sorted(set(big))}}}
    print(f"{summary['completed']}/{summary['requests']} ok in {wall:.1f}s: {summary['request_throughput']:.2f} req/s, "
          f"{summary['output_tokens_per_s']:.1f} output tok/s, errors {summary['errors']}")
    for key in ("ttft_s", "itl_s", "e2e_s"):
        p = summary[key]
        if p["p50"] is not None:
            print(f"  {key[:-2]:5} ms  p50 {p['p50'] * 1000:9.1f}  p90 {p['p90'] * 1000:9.1f}  p99 {p['p99'] * 1000:9.1f}")
    if summary["itl_max_s"] is not None:
        print(f"  itl max {summary['itl_max_s'] * 1000:.1f} ms")
    if big:
        print(f"  {len(big)} interfering prompts of {args.big_prompt_chars} characters: {summary['big_prompts']['statuses']}")
    report = make_report("serve", args, None, summary=summary)
    write_json(args.json, report)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 3, figsize=(11, 3.5))
        for a, key in zip(ax, ("ttft", "e2e")):
            a.hist([r[key] for r in ok], bins=30)
            a.set_title(f"{key} (s)")
        ax[2].hist([x for r in ok for x in r["itl"]], bins=30)
        ax[2].set_title("inter-token latency (s)")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        plt.close(fig)
    return report
