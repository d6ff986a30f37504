#pragma once
#include <torch/types.h>

// logits[r, t] = -inf where bit t of bitmask[r] is clear, for r in rows (mask_rows.cpp)
void mask_rows_(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows);
