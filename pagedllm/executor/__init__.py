"""Executors between the engine and the model runner: `Executor` (this process) and `TPExecutor`
(tensor parallelism: the driver and its worker processes)."""

from ..config import EngineConfig
from .base import Executor
from .tp import TPExecutor


def executor_for(config: EngineConfig) -> Executor:
    return TPExecutor(config) if config.tensor_parallel_size > 1 else Executor(config)


__all__ = ["Executor", "TPExecutor", "executor_for"]
