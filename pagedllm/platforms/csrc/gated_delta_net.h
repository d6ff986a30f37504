// Gated DeltaNet's decode step (gated_delta_net.cpp).
#pragma once
#include <torch/types.h>

// B decode rows (rows of p, their state slots, whether each starts fresh) through one layer's conv, delta-rule state
// update and output gate; conv [slots, C, K - 1] and recurrent [slots, Hv, Dk, Dv] updated in place. Returns the
// gated outputs [B, Hv, Dv] (out_proj's input)
torch::Tensor gated_delta_decode(torch::Tensor p, torch::Tensor rows, torch::Tensor slots, torch::Tensor fresh,
                                 torch::Tensor conv, torch::Tensor recurrent, torch::Tensor conv_w,
                                 torch::Tensor a_log, torch::Tensor dt_bias, torch::Tensor norm_w, int64_t hk,
                                 int64_t dk, bool tiled, double eps);
