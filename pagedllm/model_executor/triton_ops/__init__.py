"""Triton kernels over the paged KV pool, for GPUs (and any torch device Triton compiles for); on CPU tensors
they run in Triton's interpreter (TRITON_INTERPRET=1, set by the platform before this package is imported), which
is how CI checks them without a GPU.

- `kv_write`: new tokens' K/V into their slots (fp32 / bf16 / fp16 pools as computed; fp8 pools quantized with
  one bf16 scale per slot and KV head, as kv_quant.quantize does).
- `attention`: every row of a step over the pool in two launches: decodes by flash-decoding (the context split
  over programs, partial softmax states merged by a second kernel), every other row (prompt chunks with or
  without a prefix hit, speculative rows) by a tiled causal kernel. GQA packs a KV head's query heads into one
  tile, so each K/V tile is read once per KV head; sliding windows and attention sinks are in both.
- `norm`: RMSNorm with the residual add fused.
"""
