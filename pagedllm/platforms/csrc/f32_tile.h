// The fp32 panel micro-kernel of packed_linear (ops.cpp): tiles of y = x w^T + b, with w packed once at load
// time as panels of 48 columns (column block p of w^T, zero-padded), each panel stored as 48 / SW strips
// [K, SW] (at()), so the inner loop streams contiguous strips, broadcasts x and keeps every
// accumulator in a register (no horizontal sums).
// ISA paths (compile-time; -march=native, the build keyed by the CPU's flags):
//   AVX-512: one strip [K, 48] (SW = 48), 8 rows x three 16-float vectors, 24 of the 32 zmm registers
//     (~205-215 GFLOP/s on a 2-core Zen 5 at SmolLM2's shapes, where MKL's sgemm on the plain [O, K] weights
//     gives 130-190);
//   AVX2 + FMA: 16 ymm registers hold 12 accumulators, so a panel is cut into sub-tiles of 6 rows x 16
//     columns (BLIS's Haswell shape), the rows left as 1-2 x 48 (decode streams the panel once), 3-4 x 24
//     or 5 x 16; partial columns by masked stores (a buffer for them kept GCC from holding the accumulators
//     in registers). The panel is three strips [K, 16] (SW = 16), one per 6 x 16 sub-tile's pass, so each pass
//     reads 64 contiguous bytes a k: on [K, 48] rows the passes read every third cache line, a strided stream
//     that held the 6 x 16 tile to ~80% of the FMA peak (one thread of an AMX Xeon built as AVX2, 512 rows,
//     K 576: 96-100 -> 117-119 GFLOP/s with the k loop unrolled by 4, where the FMA peak is 121-124). The
//     AVX-512 shape spilled its 48 ymm accumulators every k (4.5 GFLOP/s for both threads at any row count);
//   otherwise: the same 16-float vectors as AVX-512, which the compiler splits for the ISA it has.
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

#include "row_tiles.h"

namespace f32 {

inline constexpr int64_t NR = 48;  // output columns per weight panel

// rows(): y [0:M, 0:cols] (+ bias) = x [M, K] . panel; x's rows ldx floats apart (K for a plain [M, K]); y is the
// panel's first column of row 0, rows O floats apart; cols: the panel's real columns (the last panel is partial)
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
inline constexpr const char* kIsa = "avx2";
inline constexpr int64_t SW = 16;  // a strip's columns: one 6 x 16 sub-tile's

// the panel's column c of weight k: strips [48 / SW][K][SW]
inline constexpr int64_t at(int64_t K, int64_t k, int64_t c) { return c / SW * K * SW + k * SW + c % SW; }

// Each pass over a strip starts a new stream of the panel, which the hardware's prefetchers take a while to
// follow when the panel comes from memory (a few rows of x: decode), so the passes prefetch their strips this
// many k ahead (2 KiB)
inline constexpr int64_t kAhead = 2048 / (SW * 4);

// R rows x C 8-float vectors of the panel's columns from column c0 (a vector never straddles strips: SW is a
// multiple of 8). R * C accumulators plus min(R, C) operands held across the other loop plus one <= 16 registers:
// the smaller side is loaded once per k and kept
template <int R, int C>
inline void sub_tile(const float* x, int64_t ldx, int64_t K, const float* panel, int64_t c0, const float* bias, float* y,
                     int64_t O, int64_t cols) {
  static_assert(R * C + (R < C ? R : C) + 1 <= 16, "the tile must fit the 16 ymm registers");
  // every loop over acc fully unrolled: one left rolled (a variable index) made GCC keep acc in memory and
  // store all of it every k (half the speed)
  __m256 acc[R][C];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < C; ++j) acc[i][j] = bias ? _mm256_loadu_ps(bias + c0 + 8 * j) : _mm256_setzero_ps();
  const float* pj[C];  // vector j's column in its strip, at k = 0
#pragma GCC unroll 16
  for (int j = 0; j < C; ++j) pj[j] = panel + at(K, 0, c0 + 8 * j);
  // unrolled by 4: the loop's own instructions took issue slots from the 12 FMAs of a k
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
#pragma GCC unroll 16
    for (int j = 0; j < C; j += 2)  // each strip's cache line kAhead ahead (past its end: the next strip's)
      _mm_prefetch(reinterpret_cast<const char*>(pj[j] + (k + kAhead) * SW), _MM_HINT_T0);
    if constexpr (C <= R) {
      __m256 w[C];
#pragma GCC unroll 16
      for (int j = 0; j < C; ++j) w[j] = _mm256_loadu_ps(pj[j] + k * SW);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);
#pragma GCC unroll 16
        for (int j = 0; j < C; ++j) acc[i][j] = _mm256_fmadd_ps(w[j], xv, acc[i][j]);
      }
    } else {
      __m256 xv[R];
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) xv[i] = _mm256_broadcast_ss(x + i * ldx + k);
#pragma GCC unroll 16
      for (int j = 0; j < C; ++j) {
        const __m256 w = _mm256_loadu_ps(pj[j] + k * SW);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(w, xv[i], acc[i][j]);
      }
    }
  }
  const int64_t n = std::min<int64_t>(C * 8, cols - c0);
#pragma GCC unroll 16
  for (int j = 0; j < C; ++j) {
    const int64_t left = n - 8 * j;  // this vector's real columns: 8 but in the last panel
    if (left >= 8) {
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) _mm256_storeu_ps(y + i * O + c0 + 8 * j, acc[i][j]);
    } else if (left > 0) {
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) _mm256_maskstore_ps(y + i * O + c0 + 8 * j, mask, acc[i][j]);
    }
  }
}

// The panel's 48 columns in sub-tiles of C vectors
template <int R, int C>
inline void across(const float* x, int64_t ldx, int64_t K, const float* panel, const float* bias, float* y, int64_t O,
                   int64_t cols) {
  for (int64_t c0 = 0; c0 < cols; c0 += 8 * C) sub_tile<R, C>(x, ldx, K, panel, c0, bias, y, O, cols);
}

// Rows [0, M): 6 rows x 16 columns (BLIS's Haswell shape: 12 FMAs per 2 panel loads and 6 broadcasts), the
// rest as 1-2 rows x 48, 3-4 rows x 24 or 5 rows x 16
inline void rows(const float* x, int64_t ldx, int64_t M, int64_t K, const float* panel, const float* bias, float* y,
                 int64_t O, int64_t cols) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) across<6, 2>(x + m * ldx, ldx, K, panel, bias, y + m * O, O, cols);
  x += m * ldx;
  y += m * O;
  switch (M - m) {
    case 5: across<5, 2>(x, ldx, K, panel, bias, y, O, cols); break;
    case 4: across<4, 3>(x, ldx, K, panel, bias, y, O, cols); break;
    case 3: across<3, 3>(x, ldx, K, panel, bias, y, O, cols); break;
    case 2: across<2, 6>(x, ldx, K, panel, bias, y, O, cols); break;
    case 1: across<1, 6>(x, ldx, K, panel, bias, y, O, cols); break;
    default: break;
  }
}

#else
inline constexpr const char* kIsa = "vec16";
inline constexpr int64_t SW = NR;  // one strip: the panel is [K, 48]

inline constexpr int64_t at(int64_t K, int64_t k, int64_t c) { return c / SW * K * SW + k * SW + c % SW; }

typedef float v16f __attribute__((vector_size(64)));

inline v16f load16(const float* p) {
  v16f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, v16f v) { __builtin_memcpy(p, &v, sizeof(v)); }

template <int R>
inline void tile(const float* x, int64_t ldx, int64_t K, const float* panel, const float* bias, float* y, int64_t O,
                 int64_t cols) {
  v16f acc[R][3];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 3; ++j) acc[i][j] = bias ? load16(bias + j * 16) : v16f{0};
  for (int64_t k = 0; k < K; ++k) {
    const float* pk = panel + k * NR;
    const v16f w0 = load16(pk), w1 = load16(pk + 16), w2 = load16(pk + 32);
    for (int i = 0; i < R; ++i) {
      const float xv = x[i * ldx + k];
      acc[i][0] += xv * w0;
      acc[i][1] += xv * w1;
      acc[i][2] += xv * w2;
    }
  }
  for (int i = 0; i < R; ++i) {
    if (cols == NR) {
      for (int j = 0; j < 3; ++j) store16(y + i * O + j * 16, acc[i][j]);
    } else {  // the last, partial panel
      float tmp[NR];
      for (int j = 0; j < 3; ++j) store16(tmp + j * 16, acc[i][j]);
      for (int64_t c = 0; c < cols; ++c) y[i * O + c] = tmp[c];
    }
  }
}

inline void rows(const float* x, int64_t ldx, int64_t M, int64_t K, const float* panel, const float* bias, float* y,
                 int64_t O, int64_t cols) {
  for_row_tiles(0, M, [&](int64_t m, auto R) {
    tile<decltype(R)::value>(x + m * ldx, ldx, K, panel, bias, y + m * O, O, cols);
  });
}
#endif

}  // namespace f32
