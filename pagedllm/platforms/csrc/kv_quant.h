#pragma once
#include <torch/types.h>

// x [T, KVH, D] fp32 quantized into the q8_0 or q4_0 pool [NB, BS, KVH, D / 32 x bytes] at slots [T]
// (kv_quant.cpp), as kv_quant.quantize_int does, bit for bit
void quantize_kv_(torch::Tensor pool, torch::Tensor slots, torch::Tensor x);

// One head's D values of a q8_0 (q8 true) or q4_0 pool row, src at its first block, widened into dst [D] fp32
// (d q, or d (n - 8))
void dequantize_kv_head(const uint8_t* src, bool q8, int64_t D, float* dst);
