// CPU kernels for the fp32 hot paths: a linear over panel-packed weights (its micro-kernel and ISA paths:
// f32_tile.h), fused RMSNorm (+ residual
// add), rotary embedding, silu_and_mul, and a row argmax; the Python bindings of every op (attention:
// attention.cpp, integer KV writes: kv_quant.cpp, other weight formats: linear_bf16.cpp / linear_ggml.cpp /
// linear_x16.cpp, experts: moe.cpp, grammar masks: mask_rows.cpp, linear attention: gated_delta_net.cpp).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "f32_tile.h"
#include "gated_delta_net.h"
#include "kv_quant.h"
#include "linear_bf16.h"
#include "linear_ggml.h"
#include "mask_rows.h"
#include "moe.h"
#include "row_tiles.h"
#include "vec16.h"

constexpr int64_t NR = f32::NR;

// y [M, O] = x [M, K] w^T + b, with w packed [P, 48 / SW, K, SW] (f32_tile.h's strips) and b padded to P * 48.
// One task = one panel.
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t O) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 4 && w.size(1) * w.size(3) == NR && x.size(1) == w.size(2) &&
              w.is_contiguous(), "packed_linear: expects x [M, K] and a packed weight [P, 48 / SW, K, SW]");
  TORCH_CHECK(w.size(3) == f32::SW, "packed_linear: the weight is packed in strips of ", w.size(3),
              " columns; this build's kernel reads strips of ", f32::SW, " (pack it with this build's f32_strip)");
  TORCH_CHECK(O <= w.size(0) * NR, "packed_linear: more outputs than panels");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = w.size(0);
  auto out = torch::empty({M, O}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = wp + p * K * NR;
      const float* pb = bp ? bp + p * NR : nullptr;
      const int64_t c0 = p * NR, cols = std::min(NR, O - c0);
      f32::rows(xp, K, M, K, panel, pb, op + c0, O, cols);
    }
  });
  return out;
}


// silu(gate) * up for gate_up = [gate | up] rows: one pass instead of three (silu, chunk, mul)
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: expects [M, 2 * I]");
  gate_up = gate_up.contiguous();
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({M, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* g = gp + m * 2 * I;
      vec::silu_mul(g, g + I, op + m * I, I);
    }
  });
  return out;
}

// RMSNorm of each row of x, times w. With `residual`: residual += x first (in place), and the
// norm is taken of the sum, the pre-norm residual stream of a decoder layer in one pass.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.size(0) == x.size(1), "rms_norm: expects contiguous [M, N]");
  const int64_t M = x.size(0), N = x.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* rp = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "rms_norm: residual must match x");
    rp = residual->data_ptr<float>();
  }
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* src = xp + m * N;
      if (rp) {
        float* r = rp + m * N;
        for (int64_t i = 0; i < N; ++i) r[i] += src[i];
        src = r;
      }
      float ss = 0.f;
      for (int64_t i = 0; i < N; ++i) ss += src[i] * src[i];
      const float inv = 1.f / std::sqrt(ss / N + static_cast<float>(eps));
      float* o = op + m * N;
      for (int64_t i = 0; i < N; ++i) o[i] = src[i] * inv * wp[i];
    }
  });
  return out;
}

// Index of the first maximum of each row (torch.argmax), one row per task.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "argmax_rows: expects [M, N] with contiguous rows");
  const int64_t M = x.size(0), N = x.size(1);
  auto out = torch::empty({M}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* r = xp + m * x.stride(0);
      float best = r[0];
      int64_t idx = 0;
      for (int64_t i = 1; i < N; ++i)
        if (r[i] > best) {
          best = r[i];
          idx = i;
        }
      op[m] = idx;
    }
  });
  return out;
}

// silu(gate) * up of a [gate | up] ggml linear in one call: a decode step of a small model makes ~240 op calls, and
// the Python between two of them costs more than this op's own pass over [M, 2 I]
torch::Tensor linear_ggml_silu_mul(torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> types,
                                   std::vector<int64_t> rows, c10::optional<torch::Tensor> bias, int64_t O,
                                   int64_t decode_rows) {
  return silu_and_mul(linear_ggml(x, std::move(ws), std::move(types), std::move(rows), bias, O, decode_rows));
}

// A layer's norm (after residual += x, in place) and the ggml projection it feeds, then silu(gate) * up where asked:
// one op call where there were two or three
torch::Tensor linear_ggml_normed(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor norm_w,
                                 double eps, std::vector<torch::Tensor> ws, std::vector<int64_t> types,
                                 std::vector<int64_t> rows, c10::optional<torch::Tensor> bias, int64_t O,
                                 int64_t decode_rows, bool silu) {
  torch::Tensor y = linear_ggml(rms_norm(x, norm_w, eps, residual), std::move(ws), std::move(types), std::move(rows),
                                bias, O, decode_rows);
  return silu ? silu_and_mul(y) : y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mask_rows_", &mask_rows_, "logits[r, t] = -inf where bit t of bitmask[r] is clear, rows in place (fp32, CPU)");
  m.def("quantize_kv_", &quantize_kv_, "rows [T, KVH, D] quantized into a q8_0 / q4_0 pool at slots (CPU)");
  m.def("quantize_fp8_kv_", &quantize_fp8_kv_, "rows [T, KVH, D] quantized into an fp8 pool and its scales at slots (CPU)",
        py::arg("pool"), py::arg("scales"), py::arg("slots"), py::arg("x"), py::arg("e5m2"));
  m.def("rms_norm", &rms_norm, "RMSNorm of rows, optionally after residual += x (fp32, CPU)");
  m.def("rope_", &rope_, "rotary embedding in place on the leading heads of qkv rows (fp32, CPU)");
  m.def("argmax_rows", &argmax_rows, "first argmax of each row (fp32, CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :I]) * x[:, I:] (fp32, CPU)");
  m.def("paged_attention", &paged_attention, "attention over a paged KV pool (fp32, bf16 or fp8 pool; fp32 math; CPU)",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("row_seq"), py::arg("q_start"), py::arg("q_len"), py::arg("ctx_len"), py::arg("scale"),
        py::arg("window"), py::arg("k_scale"), py::arg("v_scale"), py::arg("lut"), py::arg("sinks") = py::none());
  m.def("attention_qkv", &attention_qkv, "rope on q/k of qkv rows, their K/V written to an fp32 or bf16 pool, the "
        "first num_paged rows attended over the pool, prefill chunks of a bf16 pool too; returns [T, H, D] (CPU)",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"),
        py::arg("num_heads"), py::arg("num_paged"), py::arg("block_tables"), py::arg("row_seq"), py::arg("q_start"),
        py::arg("q_len"), py::arg("ctx_len"), py::arg("scale"), py::arg("window"), py::arg("chunk_tables"),
        py::arg("chunk_q_start"), py::arg("chunk_q_len"), py::arg("chunk_ctx_len"), py::arg("chunk_scratch"),
        py::arg("sinks") = py::none());
  m.def("shared_prefix_groups", &shared_prefix_groups, "the (shared keys, rows) groups paged_attention forms over a "
        "bf16 pool");
  m.def("attend_chunks", &attend_chunks, "prefill chunks attended over a bf16, fp8 or q8_0 / q4_0 paged pool on bf16 dot "
        "products, or over an fp32 pool on fp32 tiles (CPU)",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("q_start"), py::arg("q_len"), py::arg("ctx_len"), py::arg("scale"), py::arg("window"),
        py::arg("scratch"), py::arg("sinks") = py::none(), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), py::arg("lut") = py::none());
  m.def("pack_bf16", &pack_bf16, "[O, K] -> bf16 panels [P, K/2, 48, 2] for linear_bf16");
  m.def("linear_bf16", &linear_bf16, "x @ w.T (+ b), w bf16 packed by pack_bf16, x and y fp32 (CPU)");
  m.def("linear_bf16_silu_mul", &linear_bf16_silu_mul, "silu(gate) * up of x @ [gate | up].T (+ b), w packed by "
        "pack_bf16 with O / 2 a multiple of 48; [M, O / 2] fp32 (CPU)");
  m.def("linear_bf16_isa", &linear_bf16_isa, "the instruction set linear_bf16 was compiled for");
  m.def("linear_ggml", &linear_ggml, "x @ w.T (+ b), w in a ggml block format as GGUF stores it, x and y fp32 (CPU); "
        "decode_rows: x's leading single-token decode rows, which choose the path (-1: by M)",
        py::arg("x"), py::arg("ws"), py::arg("types"), py::arg("rows"), py::arg("bias"), py::arg("O"),
        py::arg("decode_rows") = -1);
  m.def("linear_ggml_silu_mul", &linear_ggml_silu_mul, "silu(gate) * up of linear_ggml's [M, O] (O = 2 I): [M, I]",
        py::arg("x"), py::arg("ws"), py::arg("types"), py::arg("rows"), py::arg("bias"), py::arg("O"),
        py::arg("decode_rows") = -1);
  m.def("linear_ggml_normed", &linear_ggml_normed, "linear_ggml of rms_norm(x) (x added into residual first, in "
        "place), silu(gate) * up of it where silu",
        py::arg("x"), py::arg("residual"), py::arg("norm_w"), py::arg("eps"), py::arg("ws"), py::arg("types"),
        py::arg("rows"), py::arg("bias"), py::arg("O"), py::arg("decode_rows"), py::arg("silu"));
  m.def("dequantize_ggml", &dequantize_ggml, "rows of a ggml block format (or repacked) -> fp32 [rows or ids, K]");
  m.def("ggml_repacks", &ggml_repacks, "whether this CPU runs a ggml type repacked into 16-row groups");
  m.def("repack_ggml", &repack_ggml, "[O, row_bytes] -> 16-row groups [ceil(O / 16), K / 32, bytes] (Q4_0 Q4_1 Q8_0)");
  m.def("linear_ggml_isa", &linear_ggml_isa, "the instruction set linear_ggml's integer dot was compiled for");
  // module_local: the fallback-ISA builds (tests) load beside this one, each with its own MoeExperts
  py::class_<MoeExperts>(m, "MoeExperts", py::module_local(),
                         "a MoE layer's ggml-format experts held once; call with (x, ids, wts)")
      .def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<int64_t>, int64_t,
                    std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<int64_t>, std::vector<torch::Tensor>,
                    std::vector<torch::Tensor>, double, double>())
      .def("__call__", &MoeExperts::operator());
  m.def("gated_delta_decode", &gated_delta_decode, "one decode token a sequence through a Gated DeltaNet layer's "
        "conv, state update and output gate, states in place (fp32, CPU)");
  m.def("packed_linear", &packed_linear, "x @ w.T (+ b) with w packed in 48-column panels (fp32, CPU)");
  m.def("f32_strip", [] { return f32::SW; }, "the columns of one strip of packed_linear's panels on this build");
}
