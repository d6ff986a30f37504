"""Reasoning parsers (vLLM's `--reasoning-parser`): a model that thinks aloud between tags (Qwen3's and
DeepSeek-R1's `<think>` ... `</think>`) has that part returned as `message.reasoning_content` (and streamed as
`delta.reasoning_content`), never as `content` and never parsed for tool calls.

The rules follow vLLM's parsers: text after the end tag is content; Qwen3 output without an end tag is all
content once it is final (its template may have closed the thought in the prompt: `enable_thinking: false`),
while DeepSeek-R1's is all reasoning (its template opens the thought in the prompt). While streaming, text after
an open tag is reasoning until the end tag arrives, and a tag that may still be completing is held back."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    unclosed_is_reasoning: bool = False  # a final output with no end tag: reasoning (R1) or content (Qwen3)
    opened_by_prompt: bool = False  # the template writes the start tag: output begins inside the thought

    def split(self, text: str, final: bool = True, streamed: bool = False) -> tuple[str, str]:
        """(reasoning, content) of a cumulative output. streamed: a thought already sent as reasoning stays
        reasoning when the output ends unclosed."""
        s = text.find(self.start)
        body_from = s + len(self.start) if s >= 0 else (0 if self.opened_by_prompt else -1)
        if body_from < 0:  # no thought opened: content, unless the start tag may still be completing
            if not final and self.start.startswith(text.lstrip()) and text.strip():
                return "", ""
            return "", text
        before = text[:s] if s >= 0 else ""
        e = text.find(self.end, body_from)
        if e < 0:
            if final and not streamed and not self.unclosed_is_reasoning:
                return "", text
            thought = text[body_from:]
            if not final:  # hold back a partial end tag
                for k in range(min(len(self.end) - 1, len(thought)), 0, -1):
                    if self.end.startswith(thought[-k:]):
                        thought = thought[:-k]
                        break
            return thought.strip("\n") if final else thought.lstrip("\n"), before
        return text[body_from:e].strip("\n"), before + text[e + len(self.end):].lstrip("\n")


PARSERS = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", unclosed_is_reasoning=True, opened_by_prompt=True),
}


class ReasoningStream:
    """One streamed choice: the new reasoning and the new content of each cumulative output."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.sent_reasoning = 0
        self.sent_content = 0

    def update(self, text: str, final: bool) -> tuple[str, str, str]:
        """(new reasoning, new content, all content so far: what tool-call parsing reads)."""
        reasoning, content = self.parser.split(text, final, streamed=True)
        new_r = reasoning[self.sent_reasoning:] if len(reasoning) > self.sent_reasoning else ""
        new_c = content[self.sent_content:] if len(content) > self.sent_content else ""
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        self.sent_content = max(self.sent_content, len(content))
        return new_r, new_c, content
