"""How close is the engine to what this machine can physically do?

Measures, with torch on the machine at hand, the memory bandwidth (streaming a large fp32
tensor) and the matmul rate (large GEMM in the engine's weight dtype, fp32 or bf16), then times
real decode steps at a batch size, or (--workload) a whole workload of `bench throughput`.
The floor of a step is max(bytes it must read / bandwidth, FLOPs / matmul rate); bytes = the
weights once per step plus the KV of every scheduled sequence's context; FLOPs = 2 x the weights
every scheduled token goes through (lm_head only for the rows that sample) plus attention's
4 x heads x head_dim x keys per query row and layer (causal: a prefill row at position p has p + 1
keys; sliding windows not discounted). A workload's compute floor is the sum of its steps' FLOPs
at the matmul rate, whatever the batching; its step floor is the sum of the steps' floors, for the
steps the scheduler chose.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..sampling_params import SamplingParams
from .common import load_workload, make_report, median_time, now, write_json
from .throughput import run_pagedllm


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=64, help="running sequences in the measured decode steps")
    p.add_argument("--context-len", type=int, default=256, help="prompt length of each sequence")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--workload", default=None, help="mixed | shared-prefix | a .jsonl file: the whole workload of "
                   "bench throughput against its floor, instead of decode steps (--num-requests of it)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--kernels", action="store_true", help="each hot kernel alone (linears of each weight format at "
                   "1 and 256 rows, decode attention over a long context) against this host's ceilings, instead of "
                   "decode steps: a path far below them shows on any CPU")


def measure_bandwidth(nbytes: int = 512 * 2**20, reps: int = 5) -> float:
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t = now()
        x.sum()  # reads every byte once
        best = min(best, now() - t)
    return nbytes / best


def measure_matmul(n: int = 2048, reps: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """The fastest of torch's matmul (MKL for fp32, oneDNN for bf16) and our packed-weight kernel on an
    n^3 product with weights in `dtype`: the ceiling is what this machine can be made to do, not what
    one library does."""
    from ..platforms.cpu import load_ops, pack_weight

    a, b = torch.randn(n, n), torch.randn(n, n)
    ops = load_ops()
    if dtype == torch.bfloat16:
        ab, bb = a.bfloat16(), b.bfloat16()
        candidates = [lambda: ab @ bb]
        if ops is not None:
            packed = ops.pack_bf16(b)
            candidates.append(lambda: ops.linear_bf16(a, packed, None, n))
    else:
        candidates = [lambda: a @ b]
        if ops is not None:
            packed = pack_weight(b, ops.f32_strip)
            candidates.append(lambda: ops.packed_linear(a, packed, None, n))
    best = float("inf")
    for f in candidates:
        f()
        for _ in range(reps):
            t = now()
            f()
            best = min(best, now() - t)
    return 2 * n**3 / best


def main(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    if args.kernels:
        return kernels_main(args, engine_kwargs)
    if args.workload:
        return workload_main(args, engine_kwargs)
    engine = LLMEngine(EngineConfig(**{**engine_kwargs, "enable_prefix_caching": False}))
    model = engine.runner.model
    # counted from the module shapes: with the C++ ops the linears hold packed copies, not .weight
    wformat = model.weight_format
    step_weight_bytes = model.step_weight_bytes()
    matmul_params = model.matmul_params()
    bw, flops = measure_bandwidth(), measure_matmul(dtype=_matmul_dtype(wformat))
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    for i in range(args.batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.context_len)]},
                           SamplingParams(temperature=0, max_tokens=args.decode_steps + 4, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill everything first
    times = []
    for _ in range(args.decode_steps):
        t = now()
        engine.step()
        times.append(now() - t)
    step = statistics.median(times)
    ctx = args.context_len + args.decode_steps // 2
    kv_bytes = args.batch * ctx * engine.kv_bytes_per_token
    bytes_floor = (step_weight_bytes + kv_bytes) / bw
    attn_flops = 4 * args.batch * ctx * model.cfg.num_heads * model.cfg.head_dim * model.cfg.num_layers
    flop_floor = (2 * matmul_params * args.batch + attn_flops) / flops
    floor = max(bytes_floor, flop_floor)
    summary = {"weight_format": wformat,
               "batch": args.batch, "context_len": ctx, "bandwidth_GBps": bw / 1e9, "matmul_GFLOPs": flops / 1e9,
               "weight_bytes_per_step": step_weight_bytes, "kv_bytes_per_step": kv_bytes,
               "bytes_floor_s": bytes_floor, "flops_floor_s": flop_floor, "floor_s": floor,
               "achieved_step_s": step, "achieved_over_floor": step / floor,
               "decode_tokens_per_s": args.batch / step}
    _print_machine(bw, flops, wformat)
    print(f"decode step, batch {args.batch}, context ~{ctx}:")
    print(f"  memory floor   {bytes_floor * 1000:8.2f} ms  ({(step_weight_bytes + kv_bytes) / 2**20:.0f} MiB weights+KV)")
    print(f"  compute floor  {flop_floor * 1000:8.2f} ms")
    print(f"  achieved       {step * 1000:8.2f} ms  = {step / floor:.2f}x the floor, {args.batch / step:.0f} tokens/s")
    report = make_report("roofline", args, engine_kwargs, summary=summary, step_times_s=times)
    write_json(args.json, report)
    return report


def _matmul_dtype(wformat: str) -> torch.dtype:
    return torch.float32 if wformat == "f32" else torch.bfloat16  # quantized formats compute on bf16 tiles


def _print_machine(bw: float, flops: float, wformat: str) -> None:
    dtype = str(_matmul_dtype(wformat)).removeprefix("torch.")
    print(f"machine: {bw / 1e9:.1f} GB/s streaming read, {flops / 1e9:.1f} GFLOP/s {dtype} matmul")


def workload_main(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    """The workload once as warm-up (a few of its requests), then whole, every step's work recorded on the way
    into the model runner: its wall time against the sum of the steps' FLOPs and floors."""
    engine = LLMEngine(EngineConfig(**engine_kwargs))
    model, cfg = engine.runner.model, engine.model_config
    lm_params = cfg.hidden_size * cfg.vocab_size
    body_params = model.matmul_params() - lm_params
    attn_per_key = 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers
    weight_bytes, kv_per_token = model.step_weight_bytes(), engine.kv_bytes_per_token
    bw, flops = measure_bandwidth(), measure_matmul(dtype=_matmul_dtype(model.weight_format))
    work = load_workload(args.workload, args.num_requests, cfg.vocab_size, args.seed, engine.tokenizer)
    steps: list[tuple[int, int, int, int]] = []  # per step: tokens, sampled rows, attended keys, KV tokens read
    execute = engine.runner.execute

    def recorded(sched, *a, **k):
        tokens = sampled = keys = kv = 0
        for s in sched.scheduled:
            start, n = s.request.num_computed_tokens, s.num_new_tokens
            tokens += n
            sampled += s.completes
            keys += n * start + n * (n + 1) // 2  # positions start .. start + n - 1 see p + 1 keys
            kv += start + n
        steps.append((tokens, sampled, keys, kv))
        return execute(sched, *a, **k)

    # the run bench throughput times, so the achieved time here is the one its table reports
    run_pagedllm(engine, load_workload(args.workload, 4, cfg.vocab_size, args.seed + 1, engine.tokenizer), False)
    engine.block_manager.reset_prefix_cache()
    engine.runner.execute = recorded
    try:
        wall = run_pagedllm(engine, work, False)["wall_s"]
    finally:
        engine.runner.execute = execute
    step_flops = [2 * body_params * t + 2 * lm_params * n + attn_per_key * k for t, n, k, _ in steps]
    step_bytes = [weight_bytes + kv_per_token * kv for *_, kv in steps]
    compute_floor = sum(step_flops) / flops
    step_floor = sum(max(f / flops, b / bw) for f, b in zip(step_flops, step_bytes))
    summary = {"weight_format": model.weight_format, "workload": args.workload, "num_requests": len(work),
               "bandwidth_GBps": bw / 1e9, "matmul_GFLOPs": flops / 1e9, "steps": len(steps),
               "tokens_computed": sum(t for t, *_ in steps), "total_TFLOP": sum(step_flops) / 1e12,
               "compute_floor_s": compute_floor, "step_floor_s": step_floor, "achieved_s": wall,
               "achieved_over_compute_floor": wall / compute_floor, "achieved_over_step_floor": wall / step_floor,
               "achieved_GFLOPs": sum(step_flops) / wall / 1e9}
    _print_machine(bw, flops, model.weight_format)
    print(f"workload {args.workload}, {len(work)} requests: {len(steps)} steps, {summary['tokens_computed']} tokens "
          f"through the model, {summary['total_TFLOP']:.2f} TFLOP")
    print(f"  compute floor  {compute_floor:8.2f} s  (all FLOPs at the matmul rate)")
    print(f"  step floor     {step_floor:8.2f} s  (each step's max of bytes and FLOPs, these steps)")
    print(f"  achieved       {wall:8.2f} s  = {wall / compute_floor:.2f}x the compute floor, "
          f"{wall / step_floor:.2f}x the step floor, {summary['achieved_GFLOPs']:.0f} GFLOP/s")
    report = make_report("roofline", args, engine_kwargs, summary=summary)
    write_json(args.json, report)
    return report


# SmolLM2-135M's linears (out, in) for one layer, repeated to 30 distinct layers: ~10x the L3 cache of these
# hosts in bf16, so one row streams the weights from memory as decode does
_LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
# an 8B-class layer's (Llama-3-8B: qkv, o, gate_up, down), 4 distinct layers (~470 MB in Q4_0, more than these
# hosts' L3): SmolLM2's small matrices put per-call costs in the row; these show the integer dot's own rate
_BIG_LAYER = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
FAR_BELOW = 0.25  # a kernel under this fraction of its ceiling is marked


def kernels_main(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    """Each hot kernel alone, its achieved rate against the ceiling that bounds it on this host: GB/s of weights
    (or K/V) against the streaming-read bandwidth where one row streams them, GFLOP/s against the best matmul
    rate (torch's library or our kernel, in that precision) where many rows make it compute-bound."""
    import numpy as np

    from ..model_executor.layers.formats import FORMATS
    from ..model_executor.layers.weight_formats import GGMLWeight
    from ..platforms.cpu import load_ops, pack_weight
    from .random_gguf import random_tensor

    ops = load_ops()
    if ops is None:
        raise SystemExit("bench roofline --kernels needs the C++ kernels")
    torch.manual_seed(args.seed)
    bw = measure_bandwidth()
    peak = {torch.float32: measure_matmul(dtype=torch.float32), torch.bfloat16: measure_matmul(dtype=torch.bfloat16)}
    shapes = _LAYER * 30
    flops_per_row = sum(2 * o * k for o, k in shapes)
    rng = np.random.default_rng(args.seed)
    formats = {
        "fp32 panels": ([pack_weight(torch.randn(o, k) * 0.02, ops.f32_strip) for o, k in shapes], 4.0, torch.float32,
                        lambda w, x, o: ops.packed_linear(x, w, None, o)),
        "bf16 panels": ([ops.pack_bf16(torch.randn(o, k) * 0.02) for o, k in shapes], 2.0, torch.bfloat16,
                        lambda w, x, o: ops.linear_bf16(x, w, None, o)),
    }
    for name in ("q4_0", "q8_0"):
        fmt = FORMATS[name]
        ws = [GGMLWeight(ops, [(torch.from_numpy(random_tensor(rng, o, k, name.upper(), fast=True)), fmt)], k)
              for o, k in shapes]
        formats[name] = (ws, fmt.bytes_per_weight, torch.bfloat16, lambda w, x, o: w.matmul(x))
    rows = []
    for name, (ws, bytes_per_weight, dtype, run) in formats.items():
        for m in (1, 256):
            xs = {k: torch.randn(m, k) for k in (576, 1536)}
            t = median_time(lambda ws=ws, xs=xs, run=run: [run(w, xs[k], o) for w, (o, k) in zip(ws, shapes)], reps=5)
            if m == 1:
                rate, ceiling, unit = sum(o * k for o, k in shapes) * bytes_per_weight / t, bw, "GB/s"
            else:
                rate, ceiling, unit = flops_per_row * m / t, peak[dtype], "GFLOP/s"
            rows.append({"kernel": f"linear, {name}", "rows": m, "achieved": rate / 1e9, "ceiling": ceiling / 1e9,
                         "unit": unit, "fraction": rate / ceiling})
        del ws
    big = _BIG_LAYER * 4
    for name in ("q4_0", "q8_0"):
        fmt = FORMATS[name]
        ws = [GGMLWeight(ops, [(torch.from_numpy(random_tensor(rng, o, k, name.upper(), fast=True)), fmt)], k)
              for o, k in big]
        xs = {k: torch.randn(1, k) for k in (4096, 14336)}
        t = median_time(lambda ws=ws, xs=xs: [w.matmul(xs[k]) for w, (_, k) in zip(ws, big)], reps=5)
        rate = sum(w.nbytes for w in ws) / t
        rows.append({"kernel": f"linear, {name}, 8B layers", "rows": 1, "achieved": rate / 1e9,
                     "ceiling": bw / 1e9, "unit": "GB/s", "fraction": rate / bw})
        del ws
    rows.append(_decode_attention_row(ops, bw))
    print(f"machine: {bw / 1e9:.1f} GB/s streaming read, {peak[torch.float32] / 1e9:.1f} GFLOP/s fp32 and "
          f"{peak[torch.bfloat16] / 1e9:.1f} GFLOP/s bf16 matmul (best of torch and our kernel); "
          f"C++ paths: fp32/bf16 {ops.linear_bf16_isa}, integer dots {ops.linear_ggml_isa}")
    for r in rows:
        mark = "   <- far below its ceiling" if r["fraction"] < FAR_BELOW else ""
        print(f"  {r['kernel']:28s} {r['rows']:4d} rows  {r['achieved']:8.1f} / {r['ceiling']:7.1f} {r['unit']:8s}"
              f" {r['fraction']:6.0%}{mark}")
    summary = {"bandwidth_GBps": bw / 1e9, "matmul_GFLOPs_fp32": peak[torch.float32] / 1e9,
               "matmul_GFLOPs_bf16": peak[torch.bfloat16] / 1e9, "linear_isa": ops.linear_bf16_isa,
               "ggml_isa": ops.linear_ggml_isa, "kernels": rows}
    report = make_report("roofline", args, engine_kwargs, summary=summary)
    write_json(args.json, report)
    return report


def _decode_attention_row(ops, bw: float) -> dict:
    """One decode row each for 16 sequences of 2048 keys, SmolLM2's heads (9 / 3 KV, D 64), an fp32 pool of
    ~50 MB: the K/V bytes read against the streaming bandwidth."""

    seqs, ctx, bs, heads, kv_heads, d = 16, 2048, 16, 9, 3, 64
    nb = seqs * ctx // bs
    k_pool, v_pool = torch.randn(nb, bs, kv_heads, d), torch.randn(nb, bs, kv_heads, d)
    tables = torch.randperm(nb).view(seqs, ctx // bs)
    q, out = torch.randn(seqs, heads, d), torch.empty(seqs, heads, d)
    meta = (tables, torch.arange(seqs), torch.arange(seqs), torch.ones(seqs, dtype=torch.long),
            torch.full((seqs,), ctx))
    t = median_time(lambda: ops.paged_attention(out, q, k_pool, v_pool, *meta, d ** -0.5, 0, None, None, None, None))
    rate = 2 * k_pool.numel() * 4 / t
    return {"kernel": "decode attention, fp32 pool", "rows": seqs, "achieved": rate / 1e9, "ceiling": bw / 1e9,
            "unit": "GB/s", "fraction": rate / bw}
