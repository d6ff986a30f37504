"""The `pagedllm` command: the parser, generate, chat, serve, and a torchrun worker's entry."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..errors import PagedLLMError
from .cli_args import add_engine_args, add_sampling_args, engine_kwargs, sampling_params
from .cli_tools import cmd_eval, cmd_eval_kv, cmd_plan, cmd_random_gguf, cmd_simulate


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
    from ..config import EngineConfig
    from ..engine.llm_engine import LLMEngine

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


def cmd_serve(args: argparse.Namespace) -> int:
    import resource

    import uvicorn

    from ..config import EngineConfig
    from .openai.api_server import build_app
    from .openai.http import DrainingServer, guarded_protocol

    config = EngineConfig(**engine_kwargs(args))  # validate options before binding the port
    address = f"http://{args.host}:{args.port}"
    app = build_app(config, served_model_name=args.served_model_name, api_key=args.api_key,
                    max_queue_len=args.max_queue_len, max_body_bytes=args.max_body_bytes,
                    trust_request_chat_template=args.trust_request_chat_template, body_timeout=args.body_timeout,
                    address=address, reasoning_parser=args.reasoning_parser)
    # connections are capped below the descriptor limit, so accept() never fails for want of one
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    max_connections = max(16, min(args.max_connections, soft - 256))
    logging.getLogger("pagedllm.server").setLevel(logging.INFO)  # the banner and its warnings, -v or not
    server = DrainingServer(uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info", access_log=not args.no_access_log,
        http=guarded_protocol(args.header_timeout, max_connections), timeout_keep_alive=args.timeout_keep_alive,
        timeout_graceful_shutdown=args.shutdown_timeout + 5), app.state.engine.drain, args.shutdown_timeout)
    import signal

    # uvicorn re-raises the signal it stopped on to the handler installed before it: a no-op one there
    # makes a requested shutdown exit 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    code = 1 if getattr(app.state, "fatal", None) else 0  # no model, or a lost tensor-parallel worker
    if getattr(app.state, "stalled", False):
        logging.getLogger("pagedllm.server").error("the engine did not stop (a step never returned); exiting")
        logging.shutdown()
        os._exit(1)  # its thread would hold the interpreter's exit forever
    return code


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

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 and /tokenize")
    sv.add_argument("--served-model-name", default=None)
    sv.add_argument("--max-queue-len", type=int, default=1024, help="waiting requests beyond this get 429")
    sv.add_argument("--max-body-bytes", type=int, default=8 * 2**20)
    sv.add_argument("--reasoning-parser", choices=["qwen3", "deepseek_r1"], default=None,
                    help="return a thinking model's <think> part as message.reasoning_content (vLLM's flag)")
    sv.add_argument("--trust-request-chat-template", action="store_true",
                    help="allow chat_template in request bodies (a template is a program; off by default, as in vLLM)")
    sv.add_argument("--shutdown-timeout", type=float, default=5.0,
                    help="on SIGTERM, seconds running requests get to finish before they are aborted")
    sv.add_argument("--header-timeout", type=float, default=10.0,
                    help="seconds a connection has to send a request head before it is closed")
    sv.add_argument("--body-timeout", type=float, default=30.0, help="seconds a request body has to arrive (408)")
    sv.add_argument("--timeout-keep-alive", type=float, default=5.0, help="idle seconds before a keep-alive closes")
    sv.add_argument("--max-connections", type=int, default=4096,
                    help="open connections beyond this are closed at once (also kept under the file limit)")
    sv.add_argument("--no-access-log", action="store_true", help="do not log each request")
    add_engine_args(sv)
    sv.set_defaults(func=cmd_serve)

    from ..bench import latency, memory, offload, roofline, serve, structured, throughput

    bench = sub.add_parser("bench", help="benchmarks: throughput | latency | serve | memory | offload | roofline | "
                                          "structured")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for name, mod, doc in (("throughput", throughput, "pagedllm vs the traditional approach on a workload"),
                           ("latency", latency, "one request: time to first token, decode tokens/s"),
                           ("serve", serve, "drive a running server: Poisson arrivals, latency percentiles"),
                           ("memory", memory, "KV bytes used by paging vs max-length preallocation"),
                           ("offload", offload, "the prefix cache's disk tier: after a restart, and past the RAM pool"),
                           ("roofline", roofline, "decode step time vs this machine's bandwidth/compute floor"),
                           ("structured", structured, "throughput with part of the batch grammar-constrained")):
        b = bsub.add_parser(name, help=doc)
        mod.add_args(b)
        if name != "serve":
            add_engine_args(b)
        else:
            b.add_argument("--seed", type=int, default=0)
        b.add_argument("--json", default=None, help="write every number, the configuration and the machine here")
        b.add_argument("--plot", default=None, help="PNG file")
        b.add_argument("--no-progress", action="store_true")
        b.set_defaults(func=lambda a, m=mod: (m.main(a, engine_kwargs(a)), 0)[1])

    rg = bsub.add_parser("random-gguf", help="write a random-weight GGUF of a real model shape (real kernels, noise)")
    rg.add_argument("out")
    rg.add_argument("--shape", default="llama3-8b",
                    help="llama3-8b | qwen3-30b-a3b | gpt-oss-20b | gemma3-4b | qwen3.5-9b | tiny | tiny-moe | tiny-qwen3.5")
    rg.add_argument("--type", default="Q4_0", help="ggml type of the linears and embeddings (Q4_0, Q4_K, Q8_0, ...)")
    rg.add_argument("--types", default=None, help="overrides by tensor-name suffix: attn_v.weight=Q6_K,ffn_down.weight=Q6_K")
    rg.add_argument("--seed", type=int, default=0)
    rg.add_argument("--exact", action="store_true", help="quantize N(0, 0.02) weights (minutes for 8B) instead of "
                                                          "random blocks of that spread (seconds)")
    rg.set_defaults(func=cmd_random_gguf)

    def model_args(x: argparse.ArgumentParser) -> None:
        m = x.add_mutually_exclusive_group()
        m.add_argument("--model", default=None, help="HF folder, .gguf file or config.json (default: SmolLM2-135M)")
        m.add_argument("--preset", default=None, help="seed-7b | seed-13b | smollm2-135m")
        x.add_argument("--kv-dtype", default="float16",
                       help="float32 | bfloat16 | float16 | fp8_e4m3 | fp8_e5m2 | q8_0 | q4_0, or K/V integer formats: "
                            "q8_0/q4_0")
        x.add_argument("--block-size", type=int, default=16)
        x.add_argument("--max-model-len", type=int, default=None)
        x.add_argument("--json", nargs="?", const=True, default=None)

    pl = sub.add_parser("plan", help="capacity planner: KV arithmetic, static vs paged concurrency")
    model_args(pl)
    pl.add_argument("--memory", default="80GB", help="device memory")
    pl.add_argument("--weights-memory", default=None, help="default: as stored (a GGUF's formats, the preset's) "
                                                            "or parameters x 2 bytes")
    pl.add_argument("--weight-format", default=None, help="parameters x this format's bytes per weight: f32, bf16, "
                                                           "q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k")
    pl.add_argument("--activation-memory", default=None)
    pl.add_argument("--mean-prompt", type=int, default=512)
    pl.add_argument("--mean-output", type=int, default=256)
    pl.add_argument("--concurrency", type=int, default=None, help="also show the KV that many sequences need")
    pl.set_defaults(func=cmd_plan)

    si = sub.add_parser("simulate", help="replay a trace: contiguous max-length allocator vs paged blocks")
    model_args(si)
    si.add_argument("--kv-memory", default="46GB", help="memory left for KV")
    si.add_argument("--trace", default=None, help="JSONL of {arrival, prompt_len, output_len, max_tokens}")
    si.add_argument("--num-requests", type=int, default=300)
    si.add_argument("--rate", type=float, default=0.5, help="mean arrivals per decode step")
    si.add_argument("--seed", type=int, default=0)
    si.add_argument("--plot", default=None, help="PNG file")
    si.add_argument("--html", default=None, help="self-contained page: each pool over time, request by request")
    si.set_defaults(func=cmd_simulate)

    ew = sub.add_parser("eval", help="weight formats vs an fp32 reference of the same weights: perplexity, mean KL, "
                                     "top-1 agreement")
    ew.add_argument("--model", default=None)
    ew.add_argument("--formats", default="bfloat16,native",
                    help="comma-separated: a dtype (the weights dequantized to it), native (a GGUF's own formats), "
                         "or a format to quantize to at load (q8_0, q4_0, q4_1, q5_0, q5_1)")
    ew.add_argument("--reference", default="float32", help="dtype of the reference (a GGUF dequantized to it)")
    ew.add_argument("--text", default=None, help="a UTF-8 text (default: an English text that ships with pagedllm)")
    ew.add_argument("--kv-cache-dtype", default="float32", help="the same for every row, fp32 to isolate the weights")
    ew.add_argument("--kv-cache-memory", default="1GiB")
    ew.add_argument("--max-model-len", type=int, default=4096)
    ew.add_argument("--chunk", type=int, default=512)
    ew.add_argument("--json", default=None)
    ew.set_defaults(func=cmd_eval)

    ev = sub.add_parser("eval-kv", help="perplexity and greedy agreement of each KV cache dtype")
    ev.add_argument("--model", default=None)
    ev.add_argument("--dtype", default="float32", help="weights; fp32 isolates the KV dtype's effect")
    ev.add_argument("--text", default=None, help="a UTF-8 text of >= 2000 tokens (default: one that ships with pagedllm)")
    ev.add_argument("--kv-dtypes", default="float32,bfloat16,fp8_e4m3,fp8_e5m2")
    ev.add_argument("--kv-cache-memory", default="1GiB")
    ev.add_argument("--max-model-len", type=int, default=4096)
    ev.add_argument("--chunk", type=int, default=512, help="prefill chunk of the perplexity pass")
    ev.add_argument("--num-prompts", type=int, default=8)
    ev.add_argument("--max-tokens", type=int, default=64)
    ev.add_argument("--json", default=None)
    ev.set_defaults(func=cmd_eval_kv)
    return parser


def run_torchrun_worker(args: argparse.Namespace) -> int:
    from ..config import EngineConfig
    from ..executor.tp import run_worker

    config = EngineConfig(**engine_kwargs(args))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != config.tensor_parallel_size:
        raise ValueError(f"torchrun WORLD_SIZE={world} differs from --tensor-parallel-size {config.tensor_parallel_size}")
    run_worker(rank, world, "env://", config)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if getattr(args, "tensor_parallel_size", 1) > 1 and os.environ.get("RANK", "0") != "0":
            return run_torchrun_worker(args)  # torchrun rank > 0: a worker of rank 0's engine
        return args.func(args)
    except (PagedLLMError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
