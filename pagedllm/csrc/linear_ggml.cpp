// y = x @ w.T (+ b) with w in ggml's quantized block formats (ggml_blocks.h), read as the GGUF file
// stores them: w is one or more parts [O_i, row_bytes_i] uint8 stacked along the outputs (a fused
// q/k/v may mix formats), each row K / QK blocks. x [M, K] fp32, y [M, sum O_i] fp32.
//
// Decode-sized batches (M < kDotRowsMax): the integer dot product, the way ggml pairs each type
// with an int8 `vec_dot_type`. Each activation row is quantized per 32 values to int8 with an fp32
// scale da (and the sums da * sum(q) per 16, for the formats' offsets); per weight chunk of 32 the
// quants are unpacked once into a register and multiplied with up to 4 activation rows:
//   sum_i w_i x_i ~= sum_chunks [ d * da * sum_i q_i qa_i ] + m * (da * sum_i qa_i)
// Weights are streamed once per call; the work is split over output rows.
// Prefill-sized batches: a panel of 48 output rows is dequantized to bf16 (ggml's fp32 values,
// rounded once) into a thread-local buffer and multiplied on the bf16 micro-kernel (bf16_tile.h),
// so the quantized weights cost their dequantization once per panel, not once per row of x.
// ISA paths of the integer dot (compile-time; -march=native, build keyed by the CPU's flags):
//   AVX512-VNNI (+VL) or AVX-VNNI: vpdpbusd on 256-bit vectors (u8 x s8 -> int32, no saturation);
//   AVX2: vpmaddubsw + vpmaddwd (u8 quants are <= 63, or the Q8_0 sign trick, so int16 never saturates);
//   otherwise: scalar integer loops.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

#include "bf16_tile.h"
#include "ggml_blocks.h"
#include "linear_ggml.h"
#include "row_tiles.h"

namespace {

constexpr int64_t kDotRowsMax = 16;  // measured (docs/bench/linear_microbench.py --ggml): bf16 tiles win above

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
const char* kIsa = "avx512_vnni";
inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
#else
const char* kIsa = "avx_vnni";
inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s); }
#endif
#elif defined(__AVX2__)
const char* kIsa = "avx2";
inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#else
const char* kIsa = "generic";
#endif

// Activation rows quantized per 32: q int8 [M, K], d [M, K / 32], s [M, K / 16] = d * sum(q) per 16
struct QAct {
  int64_t K, nch;
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

QAct quantize_rows(const float* x, int64_t M, int64_t K) {
  QAct a{K, K / 32, std::vector<int8_t>(M * K), std::vector<float>(M * (K / 32)), std::vector<float>(M * (K / 16))};
  at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m)
      for (int64_t g = 0; g < a.nch; ++g) {
        const float* xs = x + m * K + 32 * g;
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xs[i]));
        const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int8_t* q = a.q.data() + m * K + 32 * g;
        int s0 = 0, s1 = 0;
        for (int i = 0; i < 32; ++i) {
          q[i] = static_cast<int8_t>(std::nearbyint(xs[i] * id));
          (i < 16 ? s0 : s1) += q[i];
        }
        a.d[m * a.nch + g] = d;
        a.s[(m * a.nch + g) * 2] = d * static_cast<float>(s0);
        a.s[(m * a.nch + g) * 2 + 1] = d * static_cast<float>(s1);
      }
  });
  return a;
}

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// y[t0 + t, n] for n in [n_lo, n_hi), t < T: each weight chunk unpacked once, used by T activation rows
template <class F, int T>
void dot_rows(const uint8_t* w, int64_t row_bytes, int64_t n_lo, int64_t n_hi, const QAct& a, int64_t t0,
              const float* bias, float* y, int64_t O) {
  constexpr int CPB = F::QK / 32;
  const int64_t nb = a.K / F::QK, K = a.K, nch = a.nch;
  for (int64_t n = n_lo; n < n_hi; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float off[T] = {};
#if defined(__AVX2__)
    __m256 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
#else
    float acc[T] = {};
#endif
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * F::BYTES;
      for (int c = 0; c < CPB; ++c) {
        const int64_t g = b * CPB + c;
        float d[2], m[2];
        F::scales(blk, c, d, m);
#if defined(__AVX2__)
        const __m256i q = F::quants256(blk, c);
        const __m256i qu = F::kSigned ? _mm256_sign_epi8(q, q) : q;  // |q| for the sign trick
        for (int t = 0; t < T; ++t) {
          __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (t0 + t) * K + 32 * g));
          if constexpr (F::kSigned) av = _mm256_sign_epi8(av, q);
          const __m256 prod = _mm256_cvtepi32_ps(dot_u8s8(qu, av));  // lanes 0-3: weights 0-15, 4-7: 16-31
          const float da = a.d[(t0 + t) * nch + g];
          const __m256 sc = F::kSplit ? _mm256_set_m128(_mm_set1_ps(d[1] * da), _mm_set1_ps(d[0] * da))
                                      : _mm256_set1_ps(d[0] * da);
          acc[t] = _mm256_fmadd_ps(prod, sc, acc[t]);
          if constexpr (!F::kSigned) off[t] += m[0] * a.s[((t0 + t) * nch + g) * 2] + m[1] * a.s[((t0 + t) * nch + g) * 2 + 1];
        }
#else
        uint8_t q[32];
        F::quants(blk, c, q);
        for (int t = 0; t < T; ++t) {
          const int8_t* av = a.q.data() + (t0 + t) * K + 32 * g;
          int s0 = 0, s1 = 0;
          for (int i = 0; i < 32; ++i) {
            const int qi = F::kSigned ? static_cast<int8_t>(q[i]) : q[i];
            (i < 16 ? s0 : s1) += qi * av[i];
          }
          const float da = a.d[(t0 + t) * nch + g];
          acc[t] += (d[0] * s0 + d[1] * s1) * da;
          if constexpr (!F::kSigned) off[t] += m[0] * a.s[((t0 + t) * nch + g) * 2] + m[1] * a.s[((t0 + t) * nch + g) * 2 + 1];
        }
#endif
      }
    }
    for (int t = 0; t < T; ++t) {
#if defined(__AVX2__)
      const float s = hsum(acc[t]);
#else
      const float s = acc[t];
#endif
      y[(t0 + t) * O + n] = s + off[t] + (bias ? bias[n] : 0.f);
    }
  }
}

template <class F>
void dequantize_row(const uint8_t* row, int64_t K, float* out) {
  constexpr int CPB = F::QK / 32;
  for (int64_t b = 0; b < K / F::QK; ++b)
    for (int c = 0; c < CPB; ++c) {
      float d[2], m[2];
      uint8_t q[32];
      F::scales(row + b * F::BYTES, c, d, m);
      F::quants(row + b * F::BYTES, c, q);
      float* o = out + (b * CPB + c) * 32;
      for (int i = 0; i < 32; ++i) {
        const float qi = F::kSigned ? static_cast<float>(static_cast<int8_t>(q[i])) : static_cast<float>(q[i]);
        o[i] = d[i / 16] * qi + m[i / 16];
      }
    }
}

// y[:, col0 : col0 + rows of w] for one part; a is x quantized (decode-sized M) or xb its bf16 pairs
template <class F>
void linear_part(const QAct* a, const std::vector<uint32_t>* xb, int64_t M, int64_t K, const torch::Tensor& w,
                 const float* bias, float* y, int64_t O, int64_t col0) {
  const int64_t rows = w.size(0), row_bytes = w.size(1);
  TORCH_CHECK(K % F::QK == 0 && row_bytes == K / F::QK * F::BYTES,
              "linear_ggml: x [", M, ", ", K, "] does not match a weight of rows of ", row_bytes, " bytes");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yc = y + col0;
  const float* bc = bias ? bias + col0 : nullptr;
  if (a != nullptr) {
    at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
      int64_t t = 0;
      for (; t + 4 <= M; t += 4) dot_rows<F, 4>(wp, row_bytes, lo, hi, *a, t, bc, yc, O);
      switch (M - t) {
        case 3: dot_rows<F, 3>(wp, row_bytes, lo, hi, *a, t, bc, yc, O); break;
        case 2: dot_rows<F, 2>(wp, row_bytes, lo, hi, *a, t, bc, yc, O); break;
        case 1: dot_rows<F, 1>(wp, row_bytes, lo, hi, *a, t, bc, yc, O); break;
        default: break;
      }
    });
    return;
  }
  using bf16::NR;
  const int64_t K2 = (K + 1) / 2, P = (rows + NR - 1) / NR;
  at::parallel_for(0, P, 1, [&](int64_t lo, int64_t hi) {
    std::vector<uint16_t> panel(K2 * NR * 2, 0);
    std::vector<float> row(K);
    for (int64_t p = lo; p < hi; ++p) {
      const int64_t c0 = p * NR, cols = std::min(NR, rows - c0);
      for (int64_t c = 0; c < NR; ++c) {
        if (c < cols) {
          dequantize_row<F>(wp + (c0 + c) * row_bytes, K, row.data());
        } else {
          std::fill(row.begin(), row.end(), 0.f);
        }
        for (int64_t k = 0; k < K; ++k) panel[((k / 2) * NR + c) * 2 + k % 2] = bf16::to_bf16(row[k]);
      }
      const float* pb = bc ? bc + c0 : nullptr;
      for_row_tiles(0, M, [&](int64_t m, auto R) {
        bf16::tile_out<decltype(R)::value>(xb->data() + m * K2, K2, panel.data(), pb, yc + m * O + c0, O, cols);
      });
    }
  });
}

template <class F>
torch::Tensor dequantize(const torch::Tensor& w, int64_t K) {
  const int64_t R = w.size(0), row_bytes = w.size(1);
  TORCH_CHECK(K % F::QK == 0 && row_bytes == K / F::QK * F::BYTES, "dequantize_ggml: rows of ", row_bytes,
              " bytes do not hold ", K, " weights");
  auto out = torch::empty({R, K}, torch::kFloat32);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) dequantize_row<F>(wp + r * row_bytes, K, op + r * K);
  });
  return out;
}

// ggml type ids (ggml.h): the formats executed in place
template <class Fn>
auto dispatch(int64_t type, Fn&& fn) {
  switch (type) {
    case 2: return fn(ggml::Q4_0{});
    case 3: return fn(ggml::Q4_1{});
    case 6: return fn(ggml::Q5_0{});
    case 7: return fn(ggml::Q5_1{});
    case 8: return fn(ggml::Q8_0{});
    case 12: return fn(ggml::Q4_K{});
    case 13: return fn(ggml::Q5_K{});
    case 14: return fn(ggml::Q6_K{});
    default: break;
  }
  TORCH_CHECK(false, "ggml type ", type, " has no kernel (executed: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K)");
  return fn(ggml::Q8_0{});  // unreachable
}

void check_weight(const torch::Tensor& w) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "ggml weight must be a contiguous uint8 [rows, row_bytes] tensor");
}

}  // namespace

const char* linear_ggml_isa() { return kIsa; }

torch::Tensor linear_ggml(torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> types,
                          c10::optional<torch::Tensor> bias, int64_t O) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "linear_ggml: x must be [M, K] fp32");
  TORCH_CHECK(ws.size() == types.size() && !ws.empty(), "linear_ggml: one type per weight part");
  int64_t rows = 0;
  for (const auto& w : ws) {
    check_weight(w);
    rows += w.size(0);
  }
  TORCH_CHECK(rows == O, "linear_ggml: the parts have ", rows, " rows, not ", O);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  TORCH_CHECK(!bias.has_value() || bias->numel() == O, "linear_ggml: bias must have O values");
  auto y = torch::empty({M, O}, x.options());
  // activations prepared once for all parts: int8 per 32 for the dot, bf16 pairs for the panel path
  QAct a{};
  std::vector<uint32_t> xb;
  const bool dot = M < kDotRowsMax;
  if (K % 32 == 0 && dot) a = quantize_rows(x.data_ptr<float>(), M, K);
  if (!dot) xb = bf16::pairs(x.data_ptr<float>(), M, K);
  int64_t col0 = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    dispatch(types[i], [&](auto f) {
      linear_part<decltype(f)>(dot ? &a : nullptr, &xb, M, K, ws[i], b, y.data_ptr<float>(), O, col0);
      return 0;
    });
    col0 += ws[i].size(0);
  }
  return y;
}

torch::Tensor dequantize_ggml(torch::Tensor w, int64_t type, int64_t K) {
  check_weight(w);
  return dispatch(type, [&](auto f) { return dequantize<decltype(f)>(w, K); });
}
