"""State slots: a fixed-size state per running sequence for layers that keep one instead of KV (linear attention:
Qwen3.5's Gated DeltaNet). Slot ids only; the model runner holds the tensors. No torch here.

A request takes a slot for itself and one for each fork it will make when it is admitted, so the forks never
wait for one; preemption and finishing give them back (a preempted request recomputes its state from scratch).
"""

from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"need num_slots >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        """n slots, or None (nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def give(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not held")
        self._free.append(slot)
