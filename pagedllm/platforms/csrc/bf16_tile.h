// The bf16 panel micro-kernel, shared by linear_bf16.cpp (weights packed once at load) and
// linear_ggml.cpp (quantized weights dequantized a panel at a time for prefill-sized batches).
// Panel layout [K2, 48, 2] bf16: for each pair of k the two weights of a column side by side, the
// operand layout of vdpbf16ps. R (<= 8) rows x 48 columns, 3R fp32 accumulators.
// rows_out() is the entry point: AMX-BF16 tiles (bf16_amx.h) where built and granted by the kernel and K is
// a multiple of 32; else the micro-kernel, whose
// ISA paths (compile-time; -march=native, build keyed by the CPU's flags) are:
//   AVX512-BF16: vdpbf16ps;  AVX512F: bf16 pairs widened to fp32 in registers, two FMAs;
//   AVX2 + FMA: the same widening in sub-tiles that fit 16 ymm registers (1 row x 48 columns, 2 x 24, 3-4 x 16);
//   otherwise: scalar widening.
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include <ATen/Parallel.h>

#include "bf16_amx.h"
#include "row_tiles.h"
#include "vec16.h"

namespace bf16 {

inline constexpr int64_t NR = 48;  // output columns per panel

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

// xp: R rows of K2 bf16 pairs (uint32 each), ldx pairs apart; panel: [K2, 48, 2]; out: R rows of 48 floats
#if defined(__AVX512BF16__) && defined(__AVX512F__)
inline constexpr const char* kIsa = "avx512_bf16";

template <int R>
inline void tile(const uint32_t* xp, int64_t ldx, int64_t K2, const uint16_t* panel, float* out) {
  __m512 acc[R][3];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 3; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    const uint16_t* pk = panel + k * NR * 2;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(pk);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(pk + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(pk + 64);
    for (int i = 0; i < R; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[i * ldx + k]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, xv);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, xv);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], w2, xv);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 3; ++j) _mm512_storeu_ps(out + i * NR + j * 16, acc[i][j]);
}

#elif defined(__AVX512F__)
inline constexpr const char* kIsa = "avx512f";

template <int R>
inline void tile(const uint32_t* xp, int64_t ldx, int64_t K2, const uint16_t* panel, float* out) {
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
      const uint32_t pair = xp[i * ldx + k];
      const __m512 xe = _mm512_set1_ps(from_bf16(static_cast<uint16_t>(pair & 0xffff)));
      const __m512 xo = _mm512_set1_ps(from_bf16(static_cast<uint16_t>(pair >> 16)));
      for (int j = 0; j < 3; ++j) acc[i][j] = _mm512_fmadd_ps(wo[j], xo, _mm512_fmadd_ps(we[j], xe, acc[i][j]));
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 3; ++j) _mm512_storeu_ps(out + i * NR + j * 16, acc[i][j]);
}

#elif defined(__AVX2__) && defined(__FMA__)
inline constexpr const char* kIsa = "avx2";

// R rows x C 8-column vectors from column c0, widened like the AVX512F path. 3-4 rows: the C vectors' even-k and
// odd-k weights held while each row's two x values come and go; 1-2 rows: each row's x values held while the
// weights come and go (one row keeps all 48 columns: decode streams the panel once). Either way the
// accumulators, operands and the mask fit the 16 ymm registers.
template <int R, int C>
inline void sub_tile(const uint32_t* xp, int64_t ldx, int64_t K2, const uint16_t* panel, int64_t c0, float* out) {
  static_assert(R * C + (R <= 2 ? 2 * R + 2 : 2 * C + 2) + 1 <= 16, "the tile must fit the 16 ymm registers");
  __m256 acc[R][C];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_ps();
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  auto even = [&](__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); };
  auto odd = [&](__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, hi)); };
  auto weights = [](const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  const uint16_t* pk = panel + 2 * c0;
  for (int64_t k = 0; k < K2; ++k, pk += NR * 2) {
    if constexpr (R <= 2) {
      __m256 xe[R], xo[R];
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m256i pair = _mm256_set1_epi32(static_cast<int>(xp[i * ldx + k]));
        xe[i] = even(pair);
        xo[i] = odd(pair);
      }
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) {
        const __m256i v = weights(pk + 16 * j);
        const __m256 we = even(v), wo = odd(v);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(wo, xo[i], _mm256_fmadd_ps(we, xe[i], acc[i][j]));
      }
    } else {
      __m256 we[C], wo[C];
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) {
        const __m256i v = weights(pk + 16 * j);
        we[j] = even(v);
        wo[j] = odd(v);
      }
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m256i pair = _mm256_set1_epi32(static_cast<int>(xp[i * ldx + k]));
        const __m256 xe = even(pair), xo = odd(pair);
#pragma GCC unroll 8
        for (int j = 0; j < C; ++j) acc[i][j] = _mm256_fmadd_ps(wo[j], xo, _mm256_fmadd_ps(we[j], xe, acc[i][j]));
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) _mm256_storeu_ps(out + i * NR + c0 + 8 * j, acc[i][j]);
}

// R rows in sub-tiles of up to 4 rows across the panel's 48 columns: 1 row x 48, 2 x 24, 3-4 x 16
template <int R>
inline void tile(const uint32_t* xp, int64_t ldx, int64_t K2, const uint16_t* panel, float* out) {
  if constexpr (R > 4) {
    tile<4>(xp, ldx, K2, panel, out);
    tile<R - 4>(xp + 4 * ldx, ldx, K2, panel, out + 4 * NR);
  } else {
    constexpr int C = R == 1 ? 6 : R == 2 ? 3 : 2;
    for (int64_t c0 = 0; c0 < NR; c0 += 8 * C) sub_tile<R, C>(xp, ldx, K2, panel, c0, out);
  }
}

#else
inline constexpr const char* kIsa = "generic";

template <int R>
inline void tile(const uint32_t* xp, int64_t ldx, int64_t K2, const uint16_t* panel, float* out) {
  float acc[R][NR] = {};
  for (int64_t k = 0; k < K2; ++k) {
    const uint16_t* pk = panel + k * NR * 2;
    for (int i = 0; i < R; ++i) {
      const float xe = from_bf16(static_cast<uint16_t>(xp[i * ldx + k] & 0xffff));
      const float xo = from_bf16(static_cast<uint16_t>(xp[i * ldx + k] >> 16));
      for (int64_t c = 0; c < NR; ++c) acc[i][c] += from_bf16(pk[2 * c]) * xe + from_bf16(pk[2 * c + 1]) * xo;
    }
  }
  for (int i = 0; i < R; ++i)
    for (int64_t c = 0; c < NR; ++c) out[i * NR + c] = acc[i][c];
}
#endif

// n elements of T on a 64-byte boundary (tile loads split across cache lines otherwise), uninitialized
template <class T>
using Aligned = std::unique_ptr<T, decltype(&std::free)>;
template <class T>
inline Aligned<T> aligned(int64_t n) {
  const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T) + 63) / 64 * 64;
  return Aligned<T>(static_cast<T*>(std::aligned_alloc(64, bytes)), &std::free);
}

// x [M, K] fp32 -> rows of ceil(K / 2) bf16 pairs: a row's pair k is (x[2k], x[2k + 1]), so in memory the
// row is just x's row in bf16 (round to nearest even, as torch does; a NaN stays NaN), an odd K's tail zero.
// Rows 64 bytes aligned and, where the AMX tiles will read them (amx), zero rows after the last to a
// multiple of 16: a tile always loads 16.
struct Pairs {
  int64_t K2 = 0;
  bool amx = false;
  Aligned<uint32_t> buf{nullptr, &std::free};
  const uint32_t* data() const { return buf.get(); }
};

// 16 floats a vector: the scalar loop this replaced cost more than the matmul's own panels at K = 1536.
inline Pairs pairs(const float* xf, int64_t M, int64_t K) {
  Pairs xb;
  xb.K2 = (K + 1) / 2;
  const int64_t K2 = xb.K2;
  // AMX from one row: at one row it ties the micro-kernel (docs/bench/amx_microbench.py), and one path for
  // every row count keeps a row's sums the same whatever the batch (greedy tokens do not change with it)
  xb.amx = K2 % 16 == 0 && amx::usable();
  const int64_t padded = xb.amx ? (M + 15) / 16 * 16 : M;
  xb.buf = aligned<uint32_t>(padded * K2);
  if (padded > M) std::memset(xb.buf.get() + M * K2, 0, (padded - M) * K2 * 4);
  uint32_t* out = xb.buf.get();
  at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) {
      const float* src = xf + m * K;
      uint16_t* dst = reinterpret_cast<uint16_t*>(out + m * K2);
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        const vec::v16u u = vec::bits(vec::load16(src + k));
        const vec::v16u r = (u & 0x7fffffffu) > 0x7f800000u ? u | 0x400000u : u + 0x7fffu + ((u >> 16) & 1u);
        const vec::v16h h = __builtin_convertvector(r >> 16, vec::v16h);
        std::memcpy(dst + k, &h, sizeof(h));
      }
      for (; k < K; ++k) dst[k] = to_bf16(src[k]);
      if (K % 2) dst[K] = 0;
    }
  });
  return xb;
}

// y[0 : n, 0 : 48] += bias[0 : 48], rows O floats apart
inline void add_bias(float* y, int64_t n, int64_t O, const float* bias) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < NR; ++c) y[i * O + c] += bias[c];
}

// y[m, 0 : cols] (+ bias) = x pairs row m . panel for m in [m_lo, m_hi); y is the panel's first column
// of row 0, rows O floats apart. AMX tiles of 16 or 32 rows where the pairs were made for them (a tail
// computes the zero rows too and keeps only the real ones), else the micro-kernel above, 8 rows a tile.
inline void rows_out(const Pairs& xb, int64_t m_lo, int64_t m_hi, const uint16_t* panel, const float* bias,
                     float* y, int64_t O, int64_t cols) {
  const int64_t K2 = xb.K2;
  auto put = [&](const float* tmp, int64_t m, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < cols; ++c) y[(m + i) * O + c] = tmp[i * NR + c] + (bias ? bias[c] : 0.f);
  };
#if PAGEDLLM_AMX
  if (xb.amx) {
    // full tiles of real rows and a whole panel of columns are stored straight into y (the copy through
    // a buffer cost as much as the products at K = 576); the rest through tmp
    alignas(64) float tmp[32 * NR];
    amx::configure();
    int64_t m = m_lo;
    for (; m + 16 < m_hi; m += 32) {
      if (m + 32 <= m_hi && cols == NR) {
        amx::rows<2>(xb.data() + m * K2, K2, K2, panel, y + m * O, O);
        if (bias) add_bias(y + m * O, 32, O, bias);
      } else {
        amx::rows<2>(xb.data() + m * K2, K2, K2, panel, tmp, NR);
        put(tmp, m, std::min<int64_t>(32, m_hi - m));
      }
    }
    if (m < m_hi) {
      amx::rows<1>(xb.data() + m * K2, K2, K2, panel, tmp, NR);
      put(tmp, m, m_hi - m);
    }
    return;
  }
#endif
  for_row_tiles(m_lo, m_hi, [&](int64_t m, auto R) {
    constexpr int kR = decltype(R)::value;
    float tmp[kR * NR];
    tile<kR>(xb.data() + m * K2, K2, K2, panel, tmp);
    put(tmp, m, kR);
  });
}

}  // namespace bf16
