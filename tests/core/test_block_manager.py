"""Block manager: exact scripted scenarios (block ids, ref counts, eviction order) and a
stateful property test of its invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.core.block_manager import BlockManager, FreeQueue
from pagedllm.core.kv_spec import NULL_BLOCK


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
    bm.allocate_slots("b", b, 8, 1, computed_blocks=[hits])
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
    bm.allocate_slots("b", [1, 2, 3, 4, 9], 4, 1, computed_blocks=[hits])
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
        self.bm = BlockManager(num_blocks=12, block_size=3, record_events=True)
        self.seqs: dict[str, list[int]] = {}  # id -> tokens
        self.seen: dict[bytes, list[int]] = {}  # the cache as its events tell it: key -> tokens
        self.computed: dict[str, int] = {}
        self.n = 0

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=14))
    def add(self, prompt):
        rid = f"r{self.n}"
        self.n += 1
        hits = self.bm.prefix_hits(rid, prompt)
        cached = len(hits[0]) * self.bm.block_size
        assert cached < len(prompt) and all(len(h) == len(hits[0]) for h in hits)
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

    @invariant()
    def events_rebuild_the_cache(self):
        bs = self.bm.block_size
        for ev in self.bm.take_events():
            if ev[0] == "stored":
                keys, tokens = ev[1], ev[3]
                for i, key in enumerate(keys):
                    assert key not in self.seen
                    self.seen[key] = tokens[i * bs:(i + 1) * bs]
            elif ev[0] == "removed":
                for key in ev[1]:
                    del self.seen[key]
            else:
                self.seen.clear()
        assert self.seen.keys() == self.bm.cached.keys()
        assert all(tuple(self.seen[k]) == self.bm.blocks[b].token_ids for k, b in self.bm.cached.items())

    def teardown(self) -> None:
        for rid in list(self.seqs):
            self.bm.free(rid)
        assert self.bm.num_free_blocks == self.bm.num_blocks


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ---- groups: a full-attention group and a sliding-window group drawing from one pool ----------------------
def test_a_sliding_group_releases_the_blocks_that_leave_its_window():
    bm = BlockManager(num_blocks=16, block_size=4, windows=(None, 8))
    toks = list(range(100, 120))
    assert bm.allocate_slots("a", toks, 0, 12) == []
    assert bm.group_tables == [{"a": [0, 1, 2]}, {"a": [3, 4, 5]}]
    # token 12 reads keys 5..12: block 0 of the window's table (tokens 0-3) is released, block 1 is kept
    assert bm.allocate_slots("a", toks, 12, 1) == []
    assert bm.group_tables == [{"a": [0, 1, 2, 6]}, {"a": [NULL_BLOCK, 4, 5, 7]}]
    assert bm.num_free_blocks == 16 - 7 and bm.blocks[3].ref_cnt == 0 and bm.blocks[3].block_hash is not None
    assert bm.allocate_slots("a", toks, 13, 4) == []
    assert bm.group_tables == [{"a": [0, 1, 2, 6, 8]}, {"a": [NULL_BLOCK, 4, 5, 7, 9]}]
    assert bm.blocks_by_group() == [5, 4]
    bm.free("a")
    assert bm.num_free_blocks == 16 and bm.num_cached_free_blocks == 8  # the full blocks of both groups


def test_a_prefix_hit_needs_every_group_and_only_the_window_of_a_sliding_one():
    bm = BlockManager(num_blocks=16, block_size=4, windows=(None, 8))
    toks = list(range(100, 120))
    for start, n in ((0, 12), (12, 1), (13, 4)):
        bm.allocate_slots("a", toks, start, n)
    bm.free("a")
    # 4 full blocks of the prefix; token 16 reads keys 9.. : blocks 2 and 3 of the window group, not 0 or 1
    assert bm.prefix_hits("b", toks[:17] + [5, 6]) == [[0, 1, 2, 6], [NULL_BLOCK, NULL_BLOCK, 5, 7]]
    assert bm.prefix_hits("c", toks[:9]) == [[0, 1], [3, 4]]  # block 3 left a's window but stayed cached
    hits = bm.prefix_hits("b", toks[:17] + [5, 6])
    assert bm.allocate_slots("b", toks[:17] + [5, 6], 16, 3, computed_blocks=hits) == []
    assert bm.group_tables[1]["b"][:4] == [NULL_BLOCK, NULL_BLOCK, 5, 7] and bm.blocks[5].ref_cnt == 1
    bm.free("b")
    # a window block evicted: the hit falls back to the longest prefix whose window is all there
    bm.cached.pop(bm.blocks[7].block_hash)
    bm.blocks[7].block_hash = None
    assert bm.prefix_hits("d", toks[:17] + [5, 6]) == [[0, 1, 2], [NULL_BLOCK, 4, 5]]


def test_the_most_blocks_a_request_holds_bounds_its_window_groups():
    bm = BlockManager(num_blocks=16, block_size=4, windows=(None, 8, 8))
    # 1000 tokens: 250 blocks in the full group; a window group its 7 keys behind + an 8-token chunk + 1
    assert bm.max_blocks_held(1000, 8) == 250 + 2 * 5
    assert bm.max_blocks_held(10, 8) == 3 * 3


def test_forks_share_every_group_and_copy_on_write_in_each():
    bm = BlockManager(num_blocks=16, block_size=4, windows=(None, 4))
    toks = list(range(10))
    bm.allocate_slots("a", toks, 0, 10)
    bm.fork("a", "b")
    assert bm.group_tables == [{"a": [0, 1, 2], "b": [0, 1, 2]}, {"a": [3, 4, 5], "b": [3, 4, 5]}]
    # b writes token 10 into the shared partial block 2 (and 5): copied in each group; token 10 reads 7..10,
    # so block 0 of its window table is no longer b's (a still holds it)
    assert bm.allocate_slots("b", toks + [99], 10, 1) == [(2, 6), (5, 7)]
    assert bm.group_tables[1]["b"] == [NULL_BLOCK, 4, 7] and bm.blocks[3].ref_cnt == 1
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 16


class GroupedBlockManagerMachine(BlockManagerMachine):
    """The same random sequences over a full group and two sliding groups: every invariant holds in each."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=30, block_size=3, windows=(None, 4, 7), record_events=True)

    @invariant()
    def refcounts_match_tables(self):
        refs = [0] * self.bm.num_blocks
        for tables in self.bm.group_tables:
            for rid in self.seqs:
                for b in tables.get(rid, []):
                    if b != NULL_BLOCK:
                        refs[b] += 1
        for b in self.bm.blocks:
            assert b.ref_cnt == refs[b.block_id]
            assert (b.block_id in self.bm.free_queue) == (b.ref_cnt == 0)
        held = [{b for t in tables.values() for b in t if b != NULL_BLOCK} for tables in self.bm.group_tables]
        assert self.bm.blocks_by_group() == [len(h) for h in held]

    @invariant()
    def tables_cover_tokens(self):
        bs = self.bm.block_size
        for rid, n in self.computed.items():
            for g, w in enumerate(self.bm.windows):
                table = self.bm.group_tables[g][rid]
                assert len(table) == self.bm.blocks_needed(n)
                # what the next token reads is all there, and it holds blocks by content
                first = 0 if w is None else max(0, n - w + 1) // bs
                assert NULL_BLOCK not in table[first:]
                for i, b in enumerate(table[:n // bs]):
                    tok = self.bm.blocks[b].token_ids if b != NULL_BLOCK else None
                    assert tok is None or list(tok) == self.seqs[rid][i * bs:(i + 1) * bs]


TestGroupedBlockManagerMachine = GroupedBlockManagerMachine.TestCase
TestGroupedBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_new_block_never_evicts_the_hit_of_another_group():
    bm = BlockManager(num_blocks=6, block_size=3, windows=(None, 3))
    toks = [1, 2, 3, 4, 5, 6, 7]
    bm.allocate_slots("a", toks, 0, 6)
    bm.allocate_slots("a", toks, 6, 1)  # the window group releases block 2 (tokens 1-3) first
    bm.free("a")
    bm.allocate_slots("x", [9], 0, 1)  # takes the two hash-less blocks: block 2 is now the queue's head
    assert list(bm.free_queue)[0] == 2
    hits = bm.prefix_hits("b", toks[:4])
    assert hits == [[0], [2]]
    assert bm.allocate_slots("b", toks[:4], 3, 1, computed_blocks=hits) == []
    assert bm.group_tables[0]["b"] == [0, 1] and bm.group_tables[1]["b"] == [2, 3]
