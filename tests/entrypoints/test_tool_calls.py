"""Tool-call formats, prompts and parsers (no torch, no model)."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    ToolCallStream,
    check_tools,
    parse_tool_calls,
    structural_tag,
    template_messages,
    tool_calls_message,
    tool_format_for,
)
from pagedllm.errors import InvalidRequestError

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]

HERMES_TEXT = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"Ville\\" {x}"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
LLAMA_TEXT = '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "now", "parameters": {}}'


def test_format_follows_the_chat_template():
    assert tool_format_for("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert tool_format_for("<|start_header_id|>ipython<|end_header_id|>") is LLAMA3_JSON
    assert tool_format_for(None) is HERMES  # templates without tools: the prompt teaches hermes


@pytest.mark.parametrize("fmt,text", [(HERMES, HERMES_TEXT), (LLAMA3_JSON, LLAMA_TEXT)])
def test_parse_whole_and_streamed_agree(fmt, text):
    parsed = parse_tool_calls(text, fmt, final=True)
    calls = tool_calls_message(parsed)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[1]["function"]["arguments"]) == {}
    assert parsed.content == ("Let me check." if fmt is HERMES else "")
    for step in (1, 3, 7):  # any way the text arrives, the deltas add up to the same calls
        s = ToolCallStream(fmt)
        content, got = "", {}
        for k in range(step, len(text) + step, step):
            c, deltas = s.update(text[:k], final=k >= len(text))
            content += c
            for d in deltas:
                if "id" in d:
                    assert d["index"] not in got and d["id"].startswith("call_")
                    got[d["index"]] = [d["function"]["name"], ""]
                got[d["index"]][1] += d["function"]["arguments"]
        assert content == parsed.content
        assert [tuple(got[i]) for i in sorted(got)] == [(c["function"]["name"], c["function"]["arguments"])
                                                        for c in calls]


def test_partial_trigger_is_held_back_and_non_calls_stay_content():
    assert parse_tool_calls("Hello <tool_c", HERMES, final=False).content == "Hello "
    assert parse_tool_calls("Hello <tool_c", HERMES, final=True).content == "Hello <tool_c"
    bad = "Look: <tool_call>\nnot json\n</tool_call>"
    assert parse_tool_calls(bad, HERMES, final=True).content == bad
    assert parse_tool_calls('{"a": 1}', LLAMA3_JSON, final=True).content == '{"a": 1}'
    assert parse_tool_calls("Plain answer.", LLAMA3_JSON, final=True).content == "Plain answer."
    quoted = '<tool_call>\n{"name": "now", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>'
    assert tool_calls_message(parse_tool_calls(quoted, HERMES, True))[0]["function"]["arguments"] == '{"tz": "UTC"}'


def test_check_tools_refuses_by_name():
    assert check_tools(TOOLS, {"type": "function", "function": {"name": "now"}}) == "now"
    assert check_tools(TOOLS, "auto") is None
    for tools, choice, needle in [(TOOLS, {"type": "function", "function": {"name": "later"}}, "later"),
                                  ([], "required", "at least one"), ([TOOLS[1], TOOLS[1]], "auto", "twice"),
                                  ([{"type": "function", "function": {"name": "a b"}}], "auto", "a b")]:
        with pytest.raises(InvalidRequestError, match=needle):
            check_tools(tools, choice)


def test_structural_tags_per_choice():
    assert structural_tag(HERMES, TOOLS, "none", True) is None
    req = structural_tag(HERMES, TOOLS, "required", parallel=False)["format"]
    assert req["type"] == "tags_with_separator" and req["at_least_one"] and req["stop_after_first"]
    assert [t["begin"] for t in req["tags"]] == ['<tool_call>\n{"name": "get_weather", "arguments": ',
                                                 '<tool_call>\n{"name": "now", "arguments": ']
    assert req["tags"][1]["content"]["json_schema"] == {"type": "object", "properties": {}}
    auto = structural_tag(LLAMA3_JSON, TOOLS, "auto", parallel=True)["format"]
    assert auto["type"] == "triggered_tags" and auto["triggers"] == ['{"name"'] and not auto["at_least_one"]
    named = structural_tag(HERMES, TOOLS, {"type": "function", "function": {"name": "now"}}, True)["format"]
    assert named["type"] == "tag" and named["begin"].endswith('"now", "arguments": ')


def test_messages_for_a_template_without_tools():
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = template_messages(msgs, TOOLS, knows_tools=False)
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    native = template_messages(msgs, TOOLS, knows_tools=True)
    assert len(native) == 3 and native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'  # the caller's copy untouched
    with pytest.raises(InvalidRequestError, match="call_9"):
        template_messages([{"role": "assistant", "tool_calls": [
            {"id": "call_9", "function": {"name": "f", "arguments": "{oops"}}]}], TOOLS, True)
