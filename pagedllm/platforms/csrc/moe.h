// A mixture-of-experts MLP over experts in ggml block formats, in one call (moe.cpp).
#pragma once
#include <torch/types.h>

// A layer's experts, held once (the weight lists converted from Python at construction, not at every call).
// Expert e's gate_up linear is the parts gate_up[e * P, (e + 1) * P) (P = parts_per_expert; gate rows, then up
// rows), its down linear down[e]; types and rows as linear_ggml takes them; gate_up_bias, down_bias: per expert
// fp32 [2 I] and [O_down], or both empty. Called with x [T, K] fp32 and ids, wts [T, top_k] (each token's experts
// and routing weights), it returns sum over a token's experts of wts * down(act(gate, up)), [T, O_down] fp32, each
// row computed the same way in any batch; act = silu(gate) * up, or with limit > 0 gpt-oss's clamped SwiGLU.
struct MoeExperts {
  MoeExperts(std::vector<torch::Tensor> gate_up, std::vector<int64_t> gate_up_types, std::vector<int64_t> gate_up_rows,
             int64_t parts_per_expert, std::vector<torch::Tensor> down, std::vector<int64_t> down_types,
             std::vector<int64_t> down_rows, std::vector<torch::Tensor> gate_up_bias,
             std::vector<torch::Tensor> down_bias, double alpha, double limit);
  torch::Tensor operator()(torch::Tensor x, torch::Tensor ids, torch::Tensor wts) const;

  std::vector<torch::Tensor> gate_up;
  std::vector<int64_t> gate_up_types, gate_up_rows;
  std::vector<torch::Tensor> down;
  std::vector<int64_t> down_types, down_rows;
  std::vector<torch::Tensor> gate_up_bias, down_bias;
  int64_t P;
  double alpha, limit;
};

torch::Tensor silu_and_mul(torch::Tensor gate_up);  // ops.cpp
