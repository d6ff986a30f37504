#pragma once
#include <torch/types.h>

// x [T, KVH, D] fp32 quantized into the q8_0 or q4_0 pool [NB, BS, KVH, D / 32 x bytes] at slots [T]
// (kv_quant.cpp), as kv_quant.quantize_int does, bit for bit
void quantize_kv_(torch::Tensor pool, torch::Tensor slots, torch::Tensor x);

