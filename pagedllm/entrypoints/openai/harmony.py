"""gpt-oss's Harmony output: the answer comes in messages on channels, not as plain text, so chat completions
read it apart (vLLM's `openai_gptoss` reasoning parser and `openai` tool parser do the same):

    <|channel|>analysis<|message|>THOUGHT<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

The chat template ends the prompt with `<|start|>assistant`, so the output opens on a header. The analysis
channel is `reasoning_content`; the final channel, and commentary with no recipient (a preamble to the user), are
`content`; a message to `functions.NAME` is a tool call whose arguments are its body. The markers are special
tokens, so a Harmony request is detokenized with them kept. No torch here."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .tool_calls import ParsedCall, ParsedOutput, ToolCallStream
from .tool_calls import _held as held_back

MESSAGE, START = "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
MARKERS = (START, "<|channel|>", MESSAGE, *ENDS, "<|constrain|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def is_harmony(chat_template: str | None) -> bool:
    return bool(chat_template) and "<|channel|>" in chat_template  # type: ignore[operator]


@dataclass
class Message:
    channel: str | None
    recipient: str | None
    body: str
    done: bool


def _held(text: str) -> int:
    """Length of text's longest suffix that could be the start of a marker (held back while streaming)."""
    return max(held_back(text, m) for m in MARKERS)


def messages(text: str, final: bool) -> list[Message]:
    """The messages of a cumulative output, the last possibly unfinished (its body as far as it is written)."""
    out, i = [], 0
    while i < len(text):
        m = text.find(MESSAGE, i)
        if m < 0:
            break  # a header still being written
        header, start = text[i:m], m + len(MESSAGE)
        ends = [(p, t) for t in ENDS if (p := text.find(t, start)) >= 0]
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        if ends:
            p, t = min(ends)
            body, done, i = text[start:p], True, p + len(t)
        else:
            body, done, i = text[start:], final, len(text)
            if not final:
                body = body[:len(body) - _held(body)]
        out.append(Message(channel.group(1) if channel else None, recipient.group(1) if recipient else None,
                           body, done))
    return out


def split(text: str, final: bool = True) -> tuple[str, ParsedOutput]:
    """(reasoning, content and tool calls) of a cumulative Harmony output. Output with no message in it (a model
    that ignored the format) is content, once final, with any markers dropped."""
    msgs = messages(text, final)
    if not msgs:
        if not final:
            return "", ParsedOutput("")
        plain = text
        for mark in MARKERS:
            plain = plain.replace(mark, "")
        return "", ParsedOutput(plain)
    reasoning = "\n".join(m.body for m in msgs if m.channel == "analysis" and m.recipient is None)
    content = "".join(m.body for m in msgs if m.recipient is None and m.channel in ("final", "commentary", None))
    calls = [ParsedCall(m.recipient.removeprefix("functions."), m.body.strip() if m.done else m.body.lstrip(), m.done)
             for m in msgs if m.recipient is not None and m.recipient.startswith("functions.")]
    return reasoning, ParsedOutput(content, calls)


class HarmonyStream:
    """One streamed choice: new reasoning, new content and tool-call deltas of each cumulative output."""

    def __init__(self) -> None:
        self.sent_reasoning = 0
        self.calls = ToolCallStream(None)

    def update(self, text: str, final: bool) -> tuple[str, str, list[dict]]:
        reasoning, parsed = split(text, final)
        new_r = reasoning[self.sent_reasoning:] if len(reasoning) > self.sent_reasoning else ""
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        content, deltas = self.calls.update_parsed(parsed)
        return new_r, content, deltas
