"""The model's linear and embedding layers: they hold their weights dense (torch) or packed (a
PackedWeight: fp32 / bf16 panels, GGML blocks) and do their own tensor-parallel communication, so a model
file names its layers and never branches on the weight format or on parallelism."""

from __future__ import annotations

import torch
from torch import nn

from ...distributed import TPGroup
from ...platforms.cpu import Ops
from .module import InferenceModule
from .weight_formats import DensePanels, GGMLWeight, PackedWeight


class PackedLinear(InferenceModule, nn.Linear):
    """nn.Linear whose matmul runs on `packed` once the loader or the kernels set one (else F.linear on
    `weight`). reduce: a row-parallel layer's group (its partial sums are all-reduced); gather: a
    vocab-parallel output's group (the ranks' columns are all-gathered)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed: PackedWeight | None = None
        self.reduce: TPGroup | None = None
        self.gather: TPGroup | None = None
        self.quantizable = True  # whether `quantization=` at load may requantize it (a router stays as it is)

    def set_packed(self, packed: PackedWeight, shared: bool = False) -> None:
        """Weights that arrive packed (a GGUF's blocks, quantized at load); the dense copy goes unless it is
        shared (a tied lm_head's weight is the embedding table)."""
        self.packed = packed
        self.in_features, self.out_features = packed.in_features, packed.out_features  # a shard's, under TP
        if not shared:
            self.weight = nn.Parameter(torch.empty(0, device="cpu"), requires_grad=False)

    def pack(self, ops: Ops, weight_dtype: torch.dtype, shared: bool = False) -> None:
        """After loading, for the C++ kernels: a dense weight becomes fp32 or bf16 column panels and its
        [out, in] copy is dropped unless shared; weights already packed stay as they are."""
        if self.packed is not None:
            return
        w = self.weight.data
        self.packed = DensePanels(ops, w, self.bias.data if self.bias is not None else None, weight_dtype)
        if not shared:
            self.weight.data = w.new_empty(0)

    def unpack(self, keep_dense: bool = False) -> None:
        """Back to torch: the [out, in] weight rebuilt from the packed one (bit for bit for panels), unless
        keep_dense (a shared dense weight is still there)."""
        if self.packed is None:
            return
        if not keep_dense:
            self.weight.data = self.packed.dequantize().to(self.weight.dtype)
        self.packed = None

    def forward(self, x: torch.Tensor, decode_rows: int = -1) -> torch.Tensor:
        """x: [T, in]; the leading decode_rows rows are decodes (a format may take another path for them).
        Returns [T, out] (fp32 when packed, whatever the weights' format)."""
        out = super().forward(x) if self.packed is None else self.packed.matmul(x, decode_rows)
        if self.reduce is not None:
            self.reduce.all_reduce(out)
        if self.gather is not None:
            out = self.gather.all_gather_last(out)
        return out


class VocabEmbedding(InferenceModule, nn.Embedding):
    """The token table, dense or `packed` (a GGML table looked up row by row); under tensor parallelism each
    rank holds the rows of its `vocab_range` and the lookups are summed across ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        # _weight: no random init (the loader fills it; nn.init.normal_ under a meta device context goes
        # through torch._refs, which imports torch._dynamo and triton: ~70 MiB of RSS and ~1 s of startup)
        super().__init__(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
        self.packed: GGMLWeight | None = None
        self.tp: TPGroup | None = None
        self.vocab_range = (0, num_embeddings)

    def unpack(self) -> None:
        """Back to a dense table (torch)."""
        if self.packed is not None:
            self.weight.data = self.packed.dequantize()
            self.packed = None

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.packed.rows(ids) if self.packed is not None else super().forward(ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] -> [T, hidden]."""
        if self.tp is None:
            return self._rows(ids)
        lo, hi = self.vocab_range
        mine = (ids >= lo) & (ids < hi)
        x = self._rows((ids - lo).clamp(0, hi - lo - 1)) * mine.unsqueeze(1)  # [T, hidden]: others' rows zero
        self.tp.all_reduce(x)
        return x
