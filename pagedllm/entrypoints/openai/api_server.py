"""The OpenAI-compatible FastAPI app: completions, chat, models, tokenize, health, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...config import EngineConfig
from ...engine.async_engine import AsyncEngine, NewRequest, QueueFullError, RequestStream, ShuttingDownError
from ...errors import InvalidRequestError
from ...outputs import RequestOutput
from ...sample.structured_outputs import validate_json_schema
from ...sampling_params import SamplingParams, StructuredOutputsParams
from .http import BodyLimitMiddleware, error_response
from .openapi import with_model_bounds
from .protocol import (
    CHAT_NOOPS,
    COMPLETION_NOOPS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    unsupported_field,
)
from .tool_calls import (
    ToolCallStream,
    ToolFormat,
    check_tools,
    parse_tool_calls,
    structural_tag,
    template_knows_tools,
    template_messages,
    tool_calls_message,
    tool_format_for,
)

STATIC = Path(__file__).parent / "static"
DASHBOARD_FILES = {"kvmap.js": "text/javascript", "kvmap.css": "text/css", "dashboard.js": "text/javascript"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


class APIKeyMiddleware:
    def __init__(self, app, api_key: str) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        # the dashboard's page and scripts carry no data (its snapshot endpoint is behind the key)
        path = scope.get("path", "")
        if scope["type"] == "http" and path not in ("/health", "/ready", "/metrics", "/dashboard") \
                and not (path.startswith("/dashboard/") and path.rsplit("/", 1)[-1] in DASHBOARD_FILES):
            auth = dict(scope.get("headers", [])).get(b"authorization", b"").decode("latin-1")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not secrets.compare_digest(token.encode(), self.api_key.encode()):
                return await error_response(401, "invalid or missing API key", "authentication_error",
                                            code="invalid_api_key")(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(config: EngineConfig, served_model_name: str | None = None, api_key: str | None = None,
              max_queue_len: int = 1024, max_body_bytes: int = 8 * 2**20,
              trust_request_chat_template: bool = False, body_timeout: float = 30.0,
              address: str | None = None) -> FastAPI:
    """address: where the server listens, for the startup banner."""
    engine = AsyncEngine(config, max_queue_len=max_queue_len)
    log = logging.getLogger("pagedllm.server")

    def fatal(reason: str) -> None:  # the model did not load, or a tensor-parallel worker died: shut down
        import os
        import signal

        log.error("engine stopped for good (%s); shutting down", reason)
        app.state.fatal = reason
        os.kill(os.getpid(), signal.SIGTERM)

    def ready(e) -> None:
        bm = e.block_manager
        log.info("pagedllm serving %s at %s (KV pool: %d blocks x %d tokens = %d tokens, %.0f MiB; "
                 "max_model_len %d)", served_model_name or e.model_name, address or "?", bm.num_blocks,
                 bm.block_size, bm.num_blocks * bm.block_size, bm.num_blocks * e.bytes_per_block / 2**20,
                 e.max_model_len)

    engine.on_fatal = fatal
    engine.on_ready = ready

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        yield
        if not await engine.stop(timeout=5.0):
            app.state.stalled = True  # a step that never returns: the process must exit without it

    app = FastAPI(title="pagedllm", lifespan=lifespan)
    app.state.engine = engine

    def openapi() -> dict:
        """FastAPI's schema plus the loaded model's bounds (kept once the model is there)."""
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        e = engine.engine
        if e is None:
            return schema
        app.openapi_schema = with_model_bounds(schema, model_name(), e.model_config.vocab_size, e.max_model_len)
        return app.openapi_schema

    app.openapi = openapi

    def model_name() -> str:
        return served_model_name or (engine.engine.model_name if engine.engine else "pagedllm")

    def core():
        if engine.engine is None:
            if engine.load_error:
                raise APIError(503, f"model failed to load: {engine.load_error}", "service_unavailable")
            raise APIError(503, "the model is loading; retry shortly", "service_unavailable")
        return engine.engine

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name():
            raise APIError(400, f"model {name!r} does not exist; this server serves {model_name()!r}",
                           param="model", code="model_not_found")

    # ---- errors --------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg = "request body is not valid JSON (or not UTF-8)"
        return error_response(400, f"{'.'.join(loc) + ': ' if loc else ''}{msg}", param=".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else
                              "server_error")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(e).__name__}", "server_error")

    # ---- plain endpoints -----------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if engine.ready:
            return JSONResponse({"status": "ready"})
        state = engine.load_error or engine.loop_error or ("loading" if engine.engine is None else "stalled")
        return JSONResponse({"status": state}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        e = core()
        return {"object": "list", "data": [{"id": model_name(), "object": "model", "created": int(time.time()),
                                            "owned_by": "pagedllm", "max_model_len": e.max_model_len,
                                            "vocab_size": e.model_config.vocab_size}]}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        e = core()
        check_model(req.model)
        tok = e.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer")
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")

        def run() -> list[int]:  # a text surely longer than the context is refused before it is tokenized
            if req.messages is not None:
                text = tok.apply_chat_template([m.template_dict() for m in req.messages],
                                               add_generation_prompt=req.add_generation_prompt)
                return tok.encode(text, add_special_tokens=False, max_tokens=e.max_model_len)
            return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens, max_tokens=e.max_model_len)

        try:
            ids = await asyncio.to_thread(run)
        except InvalidRequestError as ex:
            raise APIError(400, str(ex), param="messages" if req.messages is not None else "prompt") from ex
        return {"tokens": ids, "count": len(ids), "max_model_len": e.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        e = core()
        check_model(req.model)
        if e.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        bad = [t for t in req.tokens if not 0 <= t < e.model_config.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary", param="tokens")
        return {"prompt": await asyncio.to_thread(e.tokenizer.decode, req.tokens, skip_special_tokens=False)}

    # ---- the KV dashboard ------------------------------------------------------------------
    @app.get("/dashboard")
    async def dashboard() -> Response:
        return Response((STATIC / "dashboard.html").read_bytes(), media_type="text/html")

    @app.get("/dashboard/{name}")
    async def dashboard_file(name: str) -> Response:
        if name not in DASHBOARD_FILES:
            raise APIError(404, f"no dashboard file {name!r}", "not_found_error")
        return Response((STATIC / name).read_bytes(), media_type=DASHBOARD_FILES[name])

    @app.get("/kv/snapshot")
    async def kv_snapshot() -> Response:
        """The KV pool block by block, built between engine steps (see LLMEngine.kv_snapshot)."""
        core()
        snap = await engine.kv_snapshot()
        return Response(json.dumps(snap).encode(), media_type="application/json")

    # ---- generation ----------------------------------------------------------------------
    def check_fields(req: Any, endpoint: dict) -> None:
        bad = unsupported_field(req.model_extra, endpoint)
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")

    async def constraint(given: tuple[str, dict] | None) -> StructuredOutputsParams | None:
        """The request's output constraint, compiled (and cached) in a worker thread: the engine loop
        keeps stepping meanwhile, and add_request finds the grammar compiled."""
        if given is None:
            return None
        param, spec = given
        try:
            so = StructuredOutputsParams.from_dict(spec)
            await asyncio.to_thread(core().compile_grammar, so)
        except ValueError as ex:  # InvalidRequestError included: the compiler's message
            raise APIError(400, str(ex), param=param) from ex
        return so

    def sampling(req: Any, max_tokens: int | None, logprobs: int | None,
                 structured: StructuredOutputsParams | None = None) -> SamplingParams:
        try:
            return SamplingParams(
                n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty, seed=req.seed, stop=req.stop,
                stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, max_tokens=max_tokens,
                min_tokens=req.min_tokens, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output, logit_bias=req.logit_bias,
                allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words, structured_outputs=structured)
        except ValueError as e:
            raise APIError(400, str(e)) from e

    async def submit(prompts: list, params: SamplingParams, req: Any, prefix: str) -> list[RequestStream]:
        """Tokenize (off the event loop) and add every prompt, all or none."""
        e = core()
        try:
            # everything the request brings is checked and prepared here, off the event loop and the step loop
            params, prepared = await asyncio.to_thread(lambda: (e.prepare_params(params),
                                                               [e.prepare_prompt(p) for p in prompts]))
            base = f"{prefix}-{uuid.uuid4().hex[:24]}"
            return await engine.add([NewRequest(f"{base}-{i}", p, params, req.priority, req.cache_salt)
                                     for i, p in enumerate(prepared)])
        except InvalidRequestError as ex:
            raise APIError(400, str(ex)) from ex
        except QueueFullError as ex:
            raise APIError(429, str(ex), "rate_limit_error", code="queue_full") from ex
        except ShuttingDownError as ex:
            raise APIError(503, str(ex), "service_unavailable") from ex

    async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several requests as they come: (prompt index, output). Each stream keeps only its
        newest cumulative output, and nothing is read from it while the caller is busy (a client that
        stops reading): a stalled response holds one output per prompt, never a backlog."""
        its = {i: engine.stream(s).__aiter__() for i, s in enumerate(streams)}
        pending = {asyncio.ensure_future(it.__anext__()): i for i, it in its.items()}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    try:
                        out = fut.result()
                    except StopAsyncIteration:
                        continue
                    except Exception as ex:
                        raise APIError(500, str(ex), "server_error") from ex
                    pending[asyncio.ensure_future(its[i].__anext__())] = i
                    yield i, out
        finally:
            for fut in pending:
                fut.cancel()
            for s in streams:
                engine.abort(s.request_id)

    async def final_outputs(streams: list[RequestStream], request: Request) -> list[RequestOutput]:
        """Wait for all to finish; a client that disconnects aborts them."""
        finals: dict[int, RequestOutput] = {}

        async def collect() -> None:
            async for i, out in merged(streams):
                if out.finished:
                    finals[i] = out

        task = asyncio.create_task(collect())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if not done and await request.is_disconnected():
                task.cancel()
                for s in streams:
                    engine.abort(s.request_id)
                raise APIError(499, "client disconnected")
        task.result()
        return [finals[i] for i in range(len(streams))]

    async def json_off_loop(build: Any) -> Response:
        """Build and encode a (possibly large: logprobs of many prompts) response in a worker thread."""
        body = await asyncio.to_thread(lambda: json.dumps(build(), ensure_ascii=False).encode())
        return Response(body, media_type="application/json")

    def usage(outs: list[RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}

    def sse(obj: dict | str) -> str:
        return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"

    def token_str(e, t: int) -> str:
        return e.tokenizer.decode([t], skip_special_tokens=False) if e.tokenizer else str(t)

    def completion_logprobs(e, token_ids: list[int], lps: list, offset0: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        off = offset0
        for t, lp in zip(token_ids, lps):
            s = token_str(e, t)
            tokens.append(s)
            token_lps.append(lp[t].logprob)
            tops.append({token_str(e, k): v.logprob for k, v in lp.items()})
            offsets.append(off)
            off += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(e, token_ids: list[int], lps: list, k: int) -> dict:
        content = []
        for t, lp in zip(token_ids, lps):
            s = token_str(e, t)
            top = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:k]
            content.append({"token": s, "logprob": lp[t].logprob, "bytes": list(s.encode()),
                            "top_logprobs": [{"token": token_str(e, a), "logprob": b.logprob,
                                              "bytes": list(token_str(e, a).encode())} for a, b in top]})
        return {"content": content}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        e = core()
        check_model(req.model)
        check_fields(req, COMPLETION_NOOPS)
        p = req.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif isinstance(p[0], int):
            prompts = [{"prompt_token_ids": p}]
        elif isinstance(p[0], list):
            if any(not x for x in p):
                raise APIError(400, "prompt must not contain empty token lists", param="prompt")
            prompts = [{"prompt_token_ids": x} for x in p]
        else:
            prompts = list(p)
        try:
            given = req.structured_spec()
        except ValueError as ex:
            raise APIError(400, str(ex), param="response_format") from ex
        params = sampling(req, req.max_tokens, req.logprobs, await constraint(given))
        streams = await submit(prompts, params, req, "cmpl")
        created, rid, name = int(time.time()), streams[0].request_id.rsplit("-", 1)[0], model_name()
        n = params.n

        def prompt_text(o: RequestOutput) -> str:
            if o.prompt is not None:
                return o.prompt
            return e.tokenizer.decode(o.prompt_token_ids, skip_special_tokens=False) if e.tokenizer else ""

        if not req.stream:
            outs = await final_outputs(streams, request)

            def body() -> dict:
                choices = []
                for i, o in enumerate(outs):
                    for c in o.outputs:
                        head = prompt_text(o) if req.echo else ""
                        choices.append({"index": i * n + c.index, "text": head + c.text,
                                        "logprobs": completion_logprobs(e, c.token_ids, c.logprobs, len(head))
                                        if req.logprobs is not None else None,
                                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                return {"id": rid, "object": "text_completion", "created": created, "model": name,
                        "choices": choices, "usage": usage(outs)}

            return await json_off_loop(body)

        async def gen() -> AsyncIterator[str]:
            sent_text: dict[int, int] = {}
            sent_tok: dict[int, int] = {}
            finals: dict[int, RequestOutput] = {}
            try:
                async for i, o in merged(streams):
                    for c in o.outputs:
                        idx = i * n + c.index
                        if idx not in sent_text:
                            sent_text[idx] = sent_tok[idx] = 0
                            if req.echo:
                                yield sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                                           "choices": [{"index": idx, "text": prompt_text(o), "logprobs": None,
                                                        "finish_reason": None}]})
                        delta = c.text[sent_text[idx]:]
                        new_toks = c.token_ids[sent_tok[idx]:]
                        if not delta and not c.finish_reason and not (req.logprobs is not None and new_toks):
                            continue
                        lp = completion_logprobs(e, new_toks, c.logprobs[sent_tok[idx]:], sent_text[idx]) \
                            if req.logprobs is not None else None
                        sent_text[idx], sent_tok[idx] = len(c.text), len(c.token_ids)
                        yield sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                                   "choices": [{"index": idx, "text": delta, "logprobs": lp,
                                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
                    if o.finished:
                        finals[i] = o
                if req.stream_options and req.stream_options.include_usage:
                    yield sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                               "choices": [], "usage": usage(list(finals.values()))})
            except APIError as ex:
                yield sse({"error": {"message": ex.message, "type": ex.type, "param": None, "code": ex.code}})
            yield sse("[DONE]")

        return StreamingResponse(gen(), media_type="text/event-stream")

    def render_chat(e, req: ChatCompletionRequest, tools: list[dict]) -> dict:  # a worker thread
        template = req.chat_template or e.tokenizer.chat_template
        knows = template_knows_tools(template)
        messages = template_messages([m.template_dict() for m in req.messages], tools, knows)
        kwargs = {**(req.chat_template_kwargs or {}), **({"tools": tools} if tools and knows else {})}
        # as in vLLM, chat_template_kwargs may set add_generation_prompt; the request's own fields win otherwise
        add_generation_prompt = kwargs.pop("add_generation_prompt", req.add_generation_prompt)
        text = e.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                               chat_template=req.chat_template, **kwargs)
        return {"prompt": text, "prompt_token_ids": e.tokenizer.encode(text, add_special_tokens=False,
                                                                       max_tokens=e.max_model_len)}

    def chat_tools(req: ChatCompletionRequest, fmt: ToolFormat) -> tuple[list[dict], tuple[str, dict] | None]:
        """(tools the model is offered, (field, output constraint)). tool_choice 'required' or a named
        function is enforced by a structural tag over the tools' parameter schemas; 'auto' lets the model
        choose, and a call it begins must be a valid one."""
        try:
            given = req.structured_spec()
        except ValueError as ex:
            raise APIError(400, str(ex), param="response_format") from ex
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
        choice = choice or ("auto" if tools else "none")
        try:
            check_tools(tools, choice)
            for t in tools:
                if "parameters" in t["function"]:
                    validate_json_schema(t["function"]["parameters"])
        except InvalidRequestError as ex:
            raise APIError(400, str(ex), param="tools") from ex
        if choice == "none" or not tools:
            return [], given
        if given is not None:
            if choice != "auto":
                raise APIError(400, f"tool_choice 'required' or a named function cannot be combined with {given[0]}",
                               param="tool_choice")
            return tools, given  # the response format constrains; calls are still parsed
        return tools, ("tools", {"structural_tag": structural_tag(fmt, tools, choice, req.parallel_tool_calls)})

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        e = core()
        check_model(req.model)
        check_fields(req, CHAT_NOOPS)
        if e.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot chat")
        if req.chat_template is not None and not trust_request_chat_template:
            raise APIError(400, "chat_template in a request is refused: a template is a program; start the server "
                           "with --trust-request-chat-template to allow it", param="chat_template")
        fmt = tool_format_for(req.chat_template or e.tokenizer.chat_template)
        tools, given = chat_tools(req, fmt)
        try:
            prompt = await asyncio.to_thread(render_chat, e, req, tools)
        except InvalidRequestError as ex:
            raise APIError(400, str(ex), param="messages") from ex
        k = req.top_logprobs or 0
        params = sampling(req, req.max_completion_tokens or req.max_tokens, k if req.logprobs else None,
                          await constraint(given))
        streams = await submit([prompt], params, req, "chatcmpl")
        created, rid, name = int(time.time()), streams[0].request_id.rsplit("-", 1)[0], model_name()

        def message(c) -> tuple[dict, str | None]:
            if not tools:
                return {"role": "assistant", "content": c.text}, c.finish_reason
            parsed = parse_tool_calls(c.text, fmt, final=True)
            calls = tool_calls_message(parsed)
            if not calls:
                return {"role": "assistant", "content": c.text}, c.finish_reason
            reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
            return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, reason

        if not req.stream:
            (o,) = await final_outputs(streams, request)

            def body() -> dict:
                choices = []
                for c in o.outputs:
                    msg, reason = message(c)
                    choices.append({"index": c.index, "message": msg,
                                    "logprobs": chat_logprobs(e, c.token_ids, c.logprobs, k) if req.logprobs else None,
                                    "finish_reason": reason, "stop_reason": c.stop_reason})
                return {"id": rid, "object": "chat.completion", "created": created, "model": name,
                        "choices": choices, "usage": usage([o])}

            return await json_off_loop(body)

        async def gen() -> AsyncIterator[str]:
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name}
            for i in range(params.n):  # the first chunk of each choice carries the role
                yield sse(head | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]})
            sent_text = [0] * params.n
            sent_tok = [0] * params.n
            parsers = [ToolCallStream(fmt) for _ in range(params.n)] if tools else None
            final = None
            try:
                async for _, o in merged(streams):
                    for c in o.outputs:
                        new_text = c.text[sent_text[c.index]:]
                        new_toks = c.token_ids[sent_tok[c.index]:]
                        if not new_text and not c.finish_reason:
                            continue
                        lp = chat_logprobs(e, new_toks, c.logprobs[sent_tok[c.index]:], k) if req.logprobs else None
                        sent_text[c.index], sent_tok[c.index] = len(c.text), len(c.token_ids)
                        delta: dict = {}
                        reason = c.finish_reason
                        if parsers is None:
                            delta = {"content": new_text} if new_text else {}
                        else:
                            content, calls = parsers[c.index].update(c.text, final=c.finish_reason is not None)
                            delta = {**({"content": content} if content else {}), **({"tool_calls": calls} if calls else {})}
                            if reason == "stop" and parsers[c.index].num_calls:
                                reason = "tool_calls"
                            if not delta and not reason and lp is None:
                                continue
                        yield sse(head | {"choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                                       "finish_reason": reason}]})
                    if o.finished:
                        final = o
                if req.stream_options and req.stream_options.include_usage and final is not None:
                    yield sse(head | {"choices": [], "usage": usage([final])})
            except APIError as ex:
                yield sse({"error": {"message": ex.message, "type": ex.type, "param": None, "code": ex.code}})
            yield sse("[DONE]")

        return StreamingResponse(gen(), media_type="text/event-stream")

    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, timeout=body_timeout)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app

