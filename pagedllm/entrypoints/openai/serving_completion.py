"""POST /v1/completions: prompts (text, token ids, or lists of either) in, choices out, whole or streamed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from ...outputs import RequestOutput
from .protocol import COMPLETION_NOOPS, CompletionRequest
from .serving import APIError, Serving, json_off_loop, sampling, sse, stream_error, token_str, usage


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


async def create_completion(s: Serving, req: CompletionRequest, request: Request) -> Any:
    e = s.core()
    s.check_model(req.model)
    s.check_fields(req, COMPLETION_NOOPS)
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
    params = sampling(req, req.max_tokens, req.logprobs, await s.constraint(given))
    streams = await s.submit(prompts, params, req, "cmpl")
    created, rid, name = int(time.time()), streams[0].request_id.rsplit("-", 1)[0], s.model_name()
    n = params.n

    def prompt_text(o: RequestOutput) -> str:
        if o.prompt is not None:
            return o.prompt
        return e.tokenizer.decode(o.prompt_token_ids, skip_special_tokens=False) if e.tokenizer else ""

    if not req.stream:
        outs = await s.final_outputs(streams, request)

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
            async for i, o in s.merged(streams):
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
            yield stream_error(ex)
        yield sse("[DONE]")

    return StreamingResponse(gen(), media_type="text/event-stream")
