// ggml's quantized block layouts, read in place (little-endian, as GGUF stores them), one struct per
// format in the spirit of ggml's type traits. Every format is decoded in chunks of 32 weights:
//   w[i] = d[i / 16] * q[i] + m[i / 16]     (i in 0..31; q unsigned 0..63, or int8 for Q8_0)
// so the linear has one dot-product loop for all of them: the two half-chunk scales differ only for
// Q6_K (16-weight sub-blocks); the offsets m are zero for Q8_0 and MXFP4 (kSigned: q is int8 and multiplied
// with the sign trick). Block sizes: 32 weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4) or 256 (K-quants).
//   scales(blk, c, d, m): the chunk's two scales and offsets (fp32, exactly as ggml computes them);
//   quants(blk, c, q):    its 32 quants as bytes (scalar, every CPU);
//   quants256(blk, c):    the same in one AVX2 register (where the CPU has AVX2);
//   quants512(b0, c0, b1, c1): chunks g and g + 1 (c0 of block b0, c1 of b1) in one AVX-512 register.
// dequantize_row<F>: a row of any of them as fp32 (llama.cpp's q8_0 / q4_0 KV blocks are Q8_0 / Q4_0 rows too).
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace ggml {

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: renormalize
    int e = -1;
    uint32_t m = man;
    do { ++e; m <<= 1; } while (!(m & 0x400u));
    u = sign | ((112 - e) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// How far ahead of the bytes in hand a decode dot prefetches the weights it streams. A thread's weights are
// contiguous, but the L2 streamer stops at each 4 KiB page, and the dot's math then waits on the page's first
// lines: without it a one-row dot ran memory and math one after the other. Measured on an AMX Xeon (23 GB/s
// read): the repacked AVX-512 dot, 24 Qwen3-30B-A3B-shaped decode layers 50.9 -> 45.7 ms; the plain-layout AVX2
// dot (built with AVX-512 masked), 8B-shaped layers at one row, Q4_0 5.2 -> 13.7 GB/s and Q8_0 12.0 -> 23.1;
// 1 KiB ahead was a little slower, 4 KiB the same, into L3 only (NTA) slower than none.
constexpr int64_t kStreamAhead = 2048;

// The scale of a 32-value activation block quantized to +-levels (127: int8, 32767: int16), as ggml
// quantizes its vec_dot_type: d = max|x| / levels; *inv = levels / max|x| (0 for an all-zero block)
inline float block_scale(const float* x, float levels, float* inv) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  *inv = amax > 0.f ? levels / amax : 0.f;
  return amax / levels;
}

// q = round(x * id) (to nearest even, as nearbyint), and the sums of q over values 0-15 and 16-31
inline void quantize32(const float* xs, float id, int8_t* q, int* s0, int* s1) {
#if defined(__AVX2__)
  const __m256 v = _mm256_set1_ps(id);
  __m256i r[4];
  for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + 8 * i), v));
  // packs work within 128-bit lanes: [r0 lo, r1 lo, r2 lo, r3 lo | r0 hi, ...] in 4-byte groups; the permute restores order
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  alignas(32) int h[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(h), _mm256_hadd_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3])));
  *s0 = h[0] + h[1] + h[4] + h[5];
  *s1 = h[2] + h[3] + h[6] + h[7];
#else
  *s0 = *s1 = 0;
  for (int i = 0; i < 32; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(xs[i] * id));
    (i < 16 ? *s0 : *s1) += q[i];
  }
#endif
}

#if defined(__AVX2__)
inline __m256i nibbles_lo_hi(const uint8_t* p) {  // 16 bytes -> 32: low nibbles, then high nibbles
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i f = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), f), _mm_and_si128(v, f));
}
inline __m256i srl16(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }
inline __m256i bits_to_0x10(uint32_t x) {  // byte i = 0x10 where bit i of x is set
  const __m256i shuf = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuf), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}
#endif

#if defined(__AVX512BW__)
// chunks g, g + 1 of a row as one 512-bit vector, from two 256-bit unpacks (the formats' default)
template <class F>
inline __m512i pair_from_256(const uint8_t* b0, int c0, const uint8_t* b1, int c1) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(F::quants256(b0, c0)), F::quants256(b1, c1), 1);
}
// two 16-byte nibble arrays (one per chunk) -> [lo0 hi0 lo1 hi1]: each chunk's 32 quants in order
inline __m512i nibble_pair(const uint8_t* p0, const uint8_t* p1) {
  const __m256i v = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p1), reinterpret_cast<const __m128i*>(p0));
  const __m256i f = _mm256_set1_epi8(0x0f);
  const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, f)),
                                       _mm256_and_si256(_mm256_srli_epi16(v, 4), f), 1);  // [lo0 lo1 hi0 hi1]
  return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
}
#endif

inline void nibbles_scalar(const uint8_t* p, uint8_t* q) {
  for (int i = 0; i < 16; ++i) {
    q[i] = p[i] & 0x0f;
    q[i + 16] = p[i] >> 4;
  }
}

// K-quant 6-bit scale and min of sub-block j (Q4_K, Q5_K), ggml's get_scale_min_k4
inline void scale_min_k4(const uint8_t* s, int j, float* sc, float* mn) {
  if (j < 4) {
    *sc = static_cast<float>(s[j] & 63);
    *mn = static_cast<float>(s[j + 4] & 63);
  } else {
    *sc = static_cast<float>((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4));
    *mn = static_cast<float>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// fp16 d; 16 B of nibbles: w[i] = d * (q[i] - 8)
struct Q4_0 {
  static constexpr int QK = 32, BYTES = 18;
  static constexpr bool kSigned = false, kSplit = false;
  static void scales(const uint8_t* b, int, float* d, float* m) {
    d[0] = d[1] = fp16(b);
    m[0] = m[1] = -8.f * d[0];
  }
  static void quants(const uint8_t* b, int, uint8_t* q) { nibbles_scalar(b + 2, q); }
#if defined(__AVX2__)
  static __m256i quants256(const uint8_t* b, int) { return nibbles_lo_hi(b + 2); }
#endif
#if defined(__AVX512BW__)
  static __m512i quants512(const uint8_t* b0, int, const uint8_t* b1, int) { return nibble_pair(b0 + 2, b1 + 2); }
#endif
};

// fp16 d, fp16 m; 16 B of nibbles: w = d * q + m
struct Q4_1 {
  static constexpr int QK = 32, BYTES = 20;
  static constexpr bool kSigned = false, kSplit = false;
  static void scales(const uint8_t* b, int, float* d, float* m) {
    d[0] = d[1] = fp16(b);
    m[0] = m[1] = fp16(b + 2);
  }
  static void quants(const uint8_t* b, int, uint8_t* q) { nibbles_scalar(b + 4, q); }
#if defined(__AVX2__)
  static __m256i quants256(const uint8_t* b, int) { return nibbles_lo_hi(b + 4); }
#endif
#if defined(__AVX512BW__)
  static __m512i quants512(const uint8_t* b0, int, const uint8_t* b1, int) { return nibble_pair(b0 + 4, b1 + 4); }
#endif
};

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// fp16 d; 32 high bits; 16 B of low nibbles: w = d * (q - 16)
struct Q5_0 {
  static constexpr int QK = 32, BYTES = 22;
  static constexpr bool kSigned = false, kSplit = false;
  static void scales(const uint8_t* b, int, float* d, float* m) {
    d[0] = d[1] = fp16(b);
    m[0] = m[1] = -16.f * d[0];
  }
  static void quants(const uint8_t* b, int, uint8_t* q) {
    nibbles_scalar(b + 6, q);
    const uint32_t h = load_u32(b + 2);
    for (int i = 0; i < 32; ++i) q[i] |= ((h >> i) & 1u) << 4;
  }
#if defined(__AVX2__)
  static __m256i quants256(const uint8_t* b, int) {
    return _mm256_or_si256(nibbles_lo_hi(b + 6), bits_to_0x10(load_u32(b + 2)));
  }
#endif
#if defined(__AVX512BW__)
  static __m512i quants512(const uint8_t* b0, int c0, const uint8_t* b1, int c1) { return pair_from_256<Q5_0>(b0, c0, b1, c1); }
#endif
};

// fp16 d, fp16 m; 32 high bits; 16 B of low nibbles: w = d * q + m
struct Q5_1 {
  static constexpr int QK = 32, BYTES = 24;
  static constexpr bool kSigned = false, kSplit = false;
  static void scales(const uint8_t* b, int, float* d, float* m) {
    d[0] = d[1] = fp16(b);
    m[0] = m[1] = fp16(b + 2);
  }
  static void quants(const uint8_t* b, int, uint8_t* q) {
    nibbles_scalar(b + 8, q);
    const uint32_t h = load_u32(b + 4);
    for (int i = 0; i < 32; ++i) q[i] |= ((h >> i) & 1u) << 4;
  }
#if defined(__AVX2__)
  static __m256i quants256(const uint8_t* b, int) {
    return _mm256_or_si256(nibbles_lo_hi(b + 8), bits_to_0x10(load_u32(b + 4)));
  }
#endif
#if defined(__AVX512BW__)
  static __m512i quants512(const uint8_t* b0, int c0, const uint8_t* b1, int c1) { return pair_from_256<Q5_1>(b0, c0, b1, c1); }
#endif
};

// fp16 d; 32 int8: w = d * q
struct Q8_0 {
  static constexpr int QK = 32, BYTES = 34;
  static constexpr bool kSigned = true, kSplit = false;
  static void scales(const uint8_t* b, int, float* d, float* m) {
    d[0] = d[1] = fp16(b);
    m[0] = m[1] = 0.f;
  }
  static void quants(const uint8_t* b, int, uint8_t* q) { std::memcpy(q, b + 2, 32); }
#if defined(__AVX2__)
  static __m256i quants256(const uint8_t* b, int) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  }
#endif
#if defined(__AVX512BW__)
  static __m512i quants512(const uint8_t* b0, int c0, const uint8_t* b1, int c1) { return pair_from_256<Q8_0>(b0, c0, b1, c1); }
#endif
};

// MXFP4 (OCP microscaling, gpt-oss's experts): an e8m0 exponent byte e, 16 B of nibbles, each an fp4 e2m1 code;
// as ggml keeps them, the codes as int8 of twice their value (kValues) and d = 2^(e - 128): w = d * kValues[q]
struct MXFP4 {
  static constexpr int QK = 32, BYTES = 17;
  static constexpr bool kSigned = true, kSplit = false;
  static constexpr int8_t kValues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  static void scales(const uint8_t* b, int, float* d, float* m) {
    const uint32_t bits = b[0] < 2 ? 0x00200000u << b[0] : static_cast<uint32_t>(b[0] - 1) << 23;  // ggml's e8m0 half
    std::memcpy(d, &bits, 4);
    d[1] = d[0];
    m[0] = m[1] = 0.f;
  }
  static void quants(const uint8_t* b, int, uint8_t* q) {
    for (int i = 0; i < 16; ++i) {
      q[i] = static_cast<uint8_t>(kValues[b[1 + i] & 0x0f]);
      q[i + 16] = static_cast<uint8_t>(kValues[b[1 + i] >> 4]);
    }
  }
#if defined(__AVX2__)
  static __m256i lut256() {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kValues)));
  }
  static __m256i quants256(const uint8_t* b, int) { return _mm256_shuffle_epi8(lut256(), nibbles_lo_hi(b + 1)); }
#endif
#if defined(__AVX512BW__)
  static __m512i quants512(const uint8_t* b0, int, const uint8_t* b1, int) {
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kValues)));
    return _mm512_shuffle_epi8(lut, nibble_pair(b0 + 1, b1 + 1));
  }
#endif
};

// 256 weights: fp16 d, fp16 dmin, 12 B of 6-bit scales/mins, 128 B of nibbles; chunk c (sub-block of
// 32) reads the low (c even) or high nibbles of bytes 32 * (c / 2) ..: w = d * sc * q - dmin * mn
struct Q4_K {
  static constexpr int QK = 256, BYTES = 144;
  static constexpr bool kSigned = false, kSplit = false;
  static void scales(const uint8_t* b, int c, float* d, float* m) {
    float sc, mn;
    scale_min_k4(b + 4, c, &sc, &mn);
    d[0] = d[1] = fp16(b) * sc;
    m[0] = m[1] = -(fp16(b + 2) * mn);
  }
  static void quants(const uint8_t* b, int c, uint8_t* q) {
    const uint8_t* p = b + 16 + 32 * (c / 2);
    for (int i = 0; i < 32; ++i) q[i] = (c & 1) ? p[i] >> 4 : p[i] & 0x0f;
  }
#if defined(__AVX2__)
  static __m256i quants256(const uint8_t* b, int c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (c / 2)));
    return _mm256_and_si256(srl16(v, 4 * (c & 1)), _mm256_set1_epi8(0x0f));
  }
#endif
#if defined(__AVX512BW__)
  static __m512i quants512(const uint8_t* b0, int c0, const uint8_t*, int) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 16 + 32 * (c0 / 2)));
    const __m256i f = _mm256_set1_epi8(0x0f);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, f)),
                              _mm256_and_si256(_mm256_srli_epi16(v, 4), f), 1);
  }
#endif
};

// 256 weights: fp16 d, fp16 dmin, 12 B scales/mins, 32 B of high bits (bit c of byte i is weight i of
// chunk c), 128 B of low nibbles as in Q4_K: w = d * sc * q - dmin * mn
struct Q5_K {
  static constexpr int QK = 256, BYTES = 176;
  static constexpr bool kSigned = false, kSplit = false;
  static void scales(const uint8_t* b, int c, float* d, float* m) { Q4_K::scales(b, c, d, m); }
  static void quants(const uint8_t* b, int c, uint8_t* q) {
    const uint8_t* qh = b + 16;
    const uint8_t* p = b + 48 + 32 * (c / 2);
    for (int i = 0; i < 32; ++i)
      q[i] = static_cast<uint8_t>(((c & 1) ? p[i] >> 4 : p[i] & 0x0f) | (((qh[i] >> c) & 1) << 4));
  }
#if defined(__AVX2__)
  static __m256i quants256(const uint8_t* b, int c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 48 + 32 * (c / 2)));
    const __m256i lo = _mm256_and_si256(srl16(v, 4 * (c & 1)), _mm256_set1_epi8(0x0f));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const __m256i hi = _mm256_and_si256(srl16(h, c), _mm256_set1_epi8(1));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
#endif
#if defined(__AVX512BW__)
  static __m512i quants512(const uint8_t* b0, int c0, const uint8_t* b1, int c1) { return pair_from_256<Q5_K>(b0, c0, b1, c1); }
#endif
};

// 256 weights: 128 B low nibbles, 64 B of 2-bit highs, 16 int8 scales (one per 16 weights), fp16 d:
// w = d * sc[i / 16] * (q - 32). Chunk c: half h = c / 4 of 128 weights; within it, g = c % 4 takes
// low (g < 2) or high nibbles of ql bytes 64h + 32 (g % 2) .., and bits 2g of qh bytes 32h ..
struct Q6_K {
  static constexpr int QK = 256, BYTES = 210;
  static constexpr bool kSigned = false, kSplit = true;
  static void scales(const uint8_t* b, int c, float* d, float* m) {
    const float dd = fp16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    d[0] = dd * sc[2 * c];
    d[1] = dd * sc[2 * c + 1];
    m[0] = -32.f * d[0];
    m[1] = -32.f * d[1];
  }
  static void quants(const uint8_t* b, int c, uint8_t* q) {
    const int h = c / 4, g = c % 4;
    const uint8_t* ql = b + 64 * h + 32 * (g % 2);
    const uint8_t* qh = b + 128 + 32 * h;
    for (int i = 0; i < 32; ++i)
      q[i] = static_cast<uint8_t>(((g < 2 ? ql[i] : ql[i] >> 4) & 0x0f) | (((qh[i] >> (2 * g)) & 3) << 4));
  }
#if defined(__AVX2__)
  static __m256i quants256(const uint8_t* b, int c) {
    const int h = c / 4, g = c % 4;
    const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (g % 2)));
    const __m256i lo = _mm256_and_si256(srl16(l, g < 2 ? 0 : 4), _mm256_set1_epi8(0x0f));
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i hi = _mm256_and_si256(srl16(hb, 2 * g), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
#endif
#if defined(__AVX512BW__)
  static __m512i quants512(const uint8_t* b0, int c0, const uint8_t* b1, int c1) { return pair_from_256<Q6_K>(b0, c0, b1, c1); }
#endif
};

// A row of K weights (whole blocks of F) as fp32: w = d q + m per chunk of 32
template <class F>
inline void dequantize_row(const uint8_t* row, int64_t K, float* out) {
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

}  // namespace ggml
