"""The pool's block records and its free queue (bookkeeping only; no torch).

The free queue holds the free block ids in eviction order. Its head is taken first, so a cached
block at the head is the least recently used one; never-used ids sit between the front and the back
as a counter, and a block's record is made on first use, so a pool of millions of blocks costs
nothing until it fills.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # kept to confirm cache hits (collision guard)
    group: int = 0  # the layer group whose tables hold it (or held it last)


def hash_block(parent: bytes | None, token_ids: Sequence[int], salt: str | None) -> bytes:
    h = hashlib.sha256(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    if salt:
        h.update(b"salt:" + salt.encode())
    return h.digest()


class FreeQueue:
    """Free block ids in eviction order: those pushed to the front, then the never-used ids in id order, then
    those pushed to the back. A never-used id is only taken from the head, so that run is a counter."""

    def __init__(self, num_blocks: int) -> None:
        self._front: OrderedDict[int, None] = OrderedDict()  # first key = the head
        self._next, self._end = 0, num_blocks  # never used: ids [_next, _end)
        self._back: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._front) + self._end - self._next + len(self._back)

    def __contains__(self, bid: int) -> bool:
        return bid in self._front or bid in self._back or self._next <= bid < self._end

    def __iter__(self) -> Iterator[int]:
        yield from self._front
        yield from range(self._next, self._end)
        yield from self._back

    def used(self) -> Iterator[int]:
        """The free ids that were used before (the only ones that can hold a hash)."""
        yield from self._front
        yield from self._back

    def pop_head(self) -> int:
        if self._front:
            return self._front.popitem(last=False)[0]
        if self._next < self._end:
            self._next += 1
            return self._next - 1
        return self._back.popitem(last=False)[0]

    def push_front(self, bid: int) -> None:
        self._front[bid] = None
        self._front.move_to_end(bid, last=False)

    def push_back(self, bid: int) -> None:
        self._back[bid] = None

    def remove(self, bid: int) -> None:  # a used id (a cached block being hit again)
        if bid in self._front:
            del self._front[bid]
        else:
            del self._back[bid]


class Blocks:
    """The KVBlock of every id, made on first access."""

    def __init__(self, num_blocks: int) -> None:
        self._made: dict[int, KVBlock] = {}
        self._n = num_blocks

    def __getitem__(self, bid: int) -> KVBlock:
        blk = self._made.get(bid)
        if blk is None:
            if not 0 <= bid < self._n:
                raise IndexError(f"block {bid} is outside the pool of {self._n}")
            blk = self._made[bid] = KVBlock(bid)
        return blk

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[KVBlock]:
        return (self[i] for i in range(self._n))

    def made(self) -> Iterator[KVBlock]:
        """The blocks used at least once (the others are free, with no hash)."""
        return iter(self._made.values())
