"""The OpenAI-compatible FastAPI app: completions, chat, models, tokenize, health, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...config import EngineConfig
from ...engine.async_engine import AsyncEngine
from ...errors import InvalidRequestError
from .http import BodyLimitMiddleware, error_response
from .openapi import with_model_bounds
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from .reasoning import PARSERS
from .serving import APIError, Serving
from .serving_chat import create_chat_completion
from .serving_completion import create_completion

STATIC = Path(__file__).parent / "static"
DASHBOARD_FILES = {"kvmap.js": "text/javascript", "kvmap.css": "text/css", "dashboard.js": "text/javascript"}


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
              address: str | None = None, reasoning_parser: str | None = None) -> FastAPI:
    """address: where the server listens, for the startup banner. reasoning_parser: a name in
    reasoning.PARSERS (qwen3, deepseek_r1): the model's thought goes to message.reasoning_content."""
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

    serving = Serving(engine, served_model_name, trust_request_chat_template,
                      PARSERS[reasoning_parser] if reasoning_parser else None)
    model_name, core, check_model = serving.model_name, serving.core, serving.check_model

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
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await create_completion(serving, req, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        return await create_chat_completion(serving, req, request)

    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, timeout=body_timeout)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app

