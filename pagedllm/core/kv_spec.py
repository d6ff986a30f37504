"""What each attention layer keeps in the KV pool, declared by the model, and how layers share the pool.

A model declares one `KVSpec` per layer: its KV heads and head size, and for a sliding-window layer how far
back it attends. `plan_kv_layout` groups the layers. Each group keeps its own block table per request, and all
tables draw from one pool of block ids:

* A full-attention group keeps a block for every token. A sliding-window group frees the blocks that leave its
  window (their table entries become `NULL_BLOCK`), so a Gemma-3 request 32k tokens long holds its window, not
  its length, in five of every six layers.
* Groups have equal numbers of layers (the last may be short), and layer j of every group stores its K/V in
  the same per-slot tensor: a block id is one page of `num_slots` layers whatever group holds it, so no group
  fragments another and the pool's bytes are all usable by any group.

Layers whose pages differ in size (heads or head size) cannot share slots: they stay in one group with full
tables, as do all layers when the hybrid layout is turned off. A layer whose spec is None keeps no KV (a
linear-attention layer keeps a state slot instead: state_slots.py); it is in no group (-1). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

NULL_BLOCK = -1  # a table entry whose block left a sliding window: never read, never written


@dataclass(frozen=True)
class KVSpec:
    num_kv_heads: int  # this rank's, under tensor parallelism
    head_dim: int
    sliding_window: int | None = None  # None: attends to every earlier token

    @property
    def kind(self) -> str:
        return "full" if self.sliding_window is None else f"sliding_window={self.sliding_window}"


@dataclass(frozen=True)
class KVGroup:
    sliding_window: int | None  # None: full attention, a block for every token
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVLayout:
    """The groups (a full-attention group first when there is one) and where each layer's K/V lives."""

    groups: tuple[KVGroup, ...]
    group_of_layer: tuple[int, ...]
    slot_of_layer: tuple[int, ...]  # which of the num_slots per-slot tensors holds the layer's K/V

    @property
    def num_slots(self) -> int:
        return max(len(g.layers) for g in self.groups)

    def slot_specs(self, specs: list[KVSpec | None]) -> list[KVSpec]:
        """The spec of each slot tensor (a slot's layers share one, by construction)."""
        first = {}
        for layer, slot in enumerate(self.slot_of_layer):
            if slot >= 0:
                first.setdefault(slot, specs[layer])
        return [first[j] for j in range(self.num_slots)]

    @property
    def windows(self) -> list[int | None]:
        return [g.sliding_window for g in self.groups]

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1 or self.groups[0].sliding_window is not None


def group_layers(specs: list[KVSpec | None]) -> dict[KVSpec, list[int]]:
    """Layer indices by spec, in first-seen order (layers without KV left out)."""
    groups: dict[KVSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        if spec is not None:
            groups.setdefault(spec, []).append(i)
    return groups


MAX_GROUPS = 8  # each group costs a block table per request and its own attention metadata each step


def plan_kv_layout(specs: list[KVSpec | None], hybrid: bool = True) -> KVLayout:
    """Groups of equal size: the size is the layer count of the rarest kind (so a kind never shares a group
    with another), raised until there are at most MAX_GROUPS groups."""
    by_kind = group_layers(specs)
    shapes = {(s.num_kv_heads, s.head_dim) for s in by_kind}
    kv_layers = tuple(i for i, s in enumerate(specs) if s is not None)
    if not hybrid or len(shapes) > 1 or all(s.sliding_window is None for s in by_kind):
        window = next(iter(by_kind)).sliding_window if len(by_kind) == 1 and hybrid and len(shapes) == 1 else None
        slot = {layer: j for j, layer in enumerate(kv_layers)}
        return KVLayout((KVGroup(window, kv_layers),), tuple(0 if s is not None else -1 for s in specs),
                        tuple(slot.get(i, -1) for i in range(len(specs))))
    kinds = sorted(by_kind.items(), key=lambda kv: kv[0].sliding_window is not None)  # full attention first
    size = min(len(ix) for _, ix in kinds)
    while sum(-(-len(ix) // size) for _, ix in kinds) > MAX_GROUPS:
        size += 1
    groups: list[KVGroup] = []
    group_of, slot_of = [-1] * len(specs), [-1] * len(specs)
    for spec, ix in kinds:
        for start in range(0, len(ix), size):
            members = tuple(ix[start:start + size])
            for slot, layer in enumerate(members):
                group_of[layer], slot_of[layer] = len(groups), slot
            groups.append(KVGroup(spec.sliding_window, members))
    return KVLayout(tuple(groups), tuple(group_of), tuple(slot_of))
