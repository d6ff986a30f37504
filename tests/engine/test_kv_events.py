"""KV events: a ZMQ subscriber written against vLLM's event types reads pagedllm's and rebuilds its prefix cache."""

from __future__ import annotations

import random
import socket
import time
from typing import Any

import msgspec
import pytest
import zmq

from pagedllm import LLM, ConfigError, SamplingParams


# vLLM's types, as a subscriber written for vLLM declares them (vllm/distributed/kv_events.py)
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_vllm_subscriber_rebuilds_the_prefix_cache_and_replays_missed_batches(llama_dir):
    pub, replay = _port(), _port()
    llm = LLM(model=llama_dir, num_kv_blocks=24, block_size=4, max_num_batched_tokens=32,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events",
                                "endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"})
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    time.sleep(0.3)  # a SUB socket sees only what is sent after it has joined
    rng = random.Random(0)
    system = [rng.randrange(3, 300) for _ in range(20)]
    prompts = [system + [rng.randrange(3, 300) for _ in range(rng.randint(2, 30))] for _ in range(12)]
    for p in prompts:  # a pool of 24 blocks: later prompts evict earlier ones' blocks
        llm.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=6, ignore_eos=True))
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    cache: dict[bytes, list[int]] = {}
    seqs, batches, stored, removed = [], [], 0, 0
    deadline = time.time() + 10
    while time.time() < deadline and sub.poll(500):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv-events"
        seqs.append(int.from_bytes(seq, "big"))
        batches.append(payload)
        for ev in decoder.decode(payload).events:
            if isinstance(ev, BlockStored):
                stored += 1
                assert ev.block_size == 4 and len(ev.token_ids) == 4 * len(ev.block_hashes)
                assert ev.parent_block_hash is None or ev.parent_block_hash in cache
                for i, h in enumerate(ev.block_hashes):
                    cache[h] = ev.token_ids[4 * i:4 * (i + 1)]
            elif isinstance(ev, BlockRemoved):
                removed += 1
                for h in ev.block_hashes:
                    del cache[h]
            else:
                cache.clear()
    bm = llm.engine.block_manager
    assert seqs == list(range(len(seqs))) and stored and removed  # in order, none missed; the pool evicted
    assert cache.keys() == bm.cached.keys()
    assert all(tuple(cache[h]) == bm.blocks[b].token_ids for h, b in bm.cached.items())
    # a subscriber that missed batches asks the replay socket from a sequence number on (as vLLM's does: a reply
    # per batch, then an empty payload; a DEALER takes them all, where a REQ socket keeps only the first)
    req = ctx.socket(zmq.DEALER)
    req.connect(f"tcp://127.0.0.1:{replay}")
    req.send_multipart((b"", (2).to_bytes(8, "big")))
    replayed = []
    while req.poll(2000):
        _, seq, payload = req.recv_multipart()
        if not payload:
            break
        replayed.append((int.from_bytes(seq, "big"), payload))
    assert replayed == list(zip(seqs[2:], batches[2:]))
    for s in (sub, req):
        s.close(linger=0)
    ctx.term()
    llm.engine.shutdown()


def test_a_kv_events_config_without_an_endpoint_is_a_clear_error(llama_dir):
    with pytest.raises(ConfigError, match="endpoint is required"):
        LLM(model=llama_dir, kv_events_config='{"enable_kv_cache_events": true, "publisher": "zmq"}')
    with pytest.raises(ConfigError, match="unknown field 'endpont'"):
        LLM(model=llama_dir, kv_events_config={"enable_kv_cache_events": True, "endpont": "tcp://*:1"})
