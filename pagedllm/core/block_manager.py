"""Paged KV memory: a pool of fixed-size blocks, per-request block tables, prefix caching.

No torch here: this module only does bookkeeping of block ids. It answers "can't" with None
and leaves the decision (wait, preempt) to the scheduler.

* Free queue (block_pool.py): the free block ids in order. The head is taken first, so it is also the eviction
  order of cached blocks (LRU). Freed blocks that hold a cached prefix go to the tail (evicted
  last); freed blocks without a hash go to the head (reused first, since nobody can hit them).
  Blocks never used yet are a counter in the middle of that order, and their KVBlock records are
  made on first use: a pool of millions of blocks (a small model, a large budget) costs nothing
  until it fills.
* Prefix cache: a full block is keyed by sha256(parent key, its token ids, cache salt). A hit
  is confirmed by comparing token ids. A request's blocks are freed last-block-first, so its
  longest prefixes are evicted before the shared beginnings.
* Copy-on-write: forks share blocks by ref count; before a sequence writes into a shared,
  partially filled block, that block is copied into a fresh one (the copy is returned for the
  model runner to perform).
* Events (`events`, None unless asked for): every key the prefix cache gains or loses, in order, as
  ("stored", [keys], parent key, token ids) / ("removed", [keys]) / ("cleared",), so that a router
  (engine/kv_events.py publishes them) can rebuild the cache's contents exactly.
* New blocks (`new_blocks`, None unless asked for): (key, block id, token ids) of every block the cache
  gained, for the disk tier to save once the step that fills them has run (engine/kv_offload.py).
* Groups (kv_spec.plan_kv_layout): each group of layers has its own table per request, all drawn
  from this one pool. A sliding-window group's table entries before the window of the next token
  become NULL_BLOCK and their blocks go back to the pool (cached, so a later prompt can still hit
  them). Cache keys carry the group, and a prefix hit needs, in every group, the blocks that the
  prompt's next token reads: all of them in a full-attention group, its window's in a sliding one.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import kv_map
from .block_pool import Blocks, FreeQueue, KVBlock, hash_block
from .kv_spec import NULL_BLOCK

__all__ = ["BlockManager", "Blocks", "FreeQueue", "KVBlock", "hash_block"]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 windows: Sequence[int | None] = (None,), record_events: bool = False,
                 record_new_blocks: bool = False) -> None:
        """windows: each group's sliding window (None: full attention), as kv_spec.KVLayout.windows;
        record_events: keep the prefix cache's changes in `events` until take_events(); record_new_blocks:
        keep the blocks it gains in `new_blocks` until take_new_blocks()."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"need one or more groups with windows >= 1 (or None), got {list(windows)}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = list(windows)
        self.blocks = Blocks(num_blocks)
        self.free_queue = FreeQueue(num_blocks)
        self.cached: dict[bytes, int] = {}
        self.group_tables: list[dict[str, list[int]]] = [{} for _ in self.windows]
        self.tables = self.group_tables[0]
        self._hashes: dict[str, list[bytes]] = {}  # chained keys of each request's full blocks
        # leading blocks of each group's table already offered to the cache
        self._num_registered: list[dict[str, int]] = [{} for _ in self.windows]
        self._in_use = [0] * len(self.windows)  # blocks with holders, by group
        self.events: list[tuple] | None = [] if record_events else None
        self.new_blocks: list[tuple[bytes, int, tuple[int, ...]]] | None = [] if record_new_blocks else None

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.free_queue.used() if self.blocks[b].block_hash is not None)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _first_needed(self, g: int, num_computed: int) -> int:
        """The first block of group g that a token at position num_computed (or later) still reads."""
        w = self.windows[g]
        return 0 if w is None else max(0, num_computed - w + 1) // self.block_size

    def max_blocks_held(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a request of num_tokens ever holds at once, over all groups, computing at most
        chunk tokens a step: a request needing more than the pool could never run alone."""
        total = 0
        for w in self.windows:
            need = self.blocks_needed(num_tokens)
            if w is not None:  # its window behind the first new token, the chunk, one block of misalignment
                need = min(need, self.blocks_needed(w - 1 + chunk) + 1)
            total += need
        return total

    def blocks_by_group(self) -> list[int]:
        """Blocks in use by each group's tables."""
        return list(self._in_use)

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def num_blocks_of(self, request_id: str) -> int:
        """The blocks a request holds in all its groups' tables."""
        return sum(1 for tables in self.group_tables for b in tables.get(request_id, ()) if b != NULL_BLOCK)

    # ---- hashing -------------------------------------------------------------------------
    def _extend_hashes(self, request_id: str, token_ids: Sequence[int], num_full: int,
                       salt: str | None) -> list[bytes]:
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, token_ids[i * bs:(i + 1) * bs], salt))
        return hashes

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int],
                            salt: str | None = None) -> list[int]:
        """The first group's prefix-cache hits (prefix_hits)."""
        return self.prefix_hits(request_id, token_ids, salt)[0]

    def prefix_hits(self, request_id: str, token_ids: Sequence[int], salt: str | None = None) -> list[list[int]]:
        """Each group's cached blocks for the longest prefix of token_ids that every group can serve, all of
        equal length (a sliding group's entries before its window are NULL_BLOCK). Never the whole prompt:
        the last token is always left to compute, so there are logits to sample from."""
        if not self.enable_caching:
            return [[] for _ in self.windows]
        num_full = (len(token_ids) - 1) // self.block_size
        hashes = self._extend_hashes(request_id, token_ids, num_full, salt)
        n = num_full
        for g, w in enumerate(self.windows):  # full groups: a run of hits from the start
            if w is None:
                n = next((i for i in range(n) if self._hit(g, i, hashes, token_ids) is None), n)

        def windows_hit(n: int) -> bool:  # sliding groups: the blocks the next token reads, from the last back
            return all(w is None or all(self._hit(g, i, hashes, token_ids) is not None
                                        for i in range(n - 1, self._first_needed(g, n * self.block_size) - 1, -1))
                       for g, w in enumerate(self.windows))

        while n > 0 and not windows_hit(n):
            n -= 1
        first = [self._first_needed(g, n * self.block_size) for g in range(len(self.windows))]
        return [[NULL_BLOCK] * first[g] + [self._hit(g, i, hashes, token_ids) for i in range(first[g], n)]
                for g in range(len(self.windows))]

    def prefix_keys(self, request_id: str, token_ids: Sequence[int], salt: str | None = None) -> list[bytes]:
        """The first group's keys of the full blocks that prefix_hits may serve (all but the last token)."""
        return list(self._extend_hashes(request_id, token_ids, (len(token_ids) - 1) // self.block_size, salt))

    @staticmethod
    def _key(h: bytes, g: int) -> bytes:
        return h if g == 0 else h + bytes((g,))

    def _hit(self, g: int, i: int, hashes: list[bytes], token_ids: Sequence[int]) -> int | None:
        bs = self.block_size
        bid = self.cached.get(self._key(hashes[i], g))
        if bid is None or self.blocks[bid].token_ids != tuple(token_ids[i * bs:(i + 1) * bs]):
            return None
        return bid

    # ---- allocation ----------------------------------------------------------------------
    def _take_free(self, g: int = 0) -> int:
        bid = self.free_queue.pop_head()
        blk = self.blocks[bid]
        if blk.block_hash is not None:  # evict its cached prefix
            if self.cached.get(blk.block_hash) == bid:
                self._uncache(blk.block_hash)
            blk.block_hash = None
            blk.token_ids = None
        blk.ref_cnt = 1
        blk.group = g
        self._in_use[g] += 1
        return bid

    def _release(self, bid: int) -> None:
        blk = self.blocks[bid]
        blk.ref_cnt -= 1
        if blk.ref_cnt == 0:
            self._in_use[blk.group] -= 1
            if blk.block_hash is None:
                self.free_queue.push_front(bid)
            else:
                self.free_queue.push_back(bid)

    def _touch(self, bid: int) -> None:
        blk = self.blocks[bid]
        if blk.ref_cnt == 0:
            self.free_queue.remove(bid)
            self._in_use[blk.group] += 1
        blk.ref_cnt += 1

    def allocate_slots(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                       num_new: int, computed_blocks: Sequence[Sequence[int]] = (), num_lookahead: int = 0,
                       salt: str | None = None, reserve_free: int = 0, cache_upto: int | None = None
                       ) -> list[tuple[int, int]] | None:
        """Make room for num_new tokens after num_computed (which includes computed_blocks, each group's
        prefix-cache hits of a newly admitted request, as prefix_hits gives them). Returns the (src, dst)
        block copies the model runner must do first (copy-on-write), or None if the pool cannot serve it
        while keeping reserve_free blocks free. Blocks that left a sliding window are released first, as
        they would be on any call; on None nothing else has changed. cache_upto: offer only the blocks of the
        first cache_upto tokens to the prefix cache (the rest are being loaded: cache_blocks once they are)."""
        bs = self.block_size
        total = num_computed + num_new + num_lookahead
        for g in range(len(self.windows)):
            self._leave_window(g, request_id, num_computed)
        plans = []  # per group: (table, hits, new blocks, copy-on-write index)
        need = 0
        for g in range(len(self.windows)):
            table = self.group_tables[g].get(request_id, [])
            hits = computed_blocks[g] if computed_blocks else ()
            n_new_blocks = max(0, self.blocks_needed(total) - len(table) - len(hits))
            # copy-on-write: writing into a shared, partially filled last block
            cow_idx = -1
            if num_new > 0 and num_computed % bs and num_computed // bs < len(table):
                idx = num_computed // bs
                if self.blocks[table[idx]].ref_cnt > 1:
                    cow_idx = idx
                    n_new_blocks += 1
            need += n_new_blocks + sum(1 for b in hits if b != NULL_BLOCK and self.blocks[b].ref_cnt == 0)
            plans.append((table, hits, n_new_blocks, cow_idx))
        if need > self.num_free_blocks - reserve_free:
            return None

        for g, (table, hits, _, _) in enumerate(plans):  # every group's hits first: no new block may evict one
            table = self.group_tables[g].setdefault(request_id, table)
            for bid in hits:
                if bid != NULL_BLOCK:
                    self._touch(bid)
                table.append(bid)
        copies: list[tuple[int, int]] = []
        for g, (_, _, n_new_blocks, cow_idx) in enumerate(plans):
            table = self.group_tables[g][request_id]
            if cow_idx >= 0:
                src = table[cow_idx]
                dst = self._take_free(g)
                self.blocks[src].ref_cnt -= 1
                table[cow_idx] = dst
                copies.append((src, dst))
                n_new_blocks -= 1
            for _ in range(n_new_blocks):
                table.append(self._take_free(g))
            if self.enable_caching:
                upto = num_computed + num_new if cache_upto is None else cache_upto
                self._cache_full_blocks(g, request_id, token_ids, upto, salt)
        return copies

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_tokens: int, salt: str | None) -> None:
        """Offer the request's full blocks of its first num_tokens tokens to the prefix cache (blocks whose KV
        was loaded rather than computed, once it is in place)."""
        if self.enable_caching:
            for g in range(len(self.windows)):
                self._cache_full_blocks(g, request_id, token_ids, num_tokens, salt)

    def _leave_window(self, g: int, request_id: str, num_computed: int) -> None:
        """Release the blocks of group g's table that no token from num_computed on reads."""
        table = self.group_tables[g].get(request_id)
        if not table or self.windows[g] is None:
            return
        for i in range(min(self._first_needed(g, num_computed), len(table)) - 1, -1, -1):
            if table[i] == NULL_BLOCK:
                break  # entries before it were released earlier
            self._release(table[i])
            table[i] = NULL_BLOCK

    def _cache_full_blocks(self, g: int, request_id: str, token_ids: Sequence[int], num_tokens: int,
                           salt: str | None) -> None:
        bs = self.block_size
        num_full = min(num_tokens, len(token_ids)) // bs
        hashes = self._extend_hashes(request_id, token_ids, num_full, salt)
        table = self.group_tables[g][request_id]
        registered = self._num_registered[g]
        stored: list[int] = []  # block indices whose keys are new to the cache
        for i in range(registered.get(request_id, 0), num_full):
            if table[i] == NULL_BLOCK:
                continue
            blk = self.blocks[table[i]]
            if blk.block_hash is not None:
                continue
            blk.block_hash = self._key(hashes[i], g)
            blk.token_ids = tuple(token_ids[i * bs:(i + 1) * bs])
            # a block with the same content computed concurrently keeps the first mapping
            if self.cached.setdefault(blk.block_hash, blk.block_id) == blk.block_id:
                stored.append(i)
        registered[request_id] = max(num_full, registered.get(request_id, 0))
        if self.new_blocks is not None:
            self.new_blocks += [(self._key(hashes[i], g), table[i], self.blocks[table[i]].token_ids) for i in stored]
        if self.events is not None:
            self._record_stored(g, hashes, stored, token_ids)

    def _record_stored(self, g: int, hashes: list[bytes], stored: list[int], token_ids: Sequence[int]) -> None:
        """One event per run of consecutive blocks: their keys, the key of the block before the run, their tokens."""
        bs, start = self.block_size, 0
        for j in range(1, len(stored) + 1):
            if j == len(stored) or stored[j] != stored[j - 1] + 1:
                first, last = stored[start], stored[j - 1]
                parent = self._key(hashes[first - 1], g) if first else None
                self.events.append(("stored", [self._key(hashes[i], g) for i in range(first, last + 1)], parent,
                                    list(token_ids[first * bs:(last + 1) * bs])))
                start = j

    def _uncache(self, key: bytes) -> None:
        del self.cached[key]
        if self.events is not None:
            self.events.append(("removed", [key]))

    def take_events(self) -> list[tuple]:
        """The cache's changes since the last call, oldest first."""
        events, self.events = self.events or [], [] if self.events is not None else None
        return events

    def take_new_blocks(self) -> list[tuple[bytes, int, tuple[int, ...]]]:
        """The blocks the cache gained since the last call: (key, block id, token ids), oldest first."""
        new, self.new_blocks = self.new_blocks or [], [] if self.new_blocks is not None else None
        return new

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares all the parent's blocks (copy-on-write on the partial one)."""
        if child_id in self.tables:
            raise ValueError(f"request {child_id!r} already has blocks")
        for g, tables in enumerate(self.group_tables):
            table = list(tables.get(parent_id, []))
            for bid in table:
                if bid != NULL_BLOCK:
                    self.blocks[bid].ref_cnt += 1
            tables[child_id] = table
            self._num_registered[g][child_id] = self._num_registered[g].get(parent_id, 0)
        self._hashes[child_id] = list(self._hashes.get(parent_id, []))

    def free(self, request_id: str) -> None:
        """Release a request's blocks, last block first (longest prefixes are evicted first)."""
        self._hashes.pop(request_id, None)
        for g, tables in enumerate(self.group_tables):
            self._num_registered[g].pop(request_id, None)
            for bid in reversed(tables.pop(request_id, [])):
                if bid != NULL_BLOCK:
                    self._release(bid)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keep only the blocks holding the first num_tokens slots (speculative decoding: rejected
        proposals' slots are rolled back). A freed block held proposals only, which never hash
        (only verified tokens are offered to the cache); any hash is cleared all the same, so a
        rolled-back block can never be hit."""
        keep = self.blocks_needed(num_tokens)
        for g, tables in enumerate(self.group_tables):
            table = tables.get(request_id)
            while table and len(table) > keep:
                bid = table.pop()
                if bid == NULL_BLOCK:
                    continue
                blk = self.blocks[bid]
                blk.ref_cnt -= 1
                if blk.ref_cnt == 0:
                    self._in_use[g] -= 1
                    if blk.block_hash is not None and self.cached.get(blk.block_hash) == bid:
                        self._uncache(blk.block_hash)
                    blk.block_hash = None
                    blk.token_ids = None
                    self.free_queue.push_front(bid)
            if self._num_registered[g].get(request_id, 0) > num_tokens // self.block_size:
                self._num_registered[g][request_id] = num_tokens // self.block_size
        hashes = self._hashes.get(request_id)
        if hashes is not None and len(hashes) > num_tokens // self.block_size:
            del hashes[num_tokens // self.block_size:]

    def reset_prefix_cache(self) -> None:
        for bid in self.free_queue.used():
            blk = self.blocks[bid]
            blk.block_hash = None
            blk.token_ids = None
        kept = {h: b for h, b in self.cached.items() if self.blocks[b].ref_cnt > 0}
        gone = [h for h in self.cached if h not in kept]
        if self.events is not None and gone:
            self.events.append(("cleared",) if not kept else ("removed", gone))
        self.cached = kept

    def snapshot(self, order: Sequence[str], num_computed: dict[str, int]) -> dict:
        """Every block's state for the KV map (core/kv_map.py)."""
        return kv_map.snapshot(self, order, num_computed)

    def filled_slots(self, num_computed: dict[str, int]) -> int:
        """Token slots holding live KV in used blocks (a shared block counts once)."""
        return kv_map.filled_slots(self, num_computed)
