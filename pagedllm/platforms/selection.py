"""The choices a config makes before any platform exists: which attention backends there are, and what device
"auto" means. Torch-free until "auto" asks torch whether it sees a GPU."""

from __future__ import annotations

ATTENTION_BACKENDS = ("auto", "torch", "triton")


def resolve_device(device: str, cpu_only: bool = False) -> str:
    """device "auto": the GPU where torch sees one (unless an option that runs on the CPU only is asked for),
    else the CPU; any other name as given."""
    if device != "auto":
        return device
    if cpu_only:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
