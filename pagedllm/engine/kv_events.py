"""KV events for fleet routers, in vLLM's schema and transport, so that a subscriber written for vLLM (llm-d, Dynamo,
vllm-router, ...) reads pagedllm's as they are.

Schema: msgpack of `KVEventBatch` = [ts, [events]], each event a tagged array: `BlockStored` [block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium], `BlockRemoved` [block_hashes, medium],
`AllBlocksCleared` []. Block hashes are the prefix cache's keys (sha256 digests chained over the blocks; a
hybrid layout's other groups add a byte for their group).

Transport (`kv_events_config` as vLLM names it): a ZMQ PUB socket bound at `endpoint` sends each batch as
[topic, sequence number (8 bytes, big-endian), payload]; a ROUTER socket at `replay_endpoint` answers a request
carrying a sequence number with every buffered batch from it on ([seq, payload] each), then an empty payload.

The block manager records the cache's changes (core/block_manager.py); the engine hands them over after each
step; a thread of this module encodes and sends them, so a slow or absent subscriber never holds a step back
(past `max_queue_size` pending batches, new ones are dropped, with a warning).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from ..errors import ConfigError
from ..settings import config_from

log = logging.getLogger("pagedllm")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change of the prefix cache."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` fields. The endpoints have no default: give them (no fixed ports here)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq", or "null": nothing sent
    endpoint: str = ""  # e.g. "tcp://*:5557"
    replay_endpoint: str | None = None  # e.g. "tcp://*:5558"
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the sending thread
    topic: str = ""

    @classmethod
    def parse(cls, value: Any) -> KVEventsConfig | None:
        """A dict, a JSON string or a KVEventsConfig; None when events are off."""
        cfg = None if value is None else config_from(cls, "kv_events_config", value)
        if cfg is None or not cfg.enable_kv_cache_events or cfg.publisher == "null":
            return None
        if cfg.publisher != "zmq":
            raise ConfigError(f"kv_events_config.publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
        if not cfg.endpoint:
            raise ConfigError("kv_events_config.endpoint is required with the zmq publisher, e.g. 'tcp://*:5557'")
        return cfg


def to_wire(event: tuple, block_size: int) -> KVCacheEvent:
    """A block manager event -> its vLLM event."""
    if event[0] == "stored":
        return BlockStored(event[1], event[2], event[3], block_size, None, None)
    if event[0] == "removed":
        return BlockRemoved(event[1], None)
    return AllBlocksCleared()


class ZmqEventPublisher:
    def __init__(self, cfg: KVEventsConfig, block_size: int) -> None:
        self.cfg, self.block_size = cfg, block_size
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay = None
        try:  # bound here, so that a taken address fails at startup; used only by the thread from then on
            self._pub.bind(cfg.endpoint)
            if cfg.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError(f"kv events: cannot bind {cfg.endpoint} / {cfg.replay_endpoint}: {e}") from None
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.max_queue_size)
        self._stop = threading.Event()
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[tuple]) -> None:
        """From the engine's thread: never blocks."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1
            log.warning("kv events: %d batches dropped (no room in the send queue)", self.dropped)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        topic = self.cfg.topic.encode()
        buffer: deque[tuple[int, bytes]] = deque(maxlen=self.cfg.buffer_steps)
        seq = 0
        while not (self._stop.is_set() and self._queue.empty()):
            try:
                ts, events = self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
            else:
                payload = encoder.encode(KVEventBatch(ts, [to_wire(e, self.block_size) for e in events]))
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                buffer.append((seq, payload))
                seq += 1
            while self._replay is not None and self._replay.poll(0):
                frames = self._replay.recv_multipart()
                start = int.from_bytes(frames[-1], "big")
                head = frames[:-1]  # the requester's identity (and the REQ delimiter)
                for s, payload in list(buffer):
                    if s >= start:
                        self._replay.send_multipart((*head, s.to_bytes(8, "big"), payload))
                self._replay.send_multipart((*head, (-1).to_bytes(8, "big", signed=True), b""))
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close."""
        self._stop.set()
        self._thread.join(timeout)


def make_publisher(value: Any, block_size: int) -> ZmqEventPublisher | None:
    cfg = KVEventsConfig.parse(value)
    return ZmqEventPublisher(cfg, block_size) if cfg is not None else None
