"""The engine and sampling flags every CLI command shares, and what they turn into."""

from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto",
                   help="auto (a GPU if torch sees one, else the CPU), cpu, or a torch device such as cuda or cuda:1")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode steps on a GPU (each kernel launched from Python)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights of the model folder's config.json (speed and memory without weights)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: the C++ kernels on the CPU, Triton on a GPU; torch: the reference; triton: the Triton "
                        "kernels on any device (on the CPU in Triton's interpreter, for tests)")
    g.add_argument("--quantization", default=None, choices=["none", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"],
                   help="default: weights as stored (a GGUF's own formats); none: dequantize a GGUF to --dtype; "
                        "else quantize the linears at load")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="auto | float32 | bfloat16 | float16 | fp8_e4m3 | fp8_e5m2 | q8_0 | q4_0, or K/V integer "
                        "formats of their own: q8_0/q4_0")
    g.add_argument("--kv-cache-memory", default=None, help="KV pool budget, e.g. 512MiB, 2GiB")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--memory-utilization", type=float, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--no-hybrid-kv-cache", dest="hybrid_kv_cache", action="store_false",
                   help="every layer keeps K/V for every token (by default sliding-window layers keep their window)")
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "reserve"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="worker processes over torch.distributed (gloo on CPU); under torchrun, ranks > 0 serve "
                        "as workers")
    g.add_argument("--kv-events-config", default=None,
                   help='prefix-cache events for fleet routers, vLLM\'s schema and transport, as JSON: '
                        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\'')
    g.add_argument("--kv-offload-dir", default=None,
                   help="a directory for the prefix cache's disk tier: computed blocks are saved there and read back "
                        "instead of recomputed (across restarts too; several servers may share it)")
    g.add_argument("--kv-offload-bytes", default="16GiB", help="the disk tier's budget, e.g. 50GiB (LRU eviction)")
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding as JSON, vLLM\'s names: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        'or \'{"method": "draft_model", "model": PATH}\'')


ENGINE_KEYS = ("model", "dtype", "device", "attention_backend", "load_format", "enforce_eager",
               "quantization", "kv_cache_dtype", "kv_cache_memory", "num_kv_blocks",
               "memory_utilization",
               "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_prefix_caching",
               "enable_chunked_prefill", "hybrid_kv_cache", "preemption_mode", "seed", "num_threads", "speculative_config",
               "kv_events_config", "kv_offload_dir", "kv_offload_bytes",
               "tensor_parallel_size")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ENGINE_KEYS if hasattr(args, k)}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--n", type=int, default=1)


def sampling_params(args: argparse.Namespace):
    from ..sampling_params import SamplingParams

    return SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.sampling_seed, stop=args.stop, max_tokens=args.max_tokens)
