"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on CUDA): the workers' loop, the driver that
feeds them one message per step, and `TPExecutor`, the engine's executor over both.

Sharding (cut by the weight loaders as they read; reduced by the layers themselves): qkv and gate_up are
column-parallel (each rank its heads / its slice of the MLP), o and down row-parallel with one all-reduce each;
the embedding and lm_head are vocab-parallel (a masked lookup + all-reduce, logits all-gathered); each rank's KV
pool holds its KV heads, with the same block ids everywhere. The scheduler and block manager stay single, in the
driver (rank 0, the engine); each step it broadcasts the batch's items and, as diffs, the tail of each block table
from its first changed entry, the copies, and the finished requests.

Rendezvous: torch.distributed's. Started by the engine, the workers are spawned processes that
join at tcp://127.0.0.1:<a free port>; under torchrun (MASTER_ADDR / MASTER_PORT / RANK /
WORLD_SIZE set) every rank is already there and ranks > 0 run `run_worker` (the CLI does this).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import TPGroup
from ..errors import ConfigError, PagedLLMError
from ..model_executor.model_runner import Batch, BatchItem, batch_of
from .base import Executor

log = logging.getLogger("pagedllm")
TIMEOUT = timedelta(seconds=60)  # a collective that waits longer than this fails (a worker is gone)


class WorkerDiedError(PagedLLMError):
    """A tensor-parallel worker exited or stopped answering: the engine cannot step any more."""


# ---- the step message ------------------------------------------------------------------------
@dataclass
class StepPlan:
    """One step for the workers: the batch's items (what the runner reads of each scheduled request),
    block-table tails from their first changed entry, copies, and finished requests."""

    work: list[BatchItem] = field(default_factory=list)
    tables: list[tuple[int, str, int, list[int]]] = field(default_factory=list)  # (group, request, at, tail)
    copies: list[tuple[int, int]] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # forks' linear-attention state slots
    gone: list[str] = field(default_factory=list)
    all_logits: bool = False


def apply_tables(tables: list[dict[str, list[int]]], plan: StepPlan) -> None:
    for rid in plan.gone:
        for group in tables:
            group.pop(rid, None)
    for g, rid, at, tail in plan.tables:
        t = tables[g].setdefault(rid, [])
        del t[at:]
        t.extend(tail)


# ---- processes -------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, init_method: str) -> TPGroup:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT)
    return TPGroup(rank, world)


def threads_per_rank(config: Any, world: int) -> int:
    """Each rank's share of this machine's cores (config.num_threads where set): the driver's too, since its
    default of every core would put two compute threads on a core that a worker's thread also runs on (TP=2 on 2
    cores: a batch-1 decode step 81-87 ms against 55-56). The ranks on this machine: torchrun's LOCAL_WORLD_SIZE
    (one rank a node: all of its cores), else all of them (spawned here)."""
    if config.num_threads:
        return config.num_threads
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return max(1, len(os.sched_getaffinity(0)) // max(1, local))


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_worker(rank: int, world: int, init_method: str, config: Any, started: Any = None) -> None:
    """A rank > 0: load its shard, then run whatever the driver broadcasts until it says stop."""
    from ..model_executor.model_loader import load_model
    from ..model_executor.model_runner import ModelRunner
    from ..platforms.allocator import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(threads_per_rank(config, world))
    if started is not None:
        started.set()  # imported and about to join: the driver may wait in the rendezvous now
    tp = _init(rank, world, init_method)
    try:
        loaded = load_model(config.model, config.dtype, config.quantization, tp=tp, registry=config.model_registry,
                            context=config.max_model_len)
        num_blocks, block_size, kv_dtype, cache_cls, layout, num_state_slots = _broadcast(None)
        runner = ModelRunner(loaded.model, num_blocks, block_size, kv_dtype, cache_cls, layout, num_state_slots)
        tables: list[dict[str, list[int]]] = [{} for _ in layout.groups]
        while True:
            plan = _broadcast(None)
            if plan is None:
                break
            apply_tables(tables, plan)
            runner.execute_batch(Batch(plan.work, plan.copies, plan.state_copies), tables, all_logits=plan.all_logits)
    finally:
        dist.destroy_process_group()


def _spawned_worker(rank: int, world: int, init_method: str, config: Any, started: Any) -> None:
    try:
        run_worker(rank, world, init_method, config, started)
    except Exception as e:  # noqa: BLE001 - a driver gone mid-collective: nothing left to serve
        log.info("tensor-parallel worker %d stops: %s", rank, e)


class TPDriver:
    """Rank 0's side: start (or, under torchrun, join) the workers, send each step, notice failures."""

    def __init__(self, config: Any) -> None:
        self.world = config.tensor_parallel_size
        self.procs: list[Any] = []
        self._sent: dict[tuple[int, str], list[int]] = {}  # (group, request): its block table as the workers know it
        self.closed = False
        self._threads_before = torch.get_num_threads()  # the process's again once this engine is closed
        env = os.environ
        if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:  # torchrun: everyone is there
            if int(env["WORLD_SIZE"]) != self.world or int(env["RANK"]) != 0:
                raise ConfigError(f"torchrun started rank {env['RANK']} of {env['WORLD_SIZE']}, but the engine is rank 0 "
                                  f"of tensor_parallel_size={self.world}")
            init = "env://"
        else:
            import torch.multiprocessing as mp

            init = f"tcp://127.0.0.1:{_free_port()}"
            ctx = mp.get_context("spawn")
            events = []
            for rank in range(1, self.world):
                ev = ctx.Event()
                p = ctx.Process(target=_spawned_worker, args=(rank, self.world, init, config, ev), daemon=True)
                p.start()
                self.procs.append(p)
                events.append(ev)
            deadline = time.monotonic() + TIMEOUT.total_seconds()
            while not all(ev.is_set() for ev in events):  # a worker that dies starting is reported now
                try:
                    self.check_alive()
                except WorkerDiedError as e:
                    self.close()
                    raise WorkerDiedError(f"{e} while starting (a script that builds the engine needs an "
                                          "`if __name__ == '__main__':` guard: workers are spawned)") from None
                if time.monotonic() > deadline:
                    self.close()
                    raise WorkerDiedError("tensor-parallel workers did not start in time")
                time.sleep(0.05)
        torch.set_num_threads(threads_per_rank(config, self.world))
        self.tp = _init(0, self.world, init)

    def setup(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype, cache_cls: type, layout: Any,
              num_state_slots: int = 0) -> None:
        self._send((num_blocks, block_size, kv_dtype, cache_cls, layout, num_state_slots))

    def check_alive(self) -> None:
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            raise WorkerDiedError(f"tensor-parallel worker (pid {dead[0].pid}) exited with code {dead[0].exitcode}")

    def _send(self, obj: Any) -> None:
        self.check_alive()
        try:
            _broadcast(obj)
        except RuntimeError as e:  # gloo: a peer closed its connection, or the timeout passed
            raise WorkerDiedError(f"a tensor-parallel worker stopped answering: {e}") from e

    def step(self, sched: Any, tables: Any, gone: list[str], all_logits: bool = False) -> None:
        """tables: one per group of the layout (request id -> block table)."""
        batch = batch_of(sched)
        plan = StepPlan(work=batch.items, copies=batch.copies, state_copies=batch.state_copies, gone=gone,
                        all_logits=all_logits)
        for rid in gone:
            for g in range(len(tables)):
                self._sent.pop((g, rid), None)
        for item in batch.items:
            rid = item.request_id
            for g, group in enumerate(tables):
                table, known = group[rid], self._sent.get((g, rid), [])
                at = next((i for i, (a, b) in enumerate(zip(table, known)) if a != b), min(len(table), len(known)))
                if at < len(table) or len(known) != len(table):
                    plan.tables.append((g, rid, at, table[at:]))
                    self._sent[(g, rid)] = list(table)
        self._send(plan)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if dist.is_initialized() and all(p.is_alive() for p in self.procs):
                _broadcast(None)
        except RuntimeError:
            pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._threads_before)



class TPExecutor(Executor):
    """The driver (rank 0) and its workers: each step goes to the workers first, then runs here."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if config.speculative_config is not None and config.speculative_config.method == "draft_model":
            raise ConfigError("a draft model is not supported with tensor_parallel_size > 1 (n-gram is)")
        from ..model_executor.model_loader import check_tensor_parallel

        check_tensor_parallel(config.model, config.model_registry, config.tensor_parallel_size)  # before any process
        self.driver = TPDriver(config)
        self.group = self.driver.tp
        self._gone: list[str] = []  # freed since the last step: the workers drop their tables
        weakref.finalize(self, self.driver.close)  # the workers stop with the engine, or at exit

    def load_model(self) -> Any:
        try:
            return super().load_model()
        except BaseException:
            self.driver.close()
            raise

    def init_kv_cache(self, model: Any, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                      cache_cls: type, layout: Any = None, num_state_slots: int = 0) -> Any:
        runner = super().init_kv_cache(model, num_blocks, block_size, kv_dtype, cache_cls, layout, num_state_slots)
        self.driver.setup(num_blocks, block_size, kv_dtype, cache_cls, runner.layout, num_state_slots)
        return runner

    def execute_model(self, sched: Any, tables: Any, all_logits: bool = False) -> Any:
        gone, self._gone = self._gone, []
        self.driver.step(sched, tables, gone, all_logits)
        return super().execute_model(sched, tables, all_logits)

    def forget(self, request_id: str) -> None:
        self._gone.append(request_id)

    def shutdown(self) -> None:
        self.driver.close()
