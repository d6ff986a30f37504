"""A torch device other than the CPU (CUDA, ROCm, XPU, MPS): the model runs on the torch reference backend
there, its KV pools in the device's memory. A device with kernels of its own (Triton) is a platform of its
own that subclasses this one and returns them from `kernels`."""

from __future__ import annotations

import torch

from ..errors import ConfigError


class TorchDevicePlatform:
    name = "torch"
    decode_graphs = False  # the reference backend's forward syncs with the host (gathers, masks)

    def __init__(self, device: str) -> None:
        dev = torch.device(device)
        module = getattr(torch, dev.type, None)
        if module is None or not hasattr(module, "is_available") or not module.is_available():
            raise ConfigError(f"device {device!r}: this torch build ({torch.__version__}) has no {dev.type} "
                              "device available")
        index = module.current_device() if dev.index is None and hasattr(module, "current_device") else None
        if isinstance(index, int):  # "cuda" names the current one: pinned, so that every tensor agrees
            dev = torch.device(dev.type, index)
        self.device = str(dev)

    def available_memory_bytes(self) -> int:
        """Free device memory (the KV budget's base for memory_utilization)."""
        dev = torch.device(self.device)
        if dev.type == "cpu":
            from .memory import host_available_memory

            return host_available_memory()
        module = getattr(torch, dev.type)
        if hasattr(module, "mem_get_info"):
            return int(module.mem_get_info(dev)[0])
        raise ConfigError(f"device {self.device!r} does not report its free memory: size the KV pool with "
                          "kv_cache_memory or num_kv_blocks")

    def kv_budget(self, utilization: float, activation_bytes: int) -> int | None:
        """vLLM's gpu_memory_utilization: weights (already here) + peak activations + KV <= utilization x the
        device's memory; None where the device reports no totals."""
        dev = torch.device(self.device)
        module = getattr(torch, dev.type)
        if dev.type == "cpu" or not hasattr(module, "mem_get_info"):
            return None
        free, total = module.mem_get_info(dev)
        return int(utilization * total) - (total - free) - activation_bytes

    def peak_bytes(self, run) -> int | None:
        """Memory a call takes at its peak beyond what is allocated before it (the profiling forward); None
        where the device keeps no such statistics."""
        dev = torch.device(self.device)
        module = getattr(torch, dev.type)
        if dev.type == "cpu" or not hasattr(module, "max_memory_allocated"):
            return None
        module.synchronize(dev)
        module.reset_peak_memory_stats(dev)
        before = module.memory_allocated(dev)
        run()
        module.synchronize(dev)
        peak = module.max_memory_allocated(dev) - before
        module.empty_cache()  # the call's memory back to the device: the budget counts it once, as this peak
        return peak

    def kernels(self, dtype: torch.dtype) -> None:
        return None  # the torch reference backend

    def backend(self) -> None:
        return None  # the torch reference, the model's own

    def auto_dtype(self) -> tuple[torch.dtype, str]:
        return torch.bfloat16, f"{self.device} runs bf16 matmuls natively"
