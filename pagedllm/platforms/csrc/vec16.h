// 16-float vectors for the attention kernels (GCC vector extensions: one AVX-512 register where
// -march=native has AVX-512, a pair of AVX2 registers or four SSE ones elsewhere), and the two pieces of
// math the decode op and the chunk kernel must compute alike: exp and bf16 rounding.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace vec {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

// 16-float vectors the register file holds: 32 zmm with AVX-512, 16 ymm (8 pairs) with AVX2 or less; kernels
// that keep tiles of them in registers size the tiles by it (AVX-512's tiles spill every key on AVX2)
#if defined(__AVX512F__)
inline constexpr int kRegs = 32;
#else
inline constexpr int kRegs = 8;
#endif

// Masked scores: finite because the build uses -ffast-math (no infinities); exp() of anything this far
// below a row's max is 0
inline constexpr float kMasked = -1e30f;

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof(v)); }

inline v16u bits(v16f v) {
  v16u u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
}

inline v16f from_bits(v16u u) {
  v16f v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// Round to nearest even at bf16 precision, as bf16 bits in the top half of each lane (finite inputs)
inline v16u bf16_bits(v16f v) {
  const v16u u = bits(v);
  return (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
}

inline v16f round_bf16(v16f v) { return from_bits(bf16_bits(v)); }

// exp(x) = 2^n e^r, n = floor(x log2(e) + 1/2), r = x - n ln(2) in two parts, e^r by Cephes' degree-6
// polynomial (~1 ulp); 0 below -87 (where expf is denormal or 0), so kMasked scores give 0
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// AVX2: the same math on each 8-float half with intrinsics. GCC lowers the generic version's comparisons of
// 16-lane vectors to scalar compares and 128-bit blends there: softmax_rows spent a third of an fp32 decode
// row's attention in it.
inline __m256 exp8(__m256 x) {
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 nf = _mm256_floor_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_fmadd_ps(nf, _mm256_set1_ps(2.12194440e-4f),
                                   _mm256_fnmadd_ps(nf, _mm256_set1_ps(0.693359375f), xc));
  __m256 y = _mm256_fmadd_ps(_mm256_set1_ps(1.9875691500e-4f), r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i n = _mm256_cvtps_epi32(nf);  // exact: nf is a whole number
  const __m256 out = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23)));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ), out);
}

inline v16f exp16(v16f x) {
  __m256 h[2];
  std::memcpy(h, &x, sizeof(h));
  h[0] = exp8(h[0]);
  h[1] = exp8(h[1]);
  std::memcpy(&x, h, sizeof(h));
  return x;
}
#else
inline v16f exp16(v16f x) {
  const v16f xc = x < -87.f ? v16f{} - 87.f : (x > 88.f ? v16f{} + 88.f : x);
  v16f fx = xc * 1.44269504088896341f + 0.5f;
  v16i n = __builtin_convertvector(fx, v16i);  // truncates: floor for negatives below
  n += __builtin_convertvector(n, v16f) > fx;  // true lanes are -1
  const v16f nf = __builtin_convertvector(n, v16f);
  const v16f r = xc - nf * 0.693359375f + nf * 2.12194440e-4f;
  v16f y = 1.9875691500e-4f * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const v16u scale = __builtin_convertvector((n + 127) << 23, v16u);
  const v16f out = y * from_bits(scale);
  return x < -87.f ? v16f{} : out;
}
#endif

// out[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u, 16 at a time with exp16 (the scalar std::exp loop this
// replaced ran at ~3.5 cycles an element, 1.7 ms for a 2048-token chunk's [2048, 2 x 1536] per layer)
inline void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16f x = load16(g + i);
    store16(out + i, x / (1.f + exp16(-x)) * load16(u + i));
  }
  for (; i < n; ++i) {  // the same math on one lane
    v16f x{};
    x[0] = g[i];
    out[i] = (x / (1.f + exp16(-x)))[0] * u[i];
  }
}

// the lanes' max: on AVX2 with intrinsics, where GCC lowers `a > b ? a : b` over 16 lanes to scalar compares
inline v16f max16(v16f a, v16f b) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  __m256 x[2], y[2];
  std::memcpy(x, &a, sizeof(x));
  std::memcpy(y, &b, sizeof(y));
  x[0] = _mm256_max_ps(x[0], y[0]);
  x[1] = _mm256_max_ps(x[1], y[1]);
  std::memcpy(&a, x, sizeof(x));
  return a;
#else
  return a > b ? a : b;
#endif
}

inline float hmax(v16f v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

inline float hsum(v16f v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

}  // namespace vec
