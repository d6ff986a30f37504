"""Block manager: exact scripted scenarios (block ids, ref counts, eviction order) and a
stateful property test of its invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.core.block_manager import BlockManager, FreeQueue


def test_allocate_on_demand_and_free_order():
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=False)
    toks = list(range(10))
    assert bm.allocate_slots("a", toks, 0, 6) == []
    assert bm.table("a") == [0, 1]  # 6 tokens: two blocks, nothing reserved beyond
    assert bm.allocate_slots("a", toks, 6, 1) == []
    assert bm.table("a") == [0, 1]
    assert bm.allocate_slots("a", toks, 7, 2) == []
    assert bm.table("a") == [0, 1, 2]
    assert bm.num_free_blocks == 5
    bm.free("a")
    assert bm.num_free_blocks == 8
    # hash-less blocks go to the head, so they are reused first (last block first)
    assert list(bm.free_queue)[:3] == [0, 1, 2]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "front", "back", "remove"]), st.integers(0, 9)), max_size=60))
def test_free_queue_is_the_ordered_dict_it_replaces(ops):
    """The never-used run is a counter, not entries: the order, length and membership must be those of one
    insertion-ordered dict of all ids, popped at the head, pushed to either end, removed from anywhere."""
    from collections import OrderedDict

    ref, q, out = OrderedDict.fromkeys(range(10)), FreeQueue(10), set()
    for op, bid in ops:
        if op == "take" and ref:
            taken = ref.popitem(last=False)[0]
            assert q.pop_head() == taken
            out.add(taken)
        elif op in ("front", "back") and bid in out:  # only a taken id comes back
            out.discard(bid)
            ref[bid] = None
            ref.move_to_end(bid, last=op == "back")
            (q.push_front if op == "front" else q.push_back)(bid)
        elif op == "remove" and bid in ref and bid in set(q.used()):  # a cached block hit again
            del ref[bid]
            q.remove(bid)
            out.add(bid)
        assert list(q) == list(ref) and len(q) == len(ref)
        assert all((i in q) == (i in ref) for i in range(10))


def test_a_pool_of_millions_of_blocks_costs_nothing_until_used():
    bm = BlockManager(num_blocks=50_000_000, block_size=16)
    assert bm.allocate_slots("a", list(range(40)), 0, 40) == []
    assert bm.table("a") == [0, 1, 2] and bm.num_free_blocks == 50_000_000 - 3
    assert len(list(bm.blocks.made())) == 3
    bm.free("a")
    assert bm.num_cached_free_blocks == 2 and bm.num_free_blocks == 50_000_000


def test_cannot_allocate_returns_none_and_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.allocate_slots("a", list(range(8)), 0, 8) == []
    assert bm.allocate_slots("b", list(range(100, 109)), 0, 9) is None
    assert "b" not in bm.tables and bm.num_free_blocks == 1
    assert bm.allocate_slots("b", list(range(100, 109)), 0, 4, reserve_free=1) is None
    assert bm.allocate_slots("b", list(range(100, 109)), 0, 4) == []


def test_prefix_hit_shares_blocks_and_never_covers_whole_prompt():
    bm = BlockManager(num_blocks=10, block_size=4)
    sys_prompt = list(range(8))
    a = sys_prompt + [100, 101]
    assert bm.allocate_slots("a", a, 0, len(a)) == []
    assert bm.table("a") == [0, 1, 2]
    b = sys_prompt + [200]
    hits = bm.get_computed_blocks("b", b)
    assert hits == [0, 1]
    bm.allocate_slots("b", b, 8, 1, computed_blocks=hits)
    assert bm.table("b") == [0, 1, 3]
    assert [bm.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    # exactly the system prompt: the last block is not a hit (its last token must be computed)
    assert bm.get_computed_blocks("c", sys_prompt) == [0]


def test_cache_salt_isolates_tenants():
    bm = BlockManager(num_blocks=10, block_size=4)
    p = list(range(9))
    bm.allocate_slots("a", p, 0, 9, salt="tenant-1")
    assert bm.get_computed_blocks("b", p, salt="tenant-2") == []
    assert bm.get_computed_blocks("c", p, salt="tenant-1") == [0, 1]


def test_freed_cached_blocks_are_lru_and_longest_prefix_evicted_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate_slots("a", [1, 2, 3, 4, 5, 6], 0, 6)  # blocks 0,1,2 all full and cached
    bm.allocate_slots("b", [7, 8, 9], 0, 3)  # blocks 3,4
    bm.free("a")
    # a's blocks go to the tail last-block-first: 2, 1, 0
    assert list(bm.free_queue) == [5, 2, 1, 0]
    assert bm.num_cached_free_blocks == 3
    bm.free("b")  # 3 is full and cached; 4 holds one token (no hash) -> head
    assert list(bm.free_queue) == [4, 5, 2, 1, 0, 3]
    # new allocations take the head: uncached first, then a's deepest block
    bm.allocate_slots("c", [50, 51, 52, 53, 54, 55], 0, 6)
    assert bm.table("c") == [4, 5, 2]
    assert bm.get_computed_blocks("d", [1, 2, 3, 4, 5, 6, 7]) == [0, 1]  # block 2 was evicted


def test_hit_on_free_cached_block_revives_it():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate_slots("a", [1, 2, 3, 4, 5], 0, 5)
    bm.free("a")
    hits = bm.get_computed_blocks("b", [1, 2, 3, 4, 9])
    assert hits == [0, 1]
    bm.allocate_slots("b", [1, 2, 3, 4, 9], 4, 1, computed_blocks=hits)
    assert bm.table("b")[:2] == [0, 1] and bm.blocks[0].ref_cnt == 1
    assert 0 not in bm.free_queue and 1 not in bm.free_queue


def test_collision_guard_compares_token_ids():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate_slots("a", [1, 2, 3], 0, 3)
    h = bm._hashes["a"][0]
    bm.blocks[bm.cached[h]].token_ids = (9, 9)  # simulate a hash collision
    assert bm.get_computed_blocks("b", [1, 2, 3]) == []


def test_fork_and_copy_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    p = list(range(6))
    bm.allocate_slots("p", p, 0, 6)  # [0, 1]; block 1 half full
    bm.fork("p", "c")
    assert bm.table("c") == [0, 1] and bm.blocks[1].ref_cnt == 2
    # the parent writes token 6 into shared partial block 1 -> copied to a fresh block
    copies = bm.allocate_slots("p", p + [7], 6, 1)
    assert copies == [(1, 2)]
    assert bm.table("p") == [0, 2] and bm.table("c") == [0, 1]
    assert bm.blocks[1].ref_cnt == 1 and bm.blocks[0].ref_cnt == 2
    # the child is now the sole owner: writes in place
    assert bm.allocate_slots("c", p + [8], 6, 1) == []
    assert bm.table("c") == [0, 1]
    bm.free("p")
    bm.free("c")
    assert bm.num_free_blocks == 8


def test_snapshot_states_owners_fill_and_shared_holders():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate_slots("a", list(range(10)), 0, 10)  # blocks 0, 1 full (hashed), 2 half
    bm.fork("a", "b")
    bm.allocate_slots("x", [50, 51, 52, 53, 54], 0, 5)  # blocks 3 (hashed), 4
    bm.free("x")  # 4 (no hash) back to the head of the free queue, 3 stays cached-free
    snap = bm.snapshot(["a", "b"], {"a": 10, "b": 10})
    assert snap["state"] == [3, 3, 3, 1, 0, 0, 0, 0]
    assert snap["ref"] == [2, 2, 2, 0, 0, 0, 0, 0]
    assert snap["owner"] == [0, 0, 0, -1, -1, -1, -1, -1] and snap["index"][:3] == [0, 1, 2]
    assert snap["fill"] == [4, 4, 2, 0, 0, 0, 0, 0] and snap["filled_slots"] == 10
    assert list(zip(snap["shared_blocks"], snap["shared_holders"])) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [h is not None for h in snap["hash"]] == [True, True, False, True, False, False, False, False]
    assert snap["hash"][0] == bm.blocks[0].block_hash[:4].hex() and snap["cached_free"] == 1
    bm.allocate_slots("b", list(range(10)) + [99], 10, 1)  # b writes into shared block 2: copied to 4
    snap = bm.snapshot(["a", "b"], {"a": 10, "b": 11})
    assert snap["state"][:5] == [3, 3, 2, 1, 2] and snap["owner"][:5] == [0, 0, 0, -1, 1]
    assert snap["fill"][:5] == [4, 4, 2, 0, 3] and snap["filled_slots"] == bm.filled_slots({"a": 10, "b": 11})


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / evict sequences keep the invariants."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=3)
        self.seqs: dict[str, list[int]] = {}  # id -> tokens
        self.computed: dict[str, int] = {}
        self.n = 0

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=14))
    def add(self, prompt):
        rid = f"r{self.n}"
        self.n += 1
        hits = self.bm.get_computed_blocks(rid, prompt)
        cached = len(hits) * self.bm.block_size
        assert cached < len(prompt)
        if self.bm.allocate_slots(rid, prompt, cached, len(prompt) - cached, computed_blocks=hits) is None:
            self.bm.free(rid)  # drop the hashes computed for the lookup
            return
        self.seqs[rid], self.computed[rid] = list(prompt), len(prompt)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tok=st.integers(0, 3))
    def append(self, data, tok):
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        toks = self.seqs[rid] + [tok]
        if self.bm.allocate_slots(rid, toks, self.computed[rid], 1) is not None:
            self.seqs[rid], self.computed[rid] = toks, len(toks)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        child = f"r{self.n}"
        self.n += 1
        self.bm.fork(rid, child)
        self.seqs[child], self.computed[child] = list(self.seqs[rid]), self.computed[rid]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free(rid)
        del self.seqs[rid], self.computed[rid]

    @invariant()
    def refcounts_match_tables(self):
        refs = [0] * self.bm.num_blocks
        for rid in self.seqs:
            for b in self.bm.table(rid):
                refs[b] += 1
        for b in self.bm.blocks:
            assert b.ref_cnt == refs[b.block_id]
            assert (b.block_id in self.bm.free_queue) == (b.ref_cnt == 0)
        assert self.bm.num_free_blocks + sum(1 for r in refs if r) == self.bm.num_blocks

    @invariant()
    def tables_cover_tokens(self):
        for rid, n in self.computed.items():
            assert len(self.bm.table(rid)) == self.bm.blocks_needed(n)

    @invariant()
    def cached_map_points_at_hashed_blocks(self):
        for h, b in self.bm.cached.items():
            assert self.bm.blocks[b].block_hash == h

    def teardown(self) -> None:
        for rid in list(self.seqs):
            self.bm.free(rid)
        assert self.bm.num_free_blocks == self.bm.num_blocks


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
