"""Input-grounded prompts for speculative decoding: rewrite, copy or quote a given passage, so outputs
copy spans of the prompt. Passages (passages.txt): the Declaration of Independence, the Gettysburg
Address and the Bill of Rights (public domain), one per paragraph."""

from __future__ import annotations

from pathlib import Path

TASKS = [
    "Rewrite the following text word for word, exactly as written:\n\n{p}",
    "Copy this passage exactly:\n\n{p}",
    "Here is a passage:\n\n{p}\n\nRepeat its first three sentences exactly.",
]


def passages() -> list[str]:
    return (Path(__file__).parent / "passages.txt").read_text().strip().split("\n\n")


def grounded_messages(n: int) -> list[list[dict]]:
    """n chat conversations, each one task on one passage (cycling through both)."""
    ps = passages()
    return [[{"role": "user", "content": TASKS[i % len(TASKS)].format(p=ps[i % len(ps)])}] for i in range(n)]
