// Linear over ggml's quantized blocks, read as GGUF stores them (linear_ggml.cpp).
#pragma once
#include <torch/types.h>

// ws[i]: [rows_i, row_bytes] in type i's file layout, or repacked (type + 1000, see linear_x16.h);
// decode_rows: the leading single-token decode rows of x (the path is chosen by them), -1 if unknown
torch::Tensor linear_ggml(torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> types,
                          std::vector<int64_t> rows, c10::optional<torch::Tensor> bias, int64_t O,
                          int64_t decode_rows);
// the integer dot for every row, any M (K a multiple of 32): a row's result is the same in any batch, which
// linear_ggml promises only by its decode_rows rule (moe.cpp: an expert's rows are a batch-dependent subset)
torch::Tensor linear_ggml_dot(torch::Tensor x, const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& types,
                              const std::vector<int64_t>& rows, int64_t O);
torch::Tensor dequantize_ggml(torch::Tensor w, int64_t type, int64_t K, int64_t rows, c10::optional<torch::Tensor> ids);
bool ggml_repacks(int64_t type);  // does this CPU run `type` repacked (repack_ggml, then type + 1000)?
torch::Tensor repack_ggml(torch::Tensor w, int64_t type);
const char* linear_ggml_isa();
