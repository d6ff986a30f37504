"""Weight methods: which format each linear runs in, decided in one place for a whole load.

The loaders read a linear's parts (this rank's shard of each, dense tensors or rows of ggml blocks) and hand
them here; they never ask which kernels exist. A linear ends up with one method:
- ggml blocks as stored (`GGMLWeight`), where the platform's kernels run every part's format and no
  requantization was asked for;
- quantized at load into a ggml format (`quantization="q8_0"`, ...; the output projection keeps >= 8 bits);
- dense, packed after loading into fp32 or bf16 column panels for the kernels (`DensePanels`), or left to torch
  (`F.linear`) where the platform has no kernels (the torch reference backend, any torch device).
Blocks the kernels cannot run are dequantized by the loader, which counts them for its warning.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ...errors import ModelLoadError
from ...platforms import Platform
from ...platforms.cpu import Ops
from .formats import FORMATS, GGML_KERNEL_FORMATS, WeightFormat
from .weight_formats import GGMLWeight, quantize, repack_experts

log = logging.getLogger("pagedllm")
LOW_BIT = ("q4_0", "q4_1", "q5_0", "q5_1")


class WeightMethods:
    """ops: the platform's kernels for the run dtype (None: torch); quantization: None runs weights as stored,
    "none" dequantizes blocks, a format name quantizes dense weights into it at load."""

    def __init__(self, ops: Ops | None, dtype: torch.dtype, quantization: str | None) -> None:
        if quantization not in (None, "none") and ops is None:
            raise ModelLoadError(f"quantization={quantization!r} needs the C++ kernels (and dtype float32 or bfloat16)")
        self.ops, self.dtype = ops, dtype
        self.requantize = quantization if quantization not in (None, "none") else None
        self.blocks_in_place = ops is not None and quantization is None  # ggml blocks run as the file stores them
        self.kept_dense = 0  # linears quantization= could not take (inputs not whole blocks)

    def runs_blocks(self, fmts: list[WeightFormat | None], in_features: int) -> bool:
        """Whether parts in these formats (None: dense) run as stored: every one a format the kernels run on
        whole blocks of the inputs."""
        return self.blocks_in_place and all(f is not None and f.name in GGML_KERNEL_FORMATS
                                            and in_features % f.block_weights == 0 for f in fmts)

    def blocks(self, parts: list[tuple[torch.Tensor, WeightFormat]], in_features: int, bias: torch.Tensor | None,
               prepacked: list[int | None] | None = None) -> GGMLWeight:
        """Parts of ggml block rows as one packed weight (call where runs_blocks)."""
        return GGMLWeight(self.ops, parts, in_features, bias, prepacked)

    def experts(self, data: torch.Tensor, fmt: WeightFormat) -> list[torch.Tensor] | None:
        """A 3-D tensor of experts repacked in one buffer, or None where each expert is packed on its own."""
        return repack_experts(self.ops, data, fmt)

    def set_blocks(self, model: nn.Module, lin: nn.Linear, weight: GGMLWeight, bias: torch.Tensor | None) -> None:
        model.set_packed(lin, weight)
        if bias is not None:  # the packed weight adds it; the module keeps it as the checkpoint's tensor
            lin.bias = nn.Parameter(bias, requires_grad=False)

    def set_dense(self, lin: nn.Linear, w: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Dense weights [out, in] (a shard)."""
        lin.weight = nn.Parameter(w, requires_grad=False)
        lin.out_features, lin.in_features = w.shape
        if bias is not None:
            lin.bias = nn.Parameter(bias, requires_grad=False)

    def quantize(self, model: nn.Module, lin: nn.Linear) -> None:
        """Quantize a dense linear now, if the load asks for it and the linear may be (a router may not); a
        loader that reads one linear at a time calls this as it goes, so dense copies never pile up. The output
        projection gets at least 8 bits (4-bit logits cost far more than 4-bit layers: q4_0 everywhere measured
        KL 0.99 on the default model); llama.cpp's quantizer likewise keeps output.weight at Q6_K or better."""
        if self.requantize is None or not lin.quantizable or lin.packed is not None:
            return
        fmt = "q8_0" if lin is model.lm_head and self.requantize in LOW_BIT else self.requantize
        if lin.weight.shape[1] % FORMATS[fmt].block_weights:  # as llama.cpp's quantizer, such a tensor stays as it is
            self.kept_dense += 1
            return
        bias = lin.bias.data if lin.bias is not None else None
        model.set_packed(lin, quantize(self.ops, lin.weight.data, bias, fmt))

    def process(self, model: nn.Module, platform: Platform) -> None:
        """Everything is loaded (and evened out by the model's after_load): linears still dense are quantized
        where the load asks, then packed into fp32 / bf16 panels for the kernels, with activations, norms,
        embeddings and the residual stream kept in fp32; without kernels the model runs in the dtype on torch,
        on the platform's device, with the platform's kernels for it if it has some (Triton)."""
        for lin in model._linears():
            self.quantize(model, lin)
        if self.kept_dense:
            log.warning("%d linears kept dense: their inputs are not whole %s blocks", self.kept_dense, self.requantize)
        if self.ops is not None:
            model.set_ops(self.ops, self.dtype)
            model.float()
        else:
            model.to(device=platform.device, dtype=self.dtype)
            backend = platform.backend()
            if backend is not None:
                model.use_backend(backend)
        model.device = platform.device
