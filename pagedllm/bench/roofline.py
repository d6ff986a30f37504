"""How close is a decode step to what this machine can physically do?

Measures, with torch on the machine at hand, the memory bandwidth (streaming a large fp32
tensor) and the matmul rate (large GEMM in the engine's weight dtype, fp32 or bf16), then times
real decode steps at a batch size.
The floor of a step is max(bytes it must read / bandwidth, FLOPs / matmul rate); bytes = the
weights once per step plus the KV of every sequence's context.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from ..config import EngineConfig
from ..engine import LLMEngine
from ..sampling_params import SamplingParams
from .common import make_report, now, write_json


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=64, help="running sequences in the measured decode steps")
    p.add_argument("--context-len", type=int, default=256, help="prompt length of each sequence")
    p.add_argument("--decode-steps", type=int, default=16)


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
    from ..kernels import load_ops, pack_weight

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
            packed = pack_weight(b)
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
    engine = LLMEngine(EngineConfig(**{**engine_kwargs, "enable_prefix_caching": False}))
    model = engine.runner.model
    # counted from the module shapes: with the C++ ops the linears hold packed copies, not .weight
    wformat = model.weight_format
    step_weight_bytes = model.step_weight_bytes()
    wdtype = torch.float32 if wformat == "f32" else torch.bfloat16  # quantized formats compute on bf16 tiles
    matmul_params = model.matmul_params()
    bw, flops = measure_bandwidth(), measure_matmul(dtype=wdtype)
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
    print(f"machine: {bw / 1e9:.1f} GB/s streaming read, {flops / 1e9:.1f} GFLOP/s {str(wdtype).removeprefix('torch.')} matmul")
    print(f"decode step, batch {args.batch}, context ~{ctx}:")
    print(f"  memory floor   {bytes_floor * 1000:8.2f} ms  ({(step_weight_bytes + kv_bytes) / 2**20:.0f} MiB weights+KV)")
    print(f"  compute floor  {flop_floor * 1000:8.2f} ms")
    print(f"  achieved       {step * 1000:8.2f} ms  = {step / floor:.2f}x the floor, {args.batch / step:.0f} tokens/s")
    report = make_report("roofline", args, engine_kwargs, summary=summary, step_times_s=times)
    write_json(args.json, report)
    return report
