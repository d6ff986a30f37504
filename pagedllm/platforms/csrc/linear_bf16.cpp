// y = x @ w.T (+ b) for bf16 weights and fp32 activations, every row count from 1 (decode:
// weights streamed from memory once) to a 2048-token prefill chunk.
//
// Layout: w is packed once at load as panels [P, K2, 48, 2] bf16 (K2 = ceil(K / 2)): panel p holds
// output columns 48p..48p+47, and for each pair of k the two weights of a column sit side by side,
// which is the operand layout of vdpbf16ps. One k pair of a panel = 192 contiguous bytes = three
// 512-bit vectors. x [M, K] fp32 is rounded to bf16 once per call (round to nearest even, as torch
// does); y [M, O] fp32; bias fp32 padded to P * 48; accumulation in fp32.
// Micro-kernel and its ISA paths (AMX-BF16 tiles: bf16_amx.h; AVX512-BF16, AVX512F widening, generic):
// bf16_tile.h.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <cstring>

#include "bf16_tile.h"
#include "huge_pages.h"
#include "linear_bf16.h"
#include "vec16.h"

using bf16::NR;

const char* linear_bf16_isa() { return amx::usable() ? "amx_bf16" : bf16::kIsa; }

torch::Tensor pack_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack_bf16: w must be [O, K]");
  const int64_t O = w.size(0), K = w.size(1), P = (O + NR - 1) / NR, K2 = (K + 1) / 2;
  auto wb = w.to(torch::kBFloat16).contiguous();
  auto packed = zeros_on_huge_pages({P, K2, NR, 2}, wb.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wb.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, P, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p)
      for (int64_t c = 0; c < NR && p * NR + c < O; ++c)
        for (int64_t k = 0; k < K; ++k) dst[((p * K2 + k / 2) * NR + c) * 2 + k % 2] = src[(p * NR + c) * K + k];
  });
  return packed;
}

// work items = (block of MB rows, panel or pair of panels), row blocks outermost: the threads sweep the panels
// over one block of x at a time, so it stays in L2 instead of streaming all of x once per panel
constexpr int64_t MB = 128;

// What both entry points need: checked arguments, x as bf16 pairs, the raw weight and bias pointers
struct Call {
  bf16::Pairs xb;
  const uint16_t* w;
  const float* bias;
  int64_t M, K2, P, nmb;
};

static Call prepare(torch::Tensor x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias, int64_t O) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "linear_bf16: x must be [M, K] fp32");
  TORCH_CHECK(w.dtype() == torch::kBFloat16 && w.dim() == 4 && w.size(2) == NR && w.size(3) == 2 && w.is_contiguous(),
              "linear_bf16: w must be packed [P, K2, 48, 2] bf16 (pack_bf16)");
  const int64_t M = x.size(0), K = x.size(1), P = w.size(0), K2 = w.size(1);
  TORCH_CHECK(K2 == (K + 1) / 2 && O <= P * NR, "linear_bf16: x [", M, ", ", K, "] does not match the packed weight");
  x = x.contiguous();
  return Call{bf16::pairs(x.data_ptr<float>(), M, K), reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
              bias.has_value() ? bias->data_ptr<float>() : nullptr, M, K2, P, (M + MB - 1) / MB};
}

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t O) {
  const Call c = prepare(x, w, bias, O);
  auto y = torch::empty({c.M, O}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, c.nmb * c.P, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t p = item % c.P, m_lo = (item / c.P) * MB, m_hi = std::min(c.M, m_lo + MB);
      const int64_t c0 = p * NR, cols = std::min(NR, O - c0);
      bf16::rows_out(c.xb, m_lo, m_hi, c.w + p * c.K2 * NR * 2, c.bias ? c.bias + c0 : nullptr, yp + c0, O, cols);
    }
  });
  return y;
}

// The MLP's gate_up linear and silu(gate) * up in one pass: w holds [gate | up] (O = 2I outputs, I a multiple of
// 48), so gate panel j and up panel j + P / 2 cover the same 48 intermediate columns; an item computes both for
// its rows into two small buffers (L1) and writes only the activation. The [M, 2I] fp32 product is never
// stored and read back: at a 2048-token chunk that was 25 MB a layer, plus a second pass over it.
torch::Tensor linear_bf16_silu_mul(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t O) {
  TORCH_CHECK(w.dim() == 4 && O == w.size(0) * NR && w.size(0) % 2 == 0,
              "linear_bf16_silu_mul: the gate and up halves must be whole panels (O / 2 a multiple of 48)");
  const Call c = prepare(x, w, bias, O);
  const int64_t half = c.P / 2, I = O / 2;
  auto y = torch::empty({c.M, I}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, c.nmb * half, 1, [&](int64_t lo, int64_t hi) {
    auto gate = bf16::aligned<float>(MB * NR), up = bf16::aligned<float>(MB * NR);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t j = item % half, m_lo = (item / half) * MB, m_hi = std::min(c.M, m_lo + MB);
      // rows_out writes row m at y + m * O: offset so that row m_lo lands on the buffers' first row
      for (auto [p, buf] : {std::pair{j, gate.get()}, std::pair{j + half, up.get()}})
        bf16::rows_out(c.xb, m_lo, m_hi, c.w + p * c.K2 * NR * 2, c.bias ? c.bias + p * NR : nullptr, buf - m_lo * NR,
                       NR, NR);
      for (int64_t m = m_lo; m < m_hi; ++m)
        vec::silu_mul(gate.get() + (m - m_lo) * NR, up.get() + (m - m_lo) * NR, yp + m * I + j * NR, NR);
    }
  });
  return y;
}
