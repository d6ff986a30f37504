// Values of the KV pools' compact formats from their bits, shared by the decode op (attention.cpp) and the chunk
// kernel (attention_chunks.cpp): fp16 (q8_0 / q4_0 block scales) and fp8 (e4m3fn or e5m2, one bf16 scale per slot
// and KV head, applied by the caller).
//
// fp8 goes through fp16: e5m2 is an fp16's top byte; e4m3fn's sign and 7 magnitude bits moved into fp16's places
// read as its value times 2^-8 (exponent bias 7 against 15), subnormals included, and fp8_unbias undoes the 2^-8
// (folded into the slot's scale by the callers). Exact, and F16C's conversions do not flush fp16 subnormals, with
// denormals-are-zero set or not. A table gather (16 loads an instruction) was the slow part of widening an fp8 row
// on Zen 4. e4m3fn's NaN (0x7F / 0xFF) reads as +-480; a pool holds it only where its slot's scale is NaN too.
// ISA: 16 values an instruction on AVX-512 (vpmovsxbw / vpmovzxbw, a shift, vcvtph2ps), 8 with F16C, scalar
// otherwise.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace kvfmt {

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -24)
                    : e == 31 ? (m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity())
                              : std::ldexp(static_cast<float>(m | 0x400), static_cast<int>(e) - 25);
  return h & 0x8000 ? -mag : mag;
#endif
}

// An fp8 byte as the fp16 whose value is the fp8 value over fp8_unbias
inline uint16_t fp8_half_bits(uint8_t x, bool e5m2) {
  return e5m2 ? static_cast<uint16_t>(x << 8) : static_cast<uint16_t>(((x & 0x80) << 8) | ((x & 0x7F) << 7));
}
inline float fp8_unbias(bool e5m2) { return e5m2 ? 1.f : 256.f; }

// The fp8 format whose 256 values lut holds: 1 e5m2, 0 e4m3fn, -1 neither. Compared as bits (-ffast-math may fold
// isnan and infinities away); NaN entries match anything.
inline int fp8_format_of(const float* lut) {
  auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    return u;
  };
  for (const bool e5m2 : {true, false}) {
    bool same = true;
    for (int x = 0; x < 256 && same; ++x) {
      const uint32_t want = bits(lut[x]);
      same = (want & 0x7fffffffu) > 0x7f800000u ||
             bits(half_to_float(fp8_half_bits(static_cast<uint8_t>(x), e5m2)) * fp8_unbias(e5m2)) == want;
    }
    if (same) return e5m2 ? 1 : 0;
  }
  return -1;
}

#if defined(__AVX512F__)
// 16 fp8 bytes at src as fp32 over fp8_unbias: sign-extended to 16 bits, e4m3's shift by 7 puts the sign in bit 15
// (and a copy in bit 14, cleared by the mask 0xBF80)
inline __m512 fp8_16(const uint8_t* src, bool e5m2) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  const __m256i h = e5m2 ? _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8)
                         : _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(-16512));
  return _mm512_cvtph_ps(h);
}
#elif defined(__F16C__)
// 8 fp8 bytes at src as fp32 over fp8_unbias (fp8_16's steps on 8 values)
inline __m256 fp8_8(const uint8_t* src, bool e5m2) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  const __m128i h = e5m2 ? _mm_slli_epi16(_mm_cvtepu8_epi16(b), 8)
                         : _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16(-16512));
  return _mm256_cvtph_ps(h);
}
#endif

// n fp8 values at src times sc (the slot's scale times fp8_unbias) into dst
inline void fp8_row(const uint8_t* src, int64_t n, bool e5m2, float sc, float* dst) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_mul_ps(fp8_16(src + i, e5m2), _mm512_set1_ps(sc)));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(fp8_8(src + i, e5m2), _mm256_set1_ps(sc)));
#endif
  for (; i < n; ++i) dst[i] = half_to_float(fp8_half_bits(src[i], e5m2)) * sc;
}

}  // namespace kvfmt
