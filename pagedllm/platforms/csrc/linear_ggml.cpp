// y = x @ w.T (+ b) with w in ggml's quantized block formats (ggml_blocks.h), read as the GGUF file
// stores them: w is one or more parts [O_i, row_bytes_i] uint8 stacked along the outputs (a fused
// q/k/v may mix formats), each row K / QK blocks. x [M, K] fp32, y [M, sum O_i] fp32.
//
// Which path a call takes is decided by its rows, so that a row's result does not depend on the
// batch it came in: a caller that knows its step passes decode_rows (its leading single-token decode
// rows); prompt rows (any rows past those) always take the panels (bf16; fp32 on AVX2), and a step of decodes alone
// takes the integer dot while it has fewer than kDotRowsMax rows. So a prompt's last row is computed
// the same way whether its prefix came from the cache (a few rows left) or not (the whole prompt).
// decode_rows = -1 (a caller that does not know): by M alone.
// Steps of decodes alone of kDotRowsMax .. kTiledRowsMax rows on 256-bit integer dots (AVX2, AVX-VNNI): the same
// int8 activations in tiles of two weight rows by four rows of x (dot_tiles), else the bf16 panels. Parts repacked
// for AVX2 (linear_x16.cpp: one weight row per lane, no shuffles) take their integer dot for steps of decodes alone
// of any size: 1.5x the fp32 panels at 64-512 rows on an AMX Xeon with AVX-512 masked.
// Decode-sized batches (M < kDotRowsMax): the integer dot product, the way ggml pairs each type
// with an int8 `vec_dot_type`. Each activation row is quantized per 32 values to int8 with an fp32
// scale da (and the sums da * sum(q) per 16, for the formats' offsets); per weight chunk of 32 the
// quants are unpacked once into a register and multiplied with up to 4 activation rows:
//   sum_i w_i x_i ~= sum_chunks [ d * da * sum_i q_i qa_i ] + m * (da * sum_i qa_i)
// Weights are streamed once per call, prefetched ggml::kStreamAhead ahead; the work is split over output rows.
// Prefill-sized batches: weights dequantized to bf16 (ggml's fp32 values, rounded once) a group of
// rows at a time into a thread-local buffer, then multiplied with all of x rounded to bf16, so the
// quantized weights cost their dequantization once per call, not once per row of x: 48-row panels
// for the panel micro-kernel of bf16_tile.h, made with AVX512-BF16 by dequantizing 16 rows and
// transposing them in registers, with 256-bit instructions 8 rows likewise (AVX-512 CPUs without BF16), else a
// scalar loop, multiplied on AMX tiles (bf16_amx.h) where the
// CPU has them, else by bf16_tile.h's vdpbf16ps / widening paths. AVX2, which has no bf16 arithmetic to gain
// from, dequantizes 8 rows at a time into fp32 panels for f32_tile.h's micro-kernel instead (PAGEDLLM_F32_PREFILL).
// ISA paths of the integer dot (compile-time; -march=native, build keyed by the CPU's flags):
//   AVX512-VNNI + BW: vpdpbusd on 512-bit vectors, two chunks at a time (rows of an even chunk count);
//   AVX512-VNNI (+VL) or AVX-VNNI: vpdpbusd on 256-bit vectors (u8 x s8 -> int32, no saturation);
//   AVX2: vpmaddubsw + vpmaddwd (u8 quants are <= 63, or the Q8_0 sign trick, so int16 never saturates);
//   otherwise: scalar integer loops.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <memory>
#include <vector>

#include "bf16_tile.h"
#include "f32_tile.h"
#include "ggml_blocks.h"
#include "linear_ggml.h"
#include "linear_x16.h"
#include "row_tiles.h"

namespace {

// rows of x below which the integer dot runs, else bf16 panels; measured with docs/bench/ggml_microbench.py
constexpr int64_t kDotRowsMax = 16;  // both layouts (repacked groups: at 64 rows the panels win for K = 4096)
// steps of decodes alone below this take dot_tiles where it is built (AVX2 / AVX-VNNI 256-bit): 1.2-1.8x the
// panels at 16-64 rows on an AMX Xeon with AVX-512 masked, 1.0-1.3x at 256-512 (docs/benchmarks.md)
constexpr int64_t kTiledRowsMax = 64;

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
  std::vector<float> dl;  // d repeated over the 8 int32 lanes of its chunk: [M, K / 32, 8] (AVX-512 path)
  // the tiled AVX2 kernel's view: per group of 4 rows and chunk, the 4 rows' d, s of weights 0-15, s of 16-31
  // [ceil(M / 4), K / 32, 3, 4], zero past M
  std::vector<float> t4;
};

QAct quantize_rows(const float* x, int64_t M, int64_t K, bool tiled = false) {
  QAct a{K, K / 32, std::vector<int8_t>(M * K), std::vector<float>(M * (K / 32)), std::vector<float>(M * (K / 16)),
         std::vector<float>(tiled ? 0 : M * (K / 32) * 8)};
  at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m)
      for (int64_t g = 0; g < a.nch; ++g) {
        const float* xs = x + m * K + 32 * g;
        float id;
        const float d = ggml::block_scale(xs, 127.f, &id);
        int s0, s1;
        ggml::quantize32(xs, id, a.q.data() + m * K + 32 * g, &s0, &s1);
        a.d[m * a.nch + g] = d;
        if (!tiled) std::fill_n(a.dl.data() + (m * a.nch + g) * 8, 8, d);
        a.s[(m * a.nch + g) * 2] = d * static_cast<float>(s0);
        a.s[(m * a.nch + g) * 2 + 1] = d * static_cast<float>(s1);
      }
  });
  if (tiled) {
    a.t4.assign(((M + 3) / 4) * a.nch * 12, 0.f);
    float* t4 = a.t4.data();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < a.nch; ++g) {
        float* c = t4 + ((m / 4) * a.nch + g) * 12 + m % 4;
        c[0] = a.d[m * a.nch + g];
        c[4] = a.s[(m * a.nch + g) * 2];
        c[8] = a.s[(m * a.nch + g) * 2 + 1];
      }
  }
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
        // a chunk's share of its block, kStreamAhead on (rows are contiguous: past a row's end, the next row's)
        _mm_prefetch(reinterpret_cast<const char*>(blk + c * F::BYTES / CPB + ggml::kStreamAhead), _MM_HINT_T0);
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

#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
#define PAGEDLLM_TILED_DOT 1
// Rows of x on 256-bit integer dots (AVX2's maddubs, or AVX-VNNI), in tiles: two weight rows against a group
// of 4 activation rows, each 32-bit lane of the accumulator one (weight row, activation row) pair:
// lanes 0-3 row n with activation rows 4j .. 4j + 3, lanes 4-7 row n + 1. Per chunk, each pair's 8 int32
// partial dots are summed by horizontal adds (exact) into its lane, so a chunk costs one convert and one fma
// per 8 pairs instead of per pair, and the scales d * da come as one product of two vectors (a.t4 holds the
// 4 rows' da side by side). Used for steps of decodes alone of kDotRowsMax .. kTiledRowsMax rows, where it
// beats both the one-row dot and the bf16 panels (widened to fp32 here); prompt rows keep the panels, whose bf16
// rounding of x is twice as accurate as int8 per 32. Past ~64 rows the panels tie it on an AMX Xeon: the hadd
// trees and broadcasts are shuffles, one port's work there; a layout with a weight row per lane (as the
// repacked AVX-512 dot has) is what would go past that.
// a value of weight row n in lanes 0-3 and one of row n + 1 in lanes 4-7 (dot_tiles' lane order)
inline __m256 row_pair(float v0, float v1) { return _mm256_set_m128(_mm_set1_ps(v1), _mm_set1_ps(v0)); }

template <class F>
void dot_tiles(const uint8_t* w, int64_t row_bytes, int64_t n_lo, int64_t n_hi, const QAct& a, int64_t M,
               const float* bias, float* y, int64_t O) {
  constexpr int CPB = F::QK / 32;
  const int64_t nb = a.K / F::QK, K = a.K, nch = a.nch;
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t n = n_lo; n < n_hi; n += 2) {  // x (under kTiledRowsMax rows) stays in L2 while a pair sweeps it
    for (int64_t j = 0; j < (M + 3) / 4; ++j) {
      const int T = static_cast<int>(std::min<int64_t>(4, M - 4 * j));
      const float* t4 = a.t4.data() + j * nch * 12;
      const bool two = n + 1 < n_hi;
      const uint8_t* r0 = w + n * row_bytes;
      const uint8_t* r1 = two ? r0 + row_bytes : r0;
      __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        for (int c = 0; c < CPB; ++c) {
          const int64_t g = b * CPB + c;
          const uint8_t* b0 = r0 + b * F::BYTES;
          const uint8_t* b1 = r1 + b * F::BYTES;
          float d0[2], m0[2], d1[2], m1[2];
          F::scales(b0, c, d0, m0);
          F::scales(b1, c, d1, m1);
          const __m256i q0 = F::quants256(b0, c), q1 = F::quants256(b1, c);
          const __m256i u0 = F::kSigned ? _mm256_sign_epi8(q0, q0) : q0, u1 = F::kSigned ? _mm256_sign_epi8(q1, q1) : q1;
          __m256i p0[4], p1[4];  // [activation row]: int32 partial dots, lanes 0-3 weights 0-15, 4-7 16-31
          for (int t = 0; t < 4; ++t) {
            if (t >= T) {
              p0[t] = p1[t] = zero;
              continue;
            }
            const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (4 * j + t) * K + 32 * g));
            p0[t] = dot_u8s8(u0, F::kSigned ? _mm256_sign_epi8(av, q0) : av);
            p1[t] = dot_u8s8(u1, F::kSigned ? _mm256_sign_epi8(av, q1) : av);
          }
          // x: lane t = row 0's sum over weights 0-15 with activation row t, lane 4 + t over 16-31
          const __m256i x0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p0[0], p0[1]), _mm256_hadd_epi32(p0[2], p0[3]));
          const __m256i x1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p1[0], p1[1]), _mm256_hadd_epi32(p1[2], p1[3]));
          const __m256i lo = _mm256_permute2x128_si256(x0, x1, 0x20), hi = _mm256_permute2x128_si256(x0, x1, 0x31);
          const __m256 da = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(t4 + g * 12));
          if constexpr (F::kSplit) {
            const __m256 s_lo = _mm256_mul_ps(row_pair(d0[0], d1[0]), da);
            const __m256 s_hi = _mm256_mul_ps(row_pair(d0[1], d1[1]), da);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), s_lo, acc);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), s_hi, acc);
          } else {
            const __m256 sc = _mm256_mul_ps(row_pair(d0[0], d1[0]), da);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), sc, acc);
          }
          if constexpr (!F::kSigned) {  // offsets m * da * sum(qa) per half
            const __m256 sa = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(t4 + g * 12 + 4));
            const __m256 sb = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(t4 + g * 12 + 8));
            off = _mm256_fmadd_ps(row_pair(m0[0], m1[0]), sa, off);
            off = _mm256_fmadd_ps(row_pair(m0[1], m1[1]), sb, off);
          }
        }
      }
      alignas(32) float r[8];
      _mm256_store_ps(r, _mm256_add_ps(acc, off));
      for (int t = 0; t < T; ++t) {
        y[(4 * j + t) * O + n] = r[t] + (bias ? bias[n] : 0.f);
        if (two) y[(4 * j + t) * O + n + 1] = r[4 + t] + (bias ? bias[n + 1] : 0.f);
      }
    }
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The same on 512-bit vectors, two chunks (64 weights) per step: quants made unsigned (Q8_0: q + 128
// with offset -128 d), lanes 0-7 chunk g and 8-15 chunk g + 1; the scale of each lane is the weight
// half-chunk's d times the activation chunk's da (a.dl), the offsets m * da * sum(qa) four at a time.
template <class F, int T>
void dot_rows512(const uint8_t* w, int64_t row_bytes, int64_t n_lo, int64_t n_hi, const QAct& a, int64_t t0,
                 const float* bias, float* y, int64_t O) {
  constexpr int CPB = F::QK / 32;
  const int64_t K = a.K, nch = a.nch;
  const __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  for (int64_t n = n_lo; n < n_hi; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m512 acc[T];
    __m128 off[T];
    for (int t = 0; t < T; ++t) {
      acc[t] = _mm512_setzero_ps();
      off[t] = _mm_setzero_ps();
    }
    for (int64_t g = 0; g < nch; g += 2) {
      const uint8_t* b0 = row + (g / CPB) * F::BYTES;
      const uint8_t* b1 = row + ((g + 1) / CPB) * F::BYTES;
      const int c0 = static_cast<int>(g % CPB), c1 = static_cast<int>((g + 1) % CPB);
      _mm_prefetch(reinterpret_cast<const char*>(b0 + c0 * F::BYTES / CPB + ggml::kStreamAhead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b1 + c1 * F::BYTES / CPB + ggml::kStreamAhead), _MM_HINT_T0);
      alignas(16) float d[4], m[4];  // half-chunks: g first, g second, g + 1 first, g + 1 second
      F::scales(b0, c0, d, m);
      F::scales(b1, c1, d + 2, m + 2);
      __m512i q = F::quants512(b0, c0, b1, c1);
      if constexpr (F::kSigned) {
        q = _mm512_xor_si512(q, _mm512_set1_epi8(static_cast<char>(0x80)));
        for (int i = 0; i < 4; ++i) m[i] = -128.f * d[i];
      }
      const __m512 dv = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_load_ps(d)));
      const __m128 mv = _mm_load_ps(m);
      for (int t = 0; t < T; ++t) {
        const int64_t r = t0 + t;
        const __m512i av = _mm512_loadu_si512(a.q.data() + r * K + 32 * g);
        const __m512 prod = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q, av));
        const __m512 sc = _mm512_mul_ps(dv, _mm512_loadu_ps(a.dl.data() + (r * nch + g) * 8));
        acc[t] = _mm512_fmadd_ps(prod, sc, acc[t]);
        off[t] = _mm_fmadd_ps(mv, _mm_loadu_ps(a.s.data() + (r * nch + g) * 2), off[t]);
      }
    }
    for (int t = 0; t < T; ++t) {
      __m128 o = _mm_add_ps(off[t], _mm_movehl_ps(off[t], off[t]));
      o = _mm_add_ss(o, _mm_movehdup_ps(o));
      y[(t0 + t) * O + n] = _mm512_reduce_add_ps(acc[t]) + _mm_cvtss_f32(o) + (bias ? bias[n] : 0.f);
    }
  }
}
#endif

// the row kernel for this CPU and row width: 512-bit chunk pairs where there are, else 256-bit / scalar
template <class F, int T>
void dot_rows_best(const uint8_t* w, int64_t row_bytes, int64_t n_lo, int64_t n_hi, const QAct& a, int64_t t0,
                   const float* bias, float* y, int64_t O) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (a.nch % 2 == 0) return dot_rows512<F, T>(w, row_bytes, n_lo, n_hi, a, t0, bias, y, O);
#endif
  dot_rows<F, T>(w, row_bytes, n_lo, n_hi, a, t0, bias, y, O);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// 16 x 16 transpose of 32-bit elements: in r[i] = row i, out r[j] = column j
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + c] 128-bit lane l: column 4l + c of rows i .. i + 3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), w = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i w2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(v, v2, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(v, v2, 0xdd);
    r[4 + c] = _mm512_shuffle_i32x4(w, w2, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(w, w2, 0xdd);
  }
}

// One 48-row panel [K2, 48, 2] bf16 straight from the blocks: per chunk of 32 k, 16 rows are
// dequantized (fp32 fma, then vcvtneps2bf16: 16 k pairs a row) and transposed in registers, so each
// k pair's 16 columns are stored as one contiguous vector. Rows past `cols` are zero.
template <class F>
void dequant_panel_bf16(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t c0, int64_t cols, uint16_t* panel) {
  constexpr int CPB = F::QK / 32;
  for (int grp = 0; grp < 3; ++grp) {
    for (int64_t g = 0; g < K / 32; ++g) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t c = 16 * grp + i;
        if (c >= cols) {
          r[i] = _mm512_setzero_si512();
          continue;
        }
        const uint8_t* blk = w + (c0 + c) * row_bytes + (g / CPB) * F::BYTES;
        const int sub = static_cast<int>(g % CPB);
        float d[2], m[2];
        F::scales(blk, sub, d, m);
        const __m256i q = F::quants256(blk, sub);
        __m256i half[2];
        for (int h = 0; h < 2; ++h) {
          const __m128i qh = h ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
          const __m512i qi = F::kSigned ? _mm512_cvtepi8_epi32(qh) : _mm512_cvtepu8_epi32(qh);
          const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qi), _mm512_set1_ps(d[h]), _mm512_set1_ps(m[h]));
          half[h] = (__m256i)_mm512_cvtneps_pbh(v);
        }
        r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(half[0]), half[1], 1);  // 16 k pairs of row c
      }
      transpose16(r);
      for (int j = 0; j < 16; ++j)
        _mm512_storeu_si512(panel + ((16 * g + j) * bf16::NR + 16 * grp) * 2, r[j]);
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512BF16__) && defined(__AVX512BW__))
// 8 x 8 transpose of 32-bit elements: in r[i] = row i, out r[j] = column j
inline void transpose8(__m256i* r) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // u[i + c] 128-bit lane l: column 4l + c of rows i .. i + 3
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
  }
}

// 8 fp32 -> their bf16 bits (round to nearest even, finite inputs) in the low half of each lane
inline __m256i bf16_low(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
}

// Chunk g (32 weights) of a row dequantized as ggml does (d * q + m, in fp32) into 4 vectors of 8: k 8j .. 8j + 7
template <class F>
inline void dequant_chunk8(const uint8_t* row, int64_t g, __m256* v) {
  constexpr int CPB = F::QK / 32;
  const uint8_t* blk = row + (g / CPB) * F::BYTES;
  const int sub = static_cast<int>(g % CPB);
  float d[2], m[2];
  F::scales(blk, sub, d, m);
  const __m256i q = F::quants256(blk, sub);
  for (int j = 0; j < 4; ++j) {
    const __m128i h = j < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
    const __m128i q8 = j % 2 ? _mm_srli_si128(h, 8) : h;
    const __m256i qi = F::kSigned ? _mm256_cvtepi8_epi32(q8) : _mm256_cvtepu8_epi32(q8);
    v[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qi), _mm256_set1_ps(d[j / 2]), _mm256_set1_ps(m[j / 2]));
  }
}

// One 48-row panel [K2, 48, 2] bf16 straight from the blocks on AVX2: per chunk of 32 k, 8 rows are
// dequantized (fp32 fma, rounded to bf16 and packed into 16 k pairs a row) and transposed in registers, so
// each k pair's 8 columns are stored as one vector. Rows past `cols` are zero.
template <class F>
void dequant_panel_bf16(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t c0, int64_t cols, uint16_t* panel) {
  for (int grp = 0; grp < 6; ++grp) {
    for (int64_t g = 0; g < K / 32; ++g) {
      __m256i r[2][8];  // [pairs 0-7 | 8-15][row]
      for (int i = 0; i < 8; ++i) {
        const int64_t c = 8 * grp + i;
        if (c >= cols) {
          r[0][i] = r[1][i] = _mm256_setzero_si256();
          continue;
        }
        __m256 v[4];
        dequant_chunk8<F>(w + (c0 + c) * row_bytes, g, v);
        __m256i b[4];  // bf16 bits of k 8j .. 8j + 7
        for (int j = 0; j < 4; ++j) b[j] = bf16_low(v[j]);
        // packus interleaves 128-bit lanes: [k0-3, k8-11 | k4-7, k12-15]; the permute restores k order
        r[0][i] = _mm256_permute4x64_epi64(_mm256_packus_epi32(b[0], b[1]), 0xd8);
        r[1][i] = _mm256_permute4x64_epi64(_mm256_packus_epi32(b[2], b[3]), 0xd8);
      }
      for (int h = 0; h < 2; ++h) {
        transpose8(r[h]);
        for (int j = 0; j < 8; ++j)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + ((16 * g + 8 * h + j) * bf16::NR + 8 * grp) * 2),
                              r[h][j]);
      }
    }
  }
}
#define PAGEDLLM_DEQUANT_PANEL 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGEDLLM_DEQUANT_PANEL 1
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// Prompt rows on AVX2, which has no bf16 arithmetic: there the bf16 panels' micro-kernel widens every weight pair
// into two fp32 vectors, a shift and a mask on the ports the FMAs need. So prompt rows take fp32 panels [K, 48]
// instead (f32_tile.h's strips and 6 x 16 tiles; the panel is made once a call and read from L2 by every row
// block), with x as it is: fp32 weights exactly as ggml dequantizes them, x not rounded.
#define PAGEDLLM_F32_PREFILL 1

// One 48-row fp32 panel (f32_tile.h's strips) straight from the blocks: per chunk of 32 k, 8 rows are dequantized and transposed
// in registers by 8 x 8, so each k's 8 columns are stored as one vector. Rows past `cols` are zero.
template <class F>
void dequant_panel_f32(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t c0, int64_t cols, float* panel) {
  for (int grp = 0; grp < 6; ++grp) {
    for (int64_t g = 0; g < K / 32; ++g) {
      __m256i r[4][8];  // [k 8j .. 8j + 7 of the chunk][row]
      for (int i = 0; i < 8; ++i) {
        const int64_t c = 8 * grp + i;
        __m256 v[4] = {};
        if (c < cols) dequant_chunk8<F>(w + (c0 + c) * row_bytes, g, v);
        for (int j = 0; j < 4; ++j) r[j][i] = _mm256_castps_si256(v[j]);
      }
      for (int j = 0; j < 4; ++j) {
        transpose8(r[j]);
        for (int t = 0; t < 8; ++t)
          _mm256_storeu_ps(panel + f32::at(K, 32 * g + 8 * j + t, 8 * grp), _mm256_castsi256_ps(r[j][t]));
      }
    }
  }
}
#endif

// y[:, 0 : rows] (yc, bc already offset to the part's columns) = x @ W^T for prefill-sized M, W made one 48-row
// panel of panel_elems T at a time by make_panel(p, panel, row_scratch), and tiles(p, panel, m_lo, m_hi) its
// products with rows [m_lo, m_hi) of x
template <class T, class MakePanel, class Tiles>
void sweep_panels(int64_t M, int64_t K, int64_t rows, int64_t panel_elems, MakePanel&& make_panel, Tiles&& tiles) {
  const int64_t P = (rows + bf16::NR - 1) / bf16::NR;
  constexpr int64_t MB = 128;  // rows of x per pass, as in linear_bf16
  if (M <= MB) {  // one pass over x: each panel made in a thread-local buffer and used at once
    at::parallel_for(0, P, 1, [&](int64_t lo, int64_t hi) {
      const bf16::Aligned<T> panel = bf16::aligned<T>(panel_elems);
      std::fill_n(panel.get(), panel_elems, T{0});
      std::vector<float> row(K);
      for (int64_t p = lo; p < hi; ++p) {
        make_panel(p, panel.get(), row);
        tiles(p, panel.get(), 0, M);
      }
    });
    return;
  }
  // long prefills: a group of panels (<= 8 MiB) made once, then swept over x in blocks of MB rows, so x stays in
  // L2 instead of streaming once per panel
  const int64_t G = std::max<int64_t>(1, (8 << 20) / (panel_elems * static_cast<int64_t>(sizeof(T))));
  const int64_t nmb = (M + MB - 1) / MB;
  // not zero-filled: make_panel writes every element (K is a multiple of 32), and zeroing 8 MiB a call
  // cost as much as the dequantization
  const bf16::Aligned<T> group = bf16::aligned<T>(std::min(G, P) * panel_elems);
  for (int64_t p0 = 0; p0 < P; p0 += G) {
    const int64_t np = std::min(G, P - p0);
    at::parallel_for(0, np, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> row(K);
      for (int64_t i = lo; i < hi; ++i) make_panel(p0 + i, group.get() + i * panel_elems, row);
    });
    at::parallel_for(0, nmb * np, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t item = lo; item < hi; ++item) {
        const int64_t i = item % np, m_lo = (item / np) * MB;
        tiles(p0 + i, group.get() + i * panel_elems, m_lo, std::min(M, m_lo + MB));
      }
    });
  }
}

// bf16 panels [K2, 48, 2] times x's bf16 pairs (bf16_tile.h's rows_out: AMX tiles, vdpbf16ps or widening)
template <class MakePanel>
void panel_sweep(const bf16::Pairs* xb, int64_t M, int64_t K, int64_t rows, const float* bc, float* yc,
                 int64_t O, MakePanel&& make_panel) {
  using bf16::NR;
  const int64_t K2 = (K + 1) / 2;
  sweep_panels<uint16_t>(M, K, rows, K2 * NR * 2, make_panel,
                         [&](int64_t p, const uint16_t* panel, int64_t m_lo, int64_t m_hi) {
    const int64_t c0 = p * NR, cols = std::min(NR, rows - c0);
    bf16::rows_out(*xb, m_lo, m_hi, panel, bc ? bc + c0 : nullptr, yc + c0, O, cols);
  });
}

#if PAGEDLLM_F32_PREFILL
// fp32 panels (f32_tile.h's strips) made by make_panel(p, panel) times x as it is (f32_tile.h's micro-kernel)
template <class MakePanel>
void f32_panel_sweep(const float* xf, int64_t M, int64_t K, int64_t rows, const float* bc, float* yc, int64_t O,
                     MakePanel&& make_panel) {
  // the micro-kernel loads whole 8-column vectors of bias: a copy padded to whole panels, so the last, partial
  // panel reads no further than its own
  std::vector<float> bias_pad;
  if (bc) {
    bias_pad.assign((rows + f32::NR - 1) / f32::NR * f32::NR, 0.f);
    std::copy(bc, bc + rows, bias_pad.begin());
  }
  sweep_panels<float>(M, K, rows, K * f32::NR, [&](int64_t p, float* panel, std::vector<float>&) {
    make_panel(p, panel);
  }, [&](int64_t p, const float* panel, int64_t m_lo, int64_t m_hi) {
    const int64_t c0 = p * f32::NR;
    f32::rows(xf + m_lo * K, K, m_hi - m_lo, K, panel, bc ? bias_pad.data() + c0 : nullptr, yc + m_lo * O + c0, O,
              std::min(f32::NR, rows - c0));
  });
}
#endif

// y[:, col0 : col0 + rows] for one part in a plain (file) layout: F is its format; x16 parts are in
// linear_x16.cpp, and both share the panel sweep below
template <class F>
void linear_part(const QAct* a, const bf16::Pairs* xb, const float* xf, int64_t M, int64_t K, const torch::Tensor& w,
                 const float* bias, float* y, int64_t O, int64_t col0) {
  const int64_t rows = w.size(0), row_bytes = w.size(1);
  TORCH_CHECK(K % F::QK == 0 && row_bytes == K / F::QK * F::BYTES,
              "linear_ggml: x [", M, ", ", K, "] does not match a weight of rows of ", row_bytes, " bytes");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yc = y + col0;
  const float* bc = bias ? bias + col0 : nullptr;
  if (a != nullptr) {
#if PAGEDLLM_TILED_DOT
    if (!a->t4.empty()) {  // weight rows in pairs (2i, 2i + 1), whatever the threads' split
      at::parallel_for(0, (rows + 1) / 2, 8, [&](int64_t lo, int64_t hi) {
        dot_tiles<F>(wp, row_bytes, 2 * lo, std::min(rows, 2 * hi), *a, M, bc, yc, O);
      });
      return;
    }
#endif
    at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
      int64_t t = 0;
      for (; t + 4 <= M; t += 4) dot_rows_best<F, 4>(wp, row_bytes, lo, hi, *a, t, bc, yc, O);
      switch (M - t) {
        case 3: dot_rows_best<F, 3>(wp, row_bytes, lo, hi, *a, t, bc, yc, O); break;
        case 2: dot_rows_best<F, 2>(wp, row_bytes, lo, hi, *a, t, bc, yc, O); break;
        case 1: dot_rows_best<F, 1>(wp, row_bytes, lo, hi, *a, t, bc, yc, O); break;
        default: break;
      }
    });
    return;
  }
#if PAGEDLLM_F32_PREFILL
  (void)xb;
  f32_panel_sweep(xf, M, K, rows, bc, yc, O, [&](int64_t p, float* panel) {
    dequant_panel_f32<F>(wp, row_bytes, K, p * f32::NR, std::min(f32::NR, rows - p * f32::NR), panel);
  });
#else
  (void)xf;
  auto make_panel = [&](int64_t p, uint16_t* panel, std::vector<float>& row) {
    constexpr int64_t NR = bf16::NR;
    const int64_t c0 = p * NR, cols = std::min(NR, rows - c0);
#if PAGEDLLM_DEQUANT_PANEL
    if (K % 32 == 0) return dequant_panel_bf16<F>(wp, row_bytes, K, c0, cols, panel);
#endif
    for (int64_t c = 0; c < NR; ++c) {
      if (c < cols) {
        ggml::dequantize_row<F>(wp + (c0 + c) * row_bytes, K, row.data());
      } else {
        std::fill(row.begin(), row.end(), 0.f);
      }
      for (int64_t k = 0; k < K; ++k) panel[((k / 2) * NR + c) * 2 + k % 2] = bf16::to_bf16(row[k]);
    }
  };
  panel_sweep(xb, M, K, rows, bc, yc, O, make_panel);
#endif
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
    for (int64_t r = lo; r < hi; ++r) ggml::dequantize_row<F>(wp + r * row_bytes, K, op + r * K);
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
    case 39: return fn(ggml::MXFP4{});
    default: break;
  }
  TORCH_CHECK(false, "ggml type ", type, " has no kernel (executed: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K MXFP4)");
  return fn(ggml::Q8_0{});  // unreachable
}

void check_weight(const torch::Tensor& w) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "ggml weight must be a contiguous uint8 [rows, row_bytes] tensor");
}

}  // namespace

const char* linear_ggml_isa() { return kIsa; }

namespace {

torch::Tensor linear_ggml_on(torch::Tensor x, const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& types,
                             const std::vector<int64_t>& rows, const c10::optional<torch::Tensor>& bias, int64_t O,
                             bool dot, bool decodes = false) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "linear_ggml: x must be [M, K] fp32");
  TORCH_CHECK(ws.size() == types.size() && ws.size() == rows.size() && !ws.empty(),
              "linear_ggml: one type and row count per weight part");
  int64_t total = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    TORCH_CHECK(ws[i].dtype() == torch::kUInt8 && ws[i].is_contiguous() && ws[i].dim() == (types[i] >= kX16 ? 3 : 2),
                "ggml weight part ", i, " must be contiguous uint8 [rows, row_bytes] (or repacked [groups, chunks, bytes])");
    TORCH_CHECK(types[i] >= kX16 ? (ws[i].size(0) * 16 >= rows[i]) : ws[i].size(0) == rows[i],
                "linear_ggml: part ", i, " does not hold ", rows[i], " rows");
    total += rows[i];
  }
  TORCH_CHECK(total == O, "linear_ggml: the parts have ", total, " rows, not ", O);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  TORCH_CHECK(!bias.has_value() || bias->numel() == O, "linear_ggml: bias must have O values");
  auto y = torch::empty({M, O}, x.options());
  float* yp = y.data_ptr<float>();
  // activations prepared once for all parts: int8 per 32 for the dot, bf16 pairs for the panel path
  TORCH_CHECK(!dot || K % 32 == 0, "linear_ggml: the integer dot needs K a multiple of 32, not ", K);
  QAct a{};
  bf16::Pairs xb;
  bool any_plain = false, any_x16 = false;
  for (size_t i = 0; i < ws.size(); ++i) (types[i] >= kX16 ? any_x16 : any_plain) = true;
#if PAGEDLLM_TILED_DOT
  const bool tiled = decodes && M < kTiledRowsMax && !dot && K % 32 == 0;  // every plain part then runs on dot_tiles
#else
  const bool tiled = false;
#endif
#if PAGEDLLM_X16_AVX2
  const bool x16dot = dot || (decodes && K % 32 == 0);  // repacked parts: every step of decodes alone
#else
  const bool x16dot = dot;
#endif
  (void)decodes;  // unused where neither 256-bit dot is built
  if (K % 32 == 0 && (dot || tiled) && any_plain) a = quantize_rows(x.data_ptr<float>(), M, K, tiled);
  X16Act a16;
  if (K % 32 == 0 && x16dot && any_x16) a16 = x16_quantize(x.data_ptr<float>(), M, K);
#if !PAGEDLLM_F32_PREFILL  // else every part's prompt rows read x as it is
  if (!dot && !tiled) xb = bf16::pairs(x.data_ptr<float>(), M, K);
#endif
  int64_t col0 = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    if (types[i] >= kX16) {
      const int64_t t = types[i] - kX16;
      TORCH_CHECK(x16_supported(t) && K % 32 == 0, "linear_ggml: repacked type ", t, " cannot run here");
      float* yc = yp + col0;
      const float* bc = b ? b + col0 : nullptr;
      if (x16dot) {
        x16_dot(t, ws[i], rows[i], a16, M, bc, yc, O);
      } else {
#if PAGEDLLM_F32_PREFILL
        f32_panel_sweep(x.data_ptr<float>(), M, K, rows[i], bc, yc, O,
                        [&](int64_t p, float* panel) { x16_panel_f32(t, ws[i], K, p, panel); });
#else
        panel_sweep(&xb, M, K, rows[i], bc, yc, O, [&](int64_t p, uint16_t* panel, std::vector<float>&) {
          x16_panel(t, ws[i], K, p, panel);
        });
#endif
      }
    } else {
      dispatch(types[i], [&](auto f) {
        linear_part<decltype(f)>(dot || tiled ? &a : nullptr, &xb, x.data_ptr<float>(), M, K, ws[i], b, yp, O, col0);
        return 0;
      });
    }
    col0 += rows[i];
  }
  return y;
}

}  // namespace

torch::Tensor linear_ggml(torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> types,
                          std::vector<int64_t> rows, c10::optional<torch::Tensor> bias, int64_t O,
                          int64_t decode_rows) {
  const int64_t M = x.dim() == 2 ? x.size(0) : 0;
  const bool decodes = decode_rows < 0 || decode_rows >= M;
  const bool dot = M < kDotRowsMax && decodes && x.size(-1) % 32 == 0;
  return linear_ggml_on(x, ws, types, rows, bias, O, dot, decodes);
}

torch::Tensor linear_ggml_dot(torch::Tensor x, const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& types,
                              const std::vector<int64_t>& rows, int64_t O) {
  return linear_ggml_on(x, ws, types, rows, c10::nullopt, O, true);
}

torch::Tensor dequantize_ggml(torch::Tensor w, int64_t type, int64_t K, int64_t rows, c10::optional<torch::Tensor> ids) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.is_contiguous(), "dequantize_ggml: w must be contiguous uint8");
  const torch::Tensor idx = ids.has_value() ? ids->to(torch::kInt64) : torch::Tensor();
  if (type >= kX16) return x16_dequantize(type - kX16, w, rows, K, idx);
  check_weight(w);
  const torch::Tensor sel = idx.defined() ? w.index_select(0, idx) : w;
  return dispatch(type, [&](auto f) { return dequantize<decltype(f)>(sel, K); });
}

bool ggml_repacks(int64_t type) { return x16_supported(type); }

torch::Tensor repack_ggml(torch::Tensor w, int64_t type) { return repack_x16(w, type); }
