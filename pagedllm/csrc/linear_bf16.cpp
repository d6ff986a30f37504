// y = x @ w.T (+ b) for bf16 weights and fp32 activations, every row count from 1 (decode:
// weights streamed from memory once) to a 2048-token prefill chunk.
//
// Layout: w is packed once at load as panels [P, K2, 48, 2] bf16 (K2 = ceil(K / 2)): panel p holds
// output columns 48p..48p+47, and for each pair of k the two weights of a column sit side by side,
// which is the operand layout of vdpbf16ps. One k pair of a panel = 192 contiguous bytes = three
// 512-bit vectors. x [M, K] fp32 is rounded to bf16 once per call (round to nearest even, as torch
// does); y [M, O] fp32; bias fp32 padded to P * 48; accumulation in fp32.
// Micro-kernel: R (<= 8) rows x 48 columns, 3R accumulators, per k pair 3 vector loads of w, R
// broadcasts of an x pair, 3R dot-product instructions; no horizontal sums (the fp32 packed linear's
// structure at twice the products per instruction).
// ISA paths (compile-time; the build is -march=native and keyed by the CPU's flags):
//   AVX512-BF16: vdpbf16ps;
//   AVX512F:     each bf16 pair widened to two fp32 vectors in registers, two FMAs;
//   otherwise:   scalar widening (the compiler vectorizes what it can, e.g. AVX2).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>

#include "linear_bf16.h"
#include "row_tiles.h"

namespace {

constexpr int64_t NR = 48;  // output columns per panel

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

[[maybe_unused]] inline float from_bf16(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// xp: R rows of K2 bf16 pairs (uint32 each); panel: [K2, 48, 2]; out: R rows of 48 floats
#if defined(__AVX512BF16__) && defined(__AVX512F__)
const char* kIsa = "avx512_bf16";

template <int R>
inline void tile(const uint32_t* xp, int64_t K2, const uint16_t* panel, float* out) {
  __m512 acc[R][3];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 3; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    const uint16_t* pk = panel + k * NR * 2;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(pk);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(pk + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(pk + 64);
    for (int i = 0; i < R; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[i * K2 + k]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, xv);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, xv);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], w2, xv);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 3; ++j) _mm512_storeu_ps(out + i * NR + j * 16, acc[i][j]);
}

#elif defined(__AVX512F__)
const char* kIsa = "avx512f";

template <int R>
inline void tile(const uint32_t* xp, int64_t K2, const uint16_t* panel, float* out) {
  __m512 acc[R][3];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 3; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t k = 0; k < K2; ++k) {
    const uint16_t* pk = panel + k * NR * 2;
    __m512 we[3], wo[3];  // the even-k and odd-k weights of 16 columns, widened
    for (int j = 0; j < 3; ++j) {
      const __m512i v = _mm512_loadu_si512(pk + 32 * j);
      we[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      wo[j] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
    }
    for (int i = 0; i < R; ++i) {
      const uint32_t pair = xp[i * K2 + k];
      const __m512 xe = _mm512_set1_ps(from_bf16(static_cast<uint16_t>(pair & 0xffff)));
      const __m512 xo = _mm512_set1_ps(from_bf16(static_cast<uint16_t>(pair >> 16)));
      for (int j = 0; j < 3; ++j) acc[i][j] = _mm512_fmadd_ps(wo[j], xo, _mm512_fmadd_ps(we[j], xe, acc[i][j]));
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 3; ++j) _mm512_storeu_ps(out + i * NR + j * 16, acc[i][j]);
}

#else
const char* kIsa = "generic";

template <int R>
inline void tile(const uint32_t* xp, int64_t K2, const uint16_t* panel, float* out) {
  float acc[R][NR] = {};
  for (int64_t k = 0; k < K2; ++k) {
    const uint16_t* pk = panel + k * NR * 2;
    for (int i = 0; i < R; ++i) {
      const float xe = from_bf16(static_cast<uint16_t>(xp[i * K2 + k] & 0xffff));
      const float xo = from_bf16(static_cast<uint16_t>(xp[i * K2 + k] >> 16));
      for (int64_t c = 0; c < NR; ++c) acc[i][c] += from_bf16(pk[2 * c]) * xe + from_bf16(pk[2 * c + 1]) * xo;
    }
  }
  for (int i = 0; i < R; ++i)
    for (int64_t c = 0; c < NR; ++c) out[i * NR + c] = acc[i][c];
}
#endif

template <int R>
inline void tile_out(const uint32_t* xp, int64_t K2, const uint16_t* panel, const float* bias, float* y, int64_t O,
                     int64_t cols) {
  float tmp[R * NR];
  tile<R>(xp, K2, panel, tmp);
  for (int i = 0; i < R; ++i)
    for (int64_t c = 0; c < cols; ++c) y[i * O + c] = tmp[i * NR + c] + (bias ? bias[c] : 0.f);
}

}  // namespace

const char* linear_bf16_isa() { return kIsa; }

torch::Tensor pack_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack_bf16: w must be [O, K]");
  const int64_t O = w.size(0), K = w.size(1), P = (O + NR - 1) / NR, K2 = (K + 1) / 2;
  auto wb = w.to(torch::kBFloat16).contiguous();
  auto packed = torch::zeros({P, K2, NR, 2}, wb.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wb.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, P, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p)
      for (int64_t c = 0; c < NR && p * NR + c < O; ++c)
        for (int64_t k = 0; k < K; ++k) dst[((p * K2 + k / 2) * NR + c) * 2 + k % 2] = src[(p * NR + c) * K + k];
  });
  return packed;
}

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t O) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "linear_bf16: x must be [M, K] fp32");
  TORCH_CHECK(w.dtype() == torch::kBFloat16 && w.dim() == 4 && w.size(2) == NR && w.size(3) == 2 && w.is_contiguous(),
              "linear_bf16: w must be packed [P, K2, 48, 2] bf16 (pack_bf16)");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = w.size(0), K2 = w.size(1);
  TORCH_CHECK(K2 == (K + 1) / 2 && O <= P * NR, "linear_bf16: x [", M, ", ", K, "] does not match the packed weight");
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  std::vector<uint32_t> xb(M * K2, 0);  // rows as bf16 pairs, the odd tail zero
  const float* xf = x.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m)
      for (int64_t k = 0; k < K; ++k)
        xb[m * K2 + k / 2] |= static_cast<uint32_t>(to_bf16(xf[m * K + k])) << (16 * (k % 2));
  });
  auto y = torch::empty({M, O}, x.options());
  float* yp = y.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  // work item = (block of MB rows, panel), row blocks outermost: the threads sweep the panels over one
  // block of x at a time, so it stays in L2 instead of streaming all of x once per panel
  constexpr int64_t MB = 128;
  const int64_t nmb = (M + MB - 1) / MB;
  at::parallel_for(0, nmb * P, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t p = item % P, m_lo = (item / P) * MB, m_hi = std::min(M, m_lo + MB);
      const uint16_t* panel = wp + p * K2 * NR * 2;
      const float* pb = b ? b + p * NR : nullptr;
      const int64_t c0 = p * NR, cols = std::min(NR, O - c0);
      for_row_tiles(m_lo, m_hi, [&](int64_t m, auto R) {
        tile_out<decltype(R)::value>(xb.data() + m * K2, K2, panel, pb, yp + m * O + c0, O, cols);
      });
    }
  });
  return y;
}
