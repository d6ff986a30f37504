// The fp32 panel micro-kernel of packed_linear (ops.cpp): tiles of y = x w^T + b, with w
// packed once at load time as panels [P, K, 48] (column block p of w^T, zero-padded), so the inner loop
// streams one contiguous panel, broadcasts x and keeps every accumulator in a register (no horizontal sums).
// ISA paths (compile-time; -march=native, the build keyed by the CPU's flags):
//   AVX-512: 8 rows x three 16-float vectors, 24 of the 32 zmm registers (~205-215 GFLOP/s on a 2-core
//     Zen 5 at SmolLM2's shapes, where MKL's sgemm on the plain [O, K] weights gives 130-190);
//   AVX2 + FMA: 16 ymm registers hold 12 accumulators, so a panel is cut into sub-tiles of 6 rows x 16
//     columns (BLIS's Haswell shape), the rows left as 1-2 x 48 (decode streams the panel once), 3-4 x 24
//     or 5 x 16; partial columns by masked stores (a buffer for them kept GCC from holding the accumulators
//     in registers). 60-67 GFLOP/s a thread at 64-1024 rows on a Zen 3 whose FMA peak is 87.5; the
//     AVX-512 shape spilled its 48 ymm accumulators every k (4.5 GFLOP/s for both threads at any row count);
//   otherwise: the same 16-float vectors as AVX-512, which the compiler splits for the ISA it has.
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

#include "row_tiles.h"

namespace f32 {

inline constexpr int64_t NR = 48;  // output columns per weight panel

// rows(): y [0:M, 0:cols] (+ bias) = x [M, K] . panel; y is the panel's first column of row 0, rows O floats
// apart; cols: the panel's real columns (the last panel is partial)
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
inline constexpr const char* kIsa = "avx2";

// A sub-tile narrower than the panel reads one or two of each 192-byte panel row's three cache lines, a strided
// stream whose misses the hardware overlaps poorly: with 6 rows, three such passes took twice the time of one
// streaming pass. So the pass over the first columns prefetches whole rows this far ahead (2 KiB) into L1, and
// the passes over the other columns find them in L2.
inline constexpr int64_t kAheadRows = 2048 / (NR * 4);

// R rows x C 8-float vectors of the panel's columns from column c0. R * C accumulators plus min(R, C) operands
// held across the other loop plus one <= 16 registers: the smaller side is loaded once per k and kept
template <int R, int C>
inline void sub_tile(const float* x, int64_t K, const float* panel, int64_t c0, const float* bias, float* y, int64_t O,
                     int64_t cols) {
  static_assert(R * C + (R < C ? R : C) + 1 <= 16, "the tile must fit the 16 ymm registers");
  // every loop over acc fully unrolled: one left rolled (a variable index) made GCC keep acc in memory and
  // store all of it every k (half the speed)
  __m256 acc[R][C];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < C; ++j) acc[i][j] = bias ? _mm256_loadu_ps(bias + c0 + 8 * j) : _mm256_setzero_ps();
  const float* pk = panel + c0;
  for (int64_t k = 0; k < K; ++k, pk += NR) {
    if (c0 == 0) {  // the first sub-tile's pass brings in whole panel rows (the later ones then hit L2): see kAheadRows
      const char* ahead = reinterpret_cast<const char*>(pk + kAheadRows * NR);
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
      _mm_prefetch(ahead + 128, _MM_HINT_T0);
    }
    if constexpr (C <= R) {
      __m256 w[C];
#pragma GCC unroll 16
      for (int j = 0; j < C; ++j) w[j] = _mm256_loadu_ps(pk + 8 * j);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const __m256 xv = _mm256_broadcast_ss(x + i * K + k);
#pragma GCC unroll 16
        for (int j = 0; j < C; ++j) acc[i][j] = _mm256_fmadd_ps(w[j], xv, acc[i][j]);
      }
    } else {
      __m256 xv[R];
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) xv[i] = _mm256_broadcast_ss(x + i * K + k);
#pragma GCC unroll 16
      for (int j = 0; j < C; ++j) {
        const __m256 w = _mm256_loadu_ps(pk + 8 * j);
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
inline void across(const float* x, int64_t K, const float* panel, const float* bias, float* y, int64_t O,
                   int64_t cols) {
  for (int64_t c0 = 0; c0 < cols; c0 += 8 * C) sub_tile<R, C>(x, K, panel, c0, bias, y, O, cols);
}

// Rows [0, M): 6 rows x 16 columns (BLIS's Haswell shape: 12 FMAs per 2 panel loads and 6 broadcasts), the
// rest as 1-2 rows x 48, 3-4 rows x 24 or 5 rows x 16
inline void rows(const float* x, int64_t M, int64_t K, const float* panel, const float* bias, float* y, int64_t O,
                 int64_t cols) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) across<6, 2>(x + m * K, K, panel, bias, y + m * O, O, cols);
  x += m * K;
  y += m * O;
  switch (M - m) {
    case 5: across<5, 2>(x, K, panel, bias, y, O, cols); break;
    case 4: across<4, 3>(x, K, panel, bias, y, O, cols); break;
    case 3: across<3, 3>(x, K, panel, bias, y, O, cols); break;
    case 2: across<2, 6>(x, K, panel, bias, y, O, cols); break;
    case 1: across<1, 6>(x, K, panel, bias, y, O, cols); break;
    default: break;
  }
}

#else
inline constexpr const char* kIsa = "vec16";

typedef float v16f __attribute__((vector_size(64)));

inline v16f load16(const float* p) {
  v16f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, v16f v) { __builtin_memcpy(p, &v, sizeof(v)); }

template <int R>
inline void tile(const float* x, int64_t K, const float* panel, const float* bias, float* y, int64_t O, int64_t cols) {
  v16f acc[R][3];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 3; ++j) acc[i][j] = bias ? load16(bias + j * 16) : v16f{0};
  for (int64_t k = 0; k < K; ++k) {
    const float* pk = panel + k * NR;
    const v16f w0 = load16(pk), w1 = load16(pk + 16), w2 = load16(pk + 32);
    for (int i = 0; i < R; ++i) {
      const float xv = x[i * K + k];
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

inline void rows(const float* x, int64_t M, int64_t K, const float* panel, const float* bias, float* y, int64_t O,
                 int64_t cols) {
  for_row_tiles(0, M, [&](int64_t m, auto R) {
    tile<decltype(R)::value>(x + m * K, K, panel, bias, y + m * O, O, cols);
  });
}
#endif

}  // namespace f32
