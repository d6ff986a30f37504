"""Platforms: the device a model runs on, the memory it has for the KV pool, and the kernels built for it.
The one place device and instruction-set questions are answered; nothing above branches on them.

`current_platform(device)`: the CPU (`CpuPlatform`, platforms/cpu.py: the C++ kernels) or another torch device
(`TorchDevicePlatform`, platforms/torch_device.py: the torch reference backend there). A platform answers where
tensors live (`device`), the memory the KV pool may take, the kernels for a dtype and what `dtype="auto"` picks.
This module stays torch-free until a platform is asked for: the control plane reads memory through it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from .memory import host_available_memory

if TYPE_CHECKING:
    from .cpu import CpuPlatform
    from .torch_device import TorchDevicePlatform


Platform = Union["CpuPlatform", "TorchDevicePlatform"]


def current_platform(device: str = "cpu") -> Platform:
    if device == "cpu":
        from .cpu import CpuPlatform

        return CpuPlatform()
    from .torch_device import TorchDevicePlatform

    return TorchDevicePlatform(device)


__all__ = ["Platform", "current_platform", "host_available_memory"]
