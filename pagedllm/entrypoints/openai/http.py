"""The HTTP edge: what a connection may cost before it reaches a handler, and how the server drains.

- `BodyLimitMiddleware` reads a request body whole before the app sees it: over `max_bytes` is a 413
  (with or without Content-Length, chunked too), a body that trickles in slower than `timeout` a 408.
- `GuardedH11Protocol` closes a connection whose request head has not arrived within its
  `header_timeout` (half-open connections, slowloris heads, idle keep-alives that start a head and stop)
  and refuses connections beyond `max_connections` at once, so file descriptors are never exhausted.
- `DrainingServer`: on the first SIGTERM / SIGINT it stops accepting, /ready turns 503, running requests
  get `shutdown_timeout` seconds to finish and are then aborted, so every stream ends with a final chunk
  (finish_reason "abort") and [DONE]; a second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Any

import uvicorn
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("pagedllm.server")


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


class BodyLimitMiddleware:
    def __init__(self, app: Any, max_bytes: int, timeout: float = 30.0) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = error_response(413, f"request body over {self.max_bytes} bytes", code="payload_too_large")
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.max_bytes:
                return await too_big(scope, receive, send)
        chunks, seen = [], 0
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return None
                    chunk = msg.get("body", b"")
                    seen += len(chunk)
                    if seen > self.max_bytes:
                        return await too_big(scope, receive, send)
                    chunks.append(chunk)
                    if not msg.get("more_body", False):
                        break
        except TimeoutError:
            return await error_response(408, f"request body not received within {self.timeout:g} s",
                                        code="request_timeout")(scope, receive, send)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        return await self.app(scope, replay, send)


class GuardedH11Protocol(H11Protocol):
    header_timeout: float = 10.0
    max_connections: int = 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.server_state.connections) >= self.max_connections:
            transport.abort()  # before any state: the descriptor is given back at once
            return
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._arm_head_deadline()

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._between_requests():
            self._arm_head_deadline()  # a head has begun: it has header_timeout to complete
        super().data_received(data)
        if not self._between_requests() and self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_head_deadline", None) is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        if hasattr(self, "transport"):  # refused connections never set one
            super().connection_lost(exc)


def guarded_protocol(header_timeout: float, max_connections: int) -> type[GuardedH11Protocol]:
    """The protocol class with this server's limits (uvicorn takes a class, not an instance)."""
    return type("GuardedH11", (GuardedH11Protocol,), {"header_timeout": header_timeout,
                                                      "max_connections": max_connections})


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Any, shutdown_timeout: float) -> None:
        """drain(timeout): called once, on the event loop, when the first signal arrives."""
        super().__init__(config)
        self.drain, self.shutdown_timeout = drain, shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:  # a second signal, SIGTERM too: stop waiting now
            self.force_exit = True
        elif self._loop is not None:
            log.warning("received %s: draining (up to %g s)", signal.Signals(sig).name, self.shutdown_timeout)
            self._loop.call_soon_threadsafe(self.drain, self.shutdown_timeout)
        super().handle_exit(sig, frame)
