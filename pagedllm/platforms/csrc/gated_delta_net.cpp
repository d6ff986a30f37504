// One decode token per sequence through a Gated DeltaNet mixer (Qwen3.5's linear attention), states in place: the
// math of model_executor/layers/gated_delta_net.py's causal_conv, recurrent_step and the layer's output gate, in one
// call a layer instead of ~40 torch ops, with each sequence's state read and written once where the torch steps
// gathered it, scaled it, summed it and scattered it back (a 9B's 24 such layers hold 48 MiB of state a sequence).
// Layout: p [T, C + Hv Dv + 2 Hv] the in_proj rows (conv input [C = 2 Hk Dk + Hv Dv]: q, k, v channels; then z, b,
// a); conv state [slots, C, K - 1]; recurrent state [slots, Hv, Dk, Dv]; all fp32, contiguous.
// Per sequence: the depthwise conv (SiLU) over all channels and the L2 norms of q and k per key head; then per
// (sequence, value head) in parallel, state S [Dk, Dv] (64 KiB at 128 x 128: it stays in L2 between the passes):
//   pass 1: S <- exp(g) S, and S^T k summed row by row (the order torch's sum over Dk takes);
//   pass 2: S <- S + k (beta (v - S^T k))^T, and o = S^T q summed the same way;
// then o RMS-normed, times the norm weight and SiLU(z). ISA: plain loops over Dv that the compiler vectorizes for
// -march=native (no intrinsics: the loops are memory- and latency-light).
#include "gated_delta_net.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's default threshold

void l2norm(float* x, int64_t n, float scale) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
  const float r = scale / std::sqrt(s + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] *= r;
}

}  // namespace

torch::Tensor gated_delta_decode(torch::Tensor p, torch::Tensor rows, torch::Tensor slots, torch::Tensor fresh,
                                 torch::Tensor conv, torch::Tensor recurrent, torch::Tensor conv_w,
                                 torch::Tensor a_log, torch::Tensor dt_bias, torch::Tensor norm_w, int64_t hk,
                                 int64_t dk, bool tiled, double eps) {
  TORCH_CHECK(recurrent.dim() == 4 && conv.dim() == 3 && p.dim() == 2, "gated_delta_decode: p [T, P], conv "
              "[slots, C, K - 1], recurrent [slots, Hv, Dk, Dv]");
  for (const auto* t : {&p, &conv, &recurrent, &conv_w, &a_log, &dt_bias, &norm_w})
    TORCH_CHECK(t->dtype() == torch::kFloat32 && t->is_contiguous(), "gated_delta_decode: fp32 contiguous tensors");
  const int64_t hv = recurrent.size(1), dv = recurrent.size(3), C = conv.size(1), km1 = conv.size(2);
  TORCH_CHECK(recurrent.size(2) == dk && C == 2 * hk * dk + hv * dv && conv_w.numel() == C * (km1 + 1) &&
              p.size(1) == C + hv * dv + 2 * hv && hv % hk == 0 && a_log.numel() == hv && dt_bias.numel() == hv &&
              norm_w.numel() == dv, "gated_delta_decode: the states, weights and rows do not match one layer");
  const int64_t B = rows.numel(), P = p.size(1), kd = hk * dk, r = hv / hk;
  TORCH_CHECK(slots.numel() == B && fresh.numel() == B, "gated_delta_decode: a slot and a fresh flag per row");
  const auto rows_c = rows.to(torch::kInt64).contiguous(), slots_c = slots.to(torch::kInt64).contiguous();
  const auto fresh_c = fresh.to(torch::kBool).contiguous();
  const int64_t* rp = rows_c.data_ptr<int64_t>();
  const int64_t* sp = slots_c.data_ptr<int64_t>();
  const bool* fp = fresh_c.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(rp[b] >= 0 && rp[b] < p.size(0) && sp[b] >= 0 && sp[b] < conv.size(0),
                "gated_delta_decode: row or slot out of range");
  const float* pp = p.data_ptr<float>();
  const float* wp = conv_w.data_ptr<float>();
  float* cp = conv.data_ptr<float>();
  float* sp_all = recurrent.data_ptr<float>();
  auto out = torch::empty({B, hv, dv}, p.options());
  float* op = out.data_ptr<float>();

  // the conv's output [B, C], q and k normalized (q scaled by Dk^-1/2)
  std::vector<float> y(B * C);
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const float* x = pp + rp[b] * P;
      float* st = cp + sp[b] * C * km1;
      float* yb = y.data() + b * C;
      for (int64_t c = 0; c < C; ++c) {
        float* s = st + c * km1;
        if (fp[b])
          for (int64_t j = 0; j < km1; ++j) s[j] = 0.f;
        const float* w = wp + c * (km1 + 1);
        float acc = 0.f;
        for (int64_t j = 0; j < km1; ++j) acc += w[j] * s[j];
        acc += w[km1] * x[c];
        for (int64_t j = 0; j + 1 < km1; ++j) s[j] = s[j + 1];  // the last K - 1 inputs
        if (km1 > 0) s[km1 - 1] = x[c];
        yb[c] = silu(acc);
      }
      for (int64_t h = 0; h < hk; ++h) {
        l2norm(yb + h * dk, dk, 1.f / std::sqrt(static_cast<float>(dk)));
        l2norm(yb + kd + h * dk, dk, 1.f);
      }
    }
  });

  at::parallel_for(0, B * hv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> pred(dv), u(dv), o(dv);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t b = item / hv, h = item % hv, kh = tiled ? h % hk : h / r;
      const float* x = pp + rp[b] * P;
      const float* yb = y.data() + b * C;
      const float* q = yb + kh * dk;
      const float* k = yb + kd + kh * dk;
      const float* v = yb + 2 * kd + h * dv;
      const float g = -std::exp(a_log.data_ptr<float>()[h]) * softplus(x[C + hv * dv + hv + h] + dt_bias.data_ptr<float>()[h]);
      const float beta = 1.f / (1.f + std::exp(-x[C + hv * dv + h]));
      const float decay = std::exp(g);
      float* S = sp_all + ((sp[b] * hv) + h) * dk * dv;
      for (int64_t j = 0; j < dv; ++j) pred[j] = 0.f;
      if (fp[b]) {  // a fresh sequence's state starts at zero, whatever the slot held
        std::fill_n(S, dk * dv, 0.f);
      } else {
        for (int64_t i = 0; i < dk; ++i) {
          float* row = S + i * dv;
          const float ki = k[i];
          for (int64_t j = 0; j < dv; ++j) {
            row[j] *= decay;
            pred[j] += row[j] * ki;
          }
        }
      }
      for (int64_t j = 0; j < dv; ++j) {
        u[j] = beta * (v[j] - pred[j]);
        o[j] = 0.f;
      }
      for (int64_t i = 0; i < dk; ++i) {
        float* row = S + i * dv;
        const float ki = k[i], qi = q[i];
        for (int64_t j = 0; j < dv; ++j) {
          row[j] += ki * u[j];
          o[j] += row[j] * qi;
        }
      }
      float ss = 0.f;
      for (int64_t j = 0; j < dv; ++j) ss += o[j] * o[j];
      const float rn = 1.f / std::sqrt(ss / static_cast<float>(dv) + static_cast<float>(eps));
      const float* z = x + C + h * dv;
      const float* nw = norm_w.data_ptr<float>();
      float* ob = op + (b * hv + h) * dv;
      for (int64_t j = 0; j < dv; ++j) ob[j] = o[j] * rn * nw[j] * silu(z[j]);
    }
  });
  return out;
}
