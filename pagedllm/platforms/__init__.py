"""Platforms: the device a model runs on, the memory it has for the KV pool, and the kernels built for it.
The one place device and instruction-set questions are answered; nothing above branches on them.

`current_platform()` is the CPU today (`CpuPlatform`, platforms/cpu.py); a GPU platform is an addition here
plus a layer backend. This module stays torch-free: the control plane reads memory through it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .memory import host_available_memory

if TYPE_CHECKING:
    from .cpu import CpuPlatform


def current_platform() -> CpuPlatform:
    from .cpu import CpuPlatform

    return CpuPlatform()


__all__ = ["current_platform", "host_available_memory"]
