// Linear over ggml's quantized blocks, read as GGUF stores them (linear_ggml.cpp).
#pragma once
#include <torch/extension.h>

torch::Tensor linear_ggml(torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> types,
                          c10::optional<torch::Tensor> bias, int64_t O);
torch::Tensor dequantize_ggml(torch::Tensor w, int64_t type, int64_t K);
const char* linear_ggml_isa();
