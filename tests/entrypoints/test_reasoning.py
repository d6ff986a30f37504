"""--reasoning-parser: a thinking model's <think> part is reasoning_content, never content or tool calls."""

from __future__ import annotations

import pytest
from helpers import Server

from pagedllm.entrypoints.openai.reasoning import PARSERS, ReasoningStream

QWEN3, R1 = PARSERS["qwen3"], PARSERS["deepseek_r1"]


def test_the_thought_and_the_answer_split_at_the_tags() -> None:
    assert QWEN3.split("<think>\nhmm, France\n</think>\n\nParis") == ("hmm, France", "Paris")
    assert QWEN3.split("Paris") == ("", "Paris")  # enable_thinking off: the template closed the thought
    assert QWEN3.split("<think>\nhmm") == ("", "<think>\nhmm")  # Qwen3, unclosed at the end: content (as vLLM)
    assert R1.split("hmm\n</think>\n\nParis") == ("hmm", "Paris")  # R1's template opens the thought
    assert R1.split("hmm") == ("hmm", "")


def test_a_tag_that_may_still_be_completing_is_held_back() -> None:
    assert QWEN3.split("<thi", final=False) == ("", "")
    assert QWEN3.split("<think>\nhmm</th", final=False) == ("hmm", "")
    assert QWEN3.split("Par", final=False) == ("", "Par")


def test_streamed_pieces_add_up_to_the_split() -> None:
    full = "<think>\nlet me think\n</think>\n\nThe answer is Paris."
    stream = ReasoningStream(QWEN3)
    pieces = [stream.update(full[:i], final=i == len(full)) for i in range(1, len(full) + 1)]
    assert "".join(p[0] for p in pieces).strip("\n") == "let me think"
    assert "".join(p[1] for p in pieces) == "The answer is Paris."
    assert pieces[-1][2] == "The answer is Paris."


@pytest.mark.slow
def test_the_server_returns_reasoning_content_whole_and_streamed() -> None:
    """The default model is made to think in tags by a regex; the server splits what it wrote, and the official
    openai client reads the two apart (reasoning_content as the extra field vLLM's clients read)."""
    from openai import OpenAI

    server = Server(None, "--reasoning-parser", "qwen3")
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60)
        kw = dict(model=client.models.list().data[0].id, max_tokens=40, temperature=0,
                  messages=[{"role": "user", "content": "What is the capital of France?"}],
                  extra_body={"structured_outputs": {"regex": "<think>[a-z ]{3,20}</think>\\n\\nParis"}})
        msg = client.chat.completions.create(**kw).choices[0].message
        thought = getattr(msg, "reasoning_content", None)
        assert msg.content == "Paris" and thought and "<" not in thought
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(**kw, stream=True):
            if chunk.choices:
                delta = chunk.choices[0].delta
                reasoning += getattr(delta, "reasoning_content", None) or ""
                content += delta.content or ""
        assert content == "Paris" and reasoning.strip("\n") == thought
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_tool_calls_in_a_thinking_models_answer_parse_and_those_in_its_thought_do_not() -> None:
    """A thought that writes a tool call, then an answer that makes one (the default model made to by a regex):
    the official openai client gets one call, the answer's, whole and streamed; the thought stays reasoning."""
    import json

    from openai import OpenAI

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    thought = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    answer = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    regex = "".join("\\" + ch if ch in "{}()[].*+?|^$\\" else ch for ch in f"<think>{thought}</think>\n\n{answer}")
    server = Server(None, "--reasoning-parser", "qwen3")
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60)
        kw = dict(model=client.models.list().data[0].id, max_tokens=80, temperature=0, tools=tools,
                  messages=[{"role": "user", "content": "Weather in Paris?"}],
                  extra_body={"structured_outputs": {"regex": regex}})
        choice = client.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("get_weather", {"city": "Paris"})]
        assert getattr(choice.message, "reasoning_content", "").strip("\n") == thought
        names, arguments, reasoning = [], "", ""
        for chunk in client.chat.completions.create(**kw, stream=True):
            if chunk.choices:
                delta = chunk.choices[0].delta
                reasoning += getattr(delta, "reasoning_content", None) or ""
                for call in delta.tool_calls or []:
                    names += [call.function.name] if call.function.name else []
                    arguments += call.function.arguments or ""
        assert names == ["get_weather"] and json.loads(arguments) == {"city": "Paris"}
        assert reasoning.strip("\n") == thought
    finally:
        assert server.stop() == 0
