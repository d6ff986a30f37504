"""Scheduler bookkeeping, without a model: sampled tokens are faked."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import SamplingParams


def make(num_blocks=16, block_size=4, max_num_seqs=8, budget=64, max_len=64, **kw):
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, max_len, **kw)


def req(rid: str, n_prompt: int, max_tokens: int, priority: int = 0, base: int = 0) -> Request:
    return Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens),
                   priority=priority)


def step(s: Scheduler) -> dict[str, int]:
    """One fake step; finishes requests that reached max_tokens. Returns scheduled counts."""
    out = s.schedule()
    s.update(out, {x.request.request_id: 7 for x in out.scheduled if x.completes})
    for x in out.scheduled:
        r = x.request
        if len(r.output_token_ids) >= r.max_tokens:
            s.finish(r, RequestStatus.FINISHED_LENGTH)
    return {x.request.request_id: x.num_new_tokens for x in out.scheduled}


CONTROL_PLANE = ["core.scheduler", "core.block_manager", "core.request", "core.kv_spec", "core.state_slots",
                 "sampling_params", "limits", "outputs", "tools.planner", "tools.simulate"]


def test_control_plane_never_loads_torch():
    """In a fresh interpreter: what the modules pull in counts, not only their own imports."""
    code = ("import sys\n" + "".join(f"import pagedllm.{m}\n" for m in CONTROL_PLANE)
            + "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_continuous_batching_leave_and_join():
    s = make(max_num_seqs=2)
    for r in (req("a", 3, 1), req("b", 3, 3), req("c", 2, 1)):
        s.add_request(r)
    assert step(s) == {"a": 3, "b": 3}  # c waits: max_num_seqs
    assert [r.request_id for r in s.running] == ["b"]  # a finished and left at once
    assert step(s) == {"b": 1, "c": 2}  # c joins the very next step
    assert step(s) == {"b": 1}
    assert s.num_unfinished == 0 and s.bm.num_free_blocks == 16


def test_chunked_prefill_shares_step_with_decodes():
    s = make(budget=8, max_len=64)
    s.add_request(req("short", 2, 5))
    assert step(s) == {"short": 2}
    s.add_request(req("long", 20, 1, base=100))
    assert step(s) == {"short": 1, "long": 7}
    assert step(s) == {"short": 1, "long": 7}
    assert step(s) == {"short": 1, "long": 6}  # prompt done: samples its first token
    assert s.counters.prompt_tokens == 22


def test_refuses_what_can_never_fit():
    s = make(num_blocks=4, block_size=4, max_len=64)
    with pytest.raises(InvalidRequestError, match="whole pool"):
        s.add_request(req("x", 10, 7))  # 17 tokens > 16 slots
    s2 = make(max_len=10)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        s2.add_request(req("y", 8, 3))
    assert s.num_unfinished == 0


def test_preempts_lowest_priority_latest_admitted_and_recomputes():
    s = make(num_blocks=4, block_size=2, budget=64, max_len=8, watermark=0.0)
    s.add_request(req("a", 2, 4, priority=0))
    s.add_request(req("b", 2, 4, priority=1, base=10))
    s.add_request(req("c", 2, 4, priority=0, base=20))
    step(s)  # a, b, c admitted in (priority, arrival) order: a, c, b
    assert [r.request_id for r in s.running] == ["a", "c", "b"]
    step(s)  # each needs a second block: 4 blocks for 3 needs -> b (lowest priority) preempted
    assert s.counters.num_preemptions == 1
    b = s.waiting["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [7]  # kept; recomputed on readmission
    while s.num_unfinished:
        step(s)
    assert s.bm.num_free_blocks == 4
    assert all(r.status.finished for r in (b,))


def test_reserve_mode_never_preempts():
    s = make(num_blocks=6, block_size=2, max_len=12, preemption_mode="reserve", watermark=0.0)
    s.add_request(req("a", 2, 6))  # reserves 4 blocks
    s.add_request(req("b", 2, 6, base=10))  # would need 4 more: waits
    assert step(s) == {"a": 2}
    assert s.bm.num_used_blocks == 4
    while "a" in {r.request_id for r in s.running}:
        step(s)
    assert s.counters.num_preemptions == 0
    assert step(s) == {"b": 2}  # admitted once a's reservation is released


def test_priority_orders_admission():
    s = make(max_num_seqs=1)
    s.add_request(req("low", 2, 1, priority=5))
    s.add_request(req("high", 2, 1, priority=-1, base=10))
    assert step(s) == {"high": 2}
    assert step(s) == {"low": 2}


def test_abort_frees_blocks_at_once():
    s = make()
    r = req("a", 9, 10)
    s.add_request(r)
    step(s)
    assert s.bm.num_used_blocks == 3
    s.finish(r, RequestStatus.FINISHED_ABORTED)
    assert s.bm.num_used_blocks == 0 and not s.running


def test_prefix_cache_hit_counts():
    s = make(block_size=4)
    s.add_request(req("a", 10, 1))
    step(s)
    s.add_request(req("b", 10, 1))
    assert step(s) == {"b": 2}  # 8 of 10 tokens from the cache
    assert s.counters.prefix_cache_hits == 8 and s.counters.prefix_cache_queries == 20


def test_a_disk_hit_is_read_in_while_its_request_waits_outside_the_batch():
    """Prompt of 14 tokens, blocks of 4: three full blocks may be served, and the disk tier holds them. The
    request is admitted with blocks for them and waits in `loading`; the others run meanwhile. Two of the
    three are read: it runs from token 8, and only those two are offered to the RAM cache."""
    held: set[bytes] = set()
    s = make(offload=lambda keys: next((i for i, k in enumerate(keys) if k not in held), len(keys)))
    probe = BlockManager(16, 4)
    held.update(probe.prefix_keys("x", list(range(14))))
    a, b = req("a", 14, 2), req("b", 3, 1, base=100)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["b"]  # a does not hold the batch up
    [(rid, blocks)] = out.loads
    assert rid == "a" and [k for k, _, _ in blocks] == probe.prefix_keys("x", list(range(14)))
    assert [bid for _, bid, _ in blocks] == s.bm.table("a") and [t for _, _, t in blocks][1] == (4, 5, 6, 7)
    assert not set(s.bm.cached.values()) & set(s.bm.table("a"))  # none of a's blocks is offered yet
    s.update(out, {"b": 7})
    assert s.num_unfinished == 2 and a.status is RequestStatus.WAITING
    s.finish_loading("a", 2)
    assert a.status is RequestStatus.RUNNING and a.num_computed_tokens == 8 and a.num_cached_tokens == 8
    assert [s.bm.cached[k] for k in probe.prefix_keys("x", list(range(14)))[:2]] == s.bm.table("a")[:2]
    assert probe.prefix_keys("x", list(range(14)))[2] not in s.bm.cached  # not read: computed instead
    assert step(s) == {"a": 6, "b": 1}  # a from token 8: the unread block and the rest of the prompt
    assert s.counters.disk_cache_hits == 8 and s.counters.prefix_cache_hits == 8


def test_a_request_aborted_while_loading_keeps_its_blocks_until_the_read_ends():
    """The loader is writing into its blocks: they go back to the pool only when it reports."""
    s = make(offload=lambda keys: len(keys))
    a = req("a", 14, 2)
    s.add_request(a)
    out = s.schedule()
    assert out.loads and not out.scheduled
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert s.bm.num_free_blocks == 16 - 3  # still held by the read in flight
    s.finish_loading("a", 3)
    assert s.bm.num_free_blocks == 16 and not s.bm.cached and s.num_unfinished == 0


def test_describe_lists_each_unfinished_request_with_its_progress_and_blocks():
    s = make(max_num_seqs=1)
    for r in (req("a", 6, 4), req("b", 3, 1)):
        s.add_request(r)
    step(s)
    assert s.describe().splitlines() == [
        "14 blocks free",
        "running a RUNNING 6/7 tokens, 2 blocks, 0 forks",
        "waiting b WAITING 0/3 tokens, 0 blocks, 0 forks",
    ]
