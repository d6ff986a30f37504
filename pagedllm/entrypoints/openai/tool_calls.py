"""Tool calling: a model family's tool-call syntax, the structural tag that enforces a tool choice,
the prompt for chat templates that know no tools, and the parser from output text to OpenAI
tool calls (whole, or as streaming deltas). No torch here.

Formats (chosen from the chat template's text):
  hermes       <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>   (Hermes, Qwen 2/2.5/3,
               and the fallback for templates without tool support, whose prompt then describes it)
  llama3_json  {"name": "f", "parameters": {...}}   (Llama 3.1+; several joined by "; ")
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...errors import InvalidRequestError

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_WHITESPACE = 16  # in a tool's arguments: room for indented JSON, never an endless run of newlines


@dataclass(frozen=True)
class ToolFormat:
    name: str
    trigger: str  # the text that opens a call
    name_prefix: str  # trigger .. the function name's JSON string
    args_infix: str  # after the name .. the arguments value
    end: str  # after the arguments value
    separator: str
    args_keys: tuple[str, ...]  # keys a parser takes as the arguments

    def begin(self, name: str) -> str:
        return f"{self.name_prefix}{json.dumps(name)}{self.args_infix}"


HERMES = ToolFormat("hermes", "<tool_call>", '<tool_call>\n{"name": ', ', "arguments": ', "}\n</tool_call>", "\n",
                    ("arguments", "parameters"))
LLAMA3_JSON = ToolFormat("llama3_json", '{"name"', '{"name": ', ', "parameters": ', "}", "; ",
                         ("parameters", "arguments"))
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON)}


def tool_format_for(chat_template: str | None) -> ToolFormat:
    t = chat_template or ""
    if "<tool_call>" in t:
        return HERMES
    if "<|python_tag|>" in t or "ipython" in t:
        return LLAMA3_JSON
    return HERMES


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template  # type: ignore[operator]


# ---- requests --------------------------------------------------------------------------------
def check_tools(tools: list[dict], tool_choice: Any) -> str | None:
    """Validate tools and tool_choice; returns the forced function's name (or None)."""
    names = []
    for t in tools:
        fn = t.get("function") or {}
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise InvalidRequestError(f"tool name {name!r} must be 1-64 letters, digits, '_' or '-'")
        if name in names:
            raise InvalidRequestError(f"tool name {name!r} is given twice")
        names.append(name)
    if isinstance(tool_choice, dict):
        forced = (tool_choice.get("function") or {}).get("name")
        if forced not in names:
            raise InvalidRequestError(f"tool_choice names function {forced!r}, which is not in tools")
        return forced
    if tool_choice == "required" and not tools:
        raise InvalidRequestError("tool_choice 'required' needs at least one tool")
    return None


def parameters_of(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def structural_tag(fmt: ToolFormat, tools: list[dict], tool_choice: Any, parallel: bool) -> dict | None:
    """The xgrammar structural tag (JSON form) that enforces tool_choice over these tools:
    'required' = one call or more and nothing else; a named function = exactly that call;
    'auto' = free text, but a call once begun is a valid call of one of the tools."""
    if not tools or tool_choice == "none":
        return None

    def tag(t: dict) -> dict:
        return {"type": "tag", "begin": fmt.begin(t["function"]["name"]),
                "content": {"type": "json_schema", "json_schema": parameters_of(t), "max_whitespace_cnt": MAX_WHITESPACE},
                "end": fmt.end}

    if isinstance(tool_choice, dict):
        forced = tool_choice["function"]["name"]
        return {"type": "structural_tag", "format": tag(next(t for t in tools if t["function"]["name"] == forced))}
    tags = [tag(t) for t in tools]
    if tool_choice == "required":
        return {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags,
                                                     "separator": fmt.separator, "at_least_one": True,
                                                     "stop_after_first": not parallel}}
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags,
                                                 "at_least_one": False, "stop_after_first": not parallel}}


def tools_system_prompt(tools: list[dict]) -> str:
    """For templates that know no tools: the tools and the hermes call syntax, in the system turn."""
    sigs = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You can call functions to help with the user's request. The functions are described as JSON "
            f"inside <tools></tools>:\n<tools>\n{sigs}\n</tools>\nTo call one, answer with a JSON object holding "
            "its name and arguments inside <tool_call></tool_call> tags, one block per call:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>')


def template_messages(messages: list[dict], tools: list[dict] | None, knows_tools: bool) -> list[dict]:
    """Messages as the chat template sees them. Tool-call arguments become objects (HF convention).
    When the template knows no tools, the tools go into the system turn, earlier calls are written
    in hermes syntax and tool results wrapped in <tool_response>."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            m["tool_calls"] = [_call_for_template(c) for c in calls]
            if not knows_tools:
                blocks = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                                 "arguments": c["function"]["arguments"]},
                                                                ensure_ascii=False) + "\n</tool_call>"
                                   for c in m["tool_calls"])
                m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + blocks
        if m.get("role") == "tool" and not knows_tools:
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        out.append(m)
    if tools and not knows_tools:
        prompt = tools_system_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_for_template(call: dict) -> dict:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except json.JSONDecodeError:
            raise InvalidRequestError(f"tool call {call.get('id')!r}: arguments are not valid JSON") from None
    return {**call, "function": fn}


# ---- output parsing --------------------------------------------------------------------------
def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[i], or None if the text ends first."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
            elif text[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if c in "{[":
        depth, j, in_str = 0, i, False
        while j < len(text):
            ch = text[j]
            if in_str:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = re.compile(r"-?[0-9.eE+\-]+|true|false|null").match(text, i)
    if m is None:
        return i  # not JSON: an empty value, which fails json.loads
    return m.end() if m.end() < len(text) else None  # a number may still be growing


@dataclass
class ParsedCall:
    name: str | None = None
    arguments: str = ""  # JSON text of the arguments, as far as it is written
    complete: bool = False


@dataclass
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def _scan_object(text: str, i: int, fmt: ToolFormat) -> tuple[ParsedCall, int | None] | None:
    """The call object starting at text[i] ('{'): (call so far, end or None while incomplete);
    None when it is not a call (bad JSON, no name)."""
    call = ParsedCall()
    j = _skip_ws(text, i + 1)
    while True:
        if j >= len(text):
            return call, None
        if text[j] == "}":
            if call.name is None:
                return None
            call.complete = True
            if not call.arguments:
                call.arguments = "{}"
            return call, j + 1
        ke = _value_end(text, j)
        if ke is None:
            return call, None
        try:
            key = json.loads(text[j:ke])
        except json.JSONDecodeError:
            return None
        j = _skip_ws(text, ke)
        if j >= len(text):
            return call, None
        if text[j] != ":":
            return None
        v = _skip_ws(text, j + 1)
        ve = _value_end(text, v)
        if key == "name":
            if ve is None:
                return call, None
            try:
                call.name = json.loads(text[v:ve])
            except json.JSONDecodeError:
                return None
        elif key in fmt.args_keys:
            if ve is None:
                if v < len(text) and text[v] != '"':  # an object being written: stream it as it comes
                    call.arguments = text[v:]
                return call, None
            raw = text[v:ve]
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                return None
            call.arguments = value if isinstance(value, str) else raw  # some models quote the arguments
        elif ve is None:
            return call, None
        j = _skip_ws(text, ve)
        if j >= len(text):
            return call, None
        if text[j] == ",":
            j = _skip_ws(text, j + 1)
        elif text[j] != "}":
            return None


def _held(text: str, trigger: str) -> int:
    """Length of text's longest suffix that could be the start of trigger (held back while streaming)."""
    for k in range(min(len(trigger) - 1, len(text)), 0, -1):
        if trigger.startswith(text[-k:]):
            return k
    return 0


def parse_tool_calls(text: str, fmt: ToolFormat, final: bool) -> ParsedOutput:
    """Content before the first call, and the calls (the last possibly incomplete unless final).
    A block that turns out not to be a call stays content."""
    calls: list[ParsedCall] = []
    if fmt is LLAMA3_JSON:
        body = text.removeprefix("<|python_tag|>")
        i = _skip_ws(body, 0)
        if i == len(body) and not final:
            return ParsedOutput("")  # only whitespace so far: a call may still begin
        if body[i:i + 1] != "{":
            return ParsedOutput(text if final else text[:len(text) - _held(text, "<|python_tag|>")])
        while i < len(body):
            scanned = _scan_object(body, i, fmt)
            if scanned is None:  # not a call after all: all of it is content
                return ParsedOutput(text)
            call, end = scanned
            calls.append(call)
            if end is None:
                break
            i = _skip_ws(body, end)
            if not body.startswith(";", i):
                break
            i = _skip_ws(body, i + 1)
        if final and not any(c.complete for c in calls):
            return ParsedOutput(text)
        return ParsedOutput("", calls)
    start = text.find(fmt.trigger)
    if start < 0:
        return ParsedOutput(text if final else text[:len(text) - _held(text, fmt.trigger)])
    content = text[:start]
    i = start
    while i >= 0:
        j = _skip_ws(text, i + len(fmt.trigger))
        if j >= len(text):
            calls.append(ParsedCall())
            break
        if text[j] != "{":
            break
        scanned = _scan_object(text, j, fmt)
        if scanned is None:
            break
        call, end = scanned
        calls.append(call)
        if end is None:
            break
        i = text.find(fmt.trigger, end)
    calls = [c for c in calls if c.name is not None or not final]
    if final and not calls:
        return ParsedOutput(text)
    return ParsedOutput(content, calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_message(parsed: ParsedOutput) -> list[dict]:
    return [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.calls if c.complete]


class ToolCallStream:
    """Streaming deltas of one choice: content pieces, then each call's id and name once, and its
    arguments in pieces (OpenAI's delta.tool_calls[i].function.arguments)."""

    def __init__(self, fmt: ToolFormat | None) -> None:
        """fmt: the syntax update() parses (None: the caller parses, update_parsed)."""
        self.fmt = fmt
        self.sent_content = 0
        self.sent: list[tuple[str, int]] = []  # per call announced: (id, arguments chars sent)

    def update(self, text: str, final: bool) -> tuple[str, list[dict]]:
        return self.update_parsed(parse_tool_calls(text, self.fmt, final))

    def update_parsed(self, parsed: ParsedOutput) -> tuple[str, list[dict]]:
        """(new content, tool-call deltas) of a cumulative parse."""
        content = parsed.content[self.sent_content:] if len(parsed.content) > self.sent_content else ""
        self.sent_content = max(self.sent_content, len(parsed.content))
        deltas = []
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break  # its name decides its id's first delta: wait for it
            if i == len(self.sent):
                self.sent.append((new_call_id(), 0))
                deltas.append({"index": i, "id": self.sent[i][0], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            cid, n = self.sent[i]
            if len(call.arguments) > n:
                piece = call.arguments[n:]
                self.sent[i] = (cid, len(call.arguments))
                if deltas and deltas[-1]["index"] == i:
                    deltas[-1]["function"]["arguments"] += piece
                else:
                    deltas.append({"index": i, "function": {"arguments": piece}})
        return content, deltas

    @property
    def num_calls(self) -> int:
        return len(self.sent)
