#pragma once
#include <torch/types.h>

// x [T, KVH, D] fp32 quantized into the q8_0 or q4_0 pool [NB, BS, KVH, D / 32 x bytes] at slots [T]
// (kv_quant.cpp), as kv_quant.quantize_int does, bit for bit
void quantize_kv_(torch::Tensor pool, torch::Tensor slots, torch::Tensor x);


// x [T, KVH, D] fp32 quantized into the fp8 pool [NB, BS, KVH, D] (uint8: e5m2, else e4m3fn bytes) and its bf16
// scales [NB, BS, KVH] at slots [T] (kv_quant.cpp), as kv_quant.quantize does, bit for bit
void quantize_fp8_kv_(torch::Tensor pool, torch::Tensor scales, torch::Tensor slots, torch::Tensor x, bool e5m2);
