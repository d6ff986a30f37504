"""The disk tier of the prefix cache: blocks the RAM cache gains are saved to files off the step loop, and a
prompt whose prefix misses in RAM but hits on disk has those blocks read back instead of computed.

Store layout: `<dir>/<fingerprint>/<key[:1] as hex>/<key as hex>.kv`, one file per block:
    magic (8 bytes) | header length (4, little-endian) | header (JSON: format, fingerprint, key, token ids,
    payload bytes, crc32 of the payload) | payload (the block's bytes in each pool tensor, in the runner's order)
- The key is the block manager's chained hash of the block's tokens and of every block before it, salt
  included: one key names one prefix under one cache salt. The fingerprint directory names the model (its
  files' content), the KV pool's format (dtypes, block size, every pool tensor's block shape) and this file
  format. So another model, format or salt never finds a block.
- A file is written under a temporary name and renamed into place: a reader never sees a torn file, and
  several processes may share one directory. A read checks the header against what was asked for (key,
  fingerprint, token ids, size) and the payload's crc32; a file that fails is removed and counts as a miss
  (the block is computed instead).
- LRU within a byte budget over the whole directory: a hit refreshes the file's mtime; once the bytes written
  pass the budget, the writer scans the directory and removes the oldest files down to 90% of it.

KVOffloader moves blocks between the runner's pool tensors and the store on two threads. A save is copied out
of the pool on the step loop (one gather per pool tensor), so later steps may reuse the blocks at once, and
written by the writer thread; a load is read and copied into the blocks the scheduler set aside for it by the
loader thread, while its request waits outside the batch.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..model_executor.model_runner import ModelRunner

log = logging.getLogger("pagedllm")

MAGIC = b"PAGEDKV\x01"
FORMAT = 1
_HEADER_LEN = struct.Struct("<I")
_STALE_TMP_S = 600  # a temporary file this old was left by a killed writer

Block = tuple[bytes, int, tuple[int, ...]]  # (prefix key, block id in the pool, token ids)


@dataclass
class OffloadCounters:
    blocks_loaded: int = 0  # blocks read back into the pool (disk hits)
    blocks_saved: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0  # the loader's time, reads and copies into the pool
    saves_dropped: int = 0  # blocks not saved because the writer was behind by more than its queue allows
    corrupt_files: int = 0  # files that failed their checks (removed; their blocks computed)
    files_evicted: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class DiskStore:
    """One directory of block files for one fingerprint, within a byte budget shared with the directory's other
    fingerprints. Safe to use from several threads and processes."""

    def __init__(self, root: str | os.PathLike, fingerprint: str, budget_bytes: int) -> None:
        if budget_bytes < 1:
            raise ValueError(f"the disk tier needs a budget of at least 1 byte, got {budget_bytes}")
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.dir = self.root / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget = budget_bytes
        self.counters = OffloadCounters()
        self._lock = threading.Lock()
        self._usage = self._scan()[0]

    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.dir / h[:2] / f"{h}.kv"

    def contains(self, key: bytes) -> bool:
        return self.path(key).exists()

    def leading_hits(self, keys: Sequence[bytes]) -> int:
        """How many of keys, from the first, have a file (the scheduler's lookup: a stat each)."""
        n = 0
        for k in keys:
            if not self.contains(k):
                break
            n += 1
        return n

    def put(self, key: bytes, token_ids: Sequence[int], parts: Sequence) -> int:
        """Write one block (parts: buffers, the payload in order) unless it is there; the bytes written."""
        path = self.path(key)
        if path.exists():
            return 0
        crc, size = 0, 0
        for part in parts:
            crc = zlib.crc32(part, crc)
            size += memoryview(part).nbytes
        header = json.dumps({"format": FORMAT, "fingerprint": self.fingerprint, "key": key.hex(),
                             "tokens": list(token_ids), "bytes": size, "crc32": crc}).encode()
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + _HEADER_LEN.pack(len(header)) + header)
                for part in parts:
                    f.write(part)
            os.replace(tmp, path)  # atomic: readers see no file or the whole file
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        total = len(MAGIC) + _HEADER_LEN.size + len(header) + size
        with self._lock:
            self.counters.blocks_saved += 1
            self.counters.bytes_written += total
            self._usage += total
            over = self._usage > self.budget
        if over:
            self.evict()
        return total

    def get(self, key: bytes, token_ids: Sequence[int], size: int) -> bytearray | None:
        """The payload of a block, or None: no such file, or one that fails its checks (removed)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                head = f.read(len(MAGIC) + _HEADER_LEN.size)
                ok = len(head) == len(MAGIC) + _HEADER_LEN.size and head.startswith(MAGIC)
                header: dict = {}
                if ok:
                    (n,) = _HEADER_LEN.unpack_from(head, len(MAGIC))
                    try:
                        header = json.loads(f.read(n)) if n < 1 << 20 else {}
                    except ValueError:
                        header = {}
                ok = ok and isinstance(header, dict) and header.get("format") == FORMAT \
                    and header.get("fingerprint") == self.fingerprint and header.get("key") == key.hex() \
                    and header.get("tokens") == list(token_ids) and header.get("bytes") == size
                payload = bytearray(size)
                ok = ok and f.readinto(payload) == size and not f.read(1) and zlib.crc32(payload) == header.get("crc32")
        except FileNotFoundError:
            return None
        if not ok:
            log.warning("disk KV tier: %s failed its checks; removed (its block is computed instead)", path)
            path.unlink(missing_ok=True)
            with self._lock:
                self.counters.corrupt_files += 1
            return None
        try:
            os.utime(path)  # recently used: evicted last
        except FileNotFoundError:
            pass  # evicted meanwhile by another process: the bytes read are whole all the same
        with self._lock:
            self.counters.bytes_read += size
        return payload

    def _scan(self) -> tuple[int, list[tuple[float, int, Path]]]:
        """(bytes, [(mtime, bytes, path)]) of the directory's block files; stale temporary files removed."""
        files, total, now = [], 0, time.time()
        for path in self.root.glob("*/*/*"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            if path.suffix == ".tmp":
                if now - st.st_mtime > _STALE_TMP_S:
                    path.unlink(missing_ok=True)
                continue
            if path.suffix == ".kv":
                files.append((st.st_mtime, st.st_size, path))
                total += st.st_size
        return total, files

    def evict(self) -> None:
        """Remove the least recently used files (any fingerprint) until the directory is within 90% of budget."""
        total, files = self._scan()
        removed = 0
        if total > self.budget:
            files.sort()
            for _, size, path in files:
                if total <= 0.9 * self.budget:
                    break
                path.unlink(missing_ok=True)
                total -= size
                removed += 1
        with self._lock:
            self._usage = total
            self.counters.files_evicted += removed


class KVOffloader:
    """Saves and loads blocks of the runner's pool tensors (`pools`: uint8 views, block id first) to and from a
    DiskStore, on a writer and a loader thread."""

    def __init__(self, store: DiskStore, pools: Sequence[torch.Tensor], max_pending_bytes: int = 256 << 20) -> None:
        self.store = store
        self.pools = list(pools)
        self.block_bytes = [p[0].numel() for p in self.pools]
        self.payload_bytes = sum(self.block_bytes)
        self.max_pending_bytes = max(max_pending_bytes, self.payload_bytes)
        self._pending = 0  # bytes copied out and not yet written
        self._lock = threading.Lock()
        self._saves: queue.Queue = queue.Queue()
        self._loads: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self.num_loading = 0  # loads started and not yet taken by poll()
        self._writer = threading.Thread(target=self._write_loop, name="pagedllm-kv-writer", daemon=True)
        self._loader = threading.Thread(target=self._load_loop, name="pagedllm-kv-loader", daemon=True)
        self._writer.start()
        self._loader.start()

    @property
    def counters(self) -> OffloadCounters:
        return self.store.counters

    def save(self, blocks: Sequence[Block]) -> None:
        """Copy these computed blocks out of the pool now; they are written later. Blocks the store has are
        skipped; if the writer is too far behind, the rest are dropped (counted), never waited for."""
        blocks = [b for b in blocks if not self.store.contains(b[0])]
        if not blocks:
            return
        with self._lock:
            room = max(0, (self.max_pending_bytes - self._pending) // self.payload_bytes)
            if room < len(blocks):
                self.store.counters.saves_dropped += len(blocks) - room
                blocks = blocks[:room]
            self._pending += len(blocks) * self.payload_bytes
        if not blocks:
            return
        ids = torch.tensor([bid for _, bid, _ in blocks])
        copies = [p.index_select(0, ids) for p in self.pools]  # each [n, ...block's bytes]
        self._saves.put((blocks, copies))

    def _write_loop(self) -> None:
        while True:
            item = self._saves.get()
            if item is None:
                return
            blocks, copies = item
            for i, (key, _, tokens) in enumerate(blocks):
                try:
                    self.store.put(key, tokens, [c[i].numpy() for c in copies])
                except OSError as e:  # a full or read-only disk costs the tier, never the engine
                    log.warning("disk KV tier: could not write a block: %s", e)
            with self._lock:
                self._pending -= len(blocks) * self.payload_bytes
            self._saves.task_done()

    def load(self, request_id: str, blocks: Sequence[Block]) -> None:
        """Read these blocks into their pool blocks, in order, stopping at the first one missing or failing its
        checks; poll() then reports (request_id, how many were read)."""
        self.num_loading += 1
        self._loads.put((request_id, list(blocks)))

    def _load_loop(self) -> None:
        while True:
            item = self._loads.get()
            if item is None:
                return
            request_id, blocks = item
            t0, n = time.perf_counter(), 0
            try:
                for key, bid, tokens in blocks:
                    data = self.store.get(key, tokens, self.payload_bytes)
                    if data is None:
                        break
                    off = 0
                    for pool, size in zip(self.pools, self.block_bytes):
                        # numpy's copy, not torch's: a torch copy of 32 KiB or more runs an OpenMP team of this
                        # thread's own, and with more team threads than cores the engine's idle workers sleep
                        pool[bid].view(-1).numpy()[:] = np.frombuffer(data, np.uint8, size, off)
                        off += size
                    n += 1
            except Exception:
                log.exception("disk KV tier: a load failed")
            with self.store._lock:
                self.store.counters.blocks_loaded += n
                self.store.counters.load_seconds += time.perf_counter() - t0
            self._done.put((request_id, n))

    def poll(self, timeout: float | None = None) -> list[tuple[str, int]]:
        """Loads finished since the last call: (request id, blocks read). timeout: wait up to that long for one."""
        done = []
        try:
            if timeout is not None and self.num_loading:
                done.append(self._done.get(timeout=timeout))
            while True:
                done.append(self._done.get_nowait())
        except queue.Empty:
            pass
        self.num_loading -= len(done)
        return done

    def flush(self) -> None:
        """Wait until every save so far is written."""
        self._saves.join()

    def close(self) -> None:
        """Write what is queued, then stop both threads."""
        self.flush()
        self._saves.put(None)
        self._loads.put(None)
        self._writer.join()
        self._loader.join()


__all__ = ["DiskStore", "KVOffloader", "OffloadCounters"]


def check_offload(config: EngineConfig, architecture: str, has_state: bool, num_groups: int, has_draft: bool) -> None:
    """Raise a ConfigError where the disk tier cannot serve the engine."""
    why = ("prefix caching is off" if not config.enable_prefix_caching else
           f"{architecture} keeps a linear-attention state" if has_state else
           "its layers keep KV in groups of different kinds (run with hybrid_kv_cache=False)" if num_groups > 1 else
           "tensor parallelism shards the pool across processes" if config.tensor_parallel_size > 1 else
           "a draft model's pool is not saved" if has_draft else None)
    if why is not None:
        raise ConfigError(f"the disk KV tier (kv_offload_dir) cannot serve this engine: {why}")


def open_offload(config: EngineConfig, runner: ModelRunner, dtype: torch.dtype, kv_dtype: torch.dtype,
                 block_size: int) -> KVOffloader:
    """The disk tier over the runner's pool, in the directory's part for this model and KV format."""
    import hashlib

    from ..model_executor.model_loader import model_content_key

    pools = runner.block_pools
    fingerprint = hashlib.sha256(json.dumps({
        "model": model_content_key(config.model), "quantization": config.quantization,
        "dtype": str(dtype), "kv_dtype": str(kv_dtype), "cache": type(runner.slot_caches[0]).__name__,
        "block_size": block_size, "pools": [list(p.shape[1:]) for p in pools], "format": FORMAT,
    }).encode()).hexdigest()[:24]
    store = DiskStore(config.kv_offload_dir, fingerprint, config.kv_offload_bytes)
    log.info("disk KV tier: %s (%.1f GiB budget)", store.dir, store.budget / 2**30)
    return KVOffloader(store, pools)
