// Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K / MXFP4 repacked into 16-row groups for AVX-512 VNNI, and Q4_0 / Q4_1 / Q8_0
// for AVX2 (linear_x16.cpp), used by linear_ggml.cpp for those types where x16_supported() says the CPU runs it.
#pragma once
#include <torch/types.h>

// which dot this build has (compile-time; -march=native): AVX-512 VNNI, or AVX2 where there is no AVX-512 (the
// builds whose prompt rows take fp32 panels, linear_ggml.cpp PAGEDLLM_F32_PREFILL)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define PAGEDLLM_X16_VNNI512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define PAGEDLLM_X16_AVX2 1
#endif

constexpr int64_t kX16 = 1000;  // internal type id = ggml type + kX16 for a repacked part

bool x16_supported(int64_t type);
torch::Tensor repack_x16(torch::Tensor w, int64_t type);  // [O, row_bytes] -> [ceil(O / 16), K / 32, bytes]

// Activation rows quantized per 32, for the dot this CPU runs:
//   AVX-512 VNNI: int16 (scale max|x| / 32767: ~2^-15 relative error, finer than bf16, so the dot's error is the
//     weights' own), each group of 4 stored as [0, 2, 1, 3] so one 32-bit broadcast is the pair a vpdpwssd lane needs;
//   AVX2: int8 (scale max|x| / 127, as ggml's vec_dot_type and the file layout's dot), in order: one 32-bit
//     broadcast is the 4 values a vpmaddubsw lane needs.
struct X16Act {
  int64_t K = 0, nch = 0;
  std::vector<int16_t> q;    // [M, K], reordered in 4s (AVX-512 VNNI; empty on AVX2)
  std::vector<int8_t> q8;    // [M, K] (AVX2; empty on AVX-512 VNNI)
  std::vector<uint8_t> lo;   // [M, K] in order: q = 256 hi + lo (AVX-512 VNNI's Q4_0 / Q4_1 / Q4_K dot)
  std::vector<int8_t> hi;
  std::vector<float> d, s;   // [M, nch]: scale; d * sum(q)
  std::vector<int32_t> sum;    // [M, nch]: sum(q)
  std::vector<int32_t> sum16;  // [M, nch, 2]: sum(q) of each 16 (Q6_K's halves have their own scales)
};
X16Act x16_quantize(const float* x, int64_t M, int64_t K);

// y[:, n] for the part's `rows` outputs (y, bias already at the part's first column): the integer dot
void x16_dot(int64_t type, const torch::Tensor& w, int64_t rows, const X16Act& a, int64_t M, const float* bias,
             float* y, int64_t O);
// the same for the 16-row groups [g_lo, g_hi) only, on the calling thread (moe.cpp runs many experts' groups in
// one parallel region)
void x16_dot_groups(int64_t type, const torch::Tensor& w, int64_t rows, const X16Act& a, int64_t M, const float* bias,
                    float* y, int64_t O, int64_t g_lo, int64_t g_hi);
// one 48-row bf16 panel [K2, 48, 2] (3 groups of 16 rows) for the prefill path; padded rows zero
void x16_panel(int64_t type, const torch::Tensor& w, int64_t K, int64_t p, uint16_t* panel);
// the same as an fp32 panel (f32_tile.h's strips), for AVX2's prefill (linear_ggml.cpp PAGEDLLM_F32_PREFILL)
void x16_panel_f32(int64_t type, const torch::Tensor& w, int64_t K, int64_t p, float* panel);
// fp32 rows [R, K] (ids: which rows; all when empty)
torch::Tensor x16_dequantize(int64_t type, const torch::Tensor& w, int64_t rows, int64_t K, const torch::Tensor& ids);
