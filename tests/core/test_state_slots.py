"""State slots: a linear-attention state per admitted sequence, taken and given back by the scheduler."""

from __future__ import annotations

import pytest

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.state_slots import StateSlots
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import SamplingParams


def test_slots_are_taken_all_or_none_and_given_back_once():
    s = StateSlots(3)
    assert s.take(2) == [0, 1] and s.num_free == 1
    assert s.take(2) is None and s.num_free == 1
    s.give(0)
    with pytest.raises(ValueError, match="not held"):
        s.give(0)
    assert s.take(2) == [0, 2]


def _req(rid: str, n_forks: int = 0, prompt: int = 6) -> Request:
    req = Request(rid, list(range(prompt)), SamplingParams(max_tokens=8))
    req.pending_forks = [Request(f"{rid}.{i}", list(range(prompt)), SamplingParams(max_tokens=8))
                         for i in range(n_forks)]
    return req


def test_a_request_takes_a_slot_for_itself_and_each_fork_and_forks_copy_its_state():
    slots = StateSlots(4)
    sc = Scheduler(BlockManager(64, 4, enable_caching=False), 8, 64, 64, state_slots=slots)
    a, b = _req("a", n_forks=1), _req("b", n_forks=2)
    sc.add_request(a)
    sc.add_request(b)
    out = sc.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a"]  # b's three slots are not free: it waits
    assert (a.state_slot, a.pending_forks[0].state_slot, slots.num_free) == (0, 1, 2)
    child = a.pending_forks[0]
    sc.update(out, {"a": [7]})
    sc.fork(a, child)
    assert sc.schedule().state_copies == [(0, 1)]  # before the step that runs both
    sc.finish(a, RequestStatus.FINISHED_STOPPED)
    sc.finish(child, RequestStatus.FINISHED_STOPPED)
    assert slots.num_free == 4 and a.state_slot is None and child.state_slot is None
    assert [s.request.request_id for s in sc.schedule().scheduled] == ["b"]
    # the slots given back last are taken first (1, then 0), then the never-used 2
    assert (b.state_slot, [c.state_slot for c in b.pending_forks]) == (1, [0, 2])


def test_preemption_gives_the_slots_back_and_a_group_larger_than_the_slots_is_refused():
    slots = StateSlots(2)
    sc = Scheduler(BlockManager(64, 4, enable_caching=False), 8, 64, 64, state_slots=slots)
    a = _req("a", n_forks=1)
    sc.add_request(a)
    sc.schedule()
    sc._preempt(a)
    assert slots.num_free == 2 and a.state_slot is None and a.pending_forks[0].state_slot is None
    with pytest.raises(InvalidRequestError, match="n=3 needs 3 linear-attention state slots"):
        sc.add_request(_req("big", n_forks=2))
