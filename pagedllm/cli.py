"""`pagedllm generate | chat` (and the other subcommands as they land)."""

from __future__ import annotations

import argparse
import logging
import sys

from .errors import PagedLLMError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"])
    g.add_argument("--kv-cache-memory", default=None, help="KV pool budget, e.g. 512MiB, 2GiB")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--memory-utilization", type=float, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "reserve"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-threads", type=int, default=None)


ENGINE_KEYS = ("model", "dtype", "kv_cache_dtype", "kv_cache_memory", "num_kv_blocks", "memory_utilization",
               "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_prefix_caching",
               "enable_chunked_prefill", "preemption_mode", "seed", "num_threads")


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


def sampling_params(args: argparse.Namespace):  # noqa: ANN201
    from .sampling_params import SamplingParams

    return SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.sampling_seed, stop=args.stop, max_tokens=args.max_tokens)


def cmd_generate(args: argparse.Namespace) -> int:
    from .llm import LLM

    llm = LLM(**engine_kwargs(args))
    outs = llm.generate(args.prompts, sampling_params(args))
    for out in outs:
        for c in out.outputs:
            if args.echo:
                sys.stdout.write(out.prompt or "")
            print(c.text)
            if len(outs) > 1 or len(out.outputs) > 1:
                print("---")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from .config import EngineConfig
    from .engine import LLMEngine

    engine = LLMEngine(EngineConfig(**engine_kwargs(args)))
    tok = engine.tokenizer
    if tok is None:
        print("error: this model has no tokenizer", file=sys.stderr)
        return 2
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    turn = 0
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        history.append({"role": "user", "content": line})
        text = tok.apply_chat_template(history, add_generation_prompt=True)
        rid = f"chat-{turn}"
        turn += 1
        engine.add_request(rid, {"prompt_token_ids": tok.encode(text, add_special_tokens=False)},
                           sampling_params(args))
        shown = 0
        reply = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                reply = out.outputs[0].text
                sys.stdout.write(reply[shown:])  # stream tokens as they come
                sys.stdout.flush()
                shown = len(reply)
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": reply})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference on a paged KV cache")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine setup (KV arithmetic, timing)")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one or more prompts")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat (reads lines from stdin, streams replies)")
    c.add_argument("--system", default=None, help="system prompt")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (PagedLLMError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
