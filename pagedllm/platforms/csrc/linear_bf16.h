// bf16-weight linear over panel-packed weights (linear_bf16.cpp).
#pragma once
#include <torch/types.h>

torch::Tensor pack_bf16(torch::Tensor w);
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t O);
torch::Tensor linear_bf16_silu_mul(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t O);
const char* linear_bf16_isa();
