"""The prefix cache's disk tier: the store's files (checks, atomic names, LRU) and the engine reading a prefix back
after a restart instead of computing it."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from pagedllm import LLM, ConfigError, SamplingParams
from pagedllm.engine.kv_offload import DiskStore

KEY = bytes(range(32))


def test_a_block_round_trips_and_a_new_store_on_the_directory_finds_it(tmp_path):
    store = DiskStore(tmp_path, "fp-a", 1 << 20)
    assert store.put(KEY, (1, 2, 3), [b"\x01" * 100, b"\x02" * 28]) > 128
    assert store.put(KEY, (1, 2, 3), [b"\x03" * 128]) == 0  # there already: not rewritten
    again = DiskStore(tmp_path, "fp-a", 1 << 20)  # a restart
    assert again.leading_hits([KEY, KEY[::-1]]) == 1
    assert again.get(KEY, (1, 2, 3), 128) == b"\x01" * 100 + b"\x02" * 28
    assert again.counters.bytes_read == 128


def test_another_fingerprint_tokens_or_size_never_get_the_block(tmp_path):
    DiskStore(tmp_path, "fp-a", 1 << 20).put(KEY, (1, 2, 3), [b"x" * 64])
    other = DiskStore(tmp_path, "fp-b", 1 << 20)
    assert other.leading_hits([KEY]) == 0 and other.get(KEY, (1, 2, 3), 64) is None
    store = DiskStore(tmp_path, "fp-a", 1 << 20)
    assert store.get(KEY, (1, 2, 4), 64) is None  # a hash collision: the tokens differ
    assert store.counters.corrupt_files == 1 and not store.contains(KEY)  # and the file is gone


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "header"])
def test_a_damaged_file_is_a_miss_and_is_removed(tmp_path, damage):
    store = DiskStore(tmp_path, "fp", 1 << 20)
    store.put(KEY, (5,), [bytes(range(256))])
    path = store.path(KEY)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-100] ^= 0x10
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "extend":
        data += b"\0"
    else:
        data[20] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.get(KEY, (5,), 256) is None
    assert store.counters.corrupt_files == 1 and not path.exists()


def test_least_recently_used_files_go_first_within_the_budget(tmp_path):
    store = DiskStore(tmp_path, "fp", 1)
    size = store.put(bytes([0]) * 32, (0,), [b"v" * 1000])  # one file's bytes (over a budget of 1: evicted)
    assert store.counters.files_evicted == 1
    store = DiskStore(tmp_path, "fp", int(3.5 * size))
    keys = [bytes([i]) * 32 for i in range(1, 5)]
    now = time.time()
    for i, k in enumerate(keys[:3]):
        store.put(k, (i,), [b"v" * 1000])
        os.utime(store.path(k), (now - 100 + i, now - 100 + i))  # 1 oldest, then 2, 3
    assert store.get(keys[0], (0,), 1000) is not None  # a hit: 1 is now the most recent
    store.put(keys[3], (3,), [b"v" * 1000])  # past the budget: the oldest go until within 90% of it
    assert [store.contains(k) for k in keys] == [True, False, True, True]
    assert store.counters.files_evicted == 1


def test_a_killed_writers_temporary_file_is_never_read_and_is_swept(tmp_path):
    store = DiskStore(tmp_path, "fp", 1 << 20)
    tmp = store.path(KEY).with_name(store.path(KEY).name + ".123.456.tmp")
    tmp.parent.mkdir(parents=True)
    tmp.write_bytes(b"half a block")
    assert store.leading_hits([KEY]) == 0
    os.utime(tmp, (time.time() - 3600, time.time() - 3600))
    store.evict()
    assert not tmp.exists()


def _prompts(n: int, length: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(5, 300) for _ in range(length)]} for _ in range(n)]


def _run(llama_dir, prompts, **kw):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    with LLM(llama_dir, dtype="float32", num_threads=1, block_size=16, **kw) as llm:
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        if llm.engine.offload is not None:
            llm.engine.offload.flush()  # the saves written, so that the counters are final
        return outs, llm.engine.stats()


@pytest.mark.slow
def test_after_a_restart_a_prefix_is_read_from_disk_not_computed(llama_dir, tmp_path):
    """Two documents of 100 tokens: saved by the first engine, read by the second (6 full blocks each, the last
    token always computed); the same tokens as an engine without the tier, logprobs within fp32 sum order (the
    rest of the prompt attends to read-in KV through the prefix-hit path rather than the prompt path)."""
    prompts = _prompts(2, 100)
    base, _ = _run(llama_dir, prompts)
    first, st1 = _run(llama_dir, prompts, kv_offload_dir=str(tmp_path))
    assert st1.kv_offload["blocks_saved"] == 12 and st1.disk_cache_hits == 0
    second, st2 = _run(llama_dir, prompts, kv_offload_dir=str(tmp_path))
    assert st2.kv_offload["blocks_loaded"] == 12 and st2.disk_cache_hits == 2 * 96
    assert st2.prefix_cache_hits == 2 * 96 and st2.kv_offload["blocks_saved"] == 0
    for a, b, c in zip(base, first, second):
        assert a.token_ids == b.token_ids == c.token_ids
        for la, lc, t in zip(a.logprobs, c.logprobs, a.token_ids):
            assert abs(la[t].logprob - lc[t].logprob) < 1e-4
    # a third prompt sharing the first 64 tokens of a document: 4 blocks from disk, the rest computed
    shared = [{"prompt_token_ids": prompts[0]["prompt_token_ids"][:64] + [7] * 40}]
    _, st3 = _run(llama_dir, shared, kv_offload_dir=str(tmp_path))
    assert st3.kv_offload["blocks_loaded"] == 4 and st3.disk_cache_hits == 64


@pytest.mark.slow
def test_damaged_files_cost_a_recompute_never_a_wrong_token(llama_dir, tmp_path):
    prompts = _prompts(2, 100, seed=1)
    first, _ = _run(llama_dir, prompts, kv_offload_dir=str(tmp_path))
    files = sorted(Path(tmp_path).glob("*/*/*.kv"))
    assert len(files) == 12
    rng = random.Random(0)
    for f in files[::2]:  # flip one byte in every other file
        data = bytearray(f.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        f.write_bytes(bytes(data))
    second, st = _run(llama_dir, prompts, kv_offload_dir=str(tmp_path))
    assert [o.token_ids for o in second] == [o.token_ids for o in first]
    assert st.kv_offload["corrupt_files"] >= 1
    assert st.disk_cache_hits == 16 * st.kv_offload["blocks_loaded"] < 2 * 96


@pytest.mark.slow
def test_another_salt_or_kv_format_never_reads_the_blocks(llama_dir, tmp_path):
    prompts = _prompts(1, 100, seed=2)
    _run(llama_dir, prompts, kv_offload_dir=str(tmp_path))
    _, st = _run(llama_dir, prompts, kv_offload_dir=str(tmp_path), kv_cache_dtype="bfloat16")
    assert st.kv_offload["blocks_loaded"] == 0 and st.kv_offload["blocks_saved"] == 6
    params = SamplingParams(temperature=0, max_tokens=2)
    with LLM(llama_dir, dtype="float32", num_threads=1, block_size=16, kv_offload_dir=str(tmp_path)) as llm:
        llm.engine.add_request("salted", prompts[0], params, cache_salt="tenant-b")
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        assert llm.engine.stats().kv_offload["blocks_loaded"] == 0


def test_an_engine_the_tier_cannot_serve_is_a_clear_error(llama_dir, tmp_path):
    with pytest.raises(ConfigError, match="prefix caching is off"):
        LLM(llama_dir, enable_prefix_caching=False, kv_offload_dir=str(tmp_path))


@pytest.mark.slow
def test_processes_sharing_a_directory_read_whole_blocks_only(tmp_path):
    """Four processes write and read the same 40 blocks at once: every read is whole (no torn or failed file), and
    no temporary file is left."""
    import subprocess
    import sys

    code = f"""
import hashlib, sys
from pagedllm.engine.kv_offload import DiskStore
store = DiskStore({str(tmp_path)!r}, "fp", 1 << 30)
for rnd in range(3):
    for i in range(40):
        key = hashlib.sha256(bytes([i])).digest()
        store.put(key, (i,), [bytes([i]) * 50000])
        got = store.get(key, (i,), 50000)
        assert got is not None and got == bytes([i]) * 50000, i
assert store.counters.corrupt_files == 0
"""
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 4
    assert len(list(Path(tmp_path).glob("*/*/*.kv"))) == 40 and not list(Path(tmp_path).glob("*/*/*.tmp"))


def test_the_tier_threads_copy_without_an_openmp_team_of_their_own(tmp_path):
    """A torch copy of a block this size runs on OpenMP; in the loader thread that makes a second team, and with
    more team threads than cores OpenMP's idle workers sleep between the engine's kernel calls. The tier copies
    with numpy: a load starts no thread, and the blocks come back bit for bit."""
    import torch

    from pagedllm.engine.kv_offload import KVOffloader

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(2)
    torch.ones(1 << 20).add_(1)  # the test thread's own team, before counting
    g = torch.Generator().manual_seed(0)
    pools = [torch.randint(0, 256, (8, 1 << 16), generator=g, dtype=torch.uint8) for _ in range(2)]  # 64 KiB blocks
    want = [p[[1, 2]].clone() for p in pools]
    off = KVOffloader(DiskStore(tmp_path, "fp", 1 << 30), pools)
    blocks = [(bytes([i]) * 16, i, (i,)) for i in (1, 2)]
    off.save(blocks)
    off._saves.join()
    for p in pools:
        p[[1, 2]] = 0
    before = threads()
    off.load("r", [(k, bid + 4, t) for k, bid, t in blocks])
    assert off.poll(timeout=30) == [("r", 2)]
    assert threads() == before
    for p, w in zip(pools, want):
        assert torch.equal(p[[5, 6]], w)
