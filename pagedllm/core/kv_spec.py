"""What each attention layer keeps in the KV pool, declared by the model: its KV heads and head size, and
for a sliding-window layer how far back it attends. Sizing counts bytes per layer from these; the model
runner allocates each layer's cache from its own spec. Layers with equal specs form a group (today every
group shares one block table per request; hybrid models will give each group its own)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVSpec:
    num_kv_heads: int  # this rank's, under tensor parallelism
    head_dim: int
    sliding_window: int | None = None  # None: attends to every earlier token

    @property
    def kind(self) -> str:
        return "full" if self.sliding_window is None else f"sliding_window={self.sliding_window}"


def group_layers(specs: list[KVSpec]) -> dict[KVSpec, list[int]]:
    """Layer indices by spec, in first-seen order."""
    groups: dict[KVSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault(spec, []).append(i)
    return groups
