"""--reasoning-parser: a thinking model's <think> part is reasoning_content, never content or tool calls."""

from __future__ import annotations

import json

import httpx
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
    """The default model is made to think in tags by a regex; the server splits what it wrote."""
    server = Server(None, "--reasoning-parser", "qwen3")
    try:
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 40,
                "temperature": 0, "structured_outputs": {"regex": "<think>[a-z ]{3,20}</think>\\n\\nParis"}}
        msg = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        assert msg["content"] == "Paris" and msg["reasoning_content"] and "<" not in msg["reasoning_content"]
        reasoning, content = "", ""
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body | {"stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    reasoning += delta.get("reasoning_content") or ""
                    content += delta.get("content") or ""
        assert content == "Paris" and reasoning.strip("\n") == msg["reasoning_content"]
    finally:
        assert server.stop() == 0
