"""POST /v1/chat/completions: messages rendered through the chat template (in a worker thread), tools offered
and their calls parsed, structured outputs, choices out whole or streamed."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from ...errors import InvalidRequestError
from ...sample.structured_outputs import validate_json_schema
from .harmony import HarmonyStream, is_harmony
from .harmony import split as harmony_split
from .protocol import CHAT_NOOPS, ChatCompletionRequest
from .reasoning import ReasoningStream
from .serving import APIError, Serving, json_off_loop, sampling, sse, stream_error, token_str, usage
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


def chat_logprobs(e, token_ids: list[int], lps: list, k: int) -> dict:
    content = []
    for t, lp in zip(token_ids, lps):
        s = token_str(e, t)
        top = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:k]
        content.append({"token": s, "logprob": lp[t].logprob, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": token_str(e, a), "logprob": b.logprob,
                                          "bytes": list(token_str(e, a).encode())} for a, b in top]})
    return {"content": content}


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

def chat_tools(req: ChatCompletionRequest, fmt: ToolFormat | None) -> tuple[list[dict], tuple[str, dict] | None]:
    """(tools the model is offered, (field, output constraint)). tool_choice 'required' or a named
    function is enforced by a structural tag over the tools' parameter schemas; 'auto' lets the model
    choose, and a call it begins must be a valid one. fmt None: a Harmony model, whose calls are channel messages
    (no structural tag for them yet: 'auto' only)."""
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
    if fmt is None:
        if choice != "auto":
            raise APIError(400, "tool_choice 'required' or a named function is not supported for Harmony (gpt-oss) "
                           "models yet: use 'auto'", param="tool_choice")
        return tools, given
    if given is not None:
        if choice != "auto":
            raise APIError(400, f"tool_choice 'required' or a named function cannot be combined with {given[0]}",
                           param="tool_choice")
        return tools, given  # the response format constrains; calls are still parsed
    return tools, ("tools", {"structural_tag": structural_tag(fmt, tools, choice, req.parallel_tool_calls)})


async def create_chat_completion(s: Serving, req: ChatCompletionRequest, request: Request) -> Any:
    e = s.core()
    s.check_model(req.model)
    s.check_fields(req, CHAT_NOOPS)
    if e.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it cannot chat")
    if req.chat_template is not None and not s.trust_request_chat_template:
        raise APIError(400, "chat_template in a request is refused: a template is a program; start the server "
                       "with --trust-request-chat-template to allow it", param="chat_template")
    template = req.chat_template or e.tokenizer.chat_template
    fmt, harmony = tool_format_for(template), is_harmony(template)
    tools, given = chat_tools(req, None if harmony else fmt)
    try:
        prompt = await asyncio.to_thread(render_chat, e, req, tools)
    except InvalidRequestError as ex:
        raise APIError(400, str(ex), param="messages") from ex
    k = req.top_logprobs or 0
    params = sampling(req, req.max_completion_tokens or req.max_tokens, k if req.logprobs else None,
                      await s.constraint(given))
    if harmony:  # its channels are special tokens: kept in the text, read apart below
        params = dataclasses.replace(params, skip_special_tokens=False)
    streams = await s.submit([prompt], params, req, "chatcmpl")
    created, rid, name = int(time.time()), streams[0].request_id.rsplit("-", 1)[0], s.model_name()

    def message(c) -> tuple[dict, str | None]:
        text, head = c.text, {"role": "assistant"}
        if harmony:
            reasoning, parsed = harmony_split(c.text)
            calls = tool_calls_message(parsed) if tools else []
            head |= {"reasoning_content": reasoning or None, "content": parsed.content or (None if calls else "")}
            if not calls:
                return head, c.finish_reason
            return head | {"tool_calls": calls}, "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        if s.reasoning is not None:  # the thought is never content, nor parsed for tool calls
            reasoning, text = s.reasoning.split(c.text)
            head["reasoning_content"] = reasoning or None
        if not tools:
            return head | {"content": text}, c.finish_reason
        parsed = parse_tool_calls(text, fmt, final=True)
        calls = tool_calls_message(parsed)
        if not calls:
            return head | {"content": text}, c.finish_reason
        reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        return head | {"content": parsed.content or None, "tool_calls": calls}, reason

    if not req.stream:
        (o,) = await s.final_outputs(streams, request)

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
        thoughts = [ReasoningStream(s.reasoning) for _ in range(params.n)] if s.reasoning is not None else None
        channels = [HarmonyStream() for _ in range(params.n)] if harmony else None
        final = None
        try:
            async for _, o in s.merged(streams):
                for c in o.outputs:
                    new_text = c.text[sent_text[c.index]:]
                    new_toks = c.token_ids[sent_tok[c.index]:]
                    if not new_text and not c.finish_reason:
                        continue
                    lp = chat_logprobs(e, new_toks, c.logprobs[sent_tok[c.index]:], k) if req.logprobs else None
                    sent_text[c.index], sent_tok[c.index] = len(c.text), len(c.token_ids)
                    reason, last = c.finish_reason, c.finish_reason is not None
                    thought, content, calls, num_calls = "", new_text, [], 0
                    if channels is not None:  # Harmony: channels, not tags
                        thought, content, calls = channels[c.index].update(c.text, last)
                        calls, num_calls = (calls, channels[c.index].calls.num_calls) if tools else ([], 0)
                    else:
                        text = c.text
                        if thoughts is not None:
                            thought, content, text = thoughts[c.index].update(c.text, last)
                        if parsers is not None:
                            content, calls = parsers[c.index].update(text, last)
                            num_calls = parsers[c.index].num_calls
                    delta = {**({"reasoning_content": thought} if thought else {}),
                             **({"content": content} if content else {}), **({"tool_calls": calls} if calls else {})}
                    if reason == "stop" and num_calls:
                        reason = "tool_calls"
                    if not delta and not reason and lp is None and (parsers is not None or channels is not None):
                        continue
                    yield sse(head | {"choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                                   "finish_reason": reason}]})
                if o.finished:
                    final = o
            if req.stream_options and req.stream_options.include_usage and final is not None:
                yield sse(head | {"choices": [], "usage": usage([final])})
        except APIError as ex:
            yield stream_error(ex)
        yield sse("[DONE]")

    return StreamingResponse(gen(), media_type="text/event-stream")
