"""Platforms: the device a model runs on, the memory it has for the KV pool, and the kernels built for it.
The one place device and instruction-set questions are answered; nothing above branches on them.

`current_platform(device, attention_backend)`: the CPU (`CpuPlatform`, platforms/cpu.py: the C++ kernels), a GPU
with the Triton kernels (`TritonPlatform`, platforms/triton.py; on the CPU: Triton's interpreter), or any torch
device on the torch reference backend (`TorchDevicePlatform`, platforms/torch_device.py). A platform answers where
tensors live (`device`), the memory the KV pool may take, the kernels for a dtype and what `dtype="auto"` picks.
This module stays torch-free until a platform is asked for: the control plane reads memory through it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from .memory import host_available_memory
from .selection import ATTENTION_BACKENDS, resolve_device

if TYPE_CHECKING:
    from .cpu import CpuPlatform
    from .torch_device import TorchDevicePlatform


Platform = Union["CpuPlatform", "TorchDevicePlatform"]


def current_platform(device: str = "cpu", attention_backend: str = "auto") -> Platform:
    """attention_backend: auto (the CPU's C++ kernels, Triton on a GPU), torch (the reference backend on any
    device), triton (the Triton kernels on any device; on the CPU in Triton's interpreter)."""
    if attention_backend == "triton" or (attention_backend == "auto" and device != "cpu" and _gpu(device)):
        from .triton import TritonPlatform

        return TritonPlatform(device)
    if device == "cpu" and attention_backend == "auto":
        from .cpu import CpuPlatform

        return CpuPlatform()
    from .torch_device import TorchDevicePlatform

    return TorchDevicePlatform(device)


def _gpu(device: str) -> bool:
    return device.split(":")[0] == "cuda"  # CUDA and ROCm builds both name their GPUs "cuda"


__all__ = ["ATTENTION_BACKENDS", "Platform", "current_platform", "host_available_memory", "resolve_device"]
