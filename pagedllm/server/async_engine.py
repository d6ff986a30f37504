"""One engine loop for many concurrent clients.

The loop runs `LLMEngine.step()` in a worker thread while any request is live. Adds and aborts
from request handlers are queued and applied between steps (the engine is never touched by two
threads at once); each request gets its own asyncio.Queue of RequestOutputs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..config import EngineConfig
from ..engine import EngineStats, LLMEngine, PromptType
from ..errors import InvalidRequestError
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .metrics import ServerMetrics

log = logging.getLogger("pagedllm.server")


class QueueFullError(Exception):
    """The bounded waiting queue is full."""


@dataclass
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    last_token_time: float | None = None
    num_tokens: int = 0


class AsyncEngine:
    def __init__(self, config: EngineConfig, max_queue_len: int = 1024, stall_timeout: float = 60.0) -> None:
        self.config = config
        self.max_queue_len = max_queue_len
        self.stall_timeout = stall_timeout
        self.engine: LLMEngine | None = None
        self.load_error: str | None = None
        self.metrics = ServerMetrics(lambda: self.stats)
        self.stats: EngineStats | None = None
        self._ops: list[tuple] = []
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.last_progress = time.monotonic()
        self.loop_error: str | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Abort live requests and stop the loop."""
        self._stopping = True
        for rid in list(self._streams):
            self._ops.append(("abort", rid, None))
        self._wake.set()
        if self._task:
            try:
                await asyncio.wait_for(self._task, timeout=30)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()

    @property
    def ready(self) -> bool:
        if self.engine is None or self.loop_error or self._stopping:
            return False
        busy = bool(self._streams)
        return not (busy and time.monotonic() - self.last_progress > self.stall_timeout)

    # ---- requests ------------------------------------------------------------------------
    async def add(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                  cache_salt: str | None = None) -> None:
        """Queue a request; raises InvalidRequestError / QueueFullError before anything runs."""
        if self.engine is None:
            raise RuntimeError("the model is still loading")
        waiting = (self.stats.num_waiting if self.stats else 0) + sum(op[0] == "add" for op in self._ops)
        if waiting >= self.max_queue_len:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue_len} requests); retry later")
        fut = asyncio.get_running_loop().create_future()
        self._streams[request_id] = _Stream()
        self._ops.append(("add", request_id, (prompt, params, priority, cache_salt), fut))
        self._wake.set()
        try:
            await fut
        except BaseException:
            self._streams.pop(request_id, None)
            raise

    def abort(self, request_id: str) -> None:
        if request_id in self._streams:
            self._ops.append(("abort", request_id, None))
            self._wake.set()

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes. Leaving early (disconnect) aborts it."""
        s = self._streams[request_id]
        finished = False
        try:
            while True:
                out = await s.queue.get()
                if isinstance(out, Exception):
                    raise out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    # ---- the loop ------------------------------------------------------------------------
    def _apply_ops(self) -> None:
        ops, self._ops = self._ops, []
        assert self.engine is not None
        for op in ops:
            kind, rid = op[0], op[1]
            if kind == "add":
                prompt, params, priority, salt = op[2]
                fut = op[3]
                try:
                    self.engine.add_request(rid, prompt, params, priority=priority, cache_salt=salt)
                except Exception as e:  # noqa: BLE001 - handed to the request's handler
                    if not fut.done():
                        fut.set_exception(e if isinstance(e, (InvalidRequestError, ValueError)) else
                                          InvalidRequestError(str(e)))
                    continue
                if not fut.done():
                    fut.set_result(None)
                if fut.cancelled():  # the client left before we got here
                    self.engine.abort(rid)
            elif kind == "abort":
                out = self.engine.abort(rid)
                if out is not None:
                    self._deliver(out)
                self._streams.pop(rid, None)

    def _deliver(self, out: RequestOutput) -> None:
        s = self._streams.get(out.request_id)
        now = time.monotonic()
        if s is not None:
            n = sum(len(c.token_ids) for c in out.outputs)
            new = n - s.num_tokens
            if new > 0:
                if s.last_token_time is None:
                    self.metrics.ttft.observe(now - s.arrival)
                else:
                    gap = (now - s.last_token_time) / new
                    for _ in range(new):
                        self.metrics.itl.observe(gap)
                s.last_token_time, s.num_tokens = now, n
            s.queue.put_nowait(out)
        if out.finished:
            for c in out.outputs:
                self.metrics.request_success.labels(c.finish_reason or "abort").inc()
            arrival = s.arrival if s else out.metrics.get("arrival_time", now)
            self.metrics.e2e.observe(now - arrival)
            sched = out.metrics.get("first_scheduled_time")
            if sched is not None and out.metrics.get("arrival_time") is not None:
                self.metrics.queue.observe(max(0.0, sched - out.metrics["arrival_time"]))
            self._streams.pop(out.request_id, None)

    async def _run(self) -> None:
        try:
            self.engine = await asyncio.to_thread(LLMEngine, self.config)
            self.stats = self.engine.stats()
        except Exception as e:  # noqa: BLE001
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("model failed to load: %s", self.load_error)
            return
        log.info("engine loaded: %s", self.engine.model_name)
        while True:
            if self._ops:
                self._apply_ops()
                self.stats = self.engine.stats()
            if self._stopping and not self._ops and not self.engine.has_unfinished_requests():
                return
            if not self.engine.has_unfinished_requests():
                self._wake.clear()
                if not self._ops:
                    await self._wake.wait()
                continue
            try:
                outs = await asyncio.to_thread(self.engine.step)
            except Exception as e:  # noqa: BLE001 - an engine bug: fail live requests, keep serving
                log.exception("engine step failed")
                self.loop_error = f"{type(e).__name__}: {e}"
                for rid, s in list(self._streams.items()):
                    s.queue.put_nowait(RuntimeError(f"engine failure: {e}"))
                    self.engine.abort(rid)
                self._streams.clear()
                self.loop_error = None
                continue
            self.last_progress = time.monotonic()
            for out in outs:
                self._deliver(out)
            self.stats = self.engine.stats()
