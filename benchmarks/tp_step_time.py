"""Tensor parallelism on this machine: decode step time at TP=1 (2 threads) and TP=2 (two processes
of 1 thread), and the bytes all-reduced per token per layer, on a random-weight Llama whose heads
divide by 2 (hidden 1024, 16 heads / 4 KV heads, 12 layers, MLP 2816, vocab 32000; fp32 weights,
dense). Greedy, 8 sequences of 64-token prompts, 32 decode steps timed (median), engines alternated.
Run: .venv/bin/python benchmarks/tp_step_time.py [out.json]; TP_THREADS=default leaves the TP=2 engine's num_threads
unset (each rank then takes its share of the cores itself)."""

import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch
import transformers

from pagedllm import LLM, SamplingParams


def build(path: str) -> None:
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def decode_steps(llm: LLM, batch: int, steps: int = 32) -> tuple[float, list[list[int]]]:
    e = llm.engine
    rng = random.Random(0)
    for i in range(batch):
        e.add_request(f"b{batch}-{i}-{time.monotonic()}", {"prompt_token_ids": [rng.randrange(32000) for _ in range(64)]},
                      SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    e.step()  # the prefills
    times, outs = [], []
    while e.has_unfinished_requests():
        t = time.perf_counter()
        for o in e.step():
            if o.finished:
                outs.append(o.outputs[0].token_ids)
        times.append(time.perf_counter() - t)
    return statistics.median(times[:steps]), outs


if __name__ == "__main__":
    report = {}
    with tempfile.TemporaryDirectory() as d:
        build(d)
        one = LLM(d, dtype="float32", num_threads=2, max_model_len=512, enable_prefix_caching=False)
        threads = {} if os.environ.get("TP_THREADS") == "default" else {"num_threads": 1}
        two = LLM(d, dtype="float32", max_model_len=512, tensor_parallel_size=2, enable_prefix_caching=False, **threads)
        # the thread count is the process's: the TP=2 driver's (set as it started) would otherwise run TP=1 too
        driver_threads = torch.get_num_threads()
        for batch in (1, 8):
            torch.set_num_threads(2)
            decode_steps(one, batch, 4)  # warm-up
            t1, o1 = decode_steps(one, batch)
            torch.set_num_threads(driver_threads)
            decode_steps(two, batch, 4)
            tp = two.engine.executor.group
            r0, g0 = tp.bytes_all_reduced, tp.bytes_gathered
            t2, o2 = decode_steps(two, batch)
            tokens = batch * 33 + batch * 64  # every scheduled token went through every layer
            per_layer = (tp.bytes_all_reduced - r0) / tokens / 12
            report[f"batch {batch}"] = {"tp1_step_ms": t1 * 1000, "tp2_step_ms": t2 * 1000, "tp2_over_tp1": t2 / t1,
                                        "bytes_all_reduced_per_token_per_layer": per_layer,
                                        "bytes_gathered_per_step": (tp.bytes_gathered - g0) / 34,
                                        "same_tokens": sorted(o1) == sorted(o2)}
            print(f"batch {batch}: decode step TP=1 {t1 * 1000:.2f} ms, TP=2 {t2 * 1000:.2f} ms ({t2 / t1:.2f}x); "
                  f"all-reduced {per_layer:.0f} B per token per layer (rank 0's share); same greedy tokens: "
                  f"{sorted(o1) == sorted(o2)}")
        two.shutdown()
    if len(sys.argv) > 1:
        json.dump(report, open(sys.argv[1], "w"), indent=1)
