"""Storage formats of weights, in the spirit of ggml's type traits: block size and bytes per block.
No torch here (the planner reads it); the kernels that run each format are in weight_formats.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightFormat:
    name: str
    ggml_type: int  # ggml's type id (ggml.h), also for the dense ones
    block_weights: int
    block_bytes: int

    @property
    def bytes_per_weight(self) -> float:
        return self.block_bytes / self.block_weights

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.block_weights * self.block_bytes


FORMATS = {f.name: f for f in [
    WeightFormat("f32", 0, 1, 4), WeightFormat("f16", 1, 1, 2), WeightFormat("bf16", 30, 1, 2),
    WeightFormat("q4_0", 2, 32, 18), WeightFormat("q4_1", 3, 32, 20), WeightFormat("q5_0", 6, 32, 22),
    WeightFormat("q5_1", 7, 32, 24), WeightFormat("q8_0", 8, 32, 34), WeightFormat("q4_k", 12, 256, 144),
    WeightFormat("q5_k", 13, 256, 176), WeightFormat("q6_k", 14, 256, 210), WeightFormat("mxfp4", 39, 32, 17),
]}
GGML_KERNEL_FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "mxfp4")
QUANTIZE_AT_LOAD = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")  # gguf-py has quantizers for these
_BY_GGML = {f.ggml_type: f for f in FORMATS.values()}
REPACKED = 1000  # kernel type id of a repacked part: ggml type + REPACKED (csrc/linear_x16.h)


def format_of_ggml(type_id: int) -> WeightFormat | None:
    return _BY_GGML.get(int(type_id))


