"""One engine loop for many concurrent clients.

The loop runs `LLMEngine.step()` in the engine's own thread while any request is live. Adds and aborts
from request handlers are queued and applied between steps, in that thread too (the engine is never
touched by two threads at once, and the event loop never does engine work). One thread, not a pool's
next free one: each thread that runs the kernels gets an OpenMP team of its own, and with more team
threads than cores OpenMP puts its idle workers to sleep after a short spin, so every kernel call of a
step would pay a wake-up (a one-stream decode ran at a third of the offline API's speed). `add`
hands back one RequestStream per prompt, owned by the caller: a request that finishes in its
first step has its output waiting there, whenever the handler starts reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..config import EngineConfig
from ..entrypoints.openai.metrics import ServerMetrics
from ..errors import InvalidRequestError, RequestFailedError
from ..executor.tp import WorkerDiedError
from ..outputs import RequestOutput
from ..platforms.allocator import release_freed_memory
from ..sampling_params import SamplingParams
from .llm_engine import EngineStats, LLMEngine, PromptType

log = logging.getLogger("pagedllm.server")


class QueueFullError(Exception):
    """The bounded waiting queue is full."""


class ShuttingDownError(Exception):
    """The server is draining: no new requests."""


@dataclass
class NewRequest:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None


@dataclass
class RequestStream:
    """The outputs of one request. Outputs are cumulative (each holds all text and tokens so far),
    so only the newest unread one is kept: a client that reads slowly, or not at all, costs one
    output's memory and never holds the engine back; it sees the tokens it missed in one delta."""

    request_id: str
    arrival: float = field(default_factory=time.monotonic)
    last_token_time: float | None = None
    num_tokens: int = 0
    _latest: RequestOutput | Exception | None = None
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, out: RequestOutput | Exception) -> None:
        if not isinstance(self._latest, Exception):  # an error is final
            self._latest = out
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        self._ready.clear()
        out, self._latest = self._latest, None
        if isinstance(out, Exception):
            raise out
        assert out is not None  # noqa: S101 - _ready is only set together with _latest
        return out


class AsyncEngine:
    def __init__(self, config: EngineConfig, max_queue_len: int = 1024, stall_timeout: float = 60.0) -> None:
        self.config = config
        self.max_queue_len = max_queue_len
        self.stall_timeout = stall_timeout
        self.recheck_interval = 1.0  # seconds between looks at a scheduler that could schedule nothing
        self.engine: LLMEngine | None = None
        self.load_error: str | None = None
        self.metrics = ServerMetrics(lambda: self.stats)
        self.stats: EngineStats | None = None
        self._ops: list[tuple] = []
        self._streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._draining = False
        self.last_progress = time.monotonic()
        self.loop_error: str | None = None
        self.on_fatal = None  # called (with the reason) when the engine can never step again
        self.on_ready = None  # called (with the LLMEngine) once the model is loaded
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-engine")

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def drain(self, timeout: float) -> None:
        """Refuse new requests from now on (/ready says so); abort those still running after timeout
        seconds, so that each ends with a final output (finish_reason "abort") rather than a cut."""
        self._draining = True
        asyncio.get_running_loop().call_later(timeout, self._abort_all)

    def _abort_all(self) -> None:
        for rid in list(self._streams):
            self.abort(rid)

    async def stop(self, timeout: float = 30.0) -> bool:
        """Abort live requests and stop the loop. False if the loop did not stop within timeout (a step
        that never returns): its thread is then left behind, and the caller should exit the process."""
        self._stopping = True
        for rid in list(self._streams):
            self._ops.append(("abort", rid))
        self._wake.set()
        stopped = True
        if self._task:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout=timeout)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
                stopped = False
        if self.engine is not None and stopped:
            self.engine.shutdown()  # tensor-parallel workers, if any
        self._executor.shutdown(wait=False)
        return stopped

    async def _in_engine_thread(self, fn: Callable, *args: object) -> object:
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    @property
    def ready(self) -> bool:
        if self.engine is None or self.loop_error or self._stopping or self._draining:
            return False
        busy = bool(self._streams)
        return not (busy and time.monotonic() - self.last_progress > self.stall_timeout)

    # ---- requests ------------------------------------------------------------------------
    async def add(self, requests: list[NewRequest]) -> list[RequestStream]:
        """Queue requests, all or none; raises InvalidRequestError / QueueFullError before any runs."""
        if self.engine is None:
            raise RuntimeError("the model is still loading")
        if self._stopping or self._draining:
            raise ShuttingDownError("the server is shutting down")
        queued = sum(len(op[1]) for op in self._ops if op[0] == "add")
        waiting = (self.stats.num_waiting if self.stats else 0) + queued
        if waiting + len(requests) > self.max_queue_len:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue_len} requests); retry later")
        fut = asyncio.get_running_loop().create_future()
        streams = [RequestStream(r.request_id) for r in requests]
        for s in streams:
            self._streams[s.request_id] = s
        self._ops.append(("add", requests, fut))
        self._wake.set()
        try:
            await fut
        except BaseException:
            for s in streams:
                self._streams.pop(s.request_id, None)
            raise
        return streams

    async def kv_snapshot(self) -> dict:
        """The engine's KV snapshot, built between two steps by the loop's thread (never mid-step)."""
        if self.engine is None:
            raise RuntimeError("the model is still loading")
        fut = asyncio.get_running_loop().create_future()
        self._ops.append(("snapshot", fut))
        self._wake.set()
        return await fut

    def abort(self, request_id: str) -> None:
        if request_id in self._streams:
            self._ops.append(("abort", request_id))
            self._wake.set()

    async def stream(self, s: RequestStream) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes. Leaving early (disconnect) aborts it."""
        finished = False
        try:
            while True:
                out = await s.get()
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(s.request_id)

    # ---- the loop ------------------------------------------------------------------------
    def _apply_ops(self, ops: list[tuple]) -> tuple[list[tuple], list[RequestOutput]]:
        """In the worker thread. Returns (future, exception or result) pairs and outputs to deliver;
        futures are settled on the event loop, which owns them."""
        assert self.engine is not None  # noqa: S101 - the loop only runs once the engine is loaded
        settled, outs = [], []
        for op in ops:
            if op[0] == "add":
                _, requests, fut = op
                added: list[str] = []
                error: Exception | None = None
                for r in requests:
                    try:
                        self.engine.add_request(r.request_id, r.prompt, r.params, priority=r.priority,
                                                cache_salt=r.cache_salt)
                        added.append(r.request_id)
                    except ValueError as e:  # bad input: a 400 for the request's handler
                        error = e if isinstance(e, InvalidRequestError) else InvalidRequestError(str(e))
                        break
                    except Exception as e:
                        log.exception("add_request failed")
                        error = e
                        break
                if error is not None or fut.cancelled():  # all or none; a client gone before it ran
                    for rid in added:
                        self.engine.abort(rid)
                settled.append((fut, error))
            elif op[0] == "snapshot":
                settled.append((op[1], self.engine.kv_snapshot()))
            else:
                out = self.engine.abort(op[1])
                if out is not None:
                    outs.append(out)
        return settled, outs

    def _step(self) -> tuple[list[RequestOutput], EngineStats]:
        assert self.engine is not None  # noqa: S101
        outs = self.engine.step()
        return outs, self.engine.stats()

    def _deliver(self, out: RequestOutput) -> None:
        s = self._streams.get(out.request_id)
        now = time.monotonic()
        if s is not None and out.error is not None:  # failed inside a step: this request alone
            s.put(RequestFailedError(f"request failed: {out.error}"))
        elif s is not None:
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
            s.put(out)
        if out.finished:
            for c in out.outputs:
                self.metrics.request_success.labels(c.finish_reason or "abort").inc()
            arrival = s.arrival if s else out.metrics.get("arrival_time", now)
            self.metrics.e2e.observe(now - arrival)
            sched = out.metrics.get("first_scheduled_time")
            if sched is not None and out.metrics.get("arrival_time") is not None:
                self.metrics.queue.observe(max(0.0, sched - out.metrics["arrival_time"]))
            self._streams.pop(out.request_id, None)  # the handler holds its own reference

    async def _run(self) -> None:
        try:
            self.engine = await self._in_engine_thread(LLMEngine, self.config)
            self.stats = self.engine.stats()
        except Exception as e:  # noqa: BLE001
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("model failed to load: %s", self.load_error)
            if self.on_fatal is not None:  # a server that cannot serve exits (non-zero), not idles "healthy"
                self.on_fatal(self.load_error)
            return
        if self.on_ready is not None:
            self.on_ready(self.engine)
        log.info("engine loaded: %s", self.engine.model_name)
        stuck = False  # the last step scheduled nothing
        while True:
            if self._ops:
                ops, self._ops = self._ops, []
                settled, outs = await self._in_engine_thread(self._apply_ops, ops)
                for fut, result in settled:
                    if fut.done():
                        continue
                    if isinstance(result, BaseException):
                        fut.set_exception(result)
                    else:
                        fut.set_result(result)
                for out in outs:
                    self._deliver(out)
                self.stats = await self._in_engine_thread(self.engine.stats)
            if self._stopping and not self._ops and not self.engine.has_unfinished_requests():
                return
            if not self.engine.has_unfinished_requests():
                self._wake.clear()
                if not self._ops:
                    await self._in_engine_thread(release_freed_memory)  # idle: what a burst took goes back
                    if not self._ops:
                        await self._wake.wait()
                continue
            steps = self.engine.num_steps
            try:
                outs, self.stats = await self._in_engine_thread(self._step)
            except Exception as e:
                log.exception("engine step failed")
                self.loop_error = f"{type(e).__name__}: {e}"
                for s in self._streams.values():
                    s.put(RuntimeError(f"engine failure: {e}"))
                for rid in list(self.engine.groups):  # every request, with or without a reader
                    out = self.engine.abort(rid)
                    if out is not None:
                        self._deliver(out)
                if isinstance(e, WorkerDiedError):  # the engine cannot step again: stop, /ready says so
                    self._stopping = True
                    self.engine.shutdown()
                    if self.on_fatal is not None:
                        self.on_fatal(self.loop_error)
                    return
                self.loop_error = None
                continue
            if self.engine.num_steps == steps:  # nothing could be scheduled: wait for a change, never spin
                if not stuck:
                    log.warning("no request can be scheduled; waiting for adds or aborts. The requests:\n%s",
                                self.engine.scheduler.describe())
                stuck = True
                self._wake.clear()
                if not self._ops:  # a second look after a while: a step may free what the next one needs
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self.recheck_interval)
                continue
            stuck = False
            self.last_progress = time.monotonic()
            for out in outs:
                self._deliver(out)
