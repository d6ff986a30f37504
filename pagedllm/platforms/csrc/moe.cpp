// A mixture-of-experts MLP in one call: the batch's (token, expert) pairs grouped by expert with a counting
// sort (tokens ascending within each expert), then for each expert that was picked: its rows gathered, gate_up
// (+ bias), silu(gate) * up or gpt-oss's clamped form, down (+ bias), and the rows scaled by their routing
// weights and summed into the output. Only the picked experts' weights are read.
// Every expert row takes linear_ggml's integer dot (activations int8 per 32, as ggml's mul_mat_id pairs each
// type with its vec_dot_type), whatever the number of rows: which rows an expert gets depends on the whole
// batch, so a row-count rule (linear_ggml's panels for prompt rows) would make a token's output, and through
// the router the next layers' picks, depend on its batch; the dot also costs no per-call dequantization of
// the expert, which the panel path would pay for every expert a prompt touches. The ISA paths are
// linear_ggml.cpp's / linear_x16.cpp's. Where every picked expert is repacked (AVX-512 VNNI; Q4_0 / Q4_1 / Q8_0 on AVX2), each stage
// (gate_up, then down) is one parallel region over all picked experts' 16-row groups: the threads start once
// a stage, not once an expert, and balance over 8 small matrices rather than within each (decode-sized
// expert matrices of 1-2 MB: 16 GB/s in one call each vs 19-23 for 6-60 MB ones, measured on Zen 4/5).
// Else one expert after the other through linear_ggml's dot. Either way the interpreter's dispatch around
// each expert (~10 framework calls per expert per layer) is gone, and so is the conversion of the layer's weight
// lists at every call: a MoeExperts holds them, made once per layer (a Python list of 128 experts' 384 tensors
// converted per call measured ~0.3 ms a layer, more than a decode step's expert work on small models).
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

#include "linear_ggml.h"
#include "linear_x16.h"
#include "moe.h"

namespace {

// one repacked linear of one expert: its 16-row groups against that expert's quantized rows
struct Job {
  const torch::Tensor* w;
  int64_t type, rows, O;  // ggml type, the part's rows, the output's row stride
  const X16Act* a;
  int64_t M;
  float* y;  // at the part's first column
  const float* bias;  // at the part's first column, or nullptr
};

// the gated activation of gate_up rows [n, 2 I] (gate | up): silu(gate) * up, or with limit > 0 gpt-oss's
// (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit) (the torch ops the layer's own
// loop runs, so both give the same bits)
torch::Tensor gated(const torch::Tensor& gate_up, double alpha, double limit) {
  if (limit <= 0) return silu_and_mul(gate_up);
  const int64_t I = gate_up.size(1) / 2;
  const auto g = gate_up.narrow(1, 0, I).clamp_max(limit);
  return ((gate_up.narrow(1, I, I).clamp(-limit, limit) + 1) * g * torch::sigmoid(g * alpha)).contiguous();
}

// every job's groups in one parallel region: threads split the groups of all experts, not each expert's
void run_groups(const std::vector<Job>& jobs) {
  std::vector<int64_t> start(jobs.size() + 1, 0);
  for (size_t j = 0; j < jobs.size(); ++j) {
    TORCH_CHECK(jobs[j].w->size(1) == jobs[j].a->nch, "moe_ggml: an expert's weight does not match its inputs");
    start[j + 1] = start[j] + (jobs[j].rows + 15) / 16;
  }
  at::parallel_for(0, start.back(), 1, [&](int64_t lo, int64_t hi) {
    size_t j = std::upper_bound(start.begin(), start.end(), lo) - start.begin() - 1;
    while (lo < hi) {
      const Job& b = jobs[j];
      const int64_t end = std::min(hi, start[j + 1]);
      x16_dot_groups(b.type, *b.w, b.rows, *b.a, b.M, b.bias, b.y, b.O, lo - start[j], end - start[j]);
      lo = end;
      ++j;
    }
  });
}

// rows `rows[0 : n]` of quantized activations (the same bits as quantizing those rows alone)
X16Act select_rows(const X16Act& all, const int64_t* rows, int64_t n) {
  X16Act a;
  a.K = all.K;
  a.nch = all.nch;
  a.q.resize(all.q.empty() ? 0 : n * a.K);  // int16 or int8 activations, whichever this CPU's dot takes
  a.q8.resize(all.q8.empty() ? 0 : n * a.K);
  a.lo.resize(all.lo.empty() ? 0 : n * a.K);
  a.hi.resize(all.hi.empty() ? 0 : n * a.K);
  a.d.resize(n * a.nch);
  a.s.resize(n * a.nch);
  a.sum.resize(n * a.nch);
  a.sum16.resize(n * a.nch * 2);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = rows[i];
    if (!a.q.empty()) std::copy_n(all.q.data() + r * a.K, a.K, a.q.data() + i * a.K);
    if (!a.q8.empty()) std::copy_n(all.q8.data() + r * a.K, a.K, a.q8.data() + i * a.K);
    if (!a.lo.empty()) std::copy_n(all.lo.data() + r * a.K, a.K, a.lo.data() + i * a.K);
    if (!a.hi.empty()) std::copy_n(all.hi.data() + r * a.K, a.K, a.hi.data() + i * a.K);
    std::copy_n(all.d.data() + r * a.nch, a.nch, a.d.data() + i * a.nch);
    std::copy_n(all.s.data() + r * a.nch, a.nch, a.s.data() + i * a.nch);
    std::copy_n(all.sum.data() + r * a.nch, a.nch, a.sum.data() + i * a.nch);
    std::copy_n(all.sum16.data() + r * a.nch * 2, a.nch * 2, a.sum16.data() + i * a.nch * 2);
  }
  return a;
}

}  // namespace

MoeExperts::MoeExperts(std::vector<torch::Tensor> gate_up_, std::vector<int64_t> gate_up_types_,
                       std::vector<int64_t> gate_up_rows_, int64_t parts_per_expert, std::vector<torch::Tensor> down_,
                       std::vector<int64_t> down_types_, std::vector<int64_t> down_rows_,
                       std::vector<torch::Tensor> gate_up_bias_, std::vector<torch::Tensor> down_bias_, double alpha_,
                       double limit_)
    : gate_up(std::move(gate_up_)), gate_up_types(std::move(gate_up_types_)), gate_up_rows(std::move(gate_up_rows_)),
      down(std::move(down_)), down_types(std::move(down_types_)), down_rows(std::move(down_rows_)),
      gate_up_bias(std::move(gate_up_bias_)), down_bias(std::move(down_bias_)), P(parts_per_expert), alpha(alpha_),
      limit(limit_) {
  const int64_t E = static_cast<int64_t>(down.size());
  TORCH_CHECK(P > 0 && static_cast<int64_t>(gate_up.size()) == E * P && gate_up_types.size() == gate_up.size() &&
                  gate_up_rows.size() == gate_up.size() && down_types.size() == down.size() &&
                  down_rows.size() == down.size(),
              "moe_ggml: ", P, " gate_up parts and one down weight per expert, each with its type and rows");
  const bool biased = !gate_up_bias.empty();
  TORCH_CHECK(gate_up_bias.size() == down_bias.size() && (!biased || static_cast<int64_t>(down_bias.size()) == E),
              "moe_ggml: biases for every expert's gate_up and down, or none");
  for (size_t e = 0; e < gate_up_bias.size(); ++e)
    TORCH_CHECK(gate_up_bias[e].scalar_type() == torch::kFloat32 && gate_up_bias[e].is_contiguous() &&
                    down_bias[e].scalar_type() == torch::kFloat32 && down_bias[e].is_contiguous(),
                "moe_ggml: biases must be contiguous fp32");
}

torch::Tensor MoeExperts::operator()(torch::Tensor x, torch::Tensor ids, torch::Tensor wts) const {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "moe_ggml: x must be [T, K] fp32");
  const int64_t E = static_cast<int64_t>(down.size());
  const bool biased = !gate_up_bias.empty();
  x = x.contiguous();
  const auto id = ids.to(torch::kInt64).contiguous();
  const auto wt = wts.to(torch::kFloat32).contiguous();
  const int64_t T = x.size(0), k = id.size(1);
  TORCH_CHECK(id.dim() == 2 && id.size(0) == T && wt.sizes() == id.sizes(), "moe_ggml: ids and wts must be [T, top_k]");
  const int64_t* idp = id.data_ptr<int64_t>();
  const float* wp = wt.data_ptr<float>();
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t i = 0; i < T * k; ++i) {
    TORCH_CHECK(idp[i] >= 0 && idp[i] < E, "moe_ggml: expert id ", idp[i], " out of [0, ", E, ")");
    ++count[idp[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
  std::vector<int64_t> rows(T * k);  // token of each pair, grouped by expert, tokens ascending (t outer)
  std::vector<float> scale(T * k);
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = idp[t * k + j], at = fill[e]++;
      rows[at] = t;
      scale[at] = wp[t * k + j];
    }
  }
  std::vector<int64_t> picked;
  for (int64_t e = 0; e < E; ++e) {
    if (count[e + 1] > count[e]) picked.push_back(e);
  }
  if (picked.empty()) return torch::zeros({T, down_rows.empty() ? 0 : down_rows[0]}, x.options());
  const int64_t O = down_rows[picked[0]];
  bool x16 = x.size(1) % 32 == 0;
  for (int64_t e : picked) {
    TORCH_CHECK(down_rows[e] == O, "moe_ggml: experts' down projections differ in outputs");
    x16 = x16 && down_types[e] >= kX16;
    for (int64_t p = e * P; p < (e + 1) * P; ++p) x16 = x16 && gate_up_types[p] >= kX16;
  }
  // per picked expert: its token ids, gathered rows, and outputs of the two stages
  std::vector<torch::Tensor> idx(E), xe(E), y(E);
  int64_t GU = 0;  // the experts' gate_up outputs (2 I), alike
  for (int64_t e : picked) {
    const int64_t lo = count[e], n = count[e + 1] - lo;
    int64_t gu_rows = 0;
    for (int64_t p = e * P; p < (e + 1) * P; ++p) gu_rows += gate_up_rows[p];
    TORCH_CHECK(GU == 0 || gu_rows == GU, "moe_ggml: experts' gate_up projections differ in outputs");
    GU = gu_rows;
    TORCH_CHECK(!biased || (gate_up_bias[e].numel() == GU && down_bias[e].numel() == O),
                "moe_ggml: expert ", e, "'s biases do not match its outputs");
    if (!x16) {
      idx[e] = torch::from_blob(rows.data() + lo, {n}, torch::kInt64);
      xe[e] = n == T && T == 1 ? x : x.index_select(0, idx[e]);  // [n, K]
    }
  }
  const int64_t pairs = T * k;
  if (x16) {  // every picked expert repacked: each stage is one parallel region over all their 16-row groups
    // the pairs' rows of both stages in one buffer each, grouped by expert (each expert's rows contiguous), the
    // tokens quantized once and each expert given its rows' quantized copies: no tensor work per expert
    const X16Act ax = x16_quantize(x.data_ptr<float>(), T, x.size(1));
    std::vector<X16Act> a(E);
    std::vector<Job> jobs;
    auto gu_all = torch::empty({pairs, GU}, x.options());
    for (int64_t e : picked) {
      const int64_t lo = count[e], n = count[e + 1] - lo;
      const X16Act* ae = &ax;  // an expert every token picked takes the batch's rows in order: ax itself
      if (n < T) ae = &(a[e] = select_rows(ax, rows.data() + lo, n));
      int64_t col0 = 0;
      for (int64_t p = e * P; p < (e + 1) * P; ++p) {
        jobs.push_back({&gate_up[p], gate_up_types[p] - kX16, gate_up_rows[p], GU, ae, n,
                        gu_all.data_ptr<float>() + lo * GU + col0,
                        biased ? gate_up_bias[e].data_ptr<float>() + col0 : nullptr});
        col0 += gate_up_rows[p];
      }
    }
    run_groups(jobs);
    jobs.clear();
    const auto act = gated(gu_all, alpha, limit);  // [pairs, I]: a row's math does not depend on its neighbours
    const int64_t I = act.size(1);
    auto y_all = torch::empty({pairs, O}, x.options());
    for (int64_t e : picked) {
      const int64_t lo = count[e], n = count[e + 1] - lo;
      a[e] = x16_quantize(act.data_ptr<float>() + lo * I, n, I);
      jobs.push_back({&down[e], down_types[e] - kX16, down_rows[e], O, &a[e], n, y_all.data_ptr<float>() + lo * O,
                      biased ? down_bias[e].data_ptr<float>() : nullptr});
    }
    run_groups(jobs);
    // (y * w) rounded, then added in the pairs' order (experts ascending): what the layer's own loop computes
    auto out = torch::zeros({T, O}, x.options());
    const auto w = torch::from_blob(scale.data(), {pairs, 1}, torch::kFloat32);
    out.index_add_(0, torch::from_blob(rows.data(), {pairs}, torch::kInt64), y_all * w);
    return out;
  }
  // a format without a repacked layout here: one expert after the other
  for (int64_t e : picked) {
    std::vector<torch::Tensor> parts(gate_up.begin() + e * P, gate_up.begin() + (e + 1) * P);
    std::vector<int64_t> types(gate_up_types.begin() + e * P, gate_up_types.begin() + (e + 1) * P);
    std::vector<int64_t> prow(gate_up_rows.begin() + e * P, gate_up_rows.begin() + (e + 1) * P);
    auto gu_e = linear_ggml_dot(xe[e], parts, types, prow, GU);  // [n, 2 I]
    if (biased) gu_e += gate_up_bias[e];
    const auto act = gated(gu_e, alpha, limit);  // [n, I]
    y[e] = linear_ggml_dot(act, {down[e]}, {down_types[e]}, {down_rows[e]}, O);  // [n, O]
    if (biased) y[e] += down_bias[e];
  }
  auto out = torch::zeros({T, O}, x.options());
  for (int64_t e : picked) {
    // (y * w) rounded, then added: what the layer's own loop computes (a fused multiply-add would round once)
    const auto w = torch::from_blob(scale.data() + count[e], {xe[e].size(0), 1}, torch::kFloat32);
    out.index_add_(0, idx[e], y[e] * w);
  }
  return out;
}

