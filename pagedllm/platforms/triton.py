"""A torch device with the Triton kernels (model_executor/triton_ops): a CUDA or ROCm GPU, where GEMMs go to
torch (cuBLAS) and the paged attention, K/V writes and norms to Triton; or the CPU under Triton's interpreter,
which runs the same kernels on CPU tensors (slowly: it is how they are tested without a GPU)."""

from __future__ import annotations

import os

import torch

from ..errors import ConfigError
from .memory import host_available_memory
from .torch_device import TorchDevicePlatform


class TritonPlatform(TorchDevicePlatform):
    name = "triton"

    def __init__(self, device: str) -> None:
        if torch.device(device).type == "cpu":
            # triton reads it as each @jit function is defined, its own library's included: before it is imported
            os.environ["TRITON_INTERPRET"] = "1"
            import triton.language as tl
            from triton.runtime.interpreter import InterpretedFunction

            if not isinstance(tl.sum, InterpretedFunction):
                raise ConfigError("Triton was imported before its interpreter was turned on (torch and transformers "
                                  "import it): start the process with TRITON_INTERPRET=1 to run the Triton kernels "
                                  "on the CPU")
        super().__init__(device)

    @property
    def decode_graphs(self) -> bool:
        """Whether decode steps may be replayed from CUDA graphs: on a CUDA GPU (ROCm's HIP graphs too)."""
        return not self.interpreted

    @property
    def interpreted(self) -> bool:
        return torch.device(self.device).type == "cpu"

    def backend(self):  # triton_ops.backend.TritonKernels
        from ..model_executor.triton_ops.backend import TritonKernels

        return TritonKernels(self.parallel_programs())

    def parallel_programs(self) -> int:
        """Programs that keep the device busy: two per multiprocessor on a GPU (the decode split's target)."""
        if self.interpreted:
            return 4
        return 2 * torch.cuda.get_device_properties(torch.device(self.device)).multi_processor_count

    def available_memory_bytes(self) -> int:
        return host_available_memory() if self.interpreted else super().available_memory_bytes()

    def auto_dtype(self) -> tuple[torch.dtype, str]:
        if self.interpreted:
            return torch.float32, "Triton's interpreter on the CPU computes in numpy"
        return super().auto_dtype()
