"""Weight formats: how a linear layer's weights are stored and multiplied (docs/design/models-and-weights.md).

A `WeightFormat` is one storage type (ggml's type traits: block size and bytes per block). A
`PackedWeight` is one linear's weights in their kernel's layout, made once at load, with
`matmul(x)` (x [M, K] fp32 -> [M, O] fp32, bias included) and `dequantize()` (the fp32 reference
that tests, eval and fallbacks use). The model holds PackedWeights and never knows the format:
- `DensePanels`: f32 or bf16, packed from a dense tensor into 48-column panels;
- `GGMLWeight`: ggml block formats exactly as the GGUF file stores them (memory-mapped, not copied),
  one or several parts stacked along the output rows (a fused q/k/v may mix Q4_K and Q6_K).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ...errors import ModelLoadError
from ...platforms.cpu import Ops, pack_weight, pad_bias, unpack_weight
from .formats import FORMATS, GGML_KERNEL_FORMATS, REPACKED, WeightFormat


class PackedWeight:
    ops: Ops
    out_features: int
    in_features: int

    def matmul(self, x: Tensor, decode_rows: int = -1) -> Tensor:
        """x [M, K] fp32 -> [M, O] fp32. decode_rows: how many leading rows of x are single-token decodes
        (-1: unknown); a format whose kernel path depends on the rows (GGML blocks) chooses it by them, so
        that a row's result does not depend on the batch it came in."""
        raise NotImplementedError

    def dequantize(self) -> Tensor:  # [O, K] fp32
        raise NotImplementedError

    def matmul_silu_and_mul(self, x: Tensor, decode_rows: int = -1) -> Tensor:
        """silu(gate) * up of this [gate | up] linear: x [M, K] fp32 -> [M, O / 2] fp32. A format whose kernel
        can apply it to its own output tiles overrides this."""
        return self.ops.silu_and_mul(self.matmul(x, decode_rows))

    def matmul_normed(self, x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, decode_rows: int = -1,
                      silu: bool = False) -> Tensor:
        """This linear of RMSNorm(x) with norm_weight, x first added into residual in place where one is given (the
        C++ rms_norm's contract); silu(gate) * up of it where silu. A format whose kernel can take the norm in the
        same call overrides this."""
        h = self.ops.rms_norm(x, norm_weight, eps, residual)
        return self.matmul_silu_and_mul(h, decode_rows) if silu else self.matmul(h, decode_rows)

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    @property
    def format_name(self) -> str:
        raise NotImplementedError


FUSED_SILU_MIN_ROWS = 16


class DensePanels(PackedWeight):
    """fp32 or bf16 weights in 48-column panels (csrc ops.cpp / linear_bf16.cpp)."""

    def __init__(self, ops: Ops, w: Tensor, bias: Tensor | None, dtype: torch.dtype) -> None:
        self.ops, self.out_features, self.in_features = ops, w.shape[0], w.shape[1]
        self.data = ops.pack_bf16(w) if dtype == torch.bfloat16 else pack_weight(w.float(), ops.f32_strip)
        self.bias = pad_bias(bias.float()) if bias is not None else None

    def matmul(self, x: Tensor, decode_rows: int = -1) -> Tensor:  # the same path for every row
        if self.data.dtype == torch.bfloat16:
            return self.ops.linear_bf16(x, self.data, self.bias, self.out_features)
        return self.ops.packed_linear(x, self.data, self.bias, self.out_features)

    def matmul_silu_and_mul(self, x: Tensor, decode_rows: int = -1) -> Tensor:
        # bf16 panels whose gate and up halves are whole panels: in one pass, the product never stored. Under
        # FUSED_SILU_MIN_ROWS the product fits in L2 anyway, and the fused kernel's two weight streams a thread
        # (gate and up panels) cost more than they save (Zen 5, 30 layers' 576 -> 2 x 1536 from memory: 1 row
        # 95 vs 112 us, 8 rows 135 vs 140, 16 rows 165 vs 159, 512 rows 2472 vs 2349). The results are the same bits.
        if self.data.dtype == torch.bfloat16 and self.out_features % 96 == 0 and x.shape[0] >= FUSED_SILU_MIN_ROWS:
            return self.ops.linear_bf16_silu_mul(x, self.data, self.bias, self.out_features)
        return super().matmul_silu_and_mul(x)

    def dequantize(self) -> Tensor:
        return unpack_weight(self.data, self.out_features)[:, :self.in_features].float()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def format_name(self) -> str:
        return "bf16" if self.data.dtype == torch.bfloat16 else "f32"


class GGMLWeight(PackedWeight):
    """Rows of ggml blocks, in parts stacked along the outputs: parts[i] is [O_i, row_bytes] uint8 as the
    file stores it. Where this CPU runs a format repacked (Q4_0 / Q4_1 / Q8_0 on AVX-512 VNNI and AVX2: 16-row
    groups, the same bytes per weight, csrc/linear_x16.cpp) the part is repacked once here; `repacked`
    says which, so the loader can drop the file's pages of those."""

    def __init__(self, ops: Ops, parts: list[tuple[Tensor, WeightFormat]], in_features: int,
                 bias: Tensor | None = None, prepacked: list[int | None] | None = None) -> None:
        """prepacked[i]: part i is already in this CPU's repacked layout (repack_experts) and holds that many
        rows; None (or no list): part i is rows as the file stores them, repacked here where the CPU runs it so."""
        prepacked = prepacked or [None] * len(parts)
        for (data, fmt), rows in zip(parts, prepacked):
            if fmt.name not in GGML_KERNEL_FORMATS or in_features % fmt.block_weights:
                raise ValueError(f"{fmt.name} cannot run a linear of {in_features} inputs in place")
            if rows is None and (data.dtype != torch.uint8 or data.dim() != 2
                                 or data.shape[1] != fmt.row_bytes(in_features)):
                raise ValueError(f"{fmt.name} part {tuple(data.shape)} is not rows of {in_features} weights")
        self.ops, self.in_features = ops, in_features
        self.formats = [f for _, f in parts]
        self.rows_per_part = [d.shape[0] if rows is None else rows for (d, _), rows in zip(parts, prepacked)]
        self.out_features = sum(self.rows_per_part)
        self.bias = bias.float().contiguous() if bias is not None else None
        self.repacked = [rows is not None or bool(ops.ggml_repacks(f.ggml_type))
                         for (_, f), rows in zip(parts, prepacked)]
        self._weights = [ops.repack_ggml(d, f.ggml_type) if r and rows is None else d
                         for (d, f), r, rows in zip(parts, self.repacked, prepacked)]
        self._types = [f.ggml_type + REPACKED if r else f.ggml_type for (_, f), r in zip(parts, self.repacked)]

    def matmul(self, x: Tensor, decode_rows: int = -1) -> Tensor:
        return self.ops.linear_ggml(x, self._weights, self._types, self.rows_per_part, self.bias, self.out_features,
                                    decode_rows)

    def matmul_silu_and_mul(self, x: Tensor, decode_rows: int = -1) -> Tensor:
        return self.ops.linear_ggml_silu_mul(x, self._weights, self._types, self.rows_per_part, self.bias,
                                             self.out_features, decode_rows)

    def matmul_normed(self, x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, decode_rows: int = -1,
                      silu: bool = False) -> Tensor:
        return self.ops.linear_ggml_normed(x, residual, norm_weight, eps, self._weights, self._types,
                                           self.rows_per_part, self.bias, self.out_features, decode_rows, silu)

    def dequantize(self) -> Tensor:
        return torch.cat([self.ops.dequantize_ggml(w, t, self.in_features, n, None)
                          for w, t, n in zip(self._weights, self._types, self.rows_per_part)])

    def rows(self, ids: Tensor) -> Tensor:
        """Embedding lookup: rows `ids` dequantized, [len(ids), K] fp32 (single-part weights)."""
        (w,), (t,), (n,) = self._weights, self._types, self.rows_per_part
        return self.ops.dequantize_ggml(w, t, self.in_features, n, ids)

    @property
    def nbytes(self) -> int:
        return sum(d.numel() for d in self._weights)

    @property
    def format_name(self) -> str:
        return "+".join(dict.fromkeys(f.name for f in self.formats))


def block_bytes_of(fmt: WeightFormat, cols: tuple[int, int], name: str) -> tuple[int, int]:
    """The bytes of each row that hold weights [cols) of a block format: a tensor-parallel shard of its inputs,
    which must fall on whole blocks."""
    if cols[0] % fmt.block_weights or cols[1] % fmt.block_weights:
        raise ModelLoadError(f"{name}: a shard of weights [{cols[0]}, {cols[1]}) does not fall on whole "
                             f"{fmt.name} blocks of {fmt.block_weights}")
    return cols[0] // fmt.block_weights * fmt.block_bytes, cols[1] // fmt.block_weights * fmt.block_bytes


@dataclass
class BlockRows:
    """A checkpoint tensor that arrives in a ggml block format (an HF folder's MXFP4 experts, laid out as ggml's
    blocks at load): rows [O, row_bytes] uint8 of `in_features` weights each."""

    data: Tensor
    fmt: WeightFormat
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.in_features

    def select(self, rows: np.ndarray | None, cols: tuple[int, int] | None, name: str) -> BlockRows:
        """This rank's rows and inputs (whole blocks)."""
        data, k = self.data, self.in_features
        if cols is not None:
            lo, hi = block_bytes_of(self.fmt, cols, name)
            data, k = data[:, lo:hi], cols[1] - cols[0]
        if rows is not None:
            data = data[torch.from_numpy(rows)]
        return BlockRows(data.contiguous(), self.fmt, k)

    def dequantize(self) -> Tensor:
        """fp32 [O, in_features] (gguf-py's reference)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        w = dequantize(self.data.numpy(), GGMLQuantizationType(self.fmt.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(w.reshape(self.data.shape[0], self.in_features), dtype=np.float32))


def repack_experts(ops: Ops, data: Tensor, fmt: WeightFormat) -> list[Tensor] | None:
    """A 3-D tensor of experts [E, O, row_bytes] repacked in one buffer (on huge pages: an expert's matrix is
    often under 2 MiB, too small to get them alone), as each expert's view; None where this CPU runs the
    format as stored or O is not whole 16-row groups (each expert is then repacked on its own)."""
    experts, rows = data.shape[0], data.shape[1]
    if fmt.name not in GGML_KERNEL_FORMATS or not ops.ggml_repacks(fmt.ggml_type) or rows % 16:
        return None
    packed = ops.repack_ggml(data.reshape(experts * rows, -1), fmt.ggml_type)  # [E * O / 16, chunks, bytes]
    return list(packed.chunk(experts))


def quantize(ops: Ops, w: Tensor, bias: Tensor | None, name: str) -> GGMLWeight:
    """A dense [O, K] weight quantized at load into a ggml format (gguf-py's quantizers)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    fmt = FORMATS[name]
    raw = gguf_quantize(w.float().numpy(), GGMLQuantizationType(fmt.ggml_type))
    return GGMLWeight(ops, [(torch.from_numpy(raw), fmt)], w.shape[1], bias)
