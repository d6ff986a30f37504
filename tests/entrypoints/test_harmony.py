"""gpt-oss's Harmony output read apart: analysis is reasoning, final is content, a message to functions.X a call."""

from __future__ import annotations

import json

import pytest
from helpers import Server

from pagedllm.entrypoints.openai.harmony import HarmonyStream, is_harmony, split

THOUGHT = "<|channel|>analysis<|message|>User wants the weather. Call the tool.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
ANSWER = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>"


def test_channels_become_reasoning_content_and_calls() -> None:
    reasoning, out = split(THOUGHT + ANSWER)
    assert reasoning == "User wants the weather. Call the tool."
    assert out.content == "It is sunny in Paris." and out.calls == []
    reasoning, out = split(THOUGHT + CALL)
    assert reasoning == "User wants the weather. Call the tool." and out.content == ""
    assert [(c.name, json.loads(c.arguments), c.complete) for c in out.calls] == [("get_weather", {"city": "Paris"}, True)]


def test_the_recipient_may_come_before_the_channel_and_a_preamble_is_content() -> None:
    text = ("<|channel|>commentary<|message|>Let me check.<|end|>"
            '<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}<|call|>')
    reasoning, out = split(text)
    assert reasoning == "" and out.content == "Let me check."
    assert [(c.name, c.arguments) for c in out.calls] == [("now", "{}")]


def test_output_that_ignores_the_format_is_content_without_markers() -> None:
    reasoning, out = split("Paris.<|return|>")
    assert (reasoning, out.content, out.calls) == ("", "Paris.", [])


def test_streamed_pieces_add_up_to_the_whole() -> None:
    full = THOUGHT + CALL
    stream = HarmonyStream()
    reasoning, content, names, arguments = "", "", [], ""
    # special tokens arrive whole: cut the text at marker and character boundaries alike
    for i in range(1, len(full) + 1):
        r, c, deltas = stream.update(full[:i], final=i == len(full))
        reasoning, content = reasoning + r, content + c
        for d in deltas:
            names += [d["function"]["name"]] if d["function"].get("name") else []
            arguments += d["function"].get("arguments") or ""
    assert reasoning == "User wants the weather. Call the tool." and content == ""
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Paris"}


def test_a_streamed_answer_never_shows_a_marker() -> None:
    full = THOUGHT + ANSWER
    stream = HarmonyStream()
    pieces = [stream.update(full[:i], final=i == len(full)) for i in range(1, len(full) + 1)]
    content = "".join(p[1] for p in pieces)
    assert content == "It is sunny in Paris." and "<|" not in "".join(p[0] for p in pieces)


def test_harmony_is_told_by_the_template() -> None:
    assert is_harmony("{{ '<|start|>assistant<|channel|>final<|message|>' }}")
    assert not is_harmony("{{ '<|im_start|>' }}") and not is_harmony(None)


HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}{% if m['role'] == 'assistant' %}<|channel|>final"
                    "{% endif %}<|message|>{{ m['content'] }}<|end|>{% endfor %}<|start|>assistant")


def _regex(text: str) -> str:
    return "".join("\\" + ch if ch in "{}()[].*+?|^$\\" else ch for ch in text)


@pytest.mark.slow
def test_the_server_reads_a_harmony_answer_apart_whole_and_streamed() -> None:
    """The default model made to write Harmony by a regex, under a Harmony template: the official openai client
    gets the analysis as reasoning_content and the final channel as content; with tools, the commentary message
    to functions.get_weather as the one tool call; a forced tool choice is a clear 400."""
    import openai
    from openai import OpenAI

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    server = Server(None, "--trust-request-chat-template")
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60)
        base = dict(model=client.models.list().data[0].id, max_tokens=120, temperature=0,
                    messages=[{"role": "user", "content": "Weather in Paris?"}])
        extra = {"chat_template": HARMONY_TEMPLATE}
        answer = {**base, "extra_body": {**extra, "structured_outputs": {"regex": _regex(THOUGHT + ANSWER)}}}
        msg = client.chat.completions.create(**answer).choices[0].message
        assert msg.content == "It is sunny in Paris." and not msg.tool_calls
        assert getattr(msg, "reasoning_content", None) == "User wants the weather. Call the tool."
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(**answer, stream=True):
            if chunk.choices:
                reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
                content += chunk.choices[0].delta.content or ""
        assert (reasoning, content) == ("User wants the weather. Call the tool.", "It is sunny in Paris.")

        call = {**base, "tools": tools, "extra_body": {**extra, "structured_outputs": {"regex": _regex(THOUGHT + CALL)}}}
        choice = client.chat.completions.create(**call).choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("get_weather", {"city": "Paris"})]
        names, arguments, finish = [], "", None
        for chunk in client.chat.completions.create(**call, stream=True):
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
                for c in chunk.choices[0].delta.tool_calls or []:
                    names += [c.function.name] if c.function.name else []
                    arguments += c.function.arguments or ""
        assert names == ["get_weather"] and json.loads(arguments) == {"city": "Paris"} and finish == "tool_calls"

        with pytest.raises(openai.BadRequestError, match="Harmony"):
            client.chat.completions.create(**base, tools=tools, tool_choice="required", extra_body=extra)
    finally:
        assert server.stop() == 0
