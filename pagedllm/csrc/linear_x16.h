// Q4_0 / Q4_1 / Q8_0 repacked into 16-row groups for AVX-512 VNNI (linear_x16.cpp), used by
// linear_ggml.cpp for those types where x16_supported() says the CPU runs it.
#pragma once
#include <torch/extension.h>

constexpr int64_t kX16 = 1000;  // internal type id = ggml type + kX16 for a repacked part

bool x16_supported(int64_t type);
torch::Tensor repack_x16(torch::Tensor w, int64_t type);  // [O, row_bytes] -> [ceil(O / 16), K / 32, bytes]

struct QActView {  // the activations quantized per 32 (linear_ggml.cpp's QAct)
  int64_t K, nch;
  const int8_t* q;    // [M, K]
  const float* d;     // [M, nch]
  const float* s;     // [M, nch * 2]: d * sum(q) per 16
  const int32_t* sum; // [M, nch]: sum(q) per 32
};

// y[:, col0 + n] for the part's `rows` outputs: the integer dot (decode-sized M)
void x16_dot(int64_t type, const torch::Tensor& w, int64_t rows, const QActView& a, int64_t M, const float* bias,
             float* y, int64_t O);
// one 48-row bf16 panel [K2, 48, 2] (3 groups of 16 rows) for the prefill path; rows past `rows` zero
void x16_panel(int64_t type, const torch::Tensor& w, int64_t rows, int64_t K, int64_t p, uint16_t* panel);
// fp32 rows [R, K] (ids: which rows; all when empty)
torch::Tensor x16_dequantize(int64_t type, const torch::Tensor& w, int64_t rows, int64_t K, const torch::Tensor& ids);
