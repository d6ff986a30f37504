"""What the completion and chat handlers share: the engine behind them, request checks, sampling parameters,
submitting prompts, reading their outputs as they come, and the response pieces (usage, SSE, JSON off the loop)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ...engine.async_engine import AsyncEngine, NewRequest, QueueFullError, RequestStream, ShuttingDownError
from ...engine.llm_engine import LLMEngine
from ...errors import InvalidRequestError
from ...outputs import RequestOutput
from ...sampling_params import SamplingParams, StructuredOutputsParams
from .protocol import unsupported_field
from .reasoning import ReasoningParser


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


class Serving:
    """The state a handler needs: the async engine, the name it serves under, the server's trust settings."""

    def __init__(self, engine: AsyncEngine, served_model_name: str | None = None,
                 trust_request_chat_template: bool = False, reasoning: ReasoningParser | None = None) -> None:
        self.engine, self.served_model_name = engine, served_model_name
        self.trust_request_chat_template = trust_request_chat_template
        self.reasoning = reasoning  # splits a thinking model's thought from its answer (chat only)

    def model_name(self) -> str:
        return self.served_model_name or (self.engine.engine.model_name if self.engine.engine else "pagedllm")

    def core(self) -> LLMEngine:
        if self.engine.engine is None:
            if self.engine.load_error:
                raise APIError(503, f"model failed to load: {self.engine.load_error}", "service_unavailable")
            raise APIError(503, "the model is loading; retry shortly", "service_unavailable")
        return self.engine.engine

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name():
            raise APIError(400, f"model {name!r} does not exist; this server serves {self.model_name()!r}",
                           param="model", code="model_not_found")

    def check_fields(self, req: Any, endpoint: dict) -> None:
        bad = unsupported_field(req.model_extra, endpoint)
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")

    async def constraint(self, given: tuple[str, dict] | None) -> StructuredOutputsParams | None:
        """The request's output constraint, compiled (and cached) in a worker thread: the engine loop
        keeps stepping meanwhile, and add_request finds the grammar compiled."""
        if given is None:
            return None
        param, spec = given
        try:
            so = StructuredOutputsParams.from_dict(spec)
            await asyncio.to_thread(self.core().compile_grammar, so)
        except ValueError as ex:  # InvalidRequestError included: the compiler's message
            raise APIError(400, str(ex), param=param) from ex
        return so

    async def submit(self, prompts: list, params: SamplingParams, req: Any, prefix: str) -> list[RequestStream]:
        """Tokenize (off the event loop) and add every prompt, all or none."""
        e = self.core()
        try:
            # everything the request brings is checked and prepared here, off the event loop and the step loop
            params, prepared = await asyncio.to_thread(lambda: (e.prepare_params(params),
                                                               [e.prepare_prompt(p) for p in prompts]))
            base = f"{prefix}-{uuid.uuid4().hex[:24]}"
            return await self.engine.add([NewRequest(f"{base}-{i}", p, params, req.priority, req.cache_salt)
                                          for i, p in enumerate(prepared)])
        except InvalidRequestError as ex:
            raise APIError(400, str(ex)) from ex
        except QueueFullError as ex:
            raise APIError(429, str(ex), "rate_limit_error", code="queue_full") from ex
        except ShuttingDownError as ex:
            raise APIError(503, str(ex), "service_unavailable") from ex

    async def merged(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several requests as they come: (prompt index, output). Each stream keeps only its
        newest cumulative output, and nothing is read from it while the caller is busy (a client that
        stops reading): a stalled response holds one output per prompt, never a backlog."""
        its = {i: self.engine.stream(s).__aiter__() for i, s in enumerate(streams)}
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
                self.engine.abort(s.request_id)

    async def final_outputs(self, streams: list[RequestStream], request: Request) -> list[RequestOutput]:
        """Wait for all to finish; a client that disconnects aborts them."""
        finals: dict[int, RequestOutput] = {}

        async def collect() -> None:
            async for i, out in self.merged(streams):
                if out.finished:
                    finals[i] = out

        task = asyncio.create_task(collect())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if not done and await request.is_disconnected():
                task.cancel()
                for s in streams:
                    self.engine.abort(s.request_id)
                raise APIError(499, "client disconnected")
        task.result()
        return [finals[i] for i in range(len(streams))]


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


def stream_error(ex: APIError) -> str:
    return sse({"error": {"message": ex.message, "type": ex.type, "param": None, "code": ex.code}})
