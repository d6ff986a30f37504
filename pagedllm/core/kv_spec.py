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

Layers of other shapes share the pool too (page-size unification): a slot's page holds one layer of the
largest kind, or `per_page` layers of a kind whose pages are that many times smaller (Gemma 4's sliding layers
against its global ones, whose heads are twice as large). Part j of a page is the layer's own virtual block
`block * per_page + j`, so each layer still sees a contiguous pool of pages of its shape. Where page sizes do not
divide (`page_parts` not given, or not in whole ratios for every pool tensor), such layers stay in one group with
full tables, as do all layers when the hybrid layout is turned off. A layer whose spec is None keeps no KV (a
linear-attention layer keeps a state slot instead: state_slots.py); it is in no group (-1). No torch here.
"""

from __future__ import annotations

from collections.abc import Callable
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
    per_page: int = 1  # layers of this group in each slot's page (smaller pages packed into the largest)

    @property
    def num_slots(self) -> int:
        return -(-len(self.layers) // self.per_page)


@dataclass(frozen=True)
class KVLayout:
    """The groups (a full-attention group first when there is one) and where each layer's K/V lives."""

    groups: tuple[KVGroup, ...]
    group_of_layer: tuple[int, ...]
    slot_of_layer: tuple[int, ...]  # which of the num_slots per-slot tensors holds the layer's K/V
    part_of_layer: tuple[int, ...] = ()  # which part of its slot's page (groups packing several layers a page)

    @property
    def num_slots(self) -> int:
        return max(g.num_slots for g in self.groups)

    @property
    def packed(self) -> bool:
        """Layers of different shapes share slots (pages of the largest kind's bytes)."""
        return bool(self.part_of_layer)

    def slot_specs(self, specs: list[KVSpec | None]) -> list[KVSpec]:
        """The spec whose one layer fills a slot's page, per slot tensor (the page's bytes)."""
        if self.packed:
            page = next(specs[i] for g in self.groups if g.per_page == 1 for i in g.layers)
            return [page] * self.num_slots
        first = {}
        for layer, slot in enumerate(self.slot_of_layer):
            if slot >= 0:
                first.setdefault(slot, specs[layer])
        return [first[j] for j in range(self.num_slots)]

    def slot_kinds(self, specs: list[KVSpec | None]) -> list[dict[KVSpec, int]]:
        """Per slot tensor: the specs of the layers it holds, each with its layers per page."""
        kinds: list[dict[KVSpec, int]] = [{} for _ in range(self.num_slots)]
        for layer, slot in enumerate(self.slot_of_layer):
            if slot >= 0:
                kinds[slot][specs[layer]] = self.groups[self.group_of_layer[layer]].per_page
        return kinds

    @property
    def views(self) -> list[tuple[int, int]]:
        """(group, part of the page) for each distinct way layers address the pool: one per group, or one per
        part in use for a group that packs several layers a page. Each needs its own block tables."""
        return [(g, part) for g, grp in enumerate(self.groups) for part in range(min(grp.per_page, len(grp.layers)))]

    def view_of_layer(self, layer: int) -> int:
        """The index in `views` of the layer's (a layer without KV: the first view)."""
        g = self.group_of_layer[layer]
        return self.views.index((g, self.part_of_layer[layer] if self.packed else 0)) if g >= 0 else 0

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


MAX_GROUPS = 12  # each group costs a block table per request and its own attention metadata each step

PageParts = Callable[[KVSpec], tuple[int, ...]]  # a layer's bytes of one block, per pool tensor of its cache


def pages_per_kind(kinds: list[KVSpec], page_parts: PageParts | None) -> dict[KVSpec, int] | None:
    """How many layers of each kind fill the largest kind's page: 1 for all where shapes agree; where they do
    not, the whole ratio of the pages, if every pool tensor (K, V, scales) is that ratio; None where not."""
    if len({(s.num_kv_heads, s.head_dim) for s in kinds}) == 1:
        return dict.fromkeys(kinds, 1)
    if page_parts is None:
        return None
    parts = {s: page_parts(s) for s in kinds}
    if not all(parts.values()):
        return None
    largest = max(parts.values(), key=sum)
    out = {}
    for spec, p in parts.items():
        if len(p) != len(largest) or any(b <= 0 or a % b for a, b in zip(largest, p)):
            return None
        ratios = {a // b for a, b in zip(largest, p)}
        if len(ratios) != 1:
            return None
        out[spec] = ratios.pop()
    return out


def plan_kv_layout(specs: list[KVSpec | None], hybrid: bool = True, page_parts: PageParts | None = None) -> KVLayout:
    """Layers grouped by kind into groups of `num_slots` pages' worth of layers. The slot count keeps the
    full-attention groups' pages fullest (they hold a block for every token: at a long context, their unused
    slots are most of the waste), then makes the fewest groups, at most MAX_GROUPS.
    page_parts: how to weigh layers of different shapes against each other (None: such layers stay in one
    group with full tables)."""
    by_kind = group_layers(specs)
    kv_layers = tuple(i for i, s in enumerate(specs) if s is not None)
    per_page = pages_per_kind(list(by_kind), page_parts) if hybrid else None
    if per_page is None or all(s.sliding_window is None for s in by_kind):
        shapes = {(s.num_kv_heads, s.head_dim) for s in by_kind}
        window = next(iter(by_kind)).sliding_window if len(by_kind) == 1 and hybrid and len(shapes) == 1 else None
        slot = {layer: j for j, layer in enumerate(kv_layers)}
        return KVLayout((KVGroup(window, kv_layers),), tuple(0 if s is not None else -1 for s in specs),
                        tuple(slot.get(i, -1) for i in range(len(specs))))
    kinds = sorted(by_kind.items(), key=lambda kv: kv[0].sliding_window is not None)  # full attention first

    def cost(slots: int) -> tuple[int, int]:
        full = sum(-(-len(ix) // (slots * per_page[s])) * slots for s, ix in kinds if s.sliding_window is None)
        return full, sum(-(-len(ix) // (slots * per_page[s])) for s, ix in kinds)

    fits = [n for n in range(1, max(len(ix) for _, ix in kinds) + 1) if cost(n)[1] <= MAX_GROUPS]
    size = min(fits, key=cost)
    groups: list[KVGroup] = []
    group_of, slot_of, part_of = [-1] * len(specs), [-1] * len(specs), [0] * len(specs)
    for spec, ix in kinds:
        m = per_page[spec]
        for start in range(0, len(ix), size * m):
            members = tuple(ix[start:start + size * m])
            for k, layer in enumerate(members):
                group_of[layer], slot_of[layer], part_of[layer] = len(groups), k // m, k % m
            groups.append(KVGroup(spec.sliding_window, members, m))
    packed = any(m > 1 for m in per_page.values()) or len({(s.num_kv_heads, s.head_dim) for s in by_kind}) > 1
    return KVLayout(tuple(groups), tuple(group_of), tuple(slot_of), tuple(part_of) if packed else ())
